"""Pointwise math, written once: the value and derivative of every unary function.

``value`` and ``derivative`` are plain Python, compiled for the CPU (``@njit``) and for CUDA
(``cuda.jit(device=True)``). The elementwise ops (``ops.elementwise``) and the fused Dense
kernels (the GEMM epilogue of ``ops.gemm``, the CPU loops of ``ops.dense``) all call them,
so the relu a Dense layer runs is the relu ``x.relu()`` runs. Each kernel that calls them is
built with its code as a constant, one way (``ops.constant_code.kernels_of_code``), so the
compiler folds the dispatch away (relu over 1M float32 on the CPU: 1.8 ms with a runtime
code, 0.36 ms folded).

``TABLE`` declares each function, one keyword-only row; the names the layers take, the
generated functions, torch's modules and ONNX's operators for it are derived from the rows
(ops/README.md, "Adding an activation").

Derivatives are written from the output ``y`` wherever that is exact. The activations read
their input ``x`` only through ``x > 0``, which ``y > 0`` answers the same way (for
leaky_relu when ``p >= 0``), so a caller that kept only ``y`` (the Dense backward) passes
``y`` for ``x``; ``Pointwise.reads_input`` says where the real ``x`` is needed.

IEEE semantics as torch: relu(-inf) = 0, relu(nan) = nan, sigmoid(+-inf) = 1 and 0, and the
derivative of ``x ** 0`` is 0 everywhere (also at x = 0). ``x / p`` divides (``x / 0`` is
+-inf or nan, as NumPy's), never multiplies by ``1 / p``, which rounds differently (and
raises ZeroDivisionError in Python for p = 0); the derivative of ``abs`` at 0 is 0, as torch's.
"""
import hashlib
import math
import pathlib
from dataclasses import dataclass

from ops.constant_code import cpu_of_constant_code
from ops.cuda import cuda

# The codes are consecutive ints from a digest of this file. Numba's disk cache keys a kernel
# by its own file and the code in its closure, never by this file, so a branch changed here
# (or a constant it reads) would otherwise leave every kernel compiled before it in use; with
# the digest every code changes with the file, and no such kernel is found again.
CODES_BASE = int(hashlib.sha256(pathlib.Path(__file__).read_bytes()).hexdigest()[:10], 16) * 64
(IDENTITY, NEG, EXP, LOG, SQRT, RELU, LEAKY_RELU, SIGMOID, TANH,
 ADD_SCALAR, MUL_SCALAR, RSUB_SCALAR, RDIV_SCALAR, POW_SCALAR, ABS, DIV_SCALAR,
 GELU, GELU_TANH, SILU, MISH, HARDSWISH, SOFTSIGN) = range(CODES_BASE, CODES_BASE + 22)

SQRT_HALF = 0.7071067811865476          # 1 / sqrt(2): GELU's erf argument
INV_SQRT_TWO_PI = 0.3989422804014327    # 1 / sqrt(2 pi): the normal density's factor
SQRT_TWO_OVER_PI = 0.7978845608028654   # sqrt(2 / pi): GELU's tanh form (torch's constants)
GELU_CUBIC = 0.044715


@dataclass(frozen=True, kw_only=True)
class Pointwise:
    """One function, and everything the layers and the interop above it need to know about
    it: a row declares a function, and every surface is derived from the rows (the kernels,
    ``engine.<name>`` and ``Tensor.<name>``, the names nn's layers take, torch's module and
    ONNX's operator for it, tests/ops/test_activation_table.py checks each row on each)."""
    name: str
    code: int
    reads_input: bool          # the derivative needs x itself, not just y (or the sign of x)
    activation: bool = False   # a name nn's layers take (nn.Activation, Dense, Conv2D)
    fuses: bool = False        # Dense/Conv2D kernels apply it in their epilogue: the
    #                            derivative is exact from y for every parameter a layer allows
    onnx: str = None           # the ONNX operator an activation exports to and imports from
    onnx_opset: int = 1        # the first ONNX opset that has that operator
    torch: str = None          # its ``torch.nn`` module, interop converts it both ways (one
    #                            taking arguments but ``inplace`` is converted by hand)
    keras: tuple = ()          # Keras's other names for it, which nn's layers also take
    initializer: str = "xavier_uniform"   # a layer's default kernel initialiser with it
    doc: str = None            # a public parameter-free function's docstring: engine.<name>
    #                            and Tensor.<name> are generated from the entry (functions
    #                            with a parameter, leaky_relu and gelu, are written by hand)


