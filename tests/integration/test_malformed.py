"""Malformed and hostile safetensors files: `diloco inspect --json --hash` against the reference reader.

Every file is generated here (8-byte little-endian header length + header bytes + data) and opened
twice: by our CLI and by the real reference (`safetensors.safe_open`, PyPI 0.8.0).  The properties:

* each malformed file is rejected by us (exit 1) with the stable error code the rules assign to it;
* every file the reference rejects, we reject too (we may be stricter, never looser);
* the files the reference accepts while we reject form an explicit, reviewed set;
* valid edge cases are accepted by both, with the same tensors (names, dtypes, shapes) and metadata;
* a few hundred seeded random mutations of a valid file never crash us and keep the properties above.

The rules are the reference implementation's (huggingface/safetensors, tensor.rs), checked against it here.
"""
import hashlib
import json
import math
import random
import struct
from dataclasses import dataclass, field
from typing import Optional

import pytest
from safetensors import safe_open

from conftest import run

MAX_HEADER = 100_000_000
U64_MAX = 2**64 - 1

STABLE_CODES = {
    "header_too_small", "header_too_large", "invalid_header_length", "invalid_header",
    "invalid_header_deserialization", "invalid_offset", "metadata_incomplete_buffer",
    "validation_overflow", "misaligned_slice", "tensor_invalid_info", "duplicate_key",
}

# Reference error text (SafetensorError Display) -> our stable code.
REFERENCE_MESSAGES = [
    ("header too small", "header_too_small"),
    ("header too large", "header_too_large"),
    ("invalid header length", "invalid_header_length"),
    ("invalid UTF-8", "invalid_header"),
    ("invalid JSON in header", "invalid_header_deserialization"),
    ("invalid offset", "invalid_offset"),
    ("incomplete metadata", "metadata_incomplete_buffer"),
    ("overflow computing buffer size", "validation_overflow"),
    ("does not end up at a byte boundary", "misaligned_slice"),
    ("invalid shape, data type, or offset", "tensor_invalid_info"),
]

# Malformed cases the reference opens without complaint while we refuse them, and why.
REFERENCE_ACCEPTS_WE_REJECT = {
    "dup-tensor-name-identical-entries": "reference: last duplicate tensor wins",
    "dup-tensor-name-different-entries": "reference: last duplicate tensor wins",
    "dup-tensor-name-via-unicode-escape": "reference: last duplicate tensor wins",
    "dup-key-inside-metadata": "reference: HashMap, last metadata value wins",
    "dup-unknown-field-in-entry": "reference: unknown fields are skipped unchecked",
    "dup-key-in-object-in-unknown-field": "reference: unknown fields are skipped unchecked",
    "dup-key-deep-in-unknown-field": "reference: unknown fields are skipped unchecked",
}


# ---- file builders ------------------------------------------------------------------------------

def b(text) -> bytes:
    return text.encode("utf-8") if isinstance(text, str) else bytes(text)


def st(header, data: bytes = b"", *, length: Optional[int] = None) -> bytes:
    """A safetensors file: u64 LE length (default: the real header length) + header + data."""
    hb = b(header)
    return struct.pack("<Q", len(hb) if length is None else length) + hb + data


def jlist(v) -> str:
    """A JSON array from a sequence of ints, or a raw JSON text passed through unchanged."""
    return v if isinstance(v, str) else "[" + ",".join(str(x) for x in v) + "]"


def entry(dtype="F32", shape=(2,), offsets=(0, 8), extra: str = "") -> str:
    """A tensor entry; shape/offsets may be raw JSON text to smuggle malformed numbers in."""
    return '{"dtype":"%s","shape":%s,"data_offsets":%s%s}' % (dtype, jlist(shape), jlist(offsets), extra)


def obj(*pairs) -> str:
    """A JSON object text from (raw key text without quotes, raw value text) pairs."""
    return "{" + ",".join('"%s":%s' % (k, v) for k, v in pairs) + "}"


def one(e: str, name: str = "a") -> str:
    return obj((name, e))


def nested_arrays(depth: int, close: bool = True) -> str:
    return "[" * depth + ("]" * depth if close else "")


DATA8 = bytes(range(1, 9))
GOOD = one(entry())                 # {"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}
GOOD_FILE = st(GOOD, DATA8)


def with_name_bytes(name: bytes, e: str = entry()) -> bytes:
    return st(b'{"' + name + b'":' + b(e) + b"}", DATA8)


def padded(header: str) -> str:
    """Pads with spaces so that 8 + N is a multiple of 8, as the writer does."""
    return header + " " * (-len(b(header)) % 8)


# ---- the catalogue ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Bad:
    id: str
    blob: bytes
    code: str
    tensor: Optional[str] = None    # the tensor the error must name, when it concerns one


