"""Optional download of data set files into a cache folder, each one checked by its sha256.

Nothing in the engine needs the network: MNIST ships with the package. This is for users who
want Fashion-MNIST (or the original MNIST files) and have internet access. Every file is
streamed through ``engine.archive.atomic_write`` (a temporary file next to its
destination), hashed on the way, and renamed into place only when the hash matches, so the
cache never holds a partial or corrupted file under a real name.
"""
import hashlib
import os
import urllib.error
import urllib.parse
import urllib.request

from engine.archive import atomic_write

_CHUNK_BYTES = 1 << 20


def cache_dir(dataset):
    """Default folder for ``dataset``: ``$XDG_CACHE_HOME/numba-engine/<dataset>``
    (``~/.cache`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "numba-engine", dataset)


def file_sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def download(base_url, checksums, folder, timeout=60):
    """Fetch ``base_url/<name>`` for every ``name -> sha256`` of ``checksums`` into ``folder``.

    A file already in ``folder`` with the expected sha256 is kept (no request is made).
    Returns ``folder``. Raises ``ValueError`` for a checksum mismatch and ``OSError`` for a
    network failure; either way nothing is left behind under the file's name or as a
    temporary file."""
    scheme = urllib.parse.urlsplit(base_url).scheme
    if scheme not in ("http", "https"):
        raise ValueError(f"download: base_url must be an http(s) URL, got {base_url!r}")
    os.makedirs(folder, exist_ok=True)
    for name, sha256 in checksums.items():
        destination = os.path.join(folder, name)
        if os.path.isfile(destination) and file_sha256(destination) == sha256:
            continue
        fetch(base_url.rstrip("/") + "/" + name, destination, sha256, timeout)
    return folder


def fetch(url, destination, sha256, timeout=60):
    """Download ``url`` to ``destination`` if and only if its content has ``sha256`` (the
    file gets the mode ``open()`` would give it)."""
    with atomic_write(destination) as out:
        digest = hashlib.sha256()
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                while chunk := response.read(_CHUNK_BYTES):
                    digest.update(chunk)
                    out.write(chunk)
        except (urllib.error.URLError, OSError) as exc:
            raise OSError(f"download {url}: {exc}") from exc
        if digest.hexdigest() != sha256:
            raise ValueError(f"download {url}: sha256 {digest.hexdigest()} does not match the "
                             f"expected {sha256}; the file was discarded")