TABLE = (
    Pointwise(name="identity", code=IDENTITY, reads_input=False),
    Pointwise(name="neg", code=NEG, reads_input=False,
              doc="``-x`` elementwise, as ``torch.neg``."),
    Pointwise(name="exp", code=EXP, reads_input=False,
              doc="``e ** x`` elementwise, as ``torch.exp``."),
    Pointwise(name="log", code=LOG, reads_input=True,
              doc="The natural logarithm elementwise, as ``torch.log``: -inf at 0, NaN below 0."),
    Pointwise(name="sqrt", code=SQRT, reads_input=False,
              doc="The square root elementwise, as ``torch.sqrt``: NaN below 0."),
    Pointwise(name="relu", code=RELU, reads_input=False, activation=True, fuses=True,
              onnx="Relu", torch="ReLU", initializer="he_normal",
              doc="``max(x, 0)`` elementwise, as ``torch.relu``: NaN stays NaN, and the "
              "gradient at 0 is 0."),
    # p = alpha; y's sign is x's only if p >= 0, which the layers require
    Pointwise(name="leaky_relu", code=LEAKY_RELU, reads_input=True, activation=True,
              fuses=True, onnx="LeakyRelu", torch="LeakyReLU",
              initializer="he_normal"),
    Pointwise(name="sigmoid", code=SIGMOID, reads_input=False, activation=True, fuses=True,
              onnx="Sigmoid", torch="Sigmoid",
              doc="``1 / (1 + exp(-x))`` elementwise, as ``torch.sigmoid`` (no exp of a "
              "large positive number: no overflow)."),
    Pointwise(name="tanh", code=TANH, reads_input=False, activation=True, fuses=True,
              onnx="Tanh", torch="Tanh",
              doc="The hyperbolic tangent elementwise, as ``torch.tanh``."),
    Pointwise(name="add_scalar", code=ADD_SCALAR, reads_input=False),     # x + p
    Pointwise(name="mul_scalar", code=MUL_SCALAR, reads_input=False),     # x * p
    Pointwise(name="rsub_scalar", code=RSUB_SCALAR, reads_input=False),   # p - x
    Pointwise(name="rdiv_scalar", code=RDIV_SCALAR, reads_input=True),    # p / x
    Pointwise(name="pow_scalar", code=POW_SCALAR, reads_input=True),      # x ** p
    Pointwise(name="abs", code=ABS, reads_input=True,   # |x|: the sign of x is not in y
              doc="``|x|`` elementwise, as ``torch.abs``; the gradient at 0 is 0, as torch's."),
    Pointwise(name="div_scalar", code=DIV_SCALAR, reads_input=False),     # x / p
    # x Phi(x), torch's approximate="none"; its derivative Phi(x) + x phi(x) is not a function
    # of y (y has a minimum at x = -0.75), so a layer runs it after its kernel, keeping x.
    # ONNX's Gelu is opset 20's; engine.onnx writes its erf composition before
    Pointwise(name="gelu", code=GELU, reads_input=True, activation=True, onnx="Gelu",
              onnx_opset=20, torch="GELU", initializer="he_normal"),
    Pointwise(name="gelu_tanh", code=GELU_TANH, reads_input=True),   # approximate="tanh"
    # x sigmoid(x); its derivative s (1 + x (1 - s)) is not a function of y either (y has a
    # minimum at x = -1.28), and ONNX names no operator for it before opset 24's Swish
    Pointwise(name="silu", code=SILU, reads_input=True, activation=True, torch="SiLU",
              keras=("swish",), initializer="he_normal",
              doc="``x * sigmoid(x)`` elementwise, as ``torch.nn.functional.silu`` (SiLU, "
              "also called swish)."),
    # x tanh(softplus(x)); not a function of y either (y has a minimum at x = -1.19)
    Pointwise(name="mish", code=MISH, reads_input=True, activation=True, onnx="Mish",
              onnx_opset=18, torch="Mish", initializer="he_normal",
              doc="``x * tanh(log(1 + exp(x)))`` elementwise, as "
              "``torch.nn.functional.mish``."),
    # x relu6(x + 3) / 6; not a function of y (y has a minimum at x = -1.5). Keras: hard_silu
    Pointwise(name="hardswish", code=HARDSWISH, reads_input=True, activation=True,
              onnx="HardSwish", onnx_opset=14, torch="Hardswish",
              keras=("hard_silu", "hard_swish"), initializer="he_normal",
              doc="``x * min(max(x + 3, 0), 6) / 6`` elementwise, as "
              "``torch.nn.functional.hardswish``."),
    # x / (1 + |x|), increasing: its derivative (1 - |y|)^2 is exact from y, so it fuses
    Pointwise(name="softsign", code=SOFTSIGN, reads_input=False, activation=True, fuses=True,
              onnx="Softsign", torch="Softsign",
              doc="``x / (1 + |x|)`` elementwise, as ``torch.nn.functional.softsign``."),
)
BY_NAME = {entry.name: entry for entry in TABLE}

# the activations Dense and Conv2D fuse into their kernels, by the names the layers take
ACTIVATIONS = {None: IDENTITY, **{entry.name: entry.code for entry in TABLE if entry.fuses}}
# every activation name a layer takes, fused or run after the layer's kernel
LAYER_ACTIVATIONS = tuple(entry.name for entry in TABLE if entry.activation)
# Keras's other names of those activations, by the name the layers keep
KERAS_NAMES = {alias: entry.name for entry in TABLE if entry.activation for alias in entry.keras}


