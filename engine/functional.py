"""The differentiable functions behind Tensor's operators and methods, and their module-level
twins (``engine.relu(x)``, ``engine.softmax(x, axis=-1)``, ...). Each one runs a registered op.

This module sits below ``engine.tensor``: it sees tensors as ``engine.autograd.Value``s, and a
binary op's other operand (a number, list or array) becomes a tensor through the Tensor side's
``_operand``.
"""
import numbers

from engine.autograd import Value, apply
from ops import elementwise as ew
from ops import matmul as mm
from ops import reduce as rd
from ops import shape as sh
from ops import softmax as sm


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


def _binary(name, op_class, scalar_op, reflected_scalar_op, a, b, scalar_map=lambda s: s):
    if _is_scalar(b) and isinstance(a, Value):
        return apply(scalar_op, a, p=scalar_map(b))
    if _is_scalar(a) and isinstance(b, Value):
        return apply(reflected_scalar_op, b, p=a)
    return apply(op_class, *_tensor_pair(name, a, b))


def add(a, b):
    return _binary("add", ew.Add, ew.AddScalar, ew.AddScalar, a, b)


def sub(a, b):
    return _binary("sub", ew.Sub, ew.AddScalar, ew.RSubScalar, a, b, scalar_map=lambda s: -s)


def mul(a, b):
    return _binary("mul", ew.Mul, ew.MulScalar, ew.MulScalar, a, b)


def div(a, b):
    return _binary("div", ew.Div, ew.MulScalar, ew.RDivScalar, a, b, scalar_map=lambda s: 1.0 / s)


def pow(x, exponent):
    if not _is_scalar(exponent):
        raise TypeError(f"pow: the exponent must be a Python number, got {type(exponent).__name__}")
    return apply(ew.PowScalar, x, p=float(exponent))


def neg(x):
    return apply(ew.Neg, x)


def exp(x):
    return apply(ew.Exp, x)


def log(x):
    return apply(ew.Log, x)


def sqrt(x):
    return apply(ew.Sqrt, x)


def relu(x):
    return apply(ew.Relu, x)


def leaky_relu(x, alpha=0.01):
    return apply(ew.LeakyRelu, x, p=float(alpha))


def sigmoid(x):
    return apply(ew.Sigmoid, x)


def tanh(x):
    return apply(ew.Tanh, x)


def sum(x, axis=None, keepdims=False):
    return apply(rd.Sum, x, axis=axis, keepdims=keepdims)


def mean(x, axis=None, keepdims=False):
    return apply(rd.Mean, x, axis=axis, keepdims=keepdims)


def max(x, axis=None, keepdims=False):
    return apply(rd.Max, x, axis=axis, keepdims=keepdims)


def reshape(x, *shape):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return apply(sh.Reshape, x, shape=shape)


def flatten(x, start_dim=1):
    if not (0 <= start_dim < x.ndim or start_dim == x.ndim == 0):
        raise ValueError(f"flatten: start_dim {start_dim} is out of range for shape {x.shape}")
    return reshape(x, x.shape[:start_dim] + (-1,))


def transpose(x):
    return apply(sh.Transpose, x)


def matmul(a, b):
    return apply(mm.MatMul, *_tensor_pair("matmul", a, b))


def softmax(x, axis=-1):
    return apply(sm.Softmax, x, axis=axis)


def log_softmax(x, axis=-1):
    return apply(sm.LogSoftmax, x, axis=axis)
