"""Data: IDX format, shipped MNIST, Fashion-MNIST, verified downloads, DataLoader, augmentation,
synthetic sets."""
import gzip
import hashlib
import os
import shutil
import struct
import tracemalloc
import zlib

import numpy as np
import pytest

import data
import engine
from data import download as downloads
from data.idx import parse_idx
from ops.gather import gather_rows
from tests.support.http_folder import served_folder

MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
# the in-kernel hash of GaussianNoise wraps uint64 on purpose; the simulator runs it as
# NumPy scalar math, which warns about every wrap
ignore_uint64_wrap = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


# ------------------------------------------------------------------ IDX

@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64])
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_idx_round_trip(tmp_path, dtype, suffix):
    rng = np.random.default_rng(0)
    for shape in [(7,), (3, 5), (2, 3, 4)]:
        array = (rng.standard_normal(shape) * 100).astype(dtype)
        path = tmp_path / f"a{len(shape)}{suffix}"
        data.write_idx(path, array)
        back = data.read_idx(path)
        assert back.dtype == np.dtype(dtype) and back.dtype.isnative
        assert back.shape == shape and back.flags.writeable
        np.testing.assert_array_equal(back, array)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"a{n}{suffix}" for n in (1, 2, 3)]


def test_idx_header_layout(tmp_path):
    path = tmp_path / "labels"
    data.write_idx(path, np.array([5, 0, 4], np.uint8))
    assert path.read_bytes() == b"\x00\x00\x08\x01" + struct.pack(">I", 3) + bytes([5, 0, 4])


def test_write_idx_replaces_atomically(tmp_path):
    path = tmp_path / "x.gz"
    data.write_idx(path, np.zeros(4, np.uint8))
    data.write_idx(path, np.ones((2, 2), np.float32))
    np.testing.assert_array_equal(data.read_idx(path), np.ones((2, 2), np.float32))
    assert [p.name for p in tmp_path.iterdir()] == ["x.gz"]   # no temporary file left
    with pytest.raises(ValueError, match="int64 has no IDX code"):
        data.write_idx(tmp_path / "y", np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="1 to 255 dimensions"):
        data.write_idx(tmp_path / "y", np.zeros((), np.uint8))
    assert [p.name for p in tmp_path.iterdir()] == ["x.gz"]


def _valid_idx():
    header = b"\x00\x00\x0d\x02" + struct.pack(">II", 2, 3)
    return header + np.arange(6, dtype=">f4").tobytes()


CORRUPTIONS = {
    "bad magic": (lambda b: b"\x01" + b[1:], "bad magic number"),
    "bad dtype code": (lambda b: b[:2] + b"\x07" + b[3:], "unknown IDX dtype code 0x07"),
    "zero dimensions": (lambda b: b[:3] + b"\x00" + b[4:], "0 dimensions"),
    "wrong ndim": (lambda b: b[:3] + b"\x03" + b[4:],
                   "trailing bytes after the data of shape \\(2, 3, 0\\)"),
    "truncated data": (lambda b: b[:-1], "truncated: shape \\(2, 3\\)"),
    "truncated header": (lambda b: b[:9], "truncated header"),
    "trailing bytes": (lambda b: b + b"\x00\x00", "2 trailing bytes"),
    "empty file": (lambda b: b"", "too short"),
    "broken gzip": (lambda b: gzip.compress(b)[:-9], "not a valid gzip stream"),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS, ids=str)
@pytest.mark.parametrize("compress", [False, True], ids=["raw", "gz"])
def test_read_idx_rejects_corruption(tmp_path, corruption, compress):
    damage, message = CORRUPTIONS[corruption]
    content = damage(_valid_idx())
    if compress and corruption != "broken gzip":
        content = gzip.compress(content)
    path = tmp_path / "damaged.idx"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as error:
        data.read_idx(path)
    assert "damaged.idx" in str(error.value)


def test_read_idx_valid_reference():
    np.testing.assert_array_equal(parse_idx(_valid_idx(), "ok"),
                                  np.arange(6, dtype=np.float32).reshape(2, 3))


