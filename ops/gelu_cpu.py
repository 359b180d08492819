"""The exact GELU's CPU kernels, ``x Φ(x)`` and its derivative ``Φ(x) + x φ(x)``, with a
float32 path that vectorises.

``ops.pointwise`` computes GELU through ``math.erf`` and ``math.exp``: library calls LLVM
cannot vectorise here (Numba has no SVML on this machine), and with float64 constants a
float32 input is computed in float64 too. The GPT's 393k-element GELU took 4 ns an element
and its derivative 9 (one core, ``time.thread_time``), a fifth of the step's kernel time.
For float32 this module evaluates erf as a rational function of x (Eigen's
``generic_fast_erf_float``: odd degree-13 over even degree-8, x clamped to [-4, 4] where erf
is 1 to float32) and exp of ``-x²/2`` by Cody-Waite reduction to ``2ⁿ eʳ`` with Cephes'
degree-7 polynomial for ``eʳ`` and ``2ⁿ`` built in the exponent bits: all multiplies, adds
and compares, so the loop runs 8 or 16 lanes at a time. Both stay within a few float32 ulps
of the float64 values (tests/ops/test_gelu_cpu.py measures it). float64 keeps the library calls
(``ops.pointwise``'s code), so float64 results and gradchecks are unchanged.

Each element is a function of its own input alone, so the results are the same bits on any
thread count and in any block of a split (``ops.element_kernel.split_over_threads``).
"""

import numpy as np
from numba import njit, types
from numba.extending import intrinsic, overload

from ops.pointwise import GELU, INV_SQRT_TWO_PI, SQRT_HALF, derivative_cpu, value_cpu

_ERF_NUMERATOR = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
                  -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
                  -1.60960333262415e-02)   # x¹³ ... x¹ (odd powers, in x²)
_ERF_DENOMINATOR = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
                    -7.37332916720468e-03, -1.42647390514189e-02)   # x⁸ ... x⁰
(A13, A11, A9, A7, A5, A3, A1) = (np.float32(c) for c in _ERF_NUMERATOR)
(B8, B6, B4, B2, B0) = (np.float32(c) for c in _ERF_DENOMINATOR)
LOG2E = np.float32(1.44269504088896341)
LN2_HIGH, LN2_LOW = np.float32(0.693359375), np.float32(-2.12194440e-4)   # Cody-Waite
(P0, P1, P2, P3, P4, P5) = (np.float32(c) for c in (
    1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
    5.0000001201e-1))   # Cephes expf: e^r = 1 + r + r² P(r) on |r| <= ln2/2
EXP_FLOOR = np.float32(-87.0)   # e^-87 is float32's smallest normal's order: below, 2ⁿ underflows
ERF_CLAMP = np.float32(4.0)
HALF, ONE = np.float32(0.5), np.float32(1.0)
SQRT_HALF_32 = np.float32(SQRT_HALF)   # the float64 constants in float32
INV_SQRT_TWO_PI_32 = np.float32(INV_SQRT_TWO_PI)


@njit(inline="always")
def erf_float32(x):
    """erf(x) for float32 x, vectorisable (see the module's notes)."""
    x = min(max(x, -ERF_CLAMP), ERF_CLAMP)
    x2 = x * x
    p = ((((((A13 * x2 + A11) * x2 + A9) * x2 + A7) * x2 + A5) * x2 + A3) * x2 + A1) * x
    q = (((B8 * x2 + B6) * x2 + B4) * x2 + B2) * x2 + B0
    return p / q


@intrinsic
def select(typingctx, condition, if_true, if_false):
    """``if_true if condition else if_false`` as one LLVM select, no branch: an inlined
    function's conditional expression left a phi that Numba's SSA check warned about
    (NumbaIRAssumptionWarning, "variable ... is not in scope") at every first compile. The
    two values must have one type (no conversion is made), the condition be a boolean."""
    if condition != types.boolean or if_true != if_false:
        return None

    def codegen(context, builder, signature, args):
        return builder.select(args[0], args[1], args[2])
    return if_true(condition, if_true, if_false), codegen


@intrinsic
def running_max(typingctx, top, value):
    """max(top, value) for floats of one type as a compare and a select that carry the
    ``nnan`` and ``nsz`` flags, which is what LLVM's loop vectoriser needs to see a maximum
    reduction: ``max()`` (its NaN tests) and an unflagged select stayed one scalar
    ``vmaxss`` chain, whose latency a causal softmax row waited on (the CPU attention's
    48x64x64 score rows, one thread on the 2-core Xeon: max and exp 407 us against 168 for
    the exp alone). With NaN, the result is either operand: a caller must not rely on it
    passing a NaN on (the attention's exp that follows does, from the element itself)."""
    if top != value or not isinstance(top, types.Float):
        return None

    def codegen(context, builder, signature, args):
        flags = ("nnan", "nsz")
        larger = builder.fcmp_ordered(">", args[0], args[1], flags=flags)
        return builder.select(larger, args[0], args[1], flags=flags)
    return top(top, value), codegen


@njit(inline="always")
def exp_nonpositive_float32(a):
    """e^a for float32 a <= 0, vectorisable; 0 below -87 (a float32 denormal or less)."""
    clamped = max(a, EXP_FLOOR)
    n = np.floor(clamped * LOG2E + HALF)   # float32: math.floor's int64 made the rest float64
    r = clamped - n * LN2_HIGH - n * LN2_LOW
    p = ((((P0 * r + P1) * r + P2) * r + P3) * r + P4) * r + P5
    e = p * r * r + r + ONE
    scale = np.int32((np.int32(n) + 127) << 23).view(np.float32)   # 2ⁿ, n in [-126, 0]
    return select(a >= EXP_FLOOR, e * scale, a - a)


def gelu_value(x):
    """GELU of one element: float32 by the vectorisable path, else ``ops.pointwise``'s."""


def gelu_derivative(x):
    """GELU's derivative at one element, as ``gelu_value``."""


@overload(gelu_value, inline="always")
def _gelu_value(x):
    if x == types.float32:
        return lambda x: HALF * x * (ONE + erf_float32(x * SQRT_HALF_32))
    return lambda x: value_cpu(GELU, x, x - x)


@overload(gelu_derivative, inline="always")
def _gelu_derivative(x):
    if x == types.float32:
        return lambda x: (HALF * (ONE + erf_float32(x * SQRT_HALF_32))
                          + x * INV_SQRT_TWO_PI_32 * exp_nonpositive_float32(-HALF * x * x))
    return lambda x: derivative_cpu(GELU, x, x, x - x)


@njit(cache=True, error_model="numpy", nogil=True)
def gelu_cpu(x, out, p):
    """out = GELU(x) elementwise (``p``, the table's unused parameter, for the signature)."""
    for i in range(out.size):
        out[i] = gelu_value(x[i])


@njit(cache=True, error_model="numpy", nogil=True)
def gelu_grad_cpu(x, y, grad_out, grad_in, p):
    """grad_in = grad_out * GELU'(x) elementwise."""
    for i in range(grad_in.size):
        grad_in[i] = grad_out[i] * gelu_derivative(x[i])
