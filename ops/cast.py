"""Dtype casts on the array's own device, and how bool storage meets the kernels.

``cast`` converts elementwise as NumPy's ``astype`` does: floats to integers truncate toward
zero (NaN and out-of-range values give an unspecified integer, as in NumPy and torch),
integers wrap to a narrower width, and anything becomes bool as ``x != 0`` (NaN is True).
Between float32 and float64 it is differentiable: the gradient is cast back.

Bool tensors hold NumPy's one-byte bools. Kernels take them as uint8 (``as_bytes``: the same
memory, 0 or 1), and bool results are written as uint8 and seen as bool: a kernel never
needs a bool array type, and a bool output is allocated as uint8 (poison mode's fill has no
bool value).
"""
import numpy as np

from ops.array_copy import COPY
from ops.cuda import device_view
from ops.dispatch import Out, run
from ops.element_kernel import element_kernel
from ops.layout import flat
from ops.registry import Op, register

BOOL = np.dtype(np.bool_)
BYTE = np.dtype(np.uint8)


def as_bytes(array):
    """A bool array seen as its uint8 bytes (the same memory); other arrays as they are."""
    return same_memory_as(array, BYTE) if array.dtype == BOOL else array


def same_memory_as(array, dtype):
    """``array`` seen as ``dtype`` of the same item size (bool and uint8), on its device."""
    return array.view(dtype) if isinstance(array, np.ndarray) else device_view(array, dtype)


def _nonzero_element(i, x, out):
    out[i] = 1 if x[i] != 0 else 0


CAST_TO_BOOL = element_kernel("cast_to_bool", _nonzero_element)


def cast(x, dtype):
    """A copy of ``x`` (any storage dtype) as ``dtype``, on its device."""
    dtype = np.dtype(dtype)
    source = flat(as_bytes(x))
    if dtype == BOOL:
        return same_memory_as(run(CAST_TO_BOOL, source, Out(x.shape, BYTE)), BOOL)
    return run(COPY, source, Out(x.shape, dtype))   # the copy kernel converts as it copies


@register
class Cast(Op):
    """``x`` as ``params["dtype"]``; takes every storage dtype (labels and masks cast too).
    Only float-to-float casts are recorded for autograd (``engine.functional.astype``)."""
    name = "cast"
    kernels = (COPY, CAST_TO_BOOL)

    def __call__(self, x):
        # the registry's checks refuse bool inputs, which a cast exists to convert
        self.check(x)
        return self.forward(x)

    def check(self, x):
        self.dtype = np.dtype(self.params["dtype"])

    def forward(self, x):
        self.x_dtype = np.dtype(x.dtype)
        return cast(x, self.dtype)

    def backward(self, grad_out, grad_dst):
        return (cast(grad_out, self.x_dtype),)
