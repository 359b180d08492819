"""The IDX file format of MNIST and Fashion-MNIST, raw or gzip-compressed.

Layout: a 4-byte magic number ``0x00 0x00 <dtype code> <ndim>``, then ``ndim`` big-endian
int32 dimension sizes, then the data in row-major order, big-endian. ``read_idx`` checks all
of it, down to the exact data length, because a truncated download or a file with trailing
garbage otherwise loads as silently wrong pixels.
"""
import gzip
import math
import os
import struct
import tempfile
import zlib

import numpy as np

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


def read_idx(path):
    """The array stored in the IDX file at ``path`` (``.gz`` or raw), native byte order.

    Raises ``ValueError`` naming the file and what is wrong with it."""
    with open(path, "rb") as f:
        return parse_idx(f.read(), path)


def parse_idx(content, name):
    """The array in ``content``, the bytes of an IDX file (gzip-compressed or raw).

    ``name`` only appears in error messages. The result is writable and owns its memory."""
    if content[:2] == _GZIP_MAGIC:
        try:
            content = zlib.decompress(content, wbits=31)   # 31: expect a gzip header
        except zlib.error as exc:
            raise ValueError(f"{name}: not a valid gzip stream ({exc})") from None
    if len(content) < 4:
        raise ValueError(f"{name}: {len(content)} bytes is too short for an IDX header")
    zero0, zero1, code, ndim = content[:4]
    if zero0 != 0 or zero1 != 0:
        raise ValueError(f"{name}: bad magic number 0x{content[:4].hex()} "
                         "(an IDX file starts with two zero bytes)")
    if code not in IDX_DTYPES:
        known = ", ".join(f"0x{c:02X}" for c in IDX_DTYPES)
        raise ValueError(f"{name}: unknown IDX dtype code 0x{code:02X} (known: {known})")
    if ndim == 0:
        raise ValueError(f"{name}: the header declares 0 dimensions (at least 1 expected)")
    header_size = 4 + 4 * ndim
    if len(content) < header_size:
        raise ValueError(f"{name}: truncated header: {ndim} dimensions need {header_size} "
                         f"bytes, the file has {len(content)}")
    shape = struct.unpack(f">{ndim}I", content[4:header_size])
    dtype = IDX_DTYPES[code]
    expected = math.prod(shape) * dtype.itemsize
    found = len(content) - header_size
    if found < expected:
        raise ValueError(f"{name}: truncated: shape {shape} of {dtype.newbyteorder('=')} "
                         f"needs {expected} data bytes, the file has {found}")
    if found > expected:
        raise ValueError(f"{name}: {found - expected} trailing bytes after the data of "
                         f"shape {shape} ({expected} bytes)")
    array = np.frombuffer(content, dtype, count=math.prod(shape), offset=header_size)
    # astype copies: the result is writable, native-endian and does not pin ``content``
    return array.reshape(shape).astype(dtype.newbyteorder("="))


def write_idx(path, array):
    """Write ``array`` as an IDX file (gzip-compressed when ``path`` ends in ``.gz``).

    Atomic: the bytes go to a temporary file in the same folder that then replaces ``path``,
    so a crash never leaves a half-written file under the final name."""
    array = np.asarray(array)
    code = _CODE_OF_KIND.get((array.dtype.kind, array.dtype.itemsize))
    if code is None:
        raise ValueError(f"write_idx {path}: dtype {array.dtype} has no IDX code "
                         "(uint8, int8, int16, int32, float32 or float64)")
    if not 1 <= array.ndim <= 255:
        raise ValueError(f"write_idx {path}: IDX stores 1 to 255 dimensions, got shape {array.shape}")
    if any(size >= 2 ** 32 for size in array.shape):
        raise ValueError(f"write_idx {path}: dimension sizes must fit in 32 bits, got {array.shape}")
    header = bytes((0, 0, code, array.ndim)) + struct.pack(f">{array.ndim}I", *array.shape)
    content = header + np.ascontiguousarray(array, dtype=IDX_DTYPES[code]).tobytes()
    if str(path).endswith(".gz"):
        content = gzip.compress(content, compresslevel=9, mtime=0)   # mtime 0: reproducible bytes
    write_atomic(path, content)


def write_atomic(path, content):
    """Write ``content`` to ``path`` through a temporary file and ``os.replace``."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, temp_path = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
        os.chmod(temp_path, 0o644)   # mkstemp makes it private (0600); a data file is not
        os.replace(temp_path, path)
    except BaseException:
        os.unlink(temp_path)
        raise
