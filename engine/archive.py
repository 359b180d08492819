"""Files written whole or not at all, the npz + JSON format of models and checkpoints, and
safetensors files.

Writing. ``atomic_write(path)`` yields a binary file; its bytes replace ``path`` only when
the block ends without an exception, so a crash, a kill or a full disk leaves the previous
file as it was. The rules:

- the bytes go to a unique temporary file in the target's folder, made by
  ``tempfile.mkstemp`` and named ``.<target name>.<pid>.<random>.partial``; they are
  flushed and fsync'ed, then ``os.replace`` renames the file over the target and the folder
  is fsync'ed, so the rename itself survives a power cut;
- two threads or processes writing one target never share a temporary file: the last
  rename wins and each reader sees one whole version;
- the final file has the mode ``open()`` would give it: an existing target keeps its mode,
  a new one gets 0o666 less the umask (not mkstemp's private 0600);
- after a successful write, the stale temporary files of the same target are removed:
  those whose writer's pid no longer runs on this machine and that were last modified more
  than ``STALE_SECONDS`` ago (the age guards a folder shared with another machine over a
  network file system, where that machine's pids mean nothing here).

Reading. ``read_npz`` reads an ``.npz`` of uncompressed ``.npy`` entries (what ``np.savez``
writes) without pickles and within bounds: every entry's header must declare exactly the
bytes the entry holds before anything is allocated, and every entry's declared size is
charged to the file's ``engine.file_safety.SizeBudget`` first (a stored entry holds exactly
what it declares), so a damaged or crafted file costs at most its own size in memory.
Any damage is a ``ValueError`` naming the file.

safetensors. ``write_safetensors`` writes ``{name: array}`` and text metadata through
``atomic_write`` with the ``safetensors`` package's NumPy API (the formats extra), adding a
CRC-32 of the metadata and of every array's name, dtype, shape and bytes under
``CHECKSUM_KEY``: safetensors itself checks only that the header's offsets cover the file,
so a flipped byte among the weights would otherwise load silently. ``read_safetensors``
reads a file through ``safetensors.safe_open`` (a JSON header and raw bytes: nothing in the
file can run code, and the offsets are checked against the file's size before anything is
allocated) and checks the CRC when the file has one (files written elsewhere have none).
Any damage is a ``ValueError`` naming the file.

Codec. ``encode`` turns nested dicts, lists, tuples, numbers, text and arrays into a JSON
skeleton plus a dict of arrays; ``decode`` turns them back, checking the skeleton's shape
and depth.
"""
import contextlib
import json
import math
import os
import re
import stat
import tempfile
import threading
import time
import zipfile
import zlib

import numpy as np

from engine.file_safety import SizeBudget, check_write_target
from ops.device import to_host

ZIP_MAGIC = b"PK\x03\x04"   # the first bytes of every .npz (a ZIP archive)
TEMPORARY_SUFFIX = ".partial"
STALE_SECONDS = 60.0
MAX_DEPTH = 64              # nesting of an encoded value; an optimizer state needs about 8
NPY_HEADER_LIMIT = 10_000   # bytes of one .npy header (numpy's own default limit)
_NAME_IN_TEMPORARY = 200    # characters of the target's name kept in its temporaries' names
_NUMERIC_OR_TEXT = "biufcU"
_umask_lock = threading.Lock()
CHECKSUM_KEY = "engine.crc32"   # the safetensors metadata entry of write_safetensors's CRC
SAFETENSORS_HINT = "pip install 'numba-engine[formats]'"
_SAFETENSORS_ITEMSIZE = {**dict.fromkeys(("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3"), 1),
                         **dict.fromkeys(("U16", "I16", "F16", "BF16"), 2),
                         **dict.fromkeys(("U32", "I32", "F32"), 4),
                         **dict.fromkeys(("U64", "I64", "F64"), 8)}


class _Damage(Exception):
    """What is wrong with a file being read, in words (becomes read_npz's ValueError)."""


def _reason(error):
    return str(error) if isinstance(error, _Damage) else f"{type(error).__name__}: {error}"


# ------------------------------------------------------------------ writing

def _temporary_prefix(name, pid):
    return f".{name[:_NAME_IN_TEMPORARY]}.{pid}."


