"""The differentiable functions behind Tensor's operators and methods, and their module-level
twins (``engine.relu(x)``, ``engine.softmax(x, axis=-1)``, ...). Each one runs a registered op.

This module sits below ``engine.tensor``: it sees tensors as ``engine.autograd.Value``s, and a
binary op's other operand (a number, list or array) becomes a tensor through the Tensor side's
``_operand``.

Every function that takes ``axis=`` also takes PyTorch's ``dim=`` (and ``keepdim=`` beside
``keepdims=``); giving both is a TypeError. Comparisons, argmax/argmin and casts to a
non-float dtype run their op without recording it: their results are never differentiated.
"""
import numbers

import numpy as np

from engine.autograd import Value, apply
from ops import arg_extrema as ax
from ops import binary_extrema as ex
from ops import cast as ct
from ops import compare as cmp
from ops import elementwise as ew
from ops import indexing as ix
from ops import join as jn
from ops import matmul as mm
from ops import reduce as rd
from ops import shape as sh
from ops import softmax as sm
from ops.fill import fill
from ops.layout import normalize_axes
from ops.memory import empty
from ops.pointwise import TABLE
from ops.registry import FLOAT_DTYPES


def _is_scalar(value):
    return isinstance(value, numbers.Real) and not hasattr(value, "shape")


def _tensor_pair(name, a, b):
    """``a`` and ``b`` as tensors of one device and dtype: the non-tensor side (a list or an
    array) is converted to the tensor side's."""
    if not isinstance(a, Value):
        if not isinstance(b, Value):
            raise TypeError(f"{name}: neither operand is an engine Tensor (got "
                            f"{type(a).__name__} and {type(b).__name__})")
        a = b._operand(a)
    if not isinstance(b, Value):
        b = a._operand(b)
    return a, b


def _axis(name, axis, dim):
    """``axis``, or PyTorch's ``dim`` in its place; both given is a TypeError."""
    if dim is None:
        return axis
    if axis is not None:
        raise TypeError(f"{name}: got both axis={axis!r} and dim={dim!r}; give one (dim is "
                        "PyTorch's name for axis)")
    return dim


def _keepdims(name, keepdims, keepdim):
    """``keepdims``, or PyTorch's ``keepdim`` in its place; both given is a TypeError."""
    if keepdim is None:
        return keepdims
    if keepdims:
        raise TypeError(f"{name}: got both keepdims and keepdim; give one")
    return bool(keepdim)


def _reduction(run, op_class, name, x, axis, keepdims, dim, keepdim):
    """``run(op_class, x, ...)`` over ``axis`` (or torch's ``dim``) with ``keepdims`` (or
    torch's ``keepdim``): the one way every reduction reads its axis arguments."""
    return run(op_class, x, axis=_axis(name, axis, dim),
               keepdims=_keepdims(name, keepdims, keepdim))


def _untracked(op_class, *inputs, **params):
    """Run an op whose result is never differentiated (bools, int64 positions, a cast to an
    integer dtype): no node, whatever the inputs require."""
    op = op_class(**params)
    maker = next(x for x in inputs if isinstance(x, Value))
    op.needs_input_grad = (False,) * len(inputs)
    return maker._wrap(op(*[x.data if isinstance(x, Value) else x for x in inputs]))


def _binary(name, op_class, scalar_op, reflected_scalar_op, a, b, scalar_map=lambda s: s):
    if _is_scalar(b) and isinstance(a, Value):
        return apply(scalar_op, a, p=scalar_map(b))
    if _is_scalar(a) and isinstance(b, Value):
        return apply(reflected_scalar_op, b, p=a)
    return apply(op_class, *_tensor_pair(name, a, b))


def add(a, b):
    return _binary("add", ew.Add, ew.AddScalarOp, ew.AddScalarOp, a, b)


def sub(a, b):
    return _binary("sub", ew.Sub, ew.AddScalarOp, ew.RSubScalarOp, a, b, scalar_map=lambda s: -s)


def mul(a, b):
    return _binary("mul", ew.Mul, ew.MulScalarOp, ew.MulScalarOp, a, b)


def div(a, b):
    return _binary("div", ew.Div, ew.DivScalarOp, ew.RDivScalarOp, a, b)


def pow(x, exponent):
    if not _is_scalar(exponent):
        raise TypeError(f"pow: the exponent must be a Python number, got {type(exponent).__name__}")
    return apply(ew.PowScalarOp, x, p=float(exponent))