def _bomb(header, inflated_bytes):
    """``header`` then ``inflated_bytes`` zero bytes, gzip-compressed (about 1000:1)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = bytes(1 << 20)
    parts = [compressor.compress(header)]
    parts += [compressor.compress(block) for _ in range(inflated_bytes >> 20)]
    return b"".join(parts) + compressor.flush()


def test_a_gzip_bomb_is_rejected_within_the_header_s_bounds():
    """A 200 KB file that inflates to 200 MB behind a one-image header: the reader stops
    after the header's 784 bytes plus TRAILING_LIMIT (it used to inflate everything)."""
    bomb = _bomb(b"\x00\x00\x08\x03" + struct.pack(">3I", 1, 28, 28), 200 << 20)
    assert len(bomb) < 300_000
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"more than 1048576 trailing bytes after the data "
                                             r"of shape \(1, 28, 28\)"):
            parse_idx(bomb, "bomb.gz")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB"


def test_a_huge_declared_shape_costs_only_the_bytes_that_exist():
    header = b"\x00\x00\x08\x03" + struct.pack(">3I", 2**32 - 1, 2**32 - 1, 2**32 - 1)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="truncated: shape .* the file has 4194304"):
            parse_idx(_bomb(header, 4 << 20), "declared.gz")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 24 << 20, f"{peak / 2**20:.1f} MiB"


def test_gzip_members_padding_and_garbage():
    content = _valid_idx()
    expected = np.arange(6, dtype=np.float32).reshape(2, 3)
    two_members = gzip.compress(content[:7]) + gzip.compress(content[7:])   # as gzip appends
    np.testing.assert_array_equal(parse_idx(two_members, "members.gz"), expected)
    np.testing.assert_array_equal(parse_idx(gzip.compress(content) + bytes(5), "padded.gz"),
                                  expected)
    with pytest.raises(ValueError, match="padded.gz: not a valid gzip stream \\(3 bytes of "
                                         "garbage after its end\\)"):
        parse_idx(gzip.compress(content) + b"abc", "padded.gz")
    crc_damaged = bytearray(gzip.compress(content))
    crc_damaged[-6] ^= 0xFF   # the trailer's CRC-32
    with pytest.raises(ValueError, match="not a valid gzip stream"):
        parse_idx(bytes(crc_damaged), "crc.gz")


def test_parse_idx_hashes_the_decompressed_content():
    for content in (_valid_idx(), gzip.compress(_valid_idx(), compresslevel=1)):
        digest = hashlib.sha256()
        parse_idx(content, "x", digest)
        assert digest.hexdigest() == hashlib.sha256(_valid_idx()).hexdigest()


def test_write_idx_gives_the_mode_open_would(tmp_path):
    previous = os.umask(0o077)
    try:
        data.write_idx(tmp_path / "private", np.zeros(3, np.uint8))
        assert os.stat(tmp_path / "private").st_mode & 0o777 == 0o600
        os.umask(0o002)
        data.write_idx(tmp_path / "shared", np.zeros(3, np.uint8))
        assert os.stat(tmp_path / "shared").st_mode & 0o777 == 0o664   # not a fixed 0644
    finally:
        os.umask(previous)


# ------------------------------------------------------------------ MNIST

@pytest.fixture(scope="module")
def mnist():
    return data.mnist.load()


def test_mnist_shapes_labels_and_counts(mnist):
    (x_train, y_train), (x_test, y_test) = mnist
    assert x_train.shape == (60000, 28, 28) and y_train.shape == (60000,)
    assert x_test.shape == (10000, 28, 28) and y_test.shape == (10000,)
    assert {a.dtype for a in (x_train, y_train, x_test, y_test)} == {np.dtype(np.uint8)}
    assert list(y_train[:10]) == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
    assert list(y_test[:10]) == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]
    assert list(np.bincount(y_train, minlength=10)) == MNIST_TRAIN_COUNTS
    assert list(np.bincount(y_test, minlength=10)) == MNIST_TEST_COUNTS
    assert x_train.min() == 0 and x_train.max() == 255
    assert abs(x_train.mean() - 33.3184) < 1e-3 and abs(x_test.mean() - 33.7912) < 1e-3


def test_mnist_loads_are_independent(mnist):
    (x_train, _), _ = data.mnist.load()
    assert not np.shares_memory(x_train, mnist[0][0])
    x_train[0] = 255   # writable, and private to this call
    (again, _), _ = data.mnist.load()
    np.testing.assert_array_equal(again[0], mnist[0][0][0])


def test_shipped_files_are_packaged():
    names = sorted(p.name for p in data.mnist.PACKAGE_DIR.iterdir())
    assert names == sorted(["PROVENANCE.md", *data.mnist.SHIPPED_SHA256])
    for name, digest in data.mnist.SHIPPED_SHA256.items():
        assert downloads.file_sha256(data.mnist.PACKAGE_DIR / name) == digest
        assert digest in (data.mnist.PACKAGE_DIR / "PROVENANCE.md").read_text()


