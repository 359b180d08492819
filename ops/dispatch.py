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
    resolved = []
    outputs = []
    for arg in args:
        kind = type(arg)
        if kind is Out:
            array = arg.array
            if array is None:   # one placeholder named twice is one array
                array = arg.array = empty(arg.shape, arg.dtype, device)
                outputs.append(array)
            resolved.append(flat(array) if arg.flat else array)
        elif kind is Meta:
            resolved.append(meta_on(device, arg.values))
        else:
            resolved.append(arg)
    kernel.run_on(device, resolved)
    if not outputs:
        return None
    return outputs[0] if len(outputs) == 1 else tuple(outputs)
