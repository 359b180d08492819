"""The data recipes of ``python -m engine.train`` and the benchmarks: a data set by name,
checked, optionally cut to its first samples, and its pixel statistics.

```python
from data import datasets
(x_train, y_train), (x_test, y_test) = datasets.load_dataset("mnist", limit=1000)
mean, std = datasets.pixel_statistics(x_train)      # of the images scaled to [0, 1]
```
"""
import numpy as np

from data import fashion_mnist, mnist

DATASETS = ("mnist", "fashion-mnist")


def load_dataset(name, data_dir=None, limit=None):
    """``(x_train, y_train), (x_test, y_test)`` of ``name`` (one of ``DATASETS``) as the data
    set ships them (uint8 images), read from ``data_dir`` when given, the first ``limit``
    samples of each split. A ValueError in one line when the files cannot be read, a split
    is empty or the splits' images differ in shape."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}: expected one of {', '.join(DATASETS)}")
    module = mnist if name == "mnist" else fashion_mnist
    try:
        (x_train, y_train), (x_test, y_test) = (module.load(root=data_dir) if data_dir
                                                else module.load())
    except (OSError, ValueError) as error:
        where = f" from {data_dir}" if data_dir else ""
        raise ValueError(f"cannot load {name}{where}: {error}") from error
    where = f"{name} in {data_dir}" if data_dir else name
    for split, images in (("training", x_train), ("test", x_test)):
        if images.size == 0:
            raise ValueError(f"{where}: the {split} images {images.shape} hold no samples")
    if x_train.shape[1:] != x_test.shape[1:]:
        raise ValueError(f"{where}: training images {x_train.shape[1:]} and test images "
                         f"{x_test.shape[1:]} differ in shape")
    if limit:
        return (x_train[:limit], y_train[:limit]), (x_test[:limit], y_test[:limit])
    return (x_train, y_train), (x_test, y_test)


def pixel_statistics(images):
    """Mean and standard deviation of uint8 ``images`` scaled to [0, 1], exact, from a
    histogram (no float copy of the data set). Float images are taken as already scaled."""
    if images.dtype != np.uint8:
        mean, std = float(images.mean(dtype=np.float64)), float(images.std(dtype=np.float64))
        return mean, (std if std > 0 else 1.0)
    counts = np.bincount(images.reshape(-1), minlength=256).astype(np.float64)
    levels = np.arange(256) / 255.0
    mean = float(counts @ levels / counts.sum())
    std = float(np.sqrt(counts @ (levels - mean) ** 2 / counts.sum()))
    return mean, (std if std > 0 else 1.0)
