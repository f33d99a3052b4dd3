"""The block hash (common/blockhash.c, `diloco hash`, the package's diloco.blockhash) against a reference
written here from its definition with Python's hashlib: sha256 of the concatenated sha256 digests of the
consecutive 16 MiB blocks, an empty file being one empty block.  Sizes around the block boundary, a file
that cannot be read (the others still hashed, exit 3), and names that are not printable."""
import hashlib
import os

import diloco.blockhash as bh

BLOCK = 16 << 20
SIZES = (0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 12345)


def reference(data):
    blocks = [data[i:i + BLOCK] for i in range(0, len(data), BLOCK)] or [b""]
    return hashlib.sha256(b"".join(hashlib.sha256(b).digest() for b in blocks)).hexdigest()


def test_the_three_implementations_agree_with_the_definition(tmp_path, diloco):
    rng = __import__("random").Random(7)
    files = {}
    for n in SIZES:
        data = rng.randbytes(n)
        p = tmp_path / f"f{n}.bin"
        p.write_bytes(data)
        files[p] = reference(data)
        assert bh.block_hash_bytes(data) == files[p], n
        assert bh.block_hash_file(p) == files[p], n
        # pieces that straddle the boundary
        h = bh.BlockHasher()
        for i in range(0, n, 7_000_001):
            h.update(data[i:i + 7_000_001])
        assert h.hexdigest() == files[p], n
    out = diloco("hash", *files, check=0).stdout.splitlines()
    assert out == [f"{want}  {p}" for p, want in files.items()], out
    # it is not the file's plain sha256 once there is more than one block
    big = tmp_path / f"f{2 * BLOCK + 12345}.bin"
    assert files[big] != hashlib.sha256(big.read_bytes()).hexdigest()


def test_a_file_that_cannot_be_read_is_named_and_the_others_hashed(tmp_path, diloco):
    good = tmp_path / "good"
    good.write_bytes(b"abc")
    p = diloco("hash", tmp_path / "missing", good, tmp_path)
    assert p.returncode == 3, (p.returncode, p.stderr)
    assert "missing" in p.stderr and "io" in p.stderr, p.stderr
    assert p.stdout.splitlines() == [f"{reference(b'abc')}  {good}"], p.stdout
    assert diloco("hash").returncode == 2
    assert "block hash" in diloco("hash", "--help", check=0).stdout


def test_a_name_with_control_bytes_is_printed_escaped(tmp_path, diloco):
    name = tmp_path / "a\x1b[2Jb"
    name.write_bytes(b"")
    line = diloco("hash", name, check=0).stdout
    assert "\x1b" not in line and line.startswith(reference(b"") + "  "), repr(line)


def test_a_finished_hasher_refuses_more_input():
    h = bh.BlockHasher()
    h.update(b"x")
    assert h.hexdigest() == reference(b"x")
    try:
        h.update(b"y")
    except ValueError:
        pass
    else:
        raise AssertionError("update after hexdigest was accepted")
    assert h.hexdigest() == reference(b"x")
