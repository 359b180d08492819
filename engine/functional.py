"""The differentiable functions behind Tensor's operators and methods, and their module-level
twins (``engine.relu(x)``, ``engine.softmax(x, axis=-1)``, ...). Each one runs a registered op."""
import numbers

from engine.autograd import apply
from ops import elementwise as ew
from ops import reduce as rd
from ops import shape as sh


def _tensor_types():
    from engine.tensor import Tensor, as_tensor
    return Tensor, as_tensor


def _is_scalar(value):
    return isinstance(value, numbers.Real) and not hasattr(value, "shape")


def _binary(op_class, scalar_op, reflected_scalar_op, a, b, scalar_map=lambda s: s):
    Tensor, as_tensor = _tensor_types()
    if _is_scalar(b) and isinstance(a, Tensor):
        return apply(scalar_op, a, p=scalar_map(b))
    if _is_scalar(a) and isinstance(b, Tensor):
        return apply(reflected_scalar_op, b, p=a)
    if not isinstance(a, Tensor):
        a = as_tensor(a, b)
    b = as_tensor(b, a)
    return apply(op_class, a, b)


def add(a, b):
    return _binary(ew.Add, ew.AddScalar, ew.AddScalar, a, b)


def sub(a, b):
    return _binary(ew.Sub, ew.AddScalar, ew.RSubScalar, a, b, scalar_map=lambda s: -s)


def mul(a, b):
    return _binary(ew.Mul, ew.MulScalar, ew.MulScalar, a, b)


def div(a, b):
    return _binary(ew.Div, ew.MulScalar, ew.RDivScalar, a, b, scalar_map=lambda s: 1.0 / s)


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
    from ops import matmul as mm
    Tensor, as_tensor = _tensor_types()
    if not isinstance(a, Tensor):
        a = as_tensor(a, b)
    return apply(mm.MatMul, a, as_tensor(b, a))


def softmax(x, axis=-1):
    from ops import softmax as sm
    return apply(sm.Softmax, x, axis=axis)


def log_softmax(x, axis=-1):
    from ops import softmax as sm
    return apply(sm.LogSoftmax, x, axis=axis)
