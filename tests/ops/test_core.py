"""Elementwise, reduction and shape ops through ``check_op`` on every backend."""
import math

import numpy as np
import pytest

import engine
from tests.support.op_check import Case, check_op


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


BROADCAST_PAIRS = [((3, 5), (3, 5)), ((3, 5), (5,)), ((2, 1, 3), (4, 1)), ((), (3,)), ((7,), ())]

CASES = (
    [Case("add", s, lambda a, b: a + b, np.add) for s in BROADCAST_PAIRS]
    + [Case("sub", s, lambda a, b: a - b, np.subtract) for s in BROADCAST_PAIRS[:3]]
    + [Case("mul", s, lambda a, b: a * b, np.multiply) for s in BROADCAST_PAIRS]
    + [Case("div", s, lambda a, b: a / b, np.divide, low=0.5, high=2.0)
       for s in BROADCAST_PAIRS[:4]]
    + [
        Case("add_scalar", ((3, 5),), lambda a: a + 2.5, lambda a: a + 2.5),
        Case("add_scalar", ((7,),), lambda a: 1.5 - (-a) - 4, lambda a: a - 2.5),
        Case("mul_scalar", ((2, 1, 3),), lambda a: 3 * a / 4, lambda a: a * 0.75),
        Case("rsub_scalar", ((3, 5),), lambda a: 1.5 - a, lambda a: 1.5 - a),
        Case("rdiv_scalar", ((7,),), lambda a: 2 / a, lambda a: 2 / a, low=0.5, high=2),
        Case("pow_scalar", ((3, 5),), lambda a: a ** 3, lambda a: a ** 3),
        Case("pow_scalar", ((7,),), lambda a: a ** 0.5, np.sqrt, low=0.5, high=2),
        Case("neg", ((3, 5),), lambda a: -a, np.negative),
        Case("exp", ((2, 1, 3),), lambda a: a.exp(), np.exp),
        Case("log", ((3, 5),), lambda a: a.log(), np.log, low=0.2, high=3),
        Case("sqrt", ((7,),), lambda a: a.sqrt(), np.sqrt, low=0.2, high=3),
        Case("relu", ((3, 5),), lambda a: a.relu(), lambda a: np.maximum(a, 0)),
        Case("relu", ((),), engine.relu, lambda a: np.maximum(a, 0), low=0.5),
        Case("leaky_relu", ((3, 5),), lambda a: a.leaky_relu(0.2),
             lambda a: np.where(a > 0, a, 0.2 * a)),
        Case("sigmoid", ((2, 1, 3),), lambda a: a.sigmoid(), _sigmoid, low=-30, high=30),
        Case("tanh", ((3, 5),), lambda a: a.tanh(), np.tanh),
        Case("gelu", ((3, 5),), lambda a: a.gelu(), _gelu, low=-4, high=4),
        Case("gelu_tanh", ((7,),), lambda a: engine.gelu(a, approximate="tanh"), _gelu_tanh,
             low=-4, high=4),
        Case("sum", ((3, 5),), lambda a: a.sum(), np.sum),
        Case("sum", ((2, 1, 3),), lambda a: a.sum(axis=(0, 2), keepdims=True),
             lambda a: a.sum(axis=(0, 2), keepdims=True)),
        Case("sum", ((7,),), lambda a: a.sum(axis=0), lambda a: a.sum(axis=0)),
        Case("sum", ((),), lambda a: a.sum(), np.sum),
        Case("mean", ((3, 5),), lambda a: a.mean(axis=1), lambda a: a.mean(axis=1)),
        Case("mean", ((2, 3, 4),), lambda a: a.mean(axis=(0, 2)), lambda a: a.mean(axis=(0, 2))),
        Case("max", ((3, 5),), lambda a: a.max(axis=0), lambda a: a.max(axis=0)),
        Case("max", ((2, 3, 4),), lambda a: a.max(axis=-1, keepdims=True),
             lambda a: a.max(axis=-1, keepdims=True)),
        Case("max", ((7,),), lambda a: a.max(), np.max),
        # two-way ties: the gradient is split evenly (central differences agree at 1/2)
        Case("max", ((2, 3),), lambda a: a.max(axis=1), lambda a: a.max(axis=1),
             make_inputs=lambda rng: [np.array([[1.0, 3.0, 3.0], [2.0, -1.0, 2.0]])]),
        Case("mean", ((2, 1, 3),), lambda a: a.mean(keepdims=True),
             lambda a: a.mean(keepdims=True)),
        Case("mean", ((7,),), lambda a: a.mean(), np.mean),
        Case("pow_scalar", ((5,),), lambda a: a ** 0, lambda a: a ** 0,
             make_inputs=lambda rng: [np.array([0.0, 1.0, -2.0, 0.5, 3.0])]),
        Case("reshape", ((3, 5),), lambda a: a.reshape(5, -1) * 1.0, lambda a: a.reshape(5, 3)),
        Case("reshape", ((2, 1, 3),), lambda a: a.flatten() * 1.0, lambda a: a.reshape(2, 3)),
        Case("transpose", ((3, 5),), lambda a: a.T, lambda a: a.T),
        Case("transpose", ((1, 7),), lambda a: a.transpose(), lambda a: a.T),
    ]
)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_op(case, device):
    check_op(case, device)