@pytest.fixture
def mnist_copy(tmp_path):
    """A copy of the shipped files with the first training label changed from 5 to 7 (still
    a valid IDX file)."""
    folder = tmp_path / "mnist"
    shutil.copytree(data.mnist.PACKAGE_DIR, folder)
    labels = data.read_idx(folder / "train-labels-idx1-ubyte.gz")
    labels[0] = 7
    data.write_idx(folder / "train-labels-idx1-ubyte.gz", labels)
    return folder


def test_tampered_package_copy_is_rejected(mnist_copy, monkeypatch):
    monkeypatch.setattr(data.mnist, "PACKAGE_DIR", mnist_copy)
    monkeypatch.delenv(data.mnist.ENV_VAR, raising=False)
    with pytest.raises(ValueError, match="train-labels-idx1-ubyte.gz: sha256 [0-9a-f]{64} matches no known"):
        data.mnist.load()


def test_root_and_env_var_read_another_copy(mnist_copy, monkeypatch):
    (_, y_train), _ = data.mnist.load(root=mnist_copy)   # your copy: not checksummed by default
    assert y_train[0] == 7
    monkeypatch.setenv(data.mnist.ENV_VAR, str(mnist_copy))
    (_, y_train), _ = data.mnist.load()
    assert y_train[0] == 7
    with pytest.raises(ValueError, match="matches no known release"):
        data.mnist.load(root=mnist_copy, verify=True)


def test_uncompressed_copy_verifies(tmp_path, mnist):
    for name in data.mnist.FILES:
        with gzip.open(data.mnist.PACKAGE_DIR / (name + ".gz")) as f:
            (tmp_path / name).write_bytes(f.read())
    (x_train, y_train), (x_test, y_test) = data.mnist.load(root=tmp_path, verify=True)
    np.testing.assert_array_equal(x_test, mnist[1][0])
    np.testing.assert_array_equal(y_train, mnist[0][1])


def test_recompressed_copy_verifies_by_its_content(tmp_path, mnist):
    """Debian recompresses the .gz files it packages: their bytes differ from every known
    release, their decompressed content does not (the check used to hash the .gz bytes)."""
    for name in data.mnist.FILES:
        with gzip.open(data.mnist.PACKAGE_DIR / (name + ".gz")) as f:
            raw = f.read()
        (tmp_path / (name + ".gz")).write_bytes(gzip.compress(raw, compresslevel=1, mtime=1))
    recompressed = tmp_path / "train-labels-idx1-ubyte.gz"
    assert downloads.file_sha256(recompressed) not in data.mnist.KNOWN_SHA256[recompressed.name]
    (x_train, y_train), (x_test, _) = data.mnist.load(root=tmp_path, verify=True)
    np.testing.assert_array_equal(x_test, mnist[1][0])
    np.testing.assert_array_equal(y_train, mnist[0][1])


def test_checksum_verdict_is_cached(mnist, monkeypatch):
    data.mnist.load()

    def no_hashing(*args):
        raise AssertionError("hashed a file whose verdict is cached")

    monkeypatch.setattr(data.mnist.hashlib, "sha256", no_hashing)
    (x_train, _), _ = data.mnist.load()
    np.testing.assert_array_equal(x_train[:5], mnist[0][0][:5])


def test_missing_or_mismatched_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.mnist.load(root=tmp_path / "nowhere")
    data.write_idx(tmp_path / "train-images-idx3-ubyte.gz", np.zeros((3, 2, 2), np.uint8))
    with pytest.raises(FileNotFoundError, match="has no train-labels-idx1-ubyte.gz"):
        data.mnist.load(root=tmp_path)
    data.write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(2, np.uint8))
    data.write_idx(tmp_path / "t10k-images-idx3-ubyte", np.zeros((1, 2, 2), np.uint8))
    data.write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.zeros(1, np.uint8))
    with pytest.raises(ValueError, match="holds 3 images but .* holds 2 labels"):
        data.mnist.load(root=tmp_path)
    data.write_idx(tmp_path / "train-labels-idx1-ubyte", np.array([0, 1, 10], np.uint8))
    with pytest.raises(ValueError, match="label 10 is out of range"):
        data.mnist.load(root=tmp_path)


# ------------------------------------------------------------------ Fashion-MNIST

