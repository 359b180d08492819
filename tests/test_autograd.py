"""The tape: recording, reverse walk, accumulation, release, grad mode, errors."""
import warnings

import numpy as np
import pytest

import engine
from engine.autograd import current_tape


def test_chain_rule_and_accumulation(device):
    x = engine.tensor([1.0, 2.0, 3.0], device=device, requires_grad=True)
    y = (x * x).sum() + (x * 3).sum()       # x used by two branches: gradients add up
    y.backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * np.array([1, 2, 3]) + 3)
    (x * 2).sum().backward()                 # a second backward accumulates into .grad
    np.testing.assert_allclose(x.grad.numpy(), 2 * np.array([1, 2, 3]) + 5)


def test_backward_uses_the_upstream_gradient(device):
    x = engine.tensor([[1.0, -2.0], [3.0, 4.0]], device=device, requires_grad=True)
    y = x.relu() * 2
    upstream = np.array([[10.0, 20.0], [30.0, 40.0]], np.float32)
    y.backward(engine.tensor(upstream, device=device))
    np.testing.assert_allclose(x.grad.numpy(), [[20, 0], [60, 80]])


def test_tape_is_released_after_backward():
    x = engine.tensor(np.ones(3), requires_grad=True)
    loss = ((x * 2).relu() + 1).sum()
    assert len(current_tape()) == 4
    loss.backward()
    assert len(current_tape()) == 0
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


def test_retain_graph_allows_a_second_backward():
    x = engine.tensor(np.ones(3), requires_grad=True)
    loss = (x * x).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    np.testing.assert_allclose(x.grad.numpy(), [4, 4, 4])


def test_no_grad_records_nothing():
    x = engine.tensor(np.ones(3), requires_grad=True)
    with engine.no_grad():
        y = (x * 2).sum()
    assert not y.requires_grad and len(current_tape()) == 0

    @engine.no_grad()
    def infer(t):
        return t * 3
    assert not infer(x).requires_grad


def test_unrelated_graphs_stay_on_the_tape():
    a = engine.tensor(np.ones(2), requires_grad=True)
    b = engine.tensor(np.ones(2), requires_grad=True)
    loss_a, loss_b = (a * 2).sum(), (b * 3).sum()
    loss_a.backward()
    assert len(current_tape()) == 2
    loss_b.backward()
    np.testing.assert_allclose(b.grad.numpy(), [3, 3])
    assert len(current_tape()) == 0


def test_dead_nodes_are_pruned_and_a_growing_tape_warns(monkeypatch):
    monkeypatch.setattr(engine.autograd, "TAPE_WARNING_SIZE", 50)
    current_tape()._warn_at = 50
    x = engine.tensor(np.ones(2), requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(200):
            (x * 2).sum()   # results dropped at once: prunable, no warning
    kept = []
    with pytest.warns(RuntimeWarning, match="no_grad"):
        for _ in range(60):
            kept.append(x * 2)


def test_non_scalar_root_needs_a_gradient():
    x = engine.tensor(np.ones((2, 3)), requires_grad=True)
    with pytest.raises(RuntimeError, match=r"shape \(2, 3\).*loss.backward\(grad\)"):
        (x * 2).backward()
    with pytest.raises(ValueError, match="does not match"):
        (x * 2).backward(np.ones(3))


def test_backward_without_grad_is_an_error():
    with pytest.raises(RuntimeError, match="does not require grad"):
        engine.tensor([1.0]).sum().backward()


def test_broadcast_mismatch_names_both_shapes(device):
    a = engine.zeros(3, 4, device=device)
    b = engine.zeros(5, device=device)
    with pytest.raises(ValueError, match=r"\(3, 4\) and \(5,\)"):
        a + b


def test_mixed_devices_and_dtypes_are_errors(device):
    a = engine.zeros(3, device=device)
    with pytest.raises(TypeError, match="float32, float64"):
        a + engine.zeros(3, dtype=np.float64, device=device)
    if device == "cuda":
        with pytest.raises(ValueError, match="different devices"):
            a + engine.zeros(3)


def test_detach_and_leaf_flags():
    x = engine.tensor(np.ones(2), requires_grad=True)
    y = x * 2
    assert x.is_leaf and not y.is_leaf
    assert not y.detach().requires_grad
    with pytest.raises(RuntimeError, match="detach"):
        y.requires_grad = False