INF, NAN = np.inf, np.nan


def test_activations_at_infinities_follow_torch(device):
    """relu(-inf) = 0, relu(nan) = nan, sigmoid(+-inf) = 1 and 0, tanh(+-inf) = +-1: the
    elementwise ops and the fused Dense epilogue are one code (ops.pointwise)."""
    x = engine.tensor([-INF, INF, NAN, -1.0, 2.0], device=device)
    np.testing.assert_array_equal(x.relu().numpy(), [0, INF, NAN, 0, 2])
    np.testing.assert_array_equal(x.sigmoid().numpy()[:2], [0, 1])
    np.testing.assert_array_equal(x.tanh().numpy()[:2], [-1, 1])
    from engine import nn
    for activation, expected in (("relu", [0, INF]), ("sigmoid", [0, 1]), ("tanh", [-1, 1])):
        layer = nn.Dense(1, activation=activation, kernel_initializer=np.ones)
        layer.build((1,), device)
        y = layer(engine.tensor([[-INF], [INF]], device=device))
        np.testing.assert_array_equal(y.numpy().ravel(), expected, err_msg=activation)


def test_gradient_of_x_to_the_zero_is_zero_at_zero(device):
    x = engine.tensor([0.0, 2.0], device=device, requires_grad=True)
    (x ** 0).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [0, 0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_log_softmax_and_cross_entropy_stay_normalised_at_huge_tied_logits(device, dtype):
    logits = engine.tensor([[1e17, 1e17, 0.0], [-1e17, 5.0, 5.0]], dtype=dtype, device=device,
                           requires_grad=True)
    probabilities = np.exp(logits.log_softmax(axis=-1).numpy().astype(np.float64))
    np.testing.assert_allclose(probabilities, [[0.5, 0.5, 0], [0, 0.5, 0.5]], atol=1e-6)
    loss = engine.losses.cross_entropy(logits, np.array([0, 1]))
    np.testing.assert_allclose(loss.item(), np.log(2), rtol=1e-6)
    loss.backward()
    np.testing.assert_allclose(logits.grad.numpy(), [[-0.25, 0.25, 0], [0, -0.25, 0.25]],
                               atol=1e-6)


@pytest.mark.parametrize("shapes", [((2, 3, 4), (3, 4)), ((2, 3, 4), (2, 3, 1)),
                                    ((2, 3, 1), (2, 3, 4)), ((3, 1), (1, 1)), ((4, 1, 5), (3, 1)),
                                    ((1,), (2, 3))])
def test_broadcast_arithmetic_matches_numpy_along_every_row_layout(shapes, device):
    """The CPU walks a row of the last dim at a time: both operands along it, one of them,
    the other, or neither (each a loop of its own); CUDA an element a thread."""
    rng = np.random.default_rng(6)
    x, y = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    a, b = (engine.tensor(v, device=device) for v in (x, y))
    for ours, theirs in ((a + b, x + y), (a - b, x - y), (a * b, x * y), (b / a, y / x)):
        np.testing.assert_array_equal(ours.numpy(), theirs)


def test_same_shape_arithmetic_in_place_matches_numpy(device):
    """``binary(code, a, b, out=a)`` (a gradient accumulated into its slot) takes a loop of
    its own on the CPU (out read through its own name, which LLVM vectorises); every code, a
    length no vector width divides."""
    from ops.elementwise import ADD, BINARY_NAMES, binary
    from ops.device import to_device
    rng = np.random.default_rng(7)
    x, y = (rng.standard_normal(37).astype(np.float32) + 2 for _ in range(2))
    expected = {ADD: x + y, 1: x - y, 2: x * y, 3: x / y}
    for code in BINARY_NAMES:
        a, b = to_device(x, device), to_device(y, device)
        assert binary(code, a, b, out=a) is a
        np.testing.assert_array_equal(engine.tensor(a).numpy(), expected[code])
        np.testing.assert_array_equal(engine.tensor(b).numpy(), y)
