"""Shape arithmetic shared by the kernels' wrappers: broadcasting and flattening."""
import numpy as np

from ops.device import device_of


def flat(array):
    """A 1-D view of a C-contiguous host or device array (0-d arrays included)."""
    return array.reshape(array.size) if array.ndim != 1 else array


def broadcast_shape(a_shape, b_shape, op_name):
    try:
        return np.broadcast_shapes(tuple(a_shape), tuple(b_shape))
    except ValueError:
        raise ValueError(
            f"{op_name}: shapes {tuple(a_shape)} and {tuple(b_shape)} cannot be broadcast together"
        ) from None


def contiguous_strides(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def broadcast_strides(in_shape, out_shape):
    """Element strides of an input read as if it had ``out_shape`` (0 on broadcast dims)."""
    pad = len(out_shape) - len(in_shape)
    own = contiguous_strides(in_shape)
    return tuple(
        0 if i < pad or in_shape[i - pad] == 1 else own[i - pad] for i in range(len(out_shape))
    )


def coalesce(shape, *stride_sets):
    """Drop size-1 dims and merge neighbours that are contiguous in every operand.

    Fewer dims means less index arithmetic per element in the kernels."""
    dims = [(s, [st[i] for st in stride_sets]) for i, s in enumerate(shape) if s != 1]
    merged = []
    for size, strides in dims:
        if merged:
            prev_size, prev_strides = merged[-1]
            if all(p == s * size for p, s in zip(prev_strides, strides)):
                merged[-1] = (prev_size * size, strides)
                continue
        merged.append((size, strides))
    shape_out = tuple(size for size, _ in merged)
    strides_out = tuple(tuple(strides[k] for _, strides in merged) for k in range(len(stride_sets)))
    return shape_out, strides_out


def same_device(op_name, *arrays):
    devices = {device_of(a) for a in arrays}
    if len(devices) > 1:
        shapes = ", ".join(f"{device_of(a)} {tuple(a.shape)}" for a in arrays)
        raise ValueError(f"{op_name}: inputs live on different devices ({shapes})")
    return devices.pop()


def same_dtype(op_name, *arrays):
    dtypes = {np.dtype(a.dtype) for a in arrays}
    if len(dtypes) > 1:
        names = ", ".join(str(np.dtype(a.dtype)) for a in arrays)
        raise TypeError(f"{op_name}: inputs have different dtypes ({names}); cast one first")
    return dtypes.pop()
