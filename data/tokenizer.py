"""``CharTokenizer``: a character-level vocabulary, as nanoGPT's shakespeare_char and
makemore build one: the sorted distinct characters of a text, each an id.

```python
tok = data.CharTokenizer(text)          # vocab_size, chars
ids = tok.encode("ROMEO:")              # int64 array
tok.decode(ids) == "ROMEO:"
data.CharTokenizer.from_config(tok.get_config())   # saved with a model, rebuilt on load
```
"""
import numpy as np


class CharTokenizer:
    """Ids ``0 .. vocab_size - 1`` for the sorted distinct characters of ``text`` (or of
    ``chars``, when the vocabulary is given as it was saved)."""

    def __init__(self, text=None, chars=None):
        if (text is None) == (chars is None):
            raise TypeError("CharTokenizer: give the text to build the vocabulary from, or "
                            "chars=")
        source = text if chars is None else chars
        if not isinstance(source, str) or not source:
            raise ValueError(f"CharTokenizer: expects a non-empty str, got {source!r:.60}")
        self.chars = "".join(sorted(set(source)))
        if chars is not None and self.chars != chars:
            raise ValueError("CharTokenizer: chars must be sorted and distinct, as "
                             "get_config() gives them")
        self._ids = {char: index for index, char in enumerate(self.chars)}

    @property
    def vocab_size(self):
        return len(self.chars)

    def encode(self, text):
        """The ids of ``text``'s characters, an int64 array."""
        try:
            return np.fromiter((self._ids[c] for c in text), np.int64, count=len(text))
        except KeyError as error:
            raise ValueError(f"CharTokenizer.encode: character {error.args[0]!r} is not in "
                             f"the vocabulary of {self.vocab_size}") from None

    def decode(self, ids):
        """The text of ``ids`` (a sequence, array or 1-D Tensor of ids)."""
        ids = np.asarray(ids.numpy() if hasattr(ids, "numpy") else ids)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError(f"CharTokenizer.decode: expects a 1-D sequence of integer ids, "
                             f"got shape {ids.shape} of {ids.dtype}")
        bad = (ids < 0) | (ids >= self.vocab_size)
        if bad.any():
            raise ValueError(f"CharTokenizer.decode: id {ids[bad][0]} is outside "
                             f"[0, {self.vocab_size})")
        return "".join(self.chars[i] for i in ids.tolist())

    def get_config(self):
        return {"chars": self.chars}

    @classmethod
    def from_config(cls, config):
        return cls(chars=config["chars"])

    def __repr__(self):
        return f"CharTokenizer(vocab_size={self.vocab_size})"
