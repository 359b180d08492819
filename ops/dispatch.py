"""The dispatcher: one call that allocates an op's outputs, builds its metadata and runs a
``Kernel`` pair on the device of its arrays.

An op's forward or backward names its kernel and the arguments in the kernel's order; two
placeholders stand for what the dispatcher makes::

    y = run(SOFTMAX, flat(x), Out(x.shape, x.dtype), rows, n, inner, log)

- ``Out(shape, dtype)``: a new uninitialised array on the arrays' device (NaN in poison mode);
  the kernel gets its flat view, the caller gets it in ``shape``. A kernel writes every
  element of its outputs.
- ``Meta(values)``: a tuple of ints (shapes, strides) as one cached int64 array: read-only
  NumPy on the CPU, a device array on CUDA (one kernel argument instead of many).
"""
from ops.launch import device_of_args
from ops.layout import flat, meta_on
from ops.memory import empty


class Out:
    """A new output of ``shape`` and ``dtype``; ``flat=False`` hands the kernel the shaped
    array instead of its flat view. After the run, ``.array`` is the array made."""
    __slots__ = ("shape", "dtype", "flat", "array")

    def __init__(self, shape, dtype, flat=True):
        self.shape, self.dtype, self.flat, self.array = shape, dtype, flat, None


class Meta:
    """Launch metadata: a tuple of ints travelling as one int64 array."""
    __slots__ = ("values",)

    def __init__(self, values):
        self.values = tuple(values)


def run(kernel, *args):
    """Run ``kernel`` on ``args`` with its ``Out`` and ``Meta`` placeholders made; returns the
    new outputs (one array, a tuple of several, or None)."""
    device = device_of_args(args)
    outputs = []
    # one comprehension over the arguments (a Dense backward passes 11; a loop of appends
    # was a third of this function's time)
    resolved = [_resolved(arg, device, outputs) if type(arg) in _PLACEHOLDERS else arg
                for arg in args]
    kernel.run_on(device, resolved)
    if not outputs:
        return None
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _resolved(placeholder, device, outputs):
    """What the kernel gets for ``placeholder``; a new output array is added to ``outputs``."""
    if type(placeholder) is Meta:
        return meta_on(device, placeholder.values)
    array = placeholder.array
    if array is None:   # one placeholder named twice is one array
        array = placeholder.array = empty(placeholder.shape, placeholder.dtype, device)
        outputs.append(array)
    return flat(array) if placeholder.flat else array


_PLACEHOLDERS = (Out, Meta)