def malformed_cases():
    c = []
    add = lambda id_, blob, code, tensor=None: c.append(Bad(id_, blob, code, tensor))  # noqa: E731

    # 1. file shorter than the 8-byte prefix
    for k in range(8):
        add(f"truncated-to-{k}-bytes", GOOD_FILE[:k], "header_too_small")

    # 2./3. header length against the cap and the file
    add("length-one-past-file", st(GOOD, DATA8, length=len(GOOD) + len(DATA8) + 1), "invalid_header_length")
    add("length-far-past-file", st(GOOD, DATA8, length=1_000_000), "invalid_header_length")
    add("length-exactly-cap-beyond-file", st(GOOD, DATA8, length=MAX_HEADER), "invalid_header_length")
    add("length-cap-plus-one", st(GOOD, DATA8, length=MAX_HEADER + 1), "header_too_large")
    add("length-2pow32", st(GOOD, DATA8, length=2**32), "header_too_large")
    add("length-2pow63", st(GOOD, DATA8, length=2**63), "header_too_large")
    add("length-u64-max", st(GOOD, DATA8, length=U64_MAX), "header_too_large")
    add("length-nonzero-prefix-only", struct.pack("<Q", 2), "invalid_header_length")
    add("length-zero-file-of-8-bytes", bytes(8), "invalid_header_deserialization")
    add("length-zero-then-valid-header", st(GOOD, DATA8, length=0), "invalid_header_deserialization")
    add("length-one-short-cuts-json", st(GOOD, DATA8, length=len(GOOD) - 1), "invalid_header_deserialization")

    # 4. header bytes not UTF-8
    add("utf8-overlong-slash-c0af", with_name_bytes(b"a\xc0\xaf"), "invalid_header")
    add("utf8-overlong-nul-c080", with_name_bytes(b"a\xc0\x80"), "invalid_header")
    add("utf8-overlong-3byte-e080af", with_name_bytes(b"a\xe0\x80\xaf"), "invalid_header")
    add("utf8-encoded-surrogate-eda080", with_name_bytes(b"a\xed\xa0\x80"), "invalid_header")
    add("utf8-truncated-3byte-seq", with_name_bytes(b"a\xe2\x82"), "invalid_header")
    add("utf8-truncated-4byte-seq-at-header-end", st(b(GOOD) + b"\xf0\x9f\x98", DATA8), "invalid_header")
    add("utf8-lone-continuation-byte", with_name_bytes(b"\x80"), "invalid_header")
    add("utf8-above-u10ffff-f4908080", with_name_bytes(b"\xf4\x90\x80\x80"), "invalid_header")
    add("utf8-byte-ff", with_name_bytes(b"\xff"), "invalid_header")
    add("utf8-latin1-in-metadata-value",
        st(b'{"__metadata__":{"k":"caf\xe9"},"a":' + b(entry()) + b"}", DATA8), "invalid_header")
    add("utf8-bad-byte-in-space-padding", st(b(GOOD) + b"   \xfe", DATA8), "invalid_header")

    # 4. JSON syntax
    idd = "invalid_header_deserialization"
    add("json-unterminated-object", st(GOOD[:-1], DATA8), idd)
    add("json-unterminated-string", st('{"a', DATA8), idd)
    add("json-trailing-comma-in-header", st(GOOD[:-1] + ",}", DATA8), idd)
    add("json-trailing-comma-in-entry", st(one(entry()[:-1] + ",}"), DATA8), idd)
    add("json-trailing-comma-in-shape", st(one(entry(shape="[2,]")), DATA8), idd)
    add("json-single-quotes", st(GOOD.replace('"', "'"), DATA8), idd)
    add("json-unquoted-key", st(GOOD.replace('"a"', "a", 1), DATA8), idd)
    add("json-key-is-number", st(GOOD.replace('"a"', "1", 1), DATA8), idd)
    add("json-missing-colon", st(GOOD.replace('"a":', '"a"', 1), DATA8), idd)
    add("json-nul-padding", st(GOOD + "\0" * 6, DATA8), idd)
    add("json-nul-before-object", st("\0" + GOOD, DATA8), idd)
    add("json-bom-prefix", st(b"\xef\xbb\xbf" + b(GOOD), DATA8), idd)
    add("json-form-feed-padding", st(GOOD + "\f", DATA8), idd)
    add("json-vertical-tab-padding", st(GOOD + "\v", DATA8), idd)
    add("json-nbsp-padding", st(GOOD + "\u00a0", DATA8), idd)
    add("json-trailing-garbage", st(GOOD + "x", DATA8), idd)
    add("json-second-object", st(GOOD + "{}", DATA8), idd)
    add("json-block-comment", st("/**/" + GOOD, DATA8), idd)
    add("json-only-spaces", st(" " * 8), idd)
    add("json-leading-zero-offset", st(one(entry(offsets="[0,08]")), DATA8), idd)
    add("json-plus-sign-offset", st(one(entry(offsets="[0,+8]")), DATA8), idd)
    add("json-hex-offset", st(one(entry(offsets="[0,0x8]")), DATA8), idd)
    add("json-nan-in-shape", st(one(entry(shape="[NaN]")), DATA8), idd)
    add("json-invalid-escape-in-name", st(one(entry(), name="a\\x41"), DATA8), idd)
    add("json-short-unicode-escape-in-name", st(one(entry(), name="\\u12"), DATA8), idd)
    add("json-capitalised-literal-in-unknown-field", st(one(entry(extra=',"x":True')), DATA8), idd)

    # 4. header not an object / tensor entry not an object
    for id_, top in [("array", "[]"), ("null", "null"), ("string", '"a"'), ("number", "0"), ("true", "true")]:
        add(f"top-level-{id_}", st(padded(top)), idd)
    for id_, val in [("array", "[]"), ("string", '"F32"'), ("null", "null"), ("number", "8")]:
        add(f"tensor-entry-is-{id_}", st(one(val), DATA8), idd)

    # 4. schema: missing fields, dtypes, field types
    add("missing-dtype", st(one('{"shape":[2],"data_offsets":[0,8]}'), DATA8), idd)
    add("missing-shape", st(one('{"dtype":"F32","data_offsets":[0,8]}'), DATA8), idd)
    add("missing-data_offsets", st(one('{"dtype":"F32","shape":[2]}'), DATA8), idd)
    add("tensor-entry-empty-object", st(one("{}"), DATA8), idd)
    for id_, dt in [("unknown-F128", "F128"), ("lowercase-f32", "f32"), ("torch-name-float32", "float32"),
                    ("F8_E4M3FN-not-a-safetensors-dtype", "F8_E4M3FN"), ("trailing-space", "F32 "),
                    ("escaped-nul-suffix", "F32\\u0000"), ("empty", "")]:
        add(f"dtype-{id_}", st(one(entry(dtype=dt)), DATA8), idd)
    add("dtype-is-number", st(one('{"dtype":17,"shape":[2],"data_offsets":[0,8]}'), DATA8), idd)
    add("dtype-is-null", st(one('{"dtype":null,"shape":[2],"data_offsets":[0,8]}'), DATA8), idd)
    for id_, offs in [("one-value", "[0]"), ("three-values", "[0,8,8]"), ("empty-list", "[]"),
                      ("string", '"0,8"'), ("nested-list", "[[0,8]]"), ("null", "null"), ("object", "{}")]:
        add(f"offsets-{id_}", st(one(entry(offsets=offs)), DATA8), idd)
    for id_, shape in [("string", '"2"'), ("element-string", '["2"]'), ("null", "null"),
                       ("element-bool", "[true]"), ("nested-list", "[[2]]"), ("element-null", "[null]")]:
        add(f"shape-{id_}", st(one(entry(shape=shape)), DATA8), idd)

    # numbers: non-negative integer literals <= u64 max only
    for id_, lit in [("negative", "-1"), ("float", "2.0"), ("exponent", "2e0"), ("capital-exponent", "2E0"),
                     ("negative-zero", "-0"), ("2pow64", str(2**64)), ("huge-40-digits", "9" * 40)]:
        add(f"shape-number-{id_}", st(one(entry(shape=f"[{lit}]")), DATA8), idd)
    for id_, offs in [("negative", "[0,-8]"), ("float", "[0,8.0]"), ("exponent", "[0,8e0]"),
                      ("negative-zero-start", "[-0,8]"), ("2pow64", f"[0,{2**64}]"),
                      ("float-start", "[0.0,8]")]:
        add(f"offsets-number-{id_}", st(one(entry(offsets=offs)), DATA8), idd)
    # numbers the reference refuses even in an ignored field: serde_json's f64 range
    add("unknown-field-number-1e400", st(one(entry(extra=',"x":1e400')), DATA8), idd)
    add("unknown-field-number-negative-1e400", st(one(entry(extra=',"x":-1e400')), DATA8), idd)
    add("unknown-field-number-1.8e308", st(one(entry(extra=',"x":1.8e308')), DATA8), idd)
    add("unknown-field-integer-of-310-digits", st(one(entry(extra=',"x":1' + "0" * 309)), DATA8), idd)

    # duplicate keys at every level
    dk = "duplicate_key"
    add("dup-tensor-name-identical-entries", st(obj(("a", entry()), ("a", entry())), DATA8), dk, "a")
    add("dup-tensor-name-different-entries",
        st(obj(("a", entry("U8", [4], [0, 4])), ("a", entry())), DATA8), dk, "a")
    add("dup-tensor-name-via-unicode-escape", st(obj(("a", entry()), ("\\u0061", entry())), DATA8), dk, "a")
    add("dup-metadata-key-at-top-level",
        st(obj(("__metadata__", '{"k":"v"}'), ("__metadata__", '{"k":"v"}'), ("a", entry())), DATA8), dk)
    add("dup-metadata-key-via-unicode-escape",
        st(obj(("__metadata__", '{"k":"v"}'), ("\\u005f_metadata__", '{"k":"v"}'), ("a", entry())), DATA8), dk)
    add("dup-metadata-key-null-then-object",
        st(obj(("__metadata__", "null"), ("__metadata__", "{}"), ("a", entry())), DATA8), dk)
    add("dup-key-inside-metadata", st(obj(("__metadata__", '{"k":"v","k":"w"}'), ("a", entry())), DATA8), dk)
    add("dup-dtype-field-in-entry",
        st(one('{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}'), DATA8), dk, "a")
    add("dup-shape-field-in-entry",
        st(one('{"dtype":"F32","shape":[2],"shape":[2],"data_offsets":[0,8]}'), DATA8), dk, "a")
    add("dup-data_offsets-field-in-entry",
        st(one('{"dtype":"F32","shape":[2],"data_offsets":[0,8],"data_offsets":[0,8]}'), DATA8), dk, "a")
    add("dup-unknown-field-in-entry", st(one(entry(extra=',"x":1,"x":2')), DATA8), dk, "a")
    add("dup-key-in-object-in-unknown-field", st(one(entry(extra=',"x":{"k":1,"k":2}')), DATA8), dk)
    add("dup-key-deep-in-unknown-field", st(one(entry(extra=',"x":[0,{"y":{"k":null,"k":null}}]')), DATA8), dk)

    # validate(): offsets
    io = "invalid_offset"
    add("offsets-gap-between-tensors",
        st(obj(("a", entry("U8", [4], [0, 4])), ("b", entry("U8", [4], [8, 12]))), bytes(12)), io, "b")
    add("offsets-overlap",
        st(obj(("a", entry("F32", [2], [0, 8])), ("b", entry("F32", [2], [4, 12]))), bytes(12)), io, "b")
    add("offsets-same-nonempty-range-twice",
        st(obj(("a", entry("F32", [2], [0, 8])), ("b", entry("F32", [2], [0, 8]))), bytes(16)), io)
    add("offsets-reversed-range",
        st(obj(("a", entry("U8", [4], [0, 4])), ("b", entry("U8", [4], [4, 0]))), bytes(8)), io, "b")
    add("offsets-reversed-single-tensor", st(one(entry(offsets=[8, 0])), DATA8), io, "a")
    add("offsets-not-starting-at-zero", st(one(entry("U8", [4], [4, 8])), DATA8), io, "a")
    add("offsets-empty-tensor-past-the-end",
        st(obj(("a", entry("U8", [4], [0, 4])), ("z", entry("U8", [0], [5, 5]))), bytes(4)), io, "z")

    # validate(): sizes, overflow, sub-byte alignment
    ti = "tensor_invalid_info"
    add("size-range-smaller-than-shape", st(one(entry(offsets=[0, 4])), bytes(4)), ti, "a")
    add("size-range-larger-than-shape", st(one(entry(offsets=[0, 12])), bytes(12)), ti, "a")
    add("size-scalar-with-empty-range", st(one(entry(shape=[], offsets=[0, 0]))), ti, "a")
    add("size-empty-tensor-with-bytes", st(one(entry(shape=[0, 3], offsets=[0, 4])), bytes(4)), ti, "a")
    add("size-bf16-sized-as-f32", st(one(entry("BF16", [2], [0, 8])), DATA8), ti, "a")
    add("size-f4-even-count-sized-as-u8", st(one(entry("F4", [4], [0, 4])), bytes(4)), ti, "a")
    vo = "validation_overflow"
    add("overflow-shape-product-2pow32-squared", st(one(entry("U8", [2**32, 2**32], [0, 1])), b"x"), vo, "a")
    add("overflow-shape-product-before-a-zero-dim",
        st(one(entry("U8", [U64_MAX, 2, 0], [0, 0]))), vo, "a")
    add("overflow-bits-f32-2pow62-elements", st(one(entry("F32", [2**62], [0, 0]))), vo, "a")
    add("overflow-bits-f4-exactly-2pow64", st(one(entry("F4", [2**62], [0, 0]))), vo, "a")
    add("overflow-bits-u8-u64-max-elements", st(one(entry("U8", [U64_MAX], [0, U64_MAX]))), vo, "a")
    ms = "misaligned_slice"
    add("misaligned-f4-odd-count", st(one(entry("F4", [3], [0, 2])), b"xx"), ms, "a")
    add("misaligned-f4-checked-before-size", st(one(entry("F4", [1], [0, 0]))), ms, "a")
    add("misaligned-f6-e2m3-one-element", st(one(entry("F6_E2M3", [1], [0, 1])), b"x"), ms, "a")
    add("misaligned-f6-e3m2-two-elements", st(one(entry("F6_E3M2", [2], [0, 2])), b"xx"), ms, "a")

    # __metadata__ types
    for id_, val in [("value-number", '{"k":1}'), ("value-null", '{"k":null}'), ("value-list", '{"k":["v"]}'),
                     ("value-object", '{"k":{}}'), ("value-bool", '{"k":true}'), ("is-list", '["k","v"]'),
                     ("is-string", '"k=v"'), ("is-number", "1"), ("is-true", "true"),
                     ("tensor-shaped-entry", entry())]:
        add(f"metadata-{id_}", st(obj(("__metadata__", val), ("a", entry())), DATA8), idd)

    # 5. data section must end exactly at the end of the file
    mi = "metadata_incomplete_buffer"
    add("trailing-byte-after-data", st(GOOD, DATA8 + b"\0"), mi)
    add("trailing-bytes-after-empty-state", st(padded("{}"), b"xx"), mi)
    add("data-one-byte-short", st(GOOD, DATA8[:7]), mi)
    add("data-missing", st(GOOD), mi)
    m = 2**61 - 1        # 8 contiguous U8 tensors of m bytes end at 2^64 - 8: 8 + N + end overflows
    add("data-end-plus-header-overflows-u64",
        st(obj(*[(f"t{i}", entry("U8", [m], [i * m, (i + 1) * m])) for i in range(8)])), mi)

    # nesting depth (serde_json refuses the 128th level)
    add("depth-128-arrays-in-unknown-field", st(one(entry(extra=',"x":' + nested_arrays(126))), DATA8), idd)
    add("depth-129-arrays-in-unknown-field", st(one(entry(extra=',"x":' + nested_arrays(127))), DATA8), idd)
    add("depth-128-objects-in-unknown-field",
        st(one(entry(extra=',"x":' + '{"k":' * 126 + "0" + "}" * 126)), DATA8), idd)
    add("depth-129-objects-in-unknown-field",
        st(one(entry(extra=',"x":' + '{"k":' * 127 + "0" + "}" * 127)), DATA8), idd)
    add("depth-100000-arrays-in-unknown-field",
        st(one(entry(extra=',"x":' + nested_arrays(100_000))), DATA8), idd)
    add("depth-100000-unclosed-arrays", st(one(entry(extra=',"x":' + nested_arrays(100_000, close=False)))), idd)
    add("depth-100000-objects-as-tensor-entry", st('{"a":' + '{"a":' * 100_000), idd)

    # names: escapes that are not characters, raw control characters
    for id_, name in [("lone-high-surrogate", "\\ud800"), ("lone-low-surrogate", "\\udc00"),
                      ("high-surrogate-then-ascii-escape", "\\ud800\\u0041"),
                      ("two-high-surrogates", "\\ud800\\ud800"), ("reversed-surrogate-pair", "\\ude00\\ud83d"),
                      ("high-surrogate-then-text", "\\ud83dx")]:
        add(f"name-{id_}", st(one(entry(), name=name), DATA8), idd)
    for id_, raw in [("newline", b"\n"), ("tab", b"\t"), ("nul-byte", b"\0"), ("unit-separator-1f", b"\x1f")]:
        add(f"name-raw-{id_}", with_name_bytes(b"a" + raw + b"b"), idd)
    add("unknown-field-string-with-lone-surrogate", st(one(entry(extra=',"x":"\\udfff"')), DATA8), idd)
    add("unknown-field-key-with-lone-surrogate", st(one(entry(extra=',"\\ud800":0')), DATA8), idd)
    add("metadata-value-with-raw-control-char",
        st(b'{"__metadata__":{"k":"a\x01b"},"a":' + b(entry()) + b"}", DATA8), idd)
    return c