def _write_set(folder, n_train=6, n_test=4, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        arrays[f"{prefix}-images-idx3-ubyte"] = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        arrays[f"{prefix}-labels-idx1-ubyte"] = rng.integers(0, 10, n, dtype=np.uint8)
    for name, array in arrays.items():
        data.write_idx(folder / (name + ".gz"), array)
    return arrays


def test_fashion_mnist_reads_root_and_env_var(tmp_path, monkeypatch):
    arrays = _write_set(tmp_path / "fashion")
    (x_train, y_train), (x_test, y_test) = data.fashion_mnist.load(root=tmp_path / "fashion")
    np.testing.assert_array_equal(x_train, arrays["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(y_test, arrays["t10k-labels-idx1-ubyte"])
    monkeypatch.setenv(data.fashion_mnist.ENV_VAR, str(tmp_path / "fashion"))
    (x_train, _), _ = data.fashion_mnist.load()
    assert x_train.shape == (6, 28, 28)
    with pytest.raises(ValueError, match="matches no known release"):
        data.fashion_mnist.load(verify=True)   # not the upstream files
    assert len(data.fashion_mnist.CLASSES) == 10


def test_fashion_mnist_checksums_cover_the_decompressed_files():
    known = data.fashion_mnist.KNOWN_SHA256
    for name in data.mnist.FILES:
        assert known[name + ".gz"] == {data.fashion_mnist.UPSTREAM_SHA256[name + ".gz"]}
        assert known[name] == {data.fashion_mnist.RAW_SHA256[name]}


def test_fashion_mnist_verify_accepts_recompressed_files(tmp_path, monkeypatch):
    """A Debian-style copy: the upstream content, recompressed (here: a synthetic set whose
    content digests stand in for the upstream ones)."""
    arrays = _write_set(tmp_path / "upstream")
    debian = tmp_path / "debian"
    debian.mkdir()
    raw_digests = {}
    for name in arrays:
        with gzip.open(tmp_path / "upstream" / (name + ".gz")) as f:
            raw = f.read()
        raw_digests[name] = hashlib.sha256(raw).hexdigest()
        (debian / (name + ".gz")).write_bytes(gzip.compress(raw, compresslevel=6, mtime=7))
    monkeypatch.setattr(data.fashion_mnist, "KNOWN_SHA256", {
        **{name + ".gz": {downloads.file_sha256(tmp_path / "upstream" / (name + ".gz"))}
           for name in arrays},
        **{name: {digest} for name, digest in raw_digests.items()}})
    (x_train, _), (_, y_test) = data.fashion_mnist.load(root=debian, verify=True)
    np.testing.assert_array_equal(x_train, arrays["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(y_test, arrays["t10k-labels-idx1-ubyte"])
    damaged = data.read_idx(debian / "t10k-labels-idx1-ubyte.gz")
    damaged[0] = (damaged[0] + 1) % 10
    data.write_idx(debian / "t10k-labels-idx1-ubyte.gz", damaged)
    with pytest.raises(ValueError, match="t10k-labels-idx1-ubyte.gz: sha256 [0-9a-f]{64} "
                                         "matches no known release of this file's IDX content"):
        data.fashion_mnist.load(root=debian, verify=True)


def test_fashion_mnist_absent_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.delenv(data.fashion_mnist.ENV_VAR, raising=False)
    monkeypatch.setattr(data.fashion_mnist, "DEBIAN_DIR", str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError) as error:
        data.fashion_mnist.load()
    message = str(error.value)
    assert "apt-get install dataset-fashion-mnist" in message and "root=" in message
    assert str(tmp_path / "absent") in message


# ------------------------------------------------------------------ downloads (127.0.0.1 only)

@pytest.fixture
def http_folder(tmp_path, monkeypatch):
    """A folder served over HTTP on 127.0.0.1; yields (folder, base_url, requested paths)."""
    folder = tmp_path / "served"
    folder.mkdir()
    with served_folder(folder, monkeypatch) as (base_url, requested):
        yield folder, base_url, requested


def _serve_shipped(folder):
    (folder / "files").mkdir()
    for name in data.mnist.SHIPPED_SHA256:
        shutil.copy(data.mnist.PACKAGE_DIR / name, folder / "files" / name)


def test_download_verifies_and_caches(http_folder, tmp_path, mnist):
    served, base_url, requested = http_folder
    _serve_shipped(served)
    cache = tmp_path / "cache" / "mnist"
    assert downloads.download(base_url, data.mnist.SHIPPED_SHA256, cache) == cache
    assert sorted(p.name for p in cache.iterdir()) == sorted(data.mnist.SHIPPED_SHA256)
    (x_train, y_train), _ = data.mnist.load(root=cache, verify=True)
    np.testing.assert_array_equal(y_train, mnist[0][1])
    assert len(requested) == 4
    downloads.download(base_url, data.mnist.SHIPPED_SHA256, cache)   # all present and valid
    assert len(requested) == 4


def test_download_rejects_corrupted_file(http_folder, tmp_path):
    served, base_url, _ = http_folder
    _serve_shipped(served)
    damaged = served / "files" / "t10k-labels-idx1-ubyte.gz"
    content = bytearray(damaged.read_bytes())
    content[100] ^= 0xFF
    damaged.write_bytes(bytes(content))
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="t10k-labels-idx1-ubyte.gz: sha256 .* does not match"):
        downloads.download(base_url, data.mnist.SHIPPED_SHA256, cache)
    left = sorted(p.name for p in cache.iterdir())
    assert "t10k-labels-idx1-ubyte.gz" not in left
    assert not [name for name in left if name.startswith(".") or name.endswith(".part")]


def test_download_failure_leaves_nothing(http_folder, tmp_path):
    _, base_url, _ = http_folder   # nothing served: every request is a 404
    cache = tmp_path / "cache"
    with pytest.raises(OSError, match="404"):
        downloads.download(base_url, {"absent.gz": "0" * 64}, cache)
    assert list(cache.iterdir()) == []
    with pytest.raises(ValueError, match="http"):
        downloads.download("file:///etc/", {"passwd": "0" * 64}, cache)


def test_download_replaces_damaged_cached_file(http_folder, tmp_path):
    served, base_url, requested = http_folder
    _serve_shipped(served)
    cache = tmp_path / "cache"
    cache.mkdir()
    name = "train-labels-idx1-ubyte.gz"
    (cache / name).write_bytes(b"half a file")
    downloads.download(base_url, {name: data.mnist.SHIPPED_SHA256[name]}, cache)
    assert downloads.file_sha256(cache / name) == data.mnist.SHIPPED_SHA256[name]
    assert requested == ["/files/" + name]


def test_downloaded_files_get_the_mode_open_would(http_folder, tmp_path):
    served, base_url, _ = http_folder
    _serve_shipped(served)
    name = "t10k-labels-idx1-ubyte.gz"
    previous = os.umask(0o027)
    try:
        downloads.download(base_url, {name: data.mnist.SHIPPED_SHA256[name]}, tmp_path / "c")
    finally:
        os.umask(previous)
    assert os.stat(tmp_path / "c" / name).st_mode & 0o777 == 0o640   # not a fixed 0644


def test_default_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert downloads.cache_dir("mnist") == os.path.join(str(tmp_path), "numba-engine", "mnist")


# ------------------------------------------------------------------ DataLoader

def _tiny_set(n=11, shape=(3, 5), seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n,) + shape, dtype=np.uint8), np.arange(n, dtype=np.uint8)


def _epoch(loader):
    return [(xb.numpy(), yb.numpy()) for xb, yb in loader]


def test_one_epoch_covers_every_sample_once(device):
    x, y = _tiny_set()
    loader = data.DataLoader(x, y, batch_size=4, shuffle=True, seed=3, device=device)
    assert len(loader) == 3
    batches = _epoch(loader)
    assert [len(yb) for _, yb in batches] == [4, 4, 3]
    seen = np.concatenate([yb for _, yb in batches])
    assert sorted(seen) == list(range(11)) and list(seen) != list(range(11))
    for xb, yb in batches:
        assert xb.dtype == np.float32 and yb.dtype == np.int64 and xb.shape[1:] == (3, 5)
        np.testing.assert_array_equal(xb, x[yb].astype(np.float32) / np.float32(255))


def test_reshuffles_every_epoch_from_its_seed():
    x, y = _tiny_set(n=40)
    loader = data.DataLoader(x, y, batch_size=8, shuffle=True, seed=1)
    orders = [np.concatenate([yb for _, yb in _epoch(loader)]) for _ in range(3)]
    assert loader.epoch == 3
    assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[1], orders[2])
    again = data.DataLoader(x, y, batch_size=8, shuffle=True, seed=1)
    again.epoch = 1   # resume at epoch 1
    np.testing.assert_array_equal(np.concatenate([yb for _, yb in _epoch(again)]), orders[1])
    other_seed = data.DataLoader(x, y, batch_size=8, shuffle=True, seed=2)
    assert not np.array_equal(np.concatenate([yb for _, yb in _epoch(other_seed)]), orders[0])
    in_order = data.DataLoader(x, y, batch_size=8)
    for _ in range(2):
        np.testing.assert_array_equal(np.concatenate([yb for _, yb in _epoch(in_order)]), y)


def test_seed_none_follows_engine_manual_seed():
    x, y = _tiny_set(n=30)
    engine.manual_seed(4)
    first = data.DataLoader(x, y, batch_size=30, shuffle=True)
    engine.manual_seed(4)
    second = data.DataLoader(x, y, batch_size=30, shuffle=True)
    assert first.seed == second.seed
    np.testing.assert_array_equal(_epoch(first)[0][1], _epoch(second)[0][1])


def test_drop_last(device):
    x, y = _tiny_set(n=10)
    loader = data.DataLoader(x, y, batch_size=3, shuffle=True, seed=0, drop_last=True, device=device)
    assert len(loader) == 3
    batches = _epoch(loader)
    assert [len(yb) for _, yb in batches] == [3, 3, 3]
    assert len(set(np.concatenate([yb for _, yb in batches]))) == 9
    assert len(data.DataLoader(x, y, batch_size=3, drop_last=False)) == 4
    assert len(data.DataLoader(x, y, batch_size=20, drop_last=True)) == 0
    assert _epoch(data.DataLoader(x, y, batch_size=20, drop_last=True)) == []


def test_conversion_normalize_and_targets(device):
    x, y = _tiny_set(n=6, shape=(2, 3))
    mean, std = 0.1307, 0.3081
    loader = data.DataLoader(x, y, batch_size=6, normalize=(mean, std), device=device)
    (xb, yb), = _epoch(loader)
    expected = (x.astype(np.float32) / np.float32(255) - np.float32(mean)) / np.float32(std)
    np.testing.assert_array_equal(xb, expected)
    per_pixel = data.DataLoader(x, y, batch_size=6, normalize=(np.zeros((2, 3)), np.full(3, 2.0)))
    np.testing.assert_array_equal(_epoch(per_pixel)[0][0], x.astype(np.float32) / np.float32(255) / 2)
    features = np.random.default_rng(0).standard_normal((6, 4))          # float64 used as given
    targets = np.linspace(0, 1, 12).reshape(6, 2).astype(np.float32)     # float targets kept
    (xb, yb), = _epoch(data.DataLoader(features, targets, batch_size=6, device=device))
    assert xb.dtype == np.float64 and yb.dtype == np.float32
    np.testing.assert_array_equal(xb, features)
    np.testing.assert_array_equal(yb, targets)
    (xb, yb), = _epoch(data.DataLoader(engine.tensor(features), engine.tensor(y), batch_size=6))
    np.testing.assert_array_equal(xb, features)


def test_loader_owns_its_data_and_batches_are_fresh(device):
    features = np.arange(24, dtype=np.float32).reshape(8, 3)
    labels = np.arange(8)
    loader = data.DataLoader(features, labels, batch_size=4, device=device)
    kept = next(iter(loader))
    features[:] = -1   # the caller's array changes after construction
    labels[:] = 0
    for xb, yb in loader:
        assert xb.numpy().min() >= 0 and len(set(yb.numpy())) == 4
    np.testing.assert_array_equal(kept[0].numpy(), np.arange(12, dtype=np.float32).reshape(4, 3))
    assert kept[0].data is not next(iter(loader))[0].data


def test_every_batch_element_is_written(device):
    x, y = _tiny_set(n=7, shape=(2, 2))
    targets = np.arange(7 * 5, dtype=np.float32).reshape(7, 5)   # wider than a sample row
    with engine.debug.poison():
        for loader in (data.DataLoader(x, y, batch_size=3, shuffle=True, seed=0, device=device),
                       data.DataLoader(x.reshape(7, 4)[:, :1].copy(), targets, batch_size=3,
                                       device=device)):
            for xb, yb in loader:
                assert np.isfinite(xb.numpy()).all()
                if yb.dtype.kind == "f":
                    assert np.isfinite(yb.numpy()).all()
                else:
                    assert yb.numpy().max() < 7


def test_gather_rows_checks_its_arguments():
    x, y, order = np.zeros((4, 3)), np.zeros((4, 1)), np.arange(4)
    with pytest.raises(ValueError, match="outside the order of length 4"):
        gather_rows(x, y, order, 2, 3)
    with pytest.raises(ValueError, match="x has 4 rows but y has 3"):
        gather_rows(x, y[:3], order, 0, 1)
    with pytest.raises(ValueError, match="2-D x and y"):
        gather_rows(x.reshape(-1), y, order, 0, 1)



def test_the_cpu_gather_takes_the_rows_of_the_order_at_the_cursor():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 7), np.float32)
    y = rng.integers(0, 10, (50, 1))
    order = rng.permutation(50)
    x_batch, y_batch = gather_rows(x, y, order, 3, 9, cursor=np.array([20], np.int64))
    np.testing.assert_array_equal(x_batch, x[order[23:32]])
    np.testing.assert_array_equal(y_batch, y[order[23:32]])


