"""``keras.utils``: ``to_categorical``."""
import numpy as np


def to_categorical(x, num_classes=None):
    """One-hot float32 rows of the integer labels ``x`` (``x.shape + (num_classes,)``; a
    trailing axis of 1 is dropped first, as Keras does). ``num_classes`` defaults to the
    largest label + 1; a label outside ``[0, num_classes)`` is a ValueError."""
    labels = np.asarray(x)
    if labels.ndim > 1 and labels.shape[-1] == 1:
        labels = labels[..., 0]
    if labels.dtype.kind not in "iub":
        if labels.size and not np.array_equal(labels, np.round(labels)):
            raise ValueError(f"to_categorical: labels must be integers, got dtype {labels.dtype}")
        labels = labels.astype(np.int64)
    if num_classes is None:
        num_classes = int(labels.max()) + 1 if labels.size else 0
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"to_categorical: labels run from {labels.min()} to {labels.max()}, "
                         f"outside [0, {num_classes}) for num_classes={num_classes}")
    return np.eye(num_classes, dtype=np.float32)[labels]
