"""The IDX file format of MNIST and Fashion-MNIST, raw or gzip-compressed.

Layout: a 4-byte magic number ``0x00 0x00 <dtype code> <ndim>``, then ``ndim`` big-endian
int32 dimension sizes, then the data in row-major order, big-endian. ``read_idx`` checks all
of it, down to the exact data length, because a truncated download or a file with trailing
garbage otherwise loads as silently wrong pixels.

Reading is bounded by the header: a gzip stream is inflated incrementally
(``zlib.decompressobj`` with a ``max_length``), never past the bytes the header's shape
needs plus ``TRAILING_LIMIT``, so a small file that inflates to gigabytes (a gzip bomb)
costs at most the memory its header declares before it is rejected. And the header's
declaration is checked against the bytes the file holds before its array is allocated (the
file's size budget, as ``engine.file_safety`` sets it for every reader): a raw file holds
its data bytes as they are; a gzip stream is trusted to inflate
to ``INFLATION_TRUSTED`` times its size (handwritten digits: about 5), and one that declares
more is first inflated in ``_INPUT_STEP`` chunks that are counted and dropped, so a 1 MB
file whose header declares gigabytes its stream does not hold is refused in linear time
within about its own size in memory.
"""
import gzip
import math
import struct
import sys
import zlib

import numpy as np

from engine.archive import atomic_write

# IDX dtype code -> big-endian NumPy dtype (the codes of the format's definition)
IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_CODE_OF_KIND = {(dtype.kind, dtype.itemsize): code for code, dtype in IDX_DTYPES.items()}
_GZIP_MAGIC = b"\x1f\x8b"
TRAILING_LIMIT = 1 << 20   # trailing bytes are counted exactly up to this many
_INPUT_STEP = 1 << 20      # compressed bytes given to one decompress call
INFLATION_TRUSTED = 8      # inflated / compressed size a gzip IDX file is believed without counting


class _Content:
    """The decompressed bytes of an IDX file, produced on demand and never more than asked
    for. A gzip file may hold several members (as ``gzip`` writes on append) and zero
    padding after them, as the ``gzip`` module accepts. The compressed input is fed in
    steps of ``_INPUT_STEP`` bytes, so no call copies the whole input as its
    ``unconsumed_tail``."""

    def __init__(self, content, name, digest):
        self.name, self.digest = name, digest
        self.source, self.position = memoryview(content), 0
        self.gzip = content[:2] == _GZIP_MAGIC
        self.inflate = zlib.decompressobj(wbits=31)   # 31: expect a gzip header
        self.pending = b""

    def read(self, count):
        """The next ``count`` bytes, fewer only at the end of the content."""
        if not self.gzip:
            chunk = self.source[self.position:self.position + count]
            self.position += len(chunk)
        else:
            pieces, have = [], 0
            while have < count and (piece := self._inflate(count - have)) is not None:
                pieces.append(piece)
                have += len(piece)
            chunk = bytearray().join(pieces)   # writable: the array can keep it, uncopied
        if self.digest is not None:
            self.digest.update(chunk)
        return chunk

    def _inflate(self, limit):
        """What one decompress call gives (at most ``limit`` bytes); None at the end."""
        if self.inflate.eof:
            rest = self.inflate.unused_data + self.source[self.position:]
            if rest[:2] != _GZIP_MAGIC:
                if rest.strip(b"\0"):
                    raise ValueError(f"{self.name}: not a valid gzip stream ({len(rest)} bytes "
                                     "of garbage after its end)")
                return None
            self.inflate = zlib.decompressobj(wbits=31)
            self.source, self.position, self.pending = memoryview(rest), 0, b""
        data = self.pending
        if not data:
            data = self.source[self.position:self.position + _INPUT_STEP]
            self.position += len(data)
        try:
            piece = self.inflate.decompress(data, min(limit, sys.maxsize))
        except zlib.error as exc:
            raise ValueError(f"{self.name}: not a valid gzip stream ({exc})") from None
        self.pending = self.inflate.unconsumed_tail
        if not piece and not data and not self.inflate.eof:
            raise ValueError(f"{self.name}: not a valid gzip stream (it ends early: "
                             "truncated)")
        return piece


def read_idx(path):
    """The array stored in the IDX file at ``path`` (``.gz`` or raw), native byte order.

    Raises ``ValueError`` naming the file and what is wrong with it."""
    with open(path, "rb") as f:
        return parse_idx(f.read(), path)