def _pointwise_function(entry):
    """``engine.<name>(x)`` of a parameter-free ``ops.pointwise`` entry, with its doc."""
    op_class = ew.UNARY_OPS[entry.name]

    def function(x):
        return apply(op_class, x)
    function.__name__ = function.__qualname__ = entry.name
    function.__doc__ = entry.doc
    return function


# neg, exp, log, sqrt, relu, sigmoid, tanh, abs, ...: every entry with a doc (Tensor binds
# the same functions as its methods)
POINTWISE = {entry.name: _pointwise_function(entry) for entry in TABLE if entry.doc}
globals().update(POINTWISE)


def leaky_relu(x, alpha=0.01):
    """``x`` where ``x > 0``, else ``alpha * x``, elementwise, as
    ``torch.nn.functional.leaky_relu`` (``negative_slope``)."""
    return apply(ew.LeakyReluOp, x, p=float(alpha))


def gelu(x, approximate="none"):
    """x·Phi(x), Phi the standard normal CDF (``approximate="none"``), or its tanh form
    (``"tanh"``), as ``torch.nn.functional.gelu``."""
    forms = {"none": ew.GeluOp, "tanh": ew.GeluTanhOp}
    if approximate not in forms:
        raise ValueError(f"gelu: approximate must be \"none\" or \"tanh\" (torch's values), "
                         f"got {approximate!r}")
    return apply(forms[approximate], x)


def clip(x, low=None, high=None, *, min=None, max=None):
    """``x`` limited to [low, high] (``min=``/``max=`` as torch.clamp and NumPy name them);
    None leaves a side open. The gradient passes where low <= x <= high."""
    for name, given, keyword in (("low", low, min), ("high", high, max)):
        if given is not None and keyword is not None:
            raise TypeError(f"clip: got the {name} bound twice ({given!r} and {keyword!r})")
    return apply(ew.Clip, x, low=low if min is None else min, high=high if max is None else max)


clamp = clip


def sum(x, axis=None, keepdims=False, *, dim=None, keepdim=None):
    return _reduction(apply, rd.Sum, "sum", x, axis, keepdims, dim, keepdim)


def mean(x, axis=None, keepdims=False, *, dim=None, keepdim=None):
    return _reduction(apply, rd.Mean, "mean", x, axis, keepdims, dim, keepdim)


def max(x, axis=None, keepdims=False, *, dim=None, keepdim=None):
    """The largest values (NumPy's max, torch's amax: not torch's (values, indices) pair;
    the positions are ``argmax``). ``max(a, b)`` with a Tensor ``b`` is torch's elementwise
    form: ``maximum(a, b)``."""
    if isinstance(axis, Value):
        return _elementwise_extremum("max", ex.Maximum, x, axis, keepdims, dim, keepdim)
    return _reduction(apply, rd.Max, "max", x, axis, keepdims, dim, keepdim)


def min(x, axis=None, keepdims=False, *, dim=None, keepdim=None):
    """The smallest values (NumPy's min, torch's amin; the positions are ``argmin``).
    ``min(a, b)`` with a Tensor ``b`` is ``minimum(a, b)``, as torch's."""
    if isinstance(axis, Value):
        return _elementwise_extremum("min", ex.Minimum, x, axis, keepdims, dim, keepdim)
    return _reduction(apply, rd.Min, "min", x, axis, keepdims, dim, keepdim)


def _elementwise_extremum(name, op_class, a, b, keepdims, dim, keepdim):
    """torch's ``max(a, b)`` / ``min(a, b)``: the other operand is a Tensor, not an axis."""
    if keepdims or dim is not None or keepdim is not None:
        raise TypeError(f"{name}: the second argument is a Tensor, so this is the elementwise "
                        f"{name}(a, b) (torch's), which takes no axis, dim or keepdims")
    return apply(op_class, *_tensor_pair(name, a, b))


def maximum(a, b):
    """The larger of ``a`` and ``b`` elementwise, broadcast together (torch.maximum,
    np.maximum); NaN where either is NaN. The gradient goes to the larger, halved on ties."""
    return apply(ex.Maximum, *_tensor_pair("maximum", a, b))


def minimum(a, b):
    """The smaller of ``a`` and ``b`` elementwise (torch.minimum, np.minimum)."""
    return apply(ex.Minimum, *_tensor_pair("minimum", a, b))


