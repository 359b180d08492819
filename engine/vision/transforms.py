"""torchvision's transforms of one image: ``ToTensor``, ``Normalize``, ``Compose``.

They act on one sample, as torchvision's do (``dataset[i]`` applies them). A DataLoader
over a whole data set does not call them per sample when ``loader_form`` recognises the
transform (``ToTensor()``, or ``Compose([ToTensor(), Normalize(mean, std)])``): the loader
then converts the whole set once with the same float32 arithmetic, so its batches equal
the stacked samples exactly.
"""
from collections import namedtuple

import numpy as np

from engine.tensor import Tensor

# how a DataLoader converts uint8 images [N, H, W] to ``transform`` of each: scaled by 1/255
# into [N, 1, H, W], then ``normalize`` (``(mean, std)`` or None) as the loader's own
LoaderForm = namedtuple("LoaderForm", "normalize")


class ToTensor:
    """An image ``[H, W]`` or ``[H, W, C]`` (NumPy array, PIL image or Tensor) as a Tensor
    ``[C, H, W]``; uint8 pixels become float32 divided by 255 (in [0, 1]), other dtypes
    keep their values, as torchvision's ``ToTensor`` does."""

    def __call__(self, picture):
        array = np.asarray(picture.numpy() if isinstance(picture, Tensor) else picture)
        if array.ndim == 2:
            array = array[:, :, None]
        if array.ndim != 3:
            raise ValueError(f"ToTensor: expected an image [H, W] or [H, W, C], got shape "
                             f"{array.shape}")
        channels_first = np.ascontiguousarray(array.transpose(2, 0, 1))
        if channels_first.dtype == np.uint8:
            channels_first = channels_first.astype(np.float32)
            channels_first /= np.float32(255)
        return Tensor(channels_first)

    def __repr__(self):
        return "ToTensor()"


class Normalize:
    """``(image - mean) / std`` per channel of a float Tensor ``[C, H, W]``; ``mean`` and
    ``std`` are sequences of ``C`` values (or of one, for every channel), computed in the
    image's dtype, as torchvision's ``Normalize``. For data samples: no gradient flows."""

    def __init__(self, mean, std, inplace=False):
        self.mean, self.std, self.inplace = mean, std, inplace

    def statistics(self, dtype):
        """``(mean, std)`` as ``dtype`` arrays ``[C or 1, 1, 1]``, checked."""
        mean = np.asarray(self.mean, dtype=dtype).reshape(-1, 1, 1)
        std = np.asarray(self.std, dtype=dtype).reshape(-1, 1, 1)
        if np.any(std == 0):
            raise ValueError(f"Normalize: std {self.std} has a zero (in {np.dtype(dtype)}): "
                             "it would divide by zero")
        return mean, std

    def __call__(self, image):
        if not isinstance(image, Tensor) or image.dtype not in (np.float32, np.float64):
            raise TypeError(f"Normalize: expects a float32 or float64 Tensor [C, H, W] (put "
                            f"ToTensor() before it), got {type(image).__name__}"
                            f"{' of ' + str(image.dtype) if isinstance(image, Tensor) else ''}")
        if image.ndim < 3:
            raise ValueError(f"Normalize: expects an image [C, H, W], got shape {image.shape}")
        mean, std = self.statistics(image.dtype)
        if len(mean) not in (1, image.shape[-3]) or len(std) not in (1, image.shape[-3]):
            raise ValueError(f"Normalize: mean {self.mean} and std {self.std} need 1 or "
                             f"{image.shape[-3]} values (the image's channels, shape "
                             f"{image.shape})")
        values = image.numpy() if self.inplace else image.numpy().copy()
        values -= mean
        values /= std
        return image if self.inplace else Tensor(values)

    def __repr__(self):
        return f"Normalize(mean={self.mean}, std={self.std})"


class Compose:
    """The transforms in order, each on the result of the one before."""

    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, image):
        for transform in self.transforms:
            image = transform(image)
        return image

    def __repr__(self):
        inner = "".join(f"\n    {transform}" for transform in self.transforms)
        return f"Compose({inner}\n)"


def loader_form(transform, channels):
    """The ``LoaderForm`` of ``transform`` on images of ``channels`` channels when it is
    ``ToTensor()``, optionally followed by one ``Normalize``; None for any other transform,
    which a loader then applies sample by sample."""
    steps = transform.transforms if type(transform) is Compose else [transform]
    if not steps or type(steps[0]) is not ToTensor or len(steps) > 2:
        return None
    if len(steps) == 1:
        return LoaderForm(normalize=None)
    if type(steps[1]) is not Normalize:
        return None
    mean, std = steps[1].statistics(np.float32)
    if len(mean) not in (1, channels) or len(std) not in (1, channels):
        return None   # the per-sample path raises Normalize's error
    return LoaderForm(normalize=(mean, std))