MALFORMED = malformed_cases()


# ---- valid edge cases ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Good:
    id: str
    blob: bytes
    names: Optional[frozenset] = field(default=None)   # the exact tensor names, when worth spelling out


def _all_dtypes():
    sizes = [("BOOL", [3], 3), ("F4", [2, 3], 3), ("F6_E2M3", [4], 3), ("F6_E3M2", [8], 6), ("U8", [2], 2),
             ("I8", [2], 2), ("F8_E5M2", [1], 1), ("F8_E4M3", [1], 1), ("F8_E8M0", [1], 1),
             ("F8_E4M3FNUZ", [1], 1), ("F8_E5M2FNUZ", [1], 1), ("I16", [1], 2), ("U16", [1], 2),
             ("F16", [2], 4), ("BF16", [2], 4), ("I32", [1], 4), ("U32", [1], 4), ("F32", [1], 4),
             ("C64", [1], 8), ("F64", [1], 8), ("I64", [1], 8), ("U64", [1], 8)]
    pairs, off = [], 0
    for dt, shape, size in sizes:
        pairs.append((dt.lower(), entry(dt, shape, [off, off + size])))
        off += size
    return st(padded(obj(*pairs)), bytes(range(off)))


def valid_cases():
    c = []
    add = lambda id_, blob, names=None: c.append(Good(id_, blob, frozenset(names) if names else None))  # noqa
    add("empty-state-padded-with-6-spaces", st("{}      "))
    add("empty-state-unpadded", st("{}"))
    add("whitespace-around-empty-object", st(" \t\n\r{}\r\n\t "))
    add("whitespace-around-object-with-tensor", st("\n  " + GOOD + "  \n", DATA8))
    add("whitespace-everywhere-inside",
        st('{ "a" :\n{ "dtype" : "F32" ,\t"shape" : [ 2 ] , "data_offsets" : [ 0 , 8 ] } }', DATA8))
    assert (8 + len(GOOD)) % 8 != 0
    add("header-length-not-multiple-of-8", st(GOOD, DATA8))
    add("scalar-shape", st(one(entry("F32", [], [0, 4])), b"\0\0\x80?"))
    add("zero-size-tensors-sharing-an-offset",
        st(obj(("z1", entry("F32", [0], [0, 0])), ("z2", entry("U8", [0, 5], [0, 0])),
               ("a", entry("F32", [1], [0, 4])), ("z3", entry("I64", [3, 0], [4, 4])),
               ("z4", entry("BF16", [0], [4, 4]))), b"abcd"))
    add("zero-dim-before-huge-dims", st(one(entry("U8", [0, U64_MAX, U64_MAX], [0, 0]))))
    add("unknown-fields-in-entry-ignored",
        st(one(entry(extra=',"note":"hi","x":{"k":[1,-2.5e3,true,false,null,{}]},"n":-0,"big":%d' % 2**64)),
           DATA8))
    add("unknown-field-numbers-at-f64-limits",
        st(one(entry(extra=',"x":[1.7976931348623157e308,-1.7976931348623157e308,1e-400,4.9e-324,1%s,-1%s]'
                     % ("0" * 308, "0" * 308))), DATA8))
    add("unknown-field-depth-127-arrays-accepted", st(one(entry(extra=',"x":' + nested_arrays(125))), DATA8))
    add("unknown-field-depth-127-objects-accepted",
        st(one(entry(extra=',"x":' + '{"k":' * 125 + "0" + "}" * 125)), DATA8))
    add("metadata-null", st(obj(("__metadata__", "null"), ("a", entry())), DATA8))
    add("metadata-empty-object", st(obj(("__metadata__", "{}"), ("a", entry())), DATA8))
    add("metadata-escapes-and-non-ascii",
        st(obj(("__metadata__", '{"format":"pt","k\\n\\u00e9":"v\\"\\\\\\/\\t\\u001f","ключ":"値 ✓"}'),
               ("a", entry())), DATA8))
    add("metadata-key-and-value-with-escaped-nul",
        st(obj(("__metadata__", '{"k\\u0000a":"v\\u0000w","k\\u0000b":"x"}'), ("a", entry())), DATA8))
    add("metadata-key-spelled-with-escape", st(obj(("\\u005f_metadata__", '{"k":"v"}'), ("a", entry())), DATA8),
        ["a"])
    add("metadata-after-the-tensors", st(obj(("a", entry()), ("__metadata__", '{"x":"y"}')), DATA8))
    add("name-empty-string", st(one(entry(), name=""), DATA8), [""])
    add("name-with-escapes", st(one(entry(), name='a\\"b\\\\c\\/\\n\\t\\u001f'), DATA8), ['a"b\\c/\n\t\x1f'])
    add("names-differing-after-an-escaped-nul",
        st(obj(("a\\u0000x", entry("U8", [4], [0, 4])), ("a\\u0000y", entry("U8", [4], [4, 8]))), DATA8),
        ["a\0x", "a\0y"])
    add("name-non-ascii-raw-utf8", st(one(entry(), name="héllo.wörld.✓.😀"), DATA8), ["héllo.wörld.✓.😀"])
    add("name-surrogate-pair-escape", st(one(entry(), name="\\ud83d\\ude00\\u00e9"), DATA8), ["😀é"])
    add("name-raw-del-0x7f", st(one(entry(), name="a\x7fb"), DATA8), ["a\x7fb"])
    add("name-looks-like-metadata", st(one(entry(), name="__metadata"), DATA8), ["__metadata"])
    add("dtype-spelled-with-unicode-escapes", st(one(entry("\\u0046\\u0033\\u0032")), DATA8))
    add("entry-field-name-spelled-with-escape",
        st(one('{"d\\u0074ype":"F32","shape":[2],"data_offsets":[0,8]}'), DATA8))
    add("entry-keys-in-unusual-order", st(one('{"data_offsets":[0,8],"shape":[2],"dtype":"F32"}'), DATA8))
    add("tensors-listed-out-of-offset-order",
        st(obj(("c", entry("U8", [2], [6, 8])), ("a", entry("U8", [2], [0, 2])), ("b", entry("U8", [4], [2, 6]))),
           DATA8))
    add("all-22-dtypes", _all_dtypes())
    add("sixty-four-dims-of-one", st(one(entry("U8", [1] * 64, [0, 1])), b"x"))
    add("max-u64-dim-with-zero", st(one(entry("F64", [U64_MAX, 0], [0, 0]))))
    add("thousand-tensors",
        st(padded(obj(*[(f"layer.{i}.w", entry("U8", [1], [999 - i, 1000 - i])) for i in range(1000)])),
           bytes(1000)))
    return c


