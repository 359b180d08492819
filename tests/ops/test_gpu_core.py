"""Real-GPU checks of the core: large shapes, the caching allocator, reproducible reductions."""
import numpy as np
import pytest

import engine
from ops.memory import allocator_stats

pytestmark = pytest.mark.gpu


def test_large_broadcast_and_unary_match_numpy():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((1023, 517)).astype(np.float32)
    b = rng.standard_normal((517,)).astype(np.float32)
    x, y = engine.tensor(a, device="cuda"), engine.tensor(b, device="cuda")
    np.testing.assert_allclose(((x * y + 1).relu() - x / (y.exp() + 1)).numpy(),
                               np.maximum(a * b + 1, 0) - a / (np.exp(b) + 1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x.sigmoid().tanh().numpy(), np.tanh(1 / (1 + np.exp(-a))),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis", [None, 0, 1, (0, 2)])
def test_large_reductions_match_numpy_and_are_reproducible(axis):
    a = np.random.default_rng(1).standard_normal((65, 333, 129))
    x = engine.tensor(a, device="cuda")
    first = x.sum(axis=axis).numpy()
    np.testing.assert_allclose(first, a.sum(axis=axis), rtol=1e-10, atol=1e-9)
    np.testing.assert_array_equal(first, x.sum(axis=axis).numpy())   # fixed order: bit-equal
    np.testing.assert_allclose(x.max(axis=axis).numpy(), a.max(axis=axis))
    np.testing.assert_allclose(x.mean(axis=axis).numpy(), a.mean(axis=axis), rtol=1e-10)


def test_large_gradients_match_cpu():
    a = np.random.default_rng(2).uniform(0.5, 2, (257, 130))
    grads = []
    for device in ("cpu", "cuda"):
        x = engine.tensor(a, device=device, requires_grad=True)
        ((x.log() * x).max(axis=1).sum() + (x ** 2).mean() + x.T.sqrt().sum()).backward()
        grads.append(x.grad.numpy())
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-12, atol=1e-12)


def test_steady_state_steps_allocate_nothing_from_the_driver():
    x = engine.tensor(np.random.default_rng(3).standard_normal((128, 256)), device="cuda",
                      requires_grad=True)

    def step():
        x.grad = None
        ((x * 2).relu().sum(axis=1) / 3).mean().backward()

    for _ in range(3):
        step()
    before = allocator_stats()["driver_allocations"]
    for _ in range(50):
        step()
    assert allocator_stats()["driver_allocations"] == before
    assert len(engine.autograd.current_tape()) == 0


def test_fast_launch_path_is_taken_and_agrees_with_numba():
    from ops.cuda import direct_launch
    from ops.elementwise import UNARY
    from ops.pointwise import EXP
    exp_cuda = UNARY[EXP][0].cuda
    a = np.random.default_rng(4).standard_normal(1000).astype(np.float32)
    x = engine.tensor(a, device="cuda")
    first = x.exp().numpy()    # Numba's path: compiles, launches, records the signature
    second = x.exp().numpy()   # the direct cuda.core launch
    assert any(kernel is exp_cuda and function
               for (kernel, _), function in direct_launch._compiled.items())
    np.testing.assert_array_equal(first, second)
    np.testing.assert_allclose(second, np.exp(a), rtol=1e-6)