def argmax(x, axis=None, keepdims=False, *, dim=None, keepdim=None):
    """The int64 position of the first maximum over ``axis`` (None: of the flattened input)."""
    return _reduction(_untracked, ax.ArgMax, "argmax", x, axis, keepdims, dim, keepdim)


def argmin(x, axis=None, keepdims=False, *, dim=None, keepdim=None):
    return _reduction(_untracked, ax.ArgMin, "argmin", x, axis, keepdims, dim, keepdim)


# ------------------------------------------------------------------ comparisons and where

def _compare(name, op_class, a, b):
    if _is_scalar(b):
        return _untracked(op_class, a, p=b)
    if not isinstance(b, Value):   # a list or array keeps its own dtype: 0.5 is no int
        b = a._operand(b, dtype=_own_dtype(b))
    return _untracked(op_class, a, b)


def _own_dtype(value):
    dtype = getattr(value, "dtype", None)
    return np.asarray(value).dtype if dtype is None else dtype


def _comparison(name, op_class):
    def compare(a, b):
        return _compare(name, op_class, a, b)
    compare.__name__ = compare.__qualname__ = name
    compare.__doc__ = f"``{name}(a, b)`` elementwise, as ``torch.{name}``: a boolean Tensor."
    return compare


lt, le, gt, ge, eq, ne = (_comparison(name, getattr(cmp, name.capitalize()))
                          for name in ("lt", "le", "gt", "ge", "eq", "ne"))


def where(cond, a, b):
    """``a`` where the bool ``cond`` holds, else ``b``, broadcast together; differentiable in
    ``a`` and ``b``. Numbers take the dtype of the tensor among ``a`` and ``b`` (float32 when
    neither is one); cond may be a bool array."""
    maker = next((v for v in (cond, a, b) if isinstance(v, Value)), None)
    if maker is None:
        raise TypeError("where: none of cond, a and b is an engine Tensor")
    floats = [v.data.dtype for v in (a, b) if isinstance(v, Value)]
    dtype = floats[0] if floats else np.dtype(np.float32)
    if not isinstance(cond, Value):
        cond = maker._operand(cond, dtype=_own_dtype(cond))
    return apply(cmp.Where, cond, _branch(a, maker, dtype), _branch(b, maker, dtype))


def _branch(value, maker, dtype):
    if isinstance(value, Value):
        return value
    if _is_scalar(value):   # filled on the device: no host-to-device copy
        return maker._wrap(fill(empty((), dtype, maker.device), value))
    return maker._operand(value, dtype=dtype)


# ------------------------------------------------------------------ dtypes

def astype(x, dtype):
    """A copy of ``x`` as ``dtype`` on its device; differentiable between float32 and float64
    (the gradient is cast back), never recorded towards integers or bool."""
    dtype = np.dtype(dtype)
    if dtype in FLOAT_DTYPES and x.data.dtype in FLOAT_DTYPES:
        return apply(ct.Cast, x, dtype=dtype)
    return _untracked(ct.Cast, x, dtype=dtype)


# ------------------------------------------------------------------ shapes

def reshape(x, *shape, op_name="reshape"):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return apply(sh.ReshapeOp, x, shape=shape, op_name=op_name)


def view(x, *shape):
    """``reshape``: every tensor is C-contiguous, so a view always exists."""
    return reshape(x, *shape, op_name="view")


def flatten(x, start_dim=1):
    if not (0 <= start_dim < x.ndim or start_dim == x.ndim == 0):
        raise ValueError(f"flatten: start_dim {start_dim} is out of range for shape {x.shape}")
    return reshape(x, x.shape[:start_dim] + (-1,))


def squeeze(x, axis=None, *, dim=None):
    """``x`` without its size-1 axes (only those of ``axis``, an int or a tuple, when given;
    the others of ``axis`` stay, as in torch). A view."""
    axis = _axis("squeeze", axis, dim)
    axes = normalize_axes(axis, x.ndim, "squeeze")
    shape = tuple(size for i, size in enumerate(x.shape) if not (i in axes and size == 1))
    return reshape(x, shape, op_name="squeeze")