def parse_idx(content, name, digest=None):
    """The array in ``content``, the bytes of an IDX file (gzip-compressed or raw).

    ``name`` only appears in error messages. ``digest``, a ``hashlib`` object, is updated
    with the decompressed IDX bytes as they are read (its digest is then the checksum of
    the content, whatever the compression). The result is writable, native-endian and
    never a view of ``content``."""
    stream = _Content(content, name, digest)
    magic = stream.read(4)
    if len(magic) < 4:
        raise ValueError(f"{name}: {len(magic)} bytes is too short for an IDX header")
    zero0, zero1, code, ndim = magic
    if zero0 != 0 or zero1 != 0:
        raise ValueError(f"{name}: bad magic number 0x{bytes(magic).hex()} "
                         "(an IDX file starts with two zero bytes)")
    if code not in IDX_DTYPES:
        known = ", ".join(f"0x{c:02X}" for c in IDX_DTYPES)
        raise ValueError(f"{name}: unknown IDX dtype code 0x{code:02X} (known: {known})")
    if ndim == 0:
        raise ValueError(f"{name}: the header declares 0 dimensions (at least 1 expected)")
    header_size = 4 + 4 * ndim
    sizes = stream.read(4 * ndim)
    if len(sizes) < 4 * ndim:
        raise ValueError(f"{name}: truncated header: {ndim} dimensions need {header_size} "
                         f"bytes, the file has {4 + len(sizes)}")
    shape = struct.unpack(f">{ndim}I", sizes)
    dtype = IDX_DTYPES[code]
    expected = math.prod(shape) * dtype.itemsize
    present = _data_bytes_present(content, name, header_size, expected)
    if expected > present:
        raise ValueError(f"{name}: truncated: shape {shape} of {dtype.newbyteorder('=')} "
                         f"needs {expected} data bytes, the file has {present}")
    data = stream.read(expected)
    if len(data) < expected:
        raise ValueError(f"{name}: truncated: shape {shape} of {dtype.newbyteorder('=')} "
                         f"needs {expected} data bytes, the file has {len(data)}")
    trailing = len(stream.read(TRAILING_LIMIT + 1))
    if trailing:
        count = f"more than {TRAILING_LIMIT}" if trailing > TRAILING_LIMIT else f"{trailing}"
        raise ValueError(f"{name}: {count} trailing bytes after the data of shape {shape} "
                         f"({expected} bytes)")
    array = np.frombuffer(data, dtype, count=math.prod(shape)).reshape(shape)
    # a view of ``content`` (raw files) is copied; inflated bytes are the array's own and
    # are copied only to swap the byte order
    return array.astype(dtype.newbyteorder("="), copy=not array.flags.writeable)


def _data_bytes_present(content, name, header_size, expected):
    """The data bytes (after the header) the IDX ``content`` can hold: a raw file's own;
    a gzip stream's, up to ``INFLATION_TRUSTED`` times its size without counting them, else
    counted (up to ``expected + 1``) by inflating it in chunks that are dropped at once."""
    if content[:2] != _GZIP_MAGIC:
        return len(content) - header_size
    if expected <= INFLATION_TRUSTED * len(content):
        return INFLATION_TRUSTED * len(content)
    stream, counted = _Content(content, name, None), 0
    while counted < header_size + expected + 1:
        chunk = stream.read(min(_INPUT_STEP, header_size + expected + 1 - counted))
        if not chunk:
            break
        counted += len(chunk)
    return counted - header_size


def write_idx(path, array):
    """Write ``array`` as an IDX file (gzip-compressed when ``path`` ends in ``.gz``).

    Atomic (``engine.archive.atomic_write``): a crash never leaves a half-written file under
    the final name, and the file gets the mode ``open()`` would give it."""
    array = np.asarray(array)
    code = _CODE_OF_KIND.get((array.dtype.kind, array.dtype.itemsize))
    if code is None:
        raise ValueError(f"write_idx {path}: dtype {array.dtype} has no IDX code "
                         "(uint8, int8, int16, int32, float32 or float64)")
    if not 1 <= array.ndim <= 255:
        raise ValueError(f"write_idx {path}: IDX stores 1 to 255 dimensions, got shape "
                         f"{array.shape}")
    if any(size >= 2 ** 32 for size in array.shape):
        raise ValueError(f"write_idx {path}: dimension sizes must fit in 32 bits, got "
                         f"{array.shape}")
    header = bytes((0, 0, code, array.ndim)) + struct.pack(f">{array.ndim}I", *array.shape)
    content = header + np.ascontiguousarray(array, dtype=IDX_DTYPES[code]).tobytes()
    if str(path).endswith(".gz"):
        content = gzip.compress(content, compresslevel=9, mtime=0)   # mtime 0: reproducible bytes
    with atomic_write(path) as file:
        file.write(content)