def test_a_cpu_gather_past_the_order_raises_and_writes_no_row():
    x, y, order = np.ones((6, 3), np.float32), np.ones((6, 1), np.int64), np.arange(6)
    with pytest.raises(IndexError, match="the batch of 4 rows at position 4 runs past the "
                                         "order of length 6"):
        gather_rows(x, y, order, 0, 4, cursor=np.array([4], np.int64))


def test_loader_rejects_bad_input():
    x, y = _tiny_set(n=5)
    with pytest.raises(ValueError, match="x has 5 samples but y has 4"):
        data.DataLoader(x, y[:4])
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        data.DataLoader(x, y, batch_size=0)
    with pytest.raises(TypeError, match="x has dtype int64"):
        data.DataLoader(x.astype(np.int64), y)
    with pytest.raises(TypeError, match="y has dtype <U1"):
        data.DataLoader(x, np.array(list("abcde")))
    with pytest.raises(ValueError, match="must broadcast against one sample of shape \\(3, 5\\)"):
        data.DataLoader(x, y, normalize=(np.zeros(5 * 3 * 5).reshape(5, 3, 5), 1.0))
    with pytest.raises(ValueError, match="std must be positive"):
        data.DataLoader(x, y, normalize=(0.0, 0.0))
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        data.DataLoader(x, y, seed=-1)
    with pytest.raises(ValueError, match="unknown device"):
        data.DataLoader(x, y, device="tpu")