def unsqueeze(x, axis=None, *, dim=None):
    """``x`` with new size-1 axes at ``axis`` (an int or a tuple, positions in the result,
    as NumPy's expand_dims). A view."""
    axis = _axis("unsqueeze", axis, dim)
    if axis is None:
        raise TypeError("unsqueeze: missing the axis (or dim) of the new size-1 axis")
    count = 1 if isinstance(axis, (int, np.integer)) else len(tuple(axis))
    new = normalize_axes(axis, x.ndim + count, "unsqueeze")
    sizes = iter(x.shape)
    shape = tuple(1 if i in new else next(sizes) for i in range(x.ndim + count))
    return reshape(x, shape, op_name="unsqueeze")


def permute(x, *axes):
    """A copy of ``x`` with its axes in the order ``axes`` (ints or one tuple)."""
    if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
        axes = tuple(axes[0])
    return apply(sh.Permute, x, axes=axes)


def transpose(x, *axes):
    """``x`` with its axes reversed (``x.T``); ``transpose(a, b)`` swaps two axes, as torch's
    (for a 2-D tensor NumPy's ``transpose(1, 0)`` means the same); three or more axes, or one
    tuple, are a permutation, as NumPy's."""
    if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
        return permute(x, *axes)
    if len(axes) == 2:
        if x.ndim == 0:   # torch's transpose(0, 0) of a 0-d tensor: nothing to swap
            if any(axis not in (0, -1) for axis in axes):
                raise ValueError(f"transpose: axes {axes} of a 0-d input (only 0 and -1)")
            return reshape(x, (), op_name="transpose")
        first, second = normalize_axes(axes[0], x.ndim, "transpose") + \
            normalize_axes(axes[1], x.ndim, "transpose")
        order = list(range(x.ndim))
        order[first], order[second] = second, first
    elif axes:
        return permute(x, *axes)
    else:
        order = list(reversed(range(x.ndim)))
    if order == list(range(x.ndim)):
        return reshape(x, x.shape, op_name="transpose")   # nothing moves: a view
    if x.ndim == 2:
        return apply(sh.Transpose, x)
    return permute(x, *order)


def cat(tensors, axis=None, *, dim=None):
    """The tensors joined along an existing ``axis`` (default 0); their other dims must
    match."""
    tensors = _tensor_list("cat", tensors)
    axis = _axis("cat", axis, dim)
    return apply(jn.Cat, *tensors, axis=0 if axis is None else axis)


def stack(tensors, axis=None, *, dim=None):
    """The tensors (all of one shape) joined along a new ``axis`` (default 0)."""
    tensors = _tensor_list("stack", tensors)
    axis = _axis("stack", axis, dim)
    axis = 0 if axis is None else axis
    shapes = {t.shape for t in tensors}
    if len(shapes) > 1:
        raise ValueError(f"stack: every tensor needs the same shape, got "
                         f"{', '.join(str(t.shape) for t in tensors)}")
    (axis,) = normalize_axes(axis, tensors[0].ndim + 1, "stack")
    return cat([unsqueeze(t, axis) for t in tensors], axis)


def _tensor_list(name, tensors):
    if isinstance(tensors, Value) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name}: expects a list or tuple of Tensors, got "
                        f"{type(tensors).__name__}")
    if not tensors:
        raise ValueError(f"{name}: expects at least one tensor")
    for k, t in enumerate(tensors):
        if not isinstance(t, Value):
            raise TypeError(f"{name}: item {k} is a {type(t).__name__}, not an engine Tensor")
    return list(tensors)


# ------------------------------------------------------------------ indexing

def index(x, key):
    """``x[key]`` (see ``ops.indexing``): differentiable in ``x``."""
    return apply(ix.Index, x, key=_storage_key(key))


def _storage_key(key):
    """The key with every Tensor replaced by its storage array."""
    if isinstance(key, tuple):
        return tuple(k.data if isinstance(k, Value) else k for k in key)
    return key.data if isinstance(key, Value) else key


def matmul(a, b):
    return apply(mm.MatMul, *_tensor_pair("matmul", a, b))


def softmax(x, axis=None, *, dim=None):
    """Softmax over ``axis`` (the last when neither axis nor dim is given)."""
    axis = _axis("softmax", axis, dim)
    return apply(sm.SoftmaxOp, x, axis=-1 if axis is None else axis)


def log_softmax(x, axis=None, *, dim=None):
    axis = _axis("log_softmax", axis, dim)
    return apply(sm.LogSoftmaxOp, x, axis=-1 if axis is None else axis)