VALID = valid_cases()


# ---- running both readers -----------------------------------------------------------------------

@dataclass
class Ours:
    rc: int
    out: Optional[dict]
    stdout: str
    stderr: str

    def describe(self) -> str:
        return f"exit {self.rc}\nstdout: {self.stdout[:2000]}\nstderr: {self.stderr[:2000]}"


@dataclass
class Ref:
    ok: bool
    tensors: Optional[dict] = None      # name -> (dtype, shape)
    metadata: Optional[dict] = None
    error: str = ""

    def code(self) -> Optional[str]:
        for needle, code in REFERENCE_MESSAGES:
            if needle in self.error:
                return code
        return None


def reference_code(code: str) -> str:
    """The reference's code for a file we reject with code: it has no duplicate_key of its own."""
    return "invalid_header_deserialization" if code == "duplicate_key" else code


def ours(diloco_bin, path) -> Ours:
    p = run([diloco_bin, "inspect", "--json", "--hash", path])
    try:
        out = json.loads(p.stdout)
    except ValueError:
        out = None
    return Ours(p.returncode, out, p.stdout, p.stderr)


def reference(path) -> Ref:
    try:
        with safe_open(str(path), framework="numpy") as f:
            tensors = {}
            for name in f.keys():
                sl = f.get_slice(name)
                tensors[name] = (sl.get_dtype(), list(sl.get_shape()))
            return Ref(True, tensors, f.metadata())
    except BaseException as e:      # SafetensorError, OSError, or a pyo3 PanicException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return Ref(False, error=f"{type(e).__name__}: {e}")


