"""engine.archive: atomic writes (modes, concurrency, orphans of killed writers), bounded
.npz reading, and the JSON skeleton codec."""
import json
import os
import stat
import subprocess
import sys
import tempfile
import threading
import time
import zipfile

import numpy as np
import pytest

from engine import archive
from tests.support.damaged_files import each_flipped_byte
from tests.support.paths import REPO_ROOT


@pytest.fixture
def umask_027():
    previous = os.umask(0o027)
    yield 0o027
    os.umask(previous)


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def _temporaries(folder):
    return sorted(name for name in os.listdir(folder) if name.endswith(archive.TEMPORARY_SUFFIX))


# ------------------------------------------------------------------ writing

def test_atomic_write_replaces_or_leaves_the_previous_file(tmp_path):
    path = tmp_path / "file.bin"
    with archive.atomic_write(path) as file:
        file.write(b"first")
    with pytest.raises(RuntimeError, match="midway"):
        with archive.atomic_write(path) as file:
            file.write(b"half of the second")
            raise RuntimeError("midway")
    assert path.read_bytes() == b"first" and os.listdir(tmp_path) == ["file.bin"]
    with pytest.raises(FileNotFoundError):
        with archive.atomic_write(tmp_path / "missing" / "file.bin"):
            pass


def test_new_files_get_the_umask_mode_and_old_files_keep_theirs(tmp_path, umask_027):
    path = tmp_path / "file.bin"
    with archive.atomic_write(path) as file:
        file.write(b"x")
    assert _mode(path) == 0o666 & ~umask_027 == 0o640   # mkstemp alone gives 0600
    os.chmod(path, 0o604)
    with archive.atomic_write(path) as file:
        file.write(b"y")
    assert _mode(path) == 0o604 and path.read_bytes() == b"y"


def test_umask_is_read_without_being_changed(umask_027):
    assert archive._umask() == 0o027
    assert os.umask(0o027) == 0o027   # still in place


def test_two_threads_saving_to_one_path_never_clash(tmp_path):
    path = tmp_path / "shared.npz"
    errors, rounds = [], 25

    def writer(value):
        try:
            for _ in range(rounds):
                archive.write_npz(path, {"value": np.full(20_000, value, np.float64)})
        except Exception as error:   # collected: the assertion below names it
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    value = archive.read_npz(path, "a test archive")["value"]   # whole: its CRC checks
    assert len(set(value.tolist())) == 1 and value[0] in range(4)
    assert os.listdir(tmp_path) == ["shared.npz"]


_KILLED_WRITER = """
import os, sys
from engine import archive
with archive.atomic_write(sys.argv[1]) as file:
    file.write(b"half a checkpoint")
    file.flush()
    os._exit(9)   # a kill in the middle of a save: no cleanup runs
"""


def _orphan_of_a_killed_writer(path):
    before = set(_temporaries(path.parent))
    subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(path)], cwd=REPO_ROOT, check=False)
    orphans = sorted(set(_temporaries(path.parent)) - before)
    assert len(orphans) == 1 and orphans[0].startswith(f".{path.name}.")
    assert (path.parent / orphans[0]).read_bytes() == b"half a checkpoint"
    return path.parent / orphans[0]


def _age(path, seconds):
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_successful_save_removes_stale_orphans_of_its_target(tmp_path):
    target = tmp_path / "run.npz"
    orphan = _orphan_of_a_killed_writer(target)
    with archive.atomic_write(target) as file:   # the orphan is fresh: it might be remote
        file.write(b"1")
    assert orphan.exists()
    _age(orphan, archive.STALE_SECONDS + 5)
    live = tmp_path / f".run.npz.{os.getpid()}.abcdefgh{archive.TEMPORARY_SUFFIX}"
    live.write_bytes(b"another thread of this process is writing")
    _age(live, archive.STALE_SECONDS + 5)
    other = _orphan_of_a_killed_writer(tmp_path / "other.npz")
    _age(other, archive.STALE_SECONDS + 5)
    with archive.atomic_write(target) as file:
        file.write(b"2")
    assert not orphan.exists()
    assert live.exists() and other.exists()   # a live writer's, another target's
    assert target.read_bytes() == b"2"