def value(code, x, p):
    """f(x) for the function ``code`` with parameter ``p`` (finite, in x's dtype)."""
    if code == IDENTITY:
        return x
    if code == NEG:
        return -x
    if code == EXP:
        return math.exp(x)
    if code == LOG:
        return math.log(x) if x > 0 else (-math.inf if x == 0 else math.nan)
    if code == SQRT:
        return math.sqrt(x) if x >= 0 else math.nan
    if code == RELU:
        return x if not x <= 0 else p - p   # NaN passes through, -inf gives 0
    if code == LEAKY_RELU:
        return x if not x <= 0 else x * p
    if code == SIGMOID:   # never exp of a large positive number
        if x >= 0:
            return 1 / (1 + math.exp(-x))
        e = math.exp(x)
        return e / (1 + e)
    if code == TANH:
        return math.tanh(x)
    if code == ADD_SCALAR:
        return x + p
    if code == MUL_SCALAR:
        return x * p
    if code == RSUB_SCALAR:
        return p - x
    if code == RDIV_SCALAR:
        return p / x
    if code == ABS:
        return abs(x)
    if code == DIV_SCALAR:
        return x / p
    if code == GELU:
        return 0.5 * x * (1 + math.erf(x * SQRT_HALF))
    if code == GELU_TANH:
        return 0.5 * x * (1 + math.tanh(SQRT_TWO_OVER_PI * (x + GELU_CUBIC * x * x * x)))
    if code == SILU:   # sigmoid as above: never exp of a large positive number
        if x >= 0:
            return x / (1 + math.exp(-x))
        e = math.exp(x)
        return x * e / (1 + e)
    if code == MISH:   # torch's form: exp overflowing to inf gives tanh(inf) = 1, so x
        return x * math.tanh(math.log1p(math.exp(x)))
    if code == HARDSWISH:   # NaN passes the clamps (comparisons are false), as torch's
        r = x + 3
        if r < 0:
            r = p - p
        if r > 6:
            r = p - p + 6
        return x * r / 6
    if code == SOFTSIGN:
        return x / (1 + abs(x))
    return x ** p   # POW_SCALAR


def derivative(code, x, y, p):
    """d y / d x, given the input x (or y where ``reads_input`` is False), the output
    y = f(x) and the parameter p (finite)."""
    zero = p - p   # 0 in the dtype of the data, so float32 math stays float32
    if code == NEG or code == RSUB_SCALAR:
        return zero - 1
    if code == EXP:
        return y
    if code == LOG:
        return 1 / x
    if code == SQRT:
        return 0.5 / y
    if code == RELU:
        return zero + 1 if x > 0 else zero
    if code == LEAKY_RELU:
        return zero + 1 if x > 0 else p
    if code == SIGMOID:
        return y * (1 - y)
    if code == TANH:
        return 1 - y * y
    if code == MUL_SCALAR:
        return p
    if code == RDIV_SCALAR:
        return -y / x
    if code == POW_SCALAR:
        return zero if p == 0 else p * x ** (p - 1)
    if code == ABS:   # 0 at x = 0 (torch's choice), nan at nan
        return zero + 1 if x > 0 else (zero - 1 if x < 0 else x - x)
    if code == DIV_SCALAR:   # not from ``zero``: p may be +-inf (x / inf), where p - p is nan
        return 1.0 / p
    if code == GELU:   # Phi(x) + x phi(x)
        return 0.5 * (1 + math.erf(x * SQRT_HALF)) + x * INV_SQRT_TWO_PI * math.exp(-0.5 * x * x)
    if code == GELU_TANH:
        t = math.tanh(SQRT_TWO_OVER_PI * (x + GELU_CUBIC * x * x * x))
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * SQRT_TWO_OVER_PI * (
            1 + 3 * GELU_CUBIC * x * x)
    if code == SILU:   # s (1 + x (1 - s)), s = sigmoid(x)
        if x >= 0:
            s = 1 / (1 + math.exp(-x))
        else:
            e = math.exp(x)
            s = e / (1 + e)
        return s * (1 + x * (1 - s))
    if code == MISH:   # t + x s (1 - t^2), t = tanh(softplus(x)), s = sigmoid(x), as torch
        t = math.tanh(math.log1p(math.exp(x)))
        if x >= 0:
            s = 1 / (1 + math.exp(-x))
        else:
            e = math.exp(x)
            s = e / (1 + e)
        return t + x * s * (1 - t * t)
    if code == HARDSWISH:   # torch's: 0 to -3, x / 3 + 1 / 2 strictly inside (-3, 3), then 1
        if x <= -3:
            return zero
        if x < 3:
            return x / 3 + 0.5
    if code == SOFTSIGN:   # 1 / (1 + |x|)^2, as 1 - |y| = 1 / (1 + |x|)
        d = 1 - abs(y)
        return d * d
    return zero + 1   # IDENTITY, ADD_SCALAR, HARDSWISH from 3 on (and at nan, as torch)


# the CPU kernels pass a constant code: each inlines only that code's branch
value_cpu, value_cuda = cpu_of_constant_code(value), cuda.jit(device=True)(value)
derivative_cpu, derivative_cuda = cpu_of_constant_code(derivative), cuda.jit(device=True)(derivative)