@pytest.mark.cuda
@ignore_uint64_wrap
def test_cpu_and_cuda_loaders_yield_the_same_batches():
    x, y = _tiny_set(n=13, shape=(3, 3))
    loaders = [data.DataLoader(x, y, batch_size=5, shuffle=True, seed=7, device=device,
                               normalize=(0.5, 0.25), transform=data.GaussianNoise(0.05, seed=2))
               for device in ("cpu", "cuda")]
    for _ in range(2):
        cpu_epoch, cuda_epoch = (_epoch(loader) for loader in loaders)
        assert len(cpu_epoch) == len(cuda_epoch) == 3
        for (x_cpu, y_cpu), (x_cuda, y_cuda) in zip(cpu_epoch, cuda_epoch):
            np.testing.assert_array_equal(y_cpu, y_cuda)
            np.testing.assert_allclose(x_cpu, x_cuda, rtol=0, atol=1e-6)   # libm may differ by an ulp
    xb, yb = next(iter(loaders[1]))
    assert xb.device == "cuda" and yb.device == "cuda"


@pytest.mark.gpu
def test_full_mnist_on_the_gpu(mnist):
    (x_train, y_train), _ = mnist
    cpu = data.DataLoader(x_train, y_train, batch_size=128, shuffle=True, seed=0)
    gpu = data.DataLoader(x_train, y_train, batch_size=128, shuffle=True, seed=0, device="cuda")
    assert len(gpu) == 469
    counts = np.zeros(10, np.int64)
    for index, ((x_cpu, y_cpu), (x_gpu, y_gpu)) in enumerate(zip(cpu, gpu)):
        assert x_gpu.device == "cuda"
        labels = y_gpu.numpy()
        counts += np.bincount(labels, minlength=10)
        if index % 50 == 0 or index == len(gpu) - 1:
            np.testing.assert_array_equal(labels, y_cpu.numpy())
            np.testing.assert_array_equal(x_gpu.numpy(), x_cpu.numpy())
    assert list(counts) == MNIST_TRAIN_COUNTS