def write(tmp_path, name: str, blob: bytes):
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(blob)
    return path


def our_error_code(o: Ours) -> Optional[str]:
    if o.out is None or not isinstance(o.out.get("error"), dict):
        return None
    return o.out["error"].get("code")


def check_rejection_shape(o: Ours, r: Ref):
    """exit 1, {"error":{"code":<stable>,"message":<non-empty>}} on stdout, a message on stderr."""
    assert o.rc == 1, f"expected exit 1, got {o.describe()}\nreference: {r.error or 'accepts'}"
    assert o.out is not None and set(o.out) == {"error"}, f"stdout is not an error object: {o.describe()}"
    err = o.out["error"]
    assert err.get("code") in STABLE_CODES, f"unknown error code {err.get('code')!r}: {o.describe()}"
    assert isinstance(err.get("message"), str) and err["message"], f"empty message: {o.describe()}"
    assert o.stderr.strip(), f"nothing on stderr: {o.describe()}"


def check_valid_output(o: Ours, blob: bytes, path):
    """exit 0 and an inspect document consistent with the bytes of the file."""
    assert o.rc == 0, f"expected exit 0, got {o.describe()}"
    assert o.out is not None and "error" not in o.out, f"not an inspect document: {o.describe()}"
    n = struct.unpack("<Q", blob[:8])[0]
    doc = o.out
    got = {k: doc.get(k) for k in ("file_size", "header_size", "data_offset")}
    assert got == {"file_size": len(blob), "header_size": n, "data_offset": 8 + n}, f"{got} for {path}"
    tensors = doc["tensors"]
    assert doc["tensor_count"] == len(tensors), f"tensor_count {doc['tensor_count']} != {len(tensors)}"
    starts = [tuple(t["data_offsets"]) for t in tensors]
    assert starts == sorted(starts), f"tensors not in offset order: {starts}"
    for t in tensors:
        lo, hi = t["data_offsets"]
        assert t["bytes"] == hi - lo, f"bytes {t['bytes']} != {hi} - {lo} for {t['name']!r}"
        want = hashlib.sha256(blob[8 + n + lo:8 + n + hi]).hexdigest()
        assert t["sha256"] == want, f"sha256 of {t['name']!r}: {t['sha256']} != {want}"
    assert doc["total_bytes"] == sum(t["bytes"] for t in tensors), f"total_bytes {doc['total_bytes']}"
    params = sum(math.prod(t["shape"]) for t in tensors)
    assert doc["total_parameters"] == params, f"total_parameters {doc['total_parameters']} != {params}"


