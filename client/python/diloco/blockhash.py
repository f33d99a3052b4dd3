"""The block hash: the project's one content hash of a file (server/README.md, "The block hash").

The sha256 of the concatenated raw sha256 digests of the file's consecutive 16 MiB blocks (the last may
be short; an empty file is one empty block).  `diloco hash FILE` prints the same; signed round records and
the downlink's views name files by it."""
import hashlib

BLOCK = 16 << 20


class BlockHasher:
    """Streaming: update() with pieces of any size, in order, then hexdigest()."""

    def __init__(self):
        self._outer = hashlib.sha256()
        self._block = hashlib.sha256()
        self._in_block = 0
        self._done = None

    def update(self, data):
        if self._done is not None:
            raise ValueError("block hash updated after it was finished")
        view = memoryview(data).cast("B")
        while len(view):
            take = min(BLOCK - self._in_block, len(view))
            self._block.update(view[:take])
            self._in_block += take
            view = view[take:]
            # a full block is closed only when more bytes follow, as in common/blockhash.c
            if self._in_block == BLOCK and len(view):
                self._close_block()
        return self

    def _close_block(self):
        self._outer.update(self._block.digest())
        self._block = hashlib.sha256()
        self._in_block = 0

    def digest(self):
        if self._done is None:
            self._close_block()
            self._done = self._outer.digest()
        return self._done

    def hexdigest(self):
        return self.digest().hex()


def block_hash_bytes(data):
    """The block hash of in-memory bytes, as hex."""
    return BlockHasher().update(data).hexdigest()


def block_hash_file(path, chunk=1 << 20):
    """The block hash of a file's bytes, as hex (read in 1 MiB pieces)."""
    h = BlockHasher()
    with open(path, "rb") as f:
        while True:
            piece = f.read(chunk)
            if not piece:
                break
            h.update(piece)
    return h.hexdigest()
