"""Signed rounds on the worker's side (README "Verifiable rounds").

With --signing-key, dilocod publishes for every committed step s a record, global/rounds/<s>.json, and
its detached Ed25519 signature, global/rounds/<s>.json.sig (64 raw bytes over the exact .json bytes).  The
record names the block hash (diloco.blockhash) of the global it published ("outputs"."global") and the
block hash of the previous step's record ("previous"), so the records form a chain.

RecordChain checks a global before it is loaded: the record's signature under the operator's public key,
its link to the last record this worker verified (walking the records of the steps it skipped), the
global's bytes against the record, and that the step is not below the highest verified (or min_step).
Anything else raises errors.RecordRefused.  The signature is checked with the `cryptography` package
(Debian's python3-cryptography), an implementation independent of the server's OpenSSL calls."""
import hashlib
import json
import re

from .blockhash import block_hash_bytes
from .errors import RecordRefused

HEX64 = re.compile(r"^[0-9a-f]{64}$")
MAX_CHAIN_WALK = 100_000            # records fetched to link a step to the last one verified


def load_public_key(path):
    """An Ed25519 public key (PEM SubjectPublicKeyInfo, as `diloco keygen` writes FILE.pub) ->
    (key, fingerprint): the sha256 of its 32 raw bytes in hex, as records name it."""
    try:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat, load_pem_public_key
    except ImportError as e:
        raise ImportError("public_key= needs the 'cryptography' package (Debian: apt install python3-cryptography; "
                          "pip: cryptography)") from e
    with open(path, "rb") as f:
        raw = f.read(1 << 16)
    key = load_pem_public_key(raw)
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"{path}: not an Ed25519 public key")
    return key, hashlib.sha256(key.public_bytes(Encoding.Raw, PublicFormat.Raw)).hexdigest()


def _is_u53(v):
    return type(v) is int and 0 <= v <= 2 ** 53 - 1


def parse_record(raw: bytes, step, fingerprint):
    """A signed record's JSON, checked for what a worker reads of it -> dict (RecordRefused "record")."""
    try:
        rec = json.loads(raw)
    except ValueError as e:
        raise RecordRefused("record", step, f"not JSON: {e}") from None
    if not isinstance(rec, dict) or rec.get("format") != 1:
        raise RecordRefused("record", step, "not a record of format 1")
    if rec.get("outer_step") != step or not _is_u53(rec.get("outer_step")):
        raise RecordRefused("record", step, f"the record is of step {rec.get('outer_step')!r:.40}")
    prev = rec.get("previous")
    if prev is not None and not (isinstance(prev, str) and HEX64.match(prev)):
        raise RecordRefused("record", step, "previous is neither null nor a block hash")
    agg = rec.get("aggregator")
    if not isinstance(agg, dict) or agg.get("key_fingerprint") != fingerprint:
        raise RecordRefused("record", step, "the record names another key's fingerprint")
    out = rec.get("outputs")
    g = out.get("global") if isinstance(out, dict) else None
    if not isinstance(g, dict) or not (isinstance(g.get("block_hash"), str) and HEX64.match(g["block_hash"])) \
            or not _is_u53(g.get("bytes")):
        raise RecordRefused("record", step, "outputs.global holds no block hash and size")
    return rec


class RecordChain:
    """The chain of records one worker has verified.  fetch(step) -> (json bytes, signature bytes) or None."""

    def __init__(self, public_key_path, fetch, min_step=None, max_walk=MAX_CHAIN_WALK):
        if min_step is not None and not _is_u53(min_step):
            raise ValueError(f"min_step must be an integer in [0, 2^53 - 1], not {min_step!r}")
        self.key, self.fingerprint = load_public_key(public_key_path)
        self.fetch = fetch
        self.min_step = min_step
        self.max_walk = max_walk
        self.last_step = None       # the newest step verified, its record's block hash and the record
        self.last_hash = None
        self.record = None
        self._pending = None

    def verified(self, step):
        """Step's record fetched, its signature checked -> (record dict, its block hash)."""
        got = self.fetch(step)
        if got is None:
            raise RecordRefused("missing", step, "no signed record of this step (global/rounds/<s>.json)")
        raw, sig = got
        from cryptography.exceptions import InvalidSignature
        try:
            if len(sig) != 64:
                raise InvalidSignature()
            self.key.verify(bytes(sig), bytes(raw))
        except InvalidSignature:
            raise RecordRefused("signature", step, "the record's signature is not the public key's") from None
        return parse_record(raw, step, self.fingerprint), block_hash_bytes(raw)

    def _link(self, step, rec):
        """rec (step's) chains back to the last verified record, through every step in between."""
        prev, s, walked = rec.get("previous"), step - 1, 0
        while s > self.last_step:
            walked += 1
            if walked > self.max_walk:
                raise RecordRefused("chain", step, f"more than {self.max_walk} records since the last verified "
                                    f"step {self.last_step}: start a new Worker with min_step")
            r, h = self.verified(s)
            if prev != h:
                raise RecordRefused("chain", step, f"the record of step {s + 1} does not name step {s}'s record "
                                    "as its previous")
            prev, s = r.get("previous"), s - 1
        if prev != self.last_hash:
            raise RecordRefused("chain", step, f"the chain does not lead back to the record of step {self.last_step} "
                                "this worker verified")

    def _record_for(self, step):
        """The verified record of step, linked to the chain, not below the floor -> (record, its hash)."""
        floor = max(x for x in (self.last_step, self.min_step, -1) if x is not None)
        if step < floor:
            raise RecordRefused("rollback", step, f"below step {floor}, the highest verified (or min_step)")
        rec, h = self.verified(step)
        if self.last_step is not None:
            if step == self.last_step and h != self.last_hash:
                raise RecordRefused("chain", step, "another record of the step already verified")
            if step > self.last_step:
                self._link(step, rec)
        return rec, h

    def check_global(self, step, files, weight_map):
        """The transport's check: the global of step, its files' bytes, before they are parsed."""
        if weight_map is not None or list(files) != ["latest.safetensors"]:
            floor = max(x for x in (self.last_step, self.min_step, -1) if x is not None)
            if step < floor:
                raise RecordRefused("rollback", step, f"below step {floor}, the highest verified (or min_step)")
            raise RecordRefused("output", step, "a sharded global's shards are not in signed records yet")
        rec, h = self._record_for(step)
        buf = files["latest.safetensors"]
        want = rec["outputs"]["global"]
        if len(buf) != want["bytes"] or block_hash_bytes(buf) != want["block_hash"]:
            raise RecordRefused("output", step, "the global's bytes are not the ones its record signs")
        self._pending = (step, h, rec)

    def check_view(self, step, buf):
        """Worker(downlink=True)'s check: the view of step (its bytes, replayed or downloaded) against the
        record's outputs.view; a step whose record names no view (a bootstrap, an adoption, the step the
        downlink starts at) serves its global as its view: outputs.global."""
        rec, h = self._record_for(step)
        want = rec["outputs"].get("view", rec["outputs"]["global"])
        if not isinstance(want, dict) or not HEX64.match(str(want.get("block_hash", ""))) or \
                not _is_u53(want.get("bytes")):
            raise RecordRefused("record", step, "outputs.view holds no block hash and size")
        if len(buf) != want["bytes"] or block_hash_bytes(buf) != want["block_hash"]:
            raise RecordRefused("output", step, "the view's bytes are not the ones its record signs")
        self._pending = (step, h, rec)

    def accept(self):
        """The global checked last was installed: its record is the chain's newest."""
        if self._pending is not None:
            self.last_step, self.last_hash, self.record = self._pending
            self._pending = None