def our_tensors(o: Ours) -> dict:
    return {t["name"]: (t["dtype"], list(t["shape"])) for t in o.out["tensors"]}


# ---- tests --------------------------------------------------------------------------------------

def test_catalogue_is_large_and_well_formed():
    ids = [c.id for c in MALFORMED] + [c.id for c in VALID]
    assert len(MALFORMED) >= 45, f"only {len(MALFORMED)} malformed cases"
    assert len(ids) == len(set(ids)), f"duplicate ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    assert all(c.code in STABLE_CODES for c in MALFORMED)
    unknown = set(REFERENCE_ACCEPTS_WE_REJECT) - {c.id for c in MALFORMED}
    assert not unknown, f"REFERENCE_ACCEPTS_WE_REJECT names unknown cases: {unknown}"


@pytest.mark.parametrize("case", MALFORMED, ids=[c.id for c in MALFORMED])
def test_malformed_file_is_rejected(diloco_bin, tmp_path, case: Bad):
    path = write(tmp_path, case.id, case.blob)
    o = ours(diloco_bin, path)
    r = reference(path)

    check_rejection_shape(o, r)
    got = our_error_code(o)
    assert got == case.code, f"error code: expected {case.code!r}, got {got!r}\n{o.describe()}"
    if case.tensor is not None:
        assert o.out["error"].get("tensor") == case.tensor, (
            f"error names tensor {o.out['error'].get('tensor')!r}, expected {case.tensor!r}")

    expected_ref_ok = case.id in REFERENCE_ACCEPTS_WE_REJECT
    assert r.ok == expected_ref_ok, (
        f"reference {'accepts' if r.ok else 'rejects'} the file, expected it to "
        f"{'accept' if expected_ref_ok else 'reject'}: {r.error or r.tensors}")
    if not r.ok:
        assert r.code() == reference_code(case.code), (
            f"reference reports {r.code()!r} ({r.error}), expected {reference_code(case.code)!r}")