# ------------------------------------------------------------------ augmentation

def test_gaussian_noise_statistics_and_seeding():
    batch = engine.tensor(np.full((200, 500), 0.5, np.float32))
    noise = data.GaussianNoise(std=0.2, seed=11)
    first = noise(batch).numpy() - 0.5
    assert abs(first.mean()) < 0.002 and abs(first.std() - 0.2) < 0.002
    assert abs(((first / 0.2) ** 4).mean() - 3) < 0.05   # Gaussian kurtosis
    second = noise(batch).numpy() - 0.5
    assert np.corrcoef(first.ravel(), second.ravel())[0, 1] < 0.01   # a fresh draw per call
    replay = data.GaussianNoise(std=0.2, seed=11)
    np.testing.assert_array_equal(replay(batch).numpy() - 0.5, first)
    np.testing.assert_array_equal(batch.numpy(), 0.5)   # the input is left alone
    clipped = data.GaussianNoise(std=1.0, seed=0, clip=(0.0, 1.0))(batch).numpy()
    assert clipped.min() == 0.0 and clipped.max() == 1.0


@ignore_uint64_wrap
def test_gaussian_noise_as_loader_transform(device):
    x, y = _tiny_set(n=6, shape=(4, 4))
    loader = data.DataLoader(x, y, batch_size=6, device=device,
                             transform=data.GaussianNoise(0.1, seed=0, clip=(0, 1)))
    (noisy, labels), = _epoch(loader)
    clean = x.astype(np.float32) / 255
    assert 0 < np.abs(noisy - clean).max() and noisy.min() >= 0 and noisy.max() <= 1
    np.testing.assert_array_equal(labels, y)