def _umask():
    """The process's umask, read without changing it where Linux tells it (/proc)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    with _umask_lock:   # elsewhere: set and restore (racy only against other threads' umask)
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def _final_mode(path):
    """The permission bits ``open(path, "w")`` would leave ``path`` with."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _sync_folder(folder):
    if not hasattr(os, "O_DIRECTORY"):   # Windows cannot open a folder to fsync it
        return
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def atomic_write(path):
    """``with atomic_write(path) as file: file.write(...)``: the bytes written replace
    ``path`` in one rename when the block ends without an exception; on an exception the
    temporary file is removed and ``path`` is untouched. Rules in the module docstring."""
    path = os.fspath(path)
    check_write_target(path)   # a rename over /dev/null would replace the device itself
    folder, name = os.path.split(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(dir=folder, suffix=TEMPORARY_SUFFIX,
                                         prefix=_temporary_prefix(name, os.getpid()))
    try:
        with os.fdopen(handle, "wb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
            os.fchmod(file.fileno(), _final_mode(path))
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    _sync_folder(folder)
    remove_stale_temporaries(path)


def _pid_runs(pid):
    if os.name != "posix":   # os.kill(pid, 0) would terminate the process on Windows
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # it runs, under another user
        return True
    return True


def remove_stale_temporaries(path):
    """Remove the temporary files of ``path`` that a killed writer left behind (stale: the
    writer's pid no longer runs and the file is older than ``STALE_SECONDS``); returns
    their names."""
    folder, name = os.path.split(os.path.abspath(os.fspath(path)))
    pattern = re.compile(re.escape(f".{name[:_NAME_IN_TEMPORARY]}.") + r"(\d+)\.\w+"
                         + re.escape(TEMPORARY_SUFFIX))
    removed = []
    now = time.time()
    with os.scandir(folder) as entries:
        for entry in entries:
            match = pattern.fullmatch(entry.name)
            if match is None or _pid_runs(int(match[1])):
                continue
            with contextlib.suppress(FileNotFoundError):
                if now - entry.stat(follow_symlinks=False).st_mtime > STALE_SECONDS:
                    os.unlink(entry.path)
                    removed.append(entry.name)
    return removed


def probe_writable(path, appending=False):
    """Raise the ``OSError`` that writing ``path`` would meet, without changing anything:
    a directory in its place, a FIFO or device (``engine.file_safety``), a missing or
    read-only folder, a file that cannot be opened for appending (``appending``: the file
    is extended in place, not replaced)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(21, "is a directory", path)
    check_write_target(path)
    folder, name = os.path.split(os.path.abspath(path))
    if appending and os.path.exists(path):
        with open(path, "ab"):
            return
    handle, temporary = tempfile.mkstemp(dir=folder, suffix=TEMPORARY_SUFFIX,
                                         prefix=_temporary_prefix(name, os.getpid()))
    os.close(handle)
    os.unlink(temporary)


def write_npz(path, arrays):
    """``np.savez`` of ``arrays`` (``{name: array}``) to ``path`` through ``atomic_write``."""
    with atomic_write(path) as file:
        np.savez(file, **arrays)


# ------------------------------------------------------------------ reading

def _read_entry(archive, info):
    """The array stored in one .npy entry, after checking its header against its size."""
    with archive.open(info) as member:
        version = np.lib.format.read_magic(member)
        if version == (1, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(
                member, max_header_size=NPY_HEADER_LIMIT)
        elif version == (2, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(
                member, max_header_size=NPY_HEADER_LIMIT)
        else:
            raise _Damage(f".npy format version {version} (expected 1.0 or 2.0)")
        if dtype.kind not in _NUMERIC_OR_TEXT or dtype.hasobject:
            raise _Damage(f"dtype {dtype} (expected numbers or text, never Python objects)")
        nbytes = math.prod(shape) * dtype.itemsize
        held = info.file_size - member.tell()
        if nbytes != held:
            raise _Damage(f"the header declares shape {shape} of {dtype} ({nbytes} bytes) "
                             f"but the entry holds {held} bytes")
        buffer = bytearray(nbytes)
        view, filled = memoryview(buffer), 0
        while filled < nbytes:
            count = member.readinto(view[filled:])
            if not count:
                raise _Damage(f"the entry ends after {filled} of {nbytes} data bytes")
            filled += count
        member.read(1)   # at the end of the entry zipfile checks its CRC-32
    array = np.frombuffer(buffer, dtype, count=math.prod(shape))
    return array.reshape(shape, order="F" if fortran_order else "C")


def _charge_entry(budget, info):
    """Charge ``budget`` with the bytes entry ``info`` declares, before any is read: a stored
    entry holds exactly its declared size, so a directory that declares more than the file
    holds (a 1 GB entry in a 2 KB file) is refused here, not zero-filled."""
    if info.compress_size != info.file_size:
        raise _Damage(f"entry {info.filename!r} declares {info.file_size:,} bytes but stores "
                      f"{info.compress_size:,} (a stored entry holds its bytes as they are)")
    try:
        budget.charge(info.file_size, f"entry {info.filename!r}")
    except ValueError as error:
        raise _Damage(str(error)) from None


def read_npz(path, kind, keep=None):
    """``{name: array}`` of the ``.npz`` at ``path`` (entries whose name ``keep`` accepts;
    all by default), read with the bounds of the module docstring. ``kind`` describes what
    the file should be, for messages: ``ValueError("'<path>' is not <kind> (<reason>)")``.
    ``OSError`` when the file cannot be opened."""
    path = os.fspath(path)
    with open(path, "rb") as file:   # FileNotFoundError, PermissionError name the path
        magic = file.read(len(ZIP_MAGIC))
        if magic != ZIP_MAGIC:   # np.load would talk about pickles instead
            raise ValueError(f"{path!r} is not {kind} (not an .npz archive: it starts with "
                             f"{magic!r})")
        file.seek(0)
        budget = SizeBudget.of_file(file, "the archive", slack=0)
        arrays, names = {}, set()
        # zipfile and numpy.lib.format raise a dozen undocumented types on damaged bytes
        # (BadZipFile, EOFError, NotImplementedError, struct.error, UnicodeDecodeError,
        # SyntaxError, OverflowError, ... met by flipping each byte of a model file): all
        # that runs here parses the file's bytes, so any failure means a damaged file
        try:
            with zipfile.ZipFile(file) as archive:
                for info in archive.infolist():
                    name = info.filename[:-len(".npy")]
                    if not info.filename.endswith(".npy"):
                        raise _Damage(f"entry {info.filename!r} is not an .npy array")
                    if name in names:   # np.load would silently give the last one
                        raise _Damage(f"two entries are named {info.filename!r}")
                    names.add(name)
                    if keep is not None and not keep(name):
                        continue
                    if info.compress_type != zipfile.ZIP_STORED:
                        raise _Damage(f"entry {info.filename!r} is compressed (np.savez "
                                      "writes stored entries)")
                    _charge_entry(budget, info)
                    try:
                        arrays[name] = _read_entry(archive, info)
                    except Exception as error:
                        raise _Damage(f"entry {info.filename!r}: {_reason(error)}") from None
        except Exception as error:
            raise ValueError(f"{path!r} is not {kind} ({_reason(error)})") from None
    return arrays


def text_entry(arrays, name, path, kind):
    """The text of entry ``name`` (a 0-d text array, as ``np.array(str)`` saves), or a
    ``ValueError`` in the format of ``read_npz``."""
    value = arrays.get(name)
    if value is None or value.shape != () or value.dtype.kind != "U":
        found = "absent" if value is None else f"{value.dtype} of shape {value.shape}"
        raise ValueError(f"{path!r} is not {kind} (entry {name!r} should be text, is {found})")
    return str(value[()])


def loads_json(text, where):
    """``json.loads`` whose every failure, deep nesting included, is a ``ValueError``
    starting with ``where``."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{where}: the JSON is nested too deeply") from None
    except ValueError as error:
        raise ValueError(f"{where}: not valid JSON ({error})") from None


# ------------------------------------------------------------------ safetensors

def _safetensors():
    try:
        import safetensors
        import safetensors.numpy
    except ImportError as error:
        raise ImportError(f"safetensors files need the safetensors package ({error}); "
                          f"{SAFETENSORS_HINT}") from None
    return safetensors


def _checksum(arrays, metadata):
    """The CRC-32 (8 hex digits) of ``metadata`` (but its checksum entry) and of every
    array's name, dtype, shape and bytes, in name order."""
    crc = 0
    for key in sorted(metadata):
        if key != CHECKSUM_KEY:
            crc = zlib.crc32(f"{key}={metadata[key]}\0".encode(), crc)
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        crc = zlib.crc32(f"{name}:{array.dtype.name}:{array.shape}\0".encode(), crc)
        crc = zlib.crc32(array.reshape(-1).view(np.uint8), crc)
    return f"{crc:08x}"


def write_safetensors(path, arrays, metadata):
    """``arrays`` (``{name: array}``, host or device) and ``metadata`` (``{text: text}``) as
    a safetensors file at ``path``, with ``CHECKSUM_KEY``, through ``atomic_write``."""
    safetensors = _safetensors()
    # asarray, not ascontiguousarray, which makes a 0-d array (a scalar Normalization's
    # statistics) 1-d: the file would not load back into the model
    arrays = {name: np.asarray(to_host(array), order="C") for name, array in arrays.items()}
    metadata = {**metadata, CHECKSUM_KEY: _checksum(arrays, metadata)}
    content = safetensors.numpy.save(arrays, metadata=metadata)
    with atomic_write(path) as file:
        file.write(content)


def _charged_tensor(file, name, budget):
    """Tensor ``name`` of the open safetensors ``file``, its declared bytes charged to the
    file's ``budget`` first (safetensors checks each tensor's offsets against the file; the
    budget also bounds them all together)."""
    declared = file.get_slice(name)
    itemsize = _SAFETENSORS_ITEMSIZE.get(declared.get_dtype(), 16)   # 16: none is wider
    try:
        budget.charge(math.prod(declared.get_shape()) * itemsize, f"tensor {name!r}")
    except ValueError as error:
        raise _Damage(str(error)) from None
    return file.get_tensor(name)


def read_safetensors(path, kind):
    """``(arrays, metadata)`` of the safetensors file at ``path``, its checksum checked when
    it has one; ``ValueError("'<path>' is not <kind> (<reason>)")`` for a damaged file,
    ``OSError`` when it cannot be opened."""
    path = os.fspath(path)
    safetensors = _safetensors()
    with open(path, "rb") as file:   # FileNotFoundError, PermissionError name the path
        magic = file.read(len(ZIP_MAGIC))
    budget = SizeBudget.of_file(path, "the file", slack=0)
    try:
        with safetensors.safe_open(path, framework="numpy") as file:
            metadata = file.metadata() or {}
            arrays = {name: _charged_tensor(file, name, budget) for name in file.keys()}
    except _Damage as error:
        raise ValueError(f"{path!r} is not {kind} ({error})") from None
    except Exception as error:   # SafetensorError, and the JSON parser's errors inside it
        found = (" but an .npz archive under a .safetensors name (training checkpoints are "
                 ".npz files, whatever their name)" if magic == ZIP_MAGIC else f": {error}")
        raise ValueError(f"{path!r} is not {kind} (not a safetensors file{found})") from None
    stored = metadata.get(CHECKSUM_KEY)
    if stored is not None and stored != _checksum(arrays, metadata):
        raise ValueError(f"{path!r} is not {kind} (its CRC-32 {stored!r} does not match "
                         f"its contents, {_checksum(arrays, metadata)!r}: the file is damaged)")
    return arrays, metadata


# ------------------------------------------------------------------ codec

def encode(value, arrays):
    """A JSON-able skeleton of ``value``; every array (NumPy, device array or Tensor) moves
    into ``arrays`` under a fresh key. Dicts become ``{"dict": [[key, value], ...]}`` (keys
    of any encodable type), lists ``{"list": [...]}``, tuples ``{"tuple": [...]}``, arrays
    ``{"array": key}``; None, bools, ints, floats and strings stay as they are."""
    if isinstance(value, dict):
        return {"dict": [[encode(k, arrays), encode(v, arrays)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return {"tuple" if isinstance(value, tuple) else "list": [encode(v, arrays)
                                                                 for v in value]}
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        if isinstance(value, np.generic):
            return value.item()
        key = f"array{len(arrays)}"
        arrays[key] = value.numpy() if hasattr(value, "numpy") else to_host(value)
        return {"array": key}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"archive: cannot store a {type(value).__name__} ({value!r})")


def decode(skeleton, arrays, depth=0):
    """The value ``encode`` made ``skeleton`` from; a ``ValueError`` saying what is wrong
    for anything ``encode`` cannot have written (an unknown tag, a missing array, an
    unhashable key, nesting deeper than ``MAX_DEPTH``)."""
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    if skeleton is None or isinstance(skeleton, (bool, int, float, str)):
        return skeleton
    if not isinstance(skeleton, dict) or len(skeleton) != 1:
        raise ValueError(f"unexpected {type(skeleton).__name__} in the skeleton")
    (tag, body), = skeleton.items()
    if tag == "array":
        if not isinstance(body, str) or body not in arrays:
            raise ValueError(f"the skeleton names an array {body!r} the file does not hold")
        return arrays[body]
    if tag not in ("list", "tuple", "dict") or not isinstance(body, list):
        raise ValueError(f"unexpected entry {tag!r} in the skeleton")
    if tag != "dict":
        items = [decode(item, arrays, depth + 1) for item in body]
        return items if tag == "list" else tuple(items)
    result = {}
    for pair in body:
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError("a dict item of the skeleton is not a [key, value] pair")
        key = decode(pair[0], arrays, depth + 1)
        try:
            hash(key)
        except TypeError:
            raise ValueError(f"a dict key of the skeleton is a {type(key).__name__}") from None
        result[key] = decode(pair[1], arrays, depth + 1)
    return result