def test_reference_accepts_exactly_the_expected_malformed_files(tmp_path):
    accepted = {c.id for c in MALFORMED if reference(write(tmp_path, c.id, c.blob)).ok}
    assert accepted == set(REFERENCE_ACCEPTS_WE_REJECT), (
        f"reference accepts {sorted(accepted)}\nexpected {sorted(REFERENCE_ACCEPTS_WE_REJECT)}")


@pytest.mark.parametrize("case", VALID, ids=[c.id for c in VALID])
def test_valid_edge_case_is_accepted_like_the_reference(diloco_bin, tmp_path, case: Good):
    path = write(tmp_path, case.id, case.blob)
    o = ours(diloco_bin, path)
    r = reference(path)

    assert r.ok, f"reference rejects a case meant to be valid: {r.error}"
    check_valid_output(o, case.blob, path)
    mine, theirs = our_tensors(o), r.tensors
    assert mine == theirs, f"tensors differ\nours:      {mine}\nreference: {theirs}"
    assert o.out["metadata"] == r.metadata, f"metadata: ours {o.out['metadata']!r}, reference {r.metadata!r}"
    if case.names is not None:
        assert set(mine) == case.names, f"names {set(mine)!r}, expected {set(case.names)!r}"


# ---- random mutations -----------------------------------------------------------------------------

MUTATION_BASE_HEADER = obj(
    ("__metadata__", '{"format":"pt","step":"12"}'),
    ("bias", entry("F32", [4], [0, 16])),
    ("w", entry("BF16", [2, 3], [16, 28])),
    ("q", entry("F4", [2, 2], [28, 30])),
    ("e", entry("U8", [0], [30, 30], extra=',"x":{"k":[1,"s"]}')),
    ("s", entry("I64", [], [30, 38])),
)
MUTATION_BASE_DATA = bytes(range(38))
MUTATIONS = 400
JSON_BYTES = b'{}[],:"\\0123456789-+.eE \t\nabfnrtu_xFUI\x00\x7f\xc3\xa9\xff'


def mutate(rng: random.Random, header: bytes, data: bytes) -> bytes:
    h = bytearray(header)
    length = None
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        kind = rng.randrange(8)
        i = rng.randrange(len(h)) if h else 0
        if kind == 0 and h:                                     # flip a bit
            h[i] ^= 1 << rng.randrange(8)
        elif kind == 1 and h:                                   # replace with a JSON-significant byte
            h[i] = rng.choice(JSON_BYTES)
        elif kind == 2 and h:                                   # delete a span
            del h[i:i + rng.randint(1, 4)]
        elif kind == 3:                                         # insert a byte
            h[i:i] = bytes([rng.choice(JSON_BYTES)])
        elif kind == 4 and h:                                   # copy a span elsewhere
            j = rng.randrange(len(h))
            h[j:j] = h[i:i + rng.randint(1, 24)]
        elif kind == 5:                                         # change a digit of a number
            digits = [k for k, ch in enumerate(h) if 0x30 <= ch <= 0x39]
            if digits:
                h[rng.choice(digits)] = rng.choice(b"0123456789")
        elif kind == 6:                                         # a length prefix that lies
            length = rng.choice([0, 1, len(h) - 1, len(h) + 1, len(h) + len(data), MAX_HEADER,
                                 MAX_HEADER + 1, U64_MAX, rng.randrange(2**64)])
        else:                                                   # grow or shrink the data
            data = data + b"\0" * rng.randint(1, 9) if rng.random() < 0.5 else data[:rng.randrange(len(data) + 1)]
    blob = st(bytes(h), data, length=length)
    if rng.random() < 0.1:                                      # truncate the whole file
        blob = blob[:rng.randrange(len(blob) + 1)]
    return blob