def test_gaussian_noise_rejects_bad_use():
    with pytest.raises(ValueError, match="std must be >= 0"):
        data.GaussianNoise(-1)
    with pytest.raises(ValueError, match="low <= high"):
        data.GaussianNoise(0.1, clip=(1, 0))
    with pytest.raises(TypeError, match="requires grad"):
        data.GaussianNoise(0.1)(engine.ones(2, requires_grad=True))
    with pytest.raises(TypeError, match="float Tensor"):
        data.GaussianNoise(0.1)(engine.tensor(np.arange(3)))


# ------------------------------------------------------------------ synthetic sets

def test_xor():
    x, y = data.xor()
    np.testing.assert_array_equal(x, [[0, 0], [0, 1], [1, 0], [1, 1]])
    np.testing.assert_array_equal(y, [0, 1, 1, 0])
    assert x.dtype == np.float32 and y.dtype == np.int64


def test_spirals():
    x, y = data.spirals(101, seed=0, classes=3, noise=0.0)
    assert x.shape == (101, 2) and x.dtype == np.float32 and y.dtype == np.int64
    assert list(np.bincount(y)) == [34, 34, 33]
    assert np.abs(x).max() <= 1.0
    x_again, y_again = data.spirals(101, seed=0, classes=3, noise=0.0)
    np.testing.assert_array_equal(x, x_again)
    noisy, _ = data.spirals(101, seed=0, classes=3)
    other, _ = data.spirals(101, seed=1, classes=3)
    assert not np.array_equal(noisy, other)
    radius = np.hypot(x[:, 0], x[:, 1])   # without noise, every point lies on its arm
    for arm in range(3):
        np.testing.assert_allclose(np.sort(radius[y == arm]), np.linspace(0.05, 1, (y == arm).sum()),
                                   rtol=1e-6)
    angle_off_arm = np.arctan2(x[:, 1], x[:, 0]) - 2 * np.pi * (y / 3 + 1.5 * radius)
    np.testing.assert_allclose(np.cos(angle_off_arm), 1, atol=1e-5)
    with pytest.raises(ValueError, match="at least one point per class"):
        data.spirals(1, classes=2)


def test_blobs():
    centres = np.array([[-10.0, 0.0, 0.0], [10.0, 0.0, 5.0]])
    x, y = data.blobs(400, centers=centres, spread=0.5, seed=3)
    assert x.shape == (400, 3) and x.dtype == np.float32 and y.dtype == np.int64
    for k in range(2):
        np.testing.assert_allclose(x[y == k].mean(axis=0), centres[k], atol=0.15)
        np.testing.assert_allclose(x[y == k].std(axis=0), 0.5, atol=0.1)
    x, y = data.blobs(30, centers=4, dim=5, seed=0)
    assert x.shape == (30, 5) and sorted(set(y)) == [0, 1, 2, 3]
    np.testing.assert_array_equal(x, data.blobs(30, centers=4, dim=5, seed=0)[0])
    with pytest.raises(ValueError, match="centers must be a count"):
        data.blobs(10, centers=np.zeros(3))
