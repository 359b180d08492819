"""Elementwise, reduction and shape ops through ``check_op`` on every backend."""
import numpy as np
import pytest

import engine
from tests.op_check import Case, check_op


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


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
        Case("reshape", ((3, 5),), lambda a: a.reshape(5, -1) * 1.0, lambda a: a.reshape(5, 3)),
        Case("reshape", ((2, 1, 3),), lambda a: a.flatten() * 1.0, lambda a: a.reshape(2, 3)),
        Case("transpose", ((3, 5),), lambda a: a.T, lambda a: a.T),
        Case("transpose", ((1, 7),), lambda a: a.transpose(), lambda a: a.T),
    ]
)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_op(case, device):
    check_op(case, device)