def test_probe_writable_finds_problems_and_changes_nothing(tmp_path, monkeypatch):
    existing = tmp_path / "log.jsonl"
    existing.write_text("kept\n")
    archive.probe_writable(existing, appending=True)
    archive.probe_writable(tmp_path / "new.npz")
    assert sorted(os.listdir(tmp_path)) == ["log.jsonl"] and existing.read_text() == "kept\n"
    with pytest.raises(IsADirectoryError):
        archive.probe_writable(tmp_path)
    with pytest.raises(FileNotFoundError):
        archive.probe_writable(tmp_path / "missing" / "x.npz")

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(PermissionError):
        archive.probe_writable(tmp_path / "new.npz")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="root writes into read-only folders")
def test_probe_writable_refuses_a_read_only_folder(tmp_path):
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        with pytest.raises(PermissionError):
            archive.probe_writable(folder / "x.npz")
    finally:
        folder.chmod(0o755)


# ------------------------------------------------------------------ reading

def _npz(path, **arrays):
    np.savez(path, **arrays)
    return path


def _stored_zip(path, entries):
    """A ZIP of ``{name: bytes}`` entries, stored like np.savez's."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for name, content in entries.items():
            out.writestr(name, content)
    return path


def _npy_bytes(header, data=b""):
    """A .npy 1.0 entry with a hand-written header dict."""
    text = repr(header).encode("latin1")
    text += b" " * ((64 - (10 + len(text) + 1) % 64) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + data


def test_read_npz_round_trips_and_selects(tmp_path):
    path = _npz(tmp_path / "a.npz", w=np.arange(6.0).reshape(2, 3), text=np.array("hi"),
                f=np.asfortranarray(np.arange(6).reshape(2, 3)), empty=np.zeros((0, 4)))
    arrays = archive.read_npz(path, "a test archive")
    np.testing.assert_array_equal(arrays["w"], np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(arrays["f"], np.arange(6).reshape(2, 3))
    assert arrays["empty"].shape == (0, 4) and arrays["w"].flags.writeable
    assert archive.text_entry(arrays, "text", path, "a test archive") == "hi"
    assert set(archive.read_npz(path, "x", keep=lambda name: name == "w")) == {"w"}
    with pytest.raises(ValueError, match="entry 'w' should be text"):
        archive.text_entry(arrays, "w", path, "a test archive")


CRAFTED = {
    "a huge declared shape": (
        {"x.npy": _npy_bytes({"descr": "<f8", "fortran_order": False, "shape": (10**12,)})},
        "declares shape \\(1000000000000,\\)"),
    "a shape larger than its data": (
        {"x.npy": _npy_bytes({"descr": "<f4", "fortran_order": False, "shape": (3,)}, b"\0" * 8)},
        "holds 8 bytes"),
    "Python objects": (
        {"x.npy": _npy_bytes({"descr": "|O", "fortran_order": False, "shape": (1,)}, b"\0" * 8)},
        "never Python objects"),
    "a non-array entry": ({"notes.txt": b"hello"}, "is not an .npy array"),
    "a header nested deeply": (
        {"x.npy": b"\x93NUMPY\x01\x00" + (3000).to_bytes(2, "little") + b"[" * 2999 + b"\n"},
        "entry 'x.npy'"),
    "an over-long header": (
        {"x.npy": b"\x93NUMPY\x02\x00" + (10**6).to_bytes(4, "little") + b" " * 10**6},
        "entry 'x.npy'"),
}


@pytest.mark.parametrize("crafted", CRAFTED, ids=str)
def test_crafted_entries_are_value_errors_before_any_allocation(tmp_path, crafted):
    entries, message = CRAFTED[crafted]
    path = _stored_zip(tmp_path / "crafted.npz", entries)
    with pytest.raises(ValueError, match=message) as error:
        archive.read_npz(path, "a test archive")
    assert "crafted.npz" in str(error.value) and "is not a test archive" in str(error.value)


def test_compressed_and_non_zip_files_are_refused(tmp_path):
    compressed = tmp_path / "compressed.npz"
    np.savez_compressed(compressed, w=np.zeros(1000))
    with pytest.raises(ValueError, match="is compressed"):
        archive.read_npz(compressed, "a test archive")
    pickle = tmp_path / "pickle.npz"
    pickle.write_bytes(b"\x80\x04\x95 a pickle")
    with pytest.raises(ValueError, match="not an .npz archive: it starts with b'\\\\x80"):
        archive.read_npz(pickle, "a test archive")
    with pytest.raises(FileNotFoundError):
        archive.read_npz(tmp_path / "absent.npz", "a test archive")


def test_every_flipped_byte_is_a_value_error_or_harmless(tmp_path):
    """Each single-byte corruption of a small archive raises ValueError or reads back the
    original values (the byte was in a field nobody checks; a flip in a length field of the
    central directory can hide an entry, which its reader then misses); never another
    exception type, never a changed value."""
    original = {"w": np.arange(7, dtype=np.float32), "t": np.array("{}")}
    content = _npz(tmp_path / "good.npz", **original).read_bytes()
    damaged = tmp_path / "damaged.npz"
    errors = 0
    for position in each_flipped_byte(content, damaged):
        try:
            arrays = archive.read_npz(damaged, "a test archive")
        except ValueError:
            errors += 1
            continue
        assert set(arrays) <= set(original), position
        for name, value in arrays.items():
            np.testing.assert_array_equal(value, original[name])
    assert errors > len(content) // 2   # 386 of 526 with numpy 2.4: the CRC covers the data


# ------------------------------------------------------------------ codec

def test_codec_round_trips_and_keeps_arrays_apart():
    state = {"a": [1, 2.5, None, True, "x"], 3: (np.arange(3), {"nested": np.ones(2)}),
             (1, 2): "tuple key"}
    arrays = {}
    skeleton = json.loads(json.dumps(archive.encode(state, arrays)))
    assert len(arrays) == 2
    restored = archive.decode(skeleton, arrays)
    assert restored["a"] == [1, 2.5, None, True, "x"] and restored[(1, 2)] == "tuple key"
    np.testing.assert_array_equal(restored[3][0], np.arange(3))


@pytest.mark.parametrize("skeleton, message", [
    ({"array": "array7"}, "does not hold"),
    ({"array": ["array0"]}, "does not hold"),
    ({"set": [1]}, "unexpected entry 'set'"),
    ({"list": 3}, "unexpected entry 'list'"),
    ([1, 2], "unexpected list"),
    ({"list": [], "tuple": []}, "unexpected dict"),
    ({"dict": [[{"list": [1]}, 2]]}, "dict key of the skeleton is a list"),
    ({"dict": [[1, 2, 3]]}, "not a \\[key, value\\] pair"),
    ({"dict": {"a": 1}}, "unexpected entry 'dict'"),
])
def test_decode_rejects_what_encode_cannot_write(skeleton, message):
    with pytest.raises(ValueError, match=message):
        archive.decode(skeleton, {"array0": np.zeros(1)})


def test_deep_nesting_is_a_value_error():
    deep = 0
    for _ in range(archive.MAX_DEPTH + 5):
        deep = {"list": [deep]}
    with pytest.raises(ValueError, match=f"nested deeper than {archive.MAX_DEPTH} levels"):
        archive.decode(deep, {})
    with pytest.raises(ValueError, match="the state: the JSON is nested too deeply"):
        archive.loads_json("[" * 200_000 + "]" * 200_000, "the state")
    with pytest.raises(ValueError, match="the state: not valid JSON"):
        archive.loads_json("{'single': 'quotes'}", "the state")