def test_random_mutations_never_crash_and_stay_stricter_than_the_reference(diloco_bin, tmp_path):
    rng = random.Random(0xD1_10C0)
    base_header, base_data = b(MUTATION_BASE_HEADER), MUTATION_BASE_DATA
    problems, outcomes = [], {"both accept": 0, "both reject": 0, "only we reject": 0}
    for i in range(MUTATIONS):
        blob = mutate(rng, base_header, base_data)
        path = write(tmp_path, f"mutant-{i:03d}", blob)
        o, r = ours(diloco_bin, path), reference(path)
        where = f"mutant {i} ({len(blob)} bytes) {blob[:300]!r}"
        if o.rc not in (0, 1):
            problems.append(f"{where}: crashed or bad exit code\n{o.describe()}")
            continue
        if o.out is None:
            problems.append(f"{where}: stdout is not JSON\n{o.describe()}")
            continue
        if o.rc == 1:
            code = our_error_code(o)
            if code not in STABLE_CODES:
                problems.append(f"{where}: unknown error code {code!r}\n{o.describe()}")
            elif r.ok:
                outcomes["only we reject"] += 1
                if code != "duplicate_key":
                    problems.append(f"{where}: we reject with {code!r}, the reference accepts {r.tensors}")
            else:
                outcomes["both reject"] += 1
                if r.code() != reference_code(code):
                    problems.append(f"{where}: we say {code!r}, the reference says {r.error}")
        else:
            if not r.ok:
                problems.append(f"{where}: we accept, the reference rejects: {r.error}\n{o.describe()}")
                continue
            outcomes["both accept"] += 1
            if our_tensors(o) != r.tensors or o.out.get("metadata") != r.metadata:
                problems.append(f"{where}: parse differs\nours:      {our_tensors(o)} {o.out.get('metadata')}"
                                f"\nreference: {r.tensors} {r.metadata}")
    assert not problems, f"{len(problems)} of {MUTATIONS} mutants misbehave ({outcomes}):\n" + "\n\n".join(
        problems[:20])
    assert outcomes["both reject"] > MUTATIONS // 2, f"mutations too weak: {outcomes}"
    assert outcomes["both accept"] > 0, f"no mutant stayed valid, the comparison of parses never ran: {outcomes}"


# ---- "not a safetensors file" on every intake path --------------------------------------------------
# The same words whichever way a foreign file comes in: diloco inspect (above), an HTTP upload, a delta
# in a file:// tree.

from test_http_api import daemons, delta_blob, put, session, small_model  # noqa: E402,F401


def _foreign_files():
    """What people upload by mistake, made by the real tools: torch.save's ZIP checkpoint and a text
    file (a Git LFS pointer, what a clone without LFS leaves in place of the weights).  Maps a name to
    the file and what the refusal must say about it."""
    import io

    import torch
    buf = io.BytesIO()
    torch.save({"layer.weight": torch.zeros(32, 16)}, buf)
    assert buf.getvalue()[:4] == b"PK\x03\x04"
    text = b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 + b"\nsize 2056\n"
    return {
        "torch.save": (buf.getvalue(), "not a safetensors file: it starts like a ZIP archive (a torch.save checkpoint is one)"),
        "text": (text, 'not a safetensors file: it starts with text ("version ") where the 8-byte header length belongs'),
    }


def test_http_upload_of_a_torch_checkpoint_or_text_says_not_a_safetensors_file(daemons):
    """A PUT with Content-Length and one with a chunked body (the length unknown up front): the refusal
    names the file's kind and keeps the reference's code; the daemon takes a real delta afterwards."""
    model = small_model(3)
    d = daemons(model, "--expected-nodes", "2")
    url = f"http://127.0.0.1:{d.port}"
    for name, (blob, words) in _foreign_files().items():
        chunked = session().put(f"{url}/nodes/node-a/delta_1.safetensors", data=iter([blob[:5], blob[5:]]),
                                timeout=60)
        for r in (put(url, "node-a", 1, blob), chunked):
            assert r.status_code == 400, (name, r.status_code, r.text)
            assert r.json()["error"] == {"code": "header_too_large", "message": words}, (name, r.text)
    tensors = {k: (v * 0.01).float().numpy() for k, v in model.items() if v.is_floating_point()}
    r = put(url, "node-a", 1, delta_blob("node-a", 0, 1, tensors))
    assert r.status_code in (200, 201, 202), r.text
    assert d.stop() == 0


def test_file_hub_delta_that_is_a_torch_checkpoint_or_text_says_not_a_safetensors_file(daemons, tmp_path):
    """The same files dropped into a file:// tree as deltas: intake logs the same words."""
    import os

    hub = tmp_path / "hub"
    hub.mkdir()
    d = daemons(small_model(3), "--expected-nodes", "2", hub=hub)
    d.wait_step(0)
    for node, (name, (blob, words)) in zip(("w1", "w2"), _foreign_files().items()):
        (hub / "nodes" / node).mkdir(parents=True)
        (hub / "nodes" / node / ".tmp").write_bytes(blob)
        os.rename(hub / "nodes" / node / ".tmp", hub / "nodes" / node / "delta_1.safetensors")
        rejected = f"intake: delta rejected path=nodes/{node}/delta_1.safetensors code=header_too_large"
        d.wait_log(rejected)
        line = [ln for ln in d.log_text().splitlines() if rejected in ln][-1]
        assert 'error="' + words.replace('"', '\\"') + '"' in line, (name, line)
    assert d.alive()
    assert d.stop() == 0
