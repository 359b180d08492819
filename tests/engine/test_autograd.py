"""The tape: recording, reverse walk, accumulation, release, grad mode, errors."""
import warnings

import numpy as np
import pytest

import engine
from engine import nn
from engine.autograd import Tape, current_tape


@pytest.fixture
def fresh_tape(monkeypatch):
    """This thread records onto a new tape for the test (a tape warns once in its life)."""
    tape = Tape()
    monkeypatch.setattr(engine.autograd._state, "tape", tape)
    return tape


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


def test_dead_nodes_are_pruned_and_a_growing_tape_warns(monkeypatch, fresh_tape):
    monkeypatch.setattr(engine.autograd, "LIVE_NODE_LIMIT", 50)
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


# ------------------------------------------------------------------ a graph walked twice

def test_second_backward_through_a_shared_subgraph_raises_and_changes_nothing(device):
    x = engine.tensor([1.0, 2.0, 3.0], device=device, requires_grad=True)
    h = x * x
    a = h.sum()
    b = (h * 3).sum()
    a.backward()
    np.testing.assert_allclose(x.grad.numpy(), [2, 4, 6])
    with pytest.raises(RuntimeError, match=r"a second time.*retain_graph=True"):
        b.backward()
    np.testing.assert_allclose(x.grad.numpy(), [2, 4, 6])   # no partial gradient added


def test_retain_graph_lets_a_second_loss_share_the_subgraph(device):
    x = engine.tensor(np.ones(3), device=device, requires_grad=True)
    h = x * x
    a = h.sum()
    b = (h * 3).sum()
    a.backward(retain_graph=True)
    b.backward()
    np.testing.assert_allclose(x.grad.numpy(), [8, 8, 8])
    assert len(current_tape()) == 1   # b's backward released all it walked; a's sum is left


def _two_head_model(seed):
    engine.manual_seed(seed)
    features = nn.Sequential([nn.Dense(5, activation="tanh", dtype=np.float64, input_shape=(4,))])
    head_a = nn.Sequential([nn.Dense(3, dtype=np.float64, input_shape=(5,))])
    head_b = nn.Sequential([nn.Dense(2, activation="sigmoid", dtype=np.float64,
                                     input_shape=(5,))])
    return features, head_a, head_b


def test_shared_features_with_two_heads_get_the_exact_summed_gradient():
    x = engine.tensor(np.random.default_rng(3).standard_normal((6, 4)))
    labels = np.array([0, 2, 1, 1, 0, 2])
    features, head_a, head_b = _two_head_model(seed=1)
    params = features.parameters()

    def total_loss(*_):
        shared = features(x)
        return (engine.losses.cross_entropy(head_a(shared), labels)
                + (head_b(shared) ** 2).mean())

    total_loss().backward()
    summed = [p.grad.numpy().copy() for p in params]
    assert engine.gradcheck(total_loss, params)

    # the same gradient from two backwards of the heads' losses over one retained graph
    for p in params:
        p.grad = None
    shared = features(x)
    engine.losses.cross_entropy(head_a(shared), labels).backward(retain_graph=True)
    ((head_b(shared) ** 2).mean()).backward()
    for one_backward, two_backwards in zip(summed, params):
        np.testing.assert_allclose(two_backwards.grad.numpy(), one_backward, rtol=1e-12)


# ------------------------------------------------------------------ threads

def _in_thread(fn):
    """Run ``fn`` on another thread; re-raise what it raised."""
    import threading
    outcome = {}

    def target():
        try:
            outcome["value"] = fn()
        except BaseException as error:   # handed back to the test's thread
            outcome["error"] = error
    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def test_backward_from_another_thread_reaches_the_leaves():
    x = engine.tensor([1.0, 2.0, 3.0], requires_grad=True)
    loss = ((x * x).relu() * 2).sum()
    _in_thread(loss.backward)
    np.testing.assert_allclose(x.grad.numpy(), [4, 8, 12])
    assert len(current_tape()) == 0   # released from the tape of the thread that recorded it


def test_a_model_trains_when_backward_runs_on_another_thread():
    import optim
    model = nn.Sequential([nn.Dense(3, activation="relu", input_shape=(4,)), nn.Dense(2)])
    opt = optim.SGD(model.parameters(), lr=0.1)
    before = [p.numpy().copy() for p in model.parameters()]
    loss = engine.losses.cross_entropy(model(np.ones((5, 4), np.float32)), [0, 1, 0, 1, 1])
    _in_thread(loss.backward)
    assert all(p.grad is not None for p in model.parameters())
    opt.step()
    assert all(not np.array_equal(b, p.numpy()) for b, p in zip(before, model.parameters()))


def test_grad_mode_is_per_thread():
    x = engine.tensor(np.ones(2), requires_grad=True)
    with engine.no_grad():
        assert _in_thread(lambda: (x * 2).requires_grad)        # the other thread records
        assert not (x * 2).requires_grad
    assert not _in_thread(lambda: engine.no_grad()(lambda: (x * 2).requires_grad)())
    assert (x * 2).requires_grad


# ------------------------------------------------------------------ a graph kept alive

def test_total_plus_loss_warns_early_and_once(fresh_tape):
    model = nn.Sequential([nn.Dense(8, activation="relu", input_shape=(4,)), nn.Dense(3)])
    xb, yb = np.ones((16, 4), np.float32), np.arange(16) % 3
    total = 0.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(300):
            loss = engine.losses.cross_entropy(model(xb), yb)
            loss.backward()
            total += loss    # should have been loss.item(): keeps one node alive per step
            if step == 100 + engine.autograd.STALE_BACKWARDS:
                assert [w.category for w in caught] == [RuntimeWarning]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert "total += loss.item()" in messages[0] and "no_grad" in messages[0]


def test_dropped_graphs_hold_nothing_and_never_warn(fresh_tape):
    model = nn.Sequential([nn.Dense(8, activation="relu", input_shape=(4,)), nn.Dense(3)])
    xb = np.ones((16, 4), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2 * engine.autograd.LIVE_NODE_LIMIT):
            correct = int((model(xb).numpy().argmax(axis=1) == 0).sum())   # eval, no no_grad
    assert correct in range(17) and len(fresh_tape) == 0


def test_stale_nodes_holding_many_bytes_warn(monkeypatch, fresh_tape):
    monkeypatch.setattr(engine.autograd, "STALE_BYTES_LIMIT", 10_000)
    x = engine.tensor(np.ones(1000), requires_grad=True)
    kept = [x * 2, x * 3]     # 16 kB of outputs no backward will reach
    with pytest.warns(RuntimeWarning, match="MB of outputs"):
        for _ in range(engine.autograd.STALE_BACKWARDS):
            (x * 4).sum().backward()
    assert len(kept) == 2


def test_a_retained_graph_reused_every_step_is_not_stale(monkeypatch, fresh_tape):
    monkeypatch.setattr(engine.autograd, "STALE_NODE_LIMIT", 2)
    x = engine.tensor(np.ones(3), requires_grad=True)
    loss = ((((x * 2) * 3) * 4) * 5).sum()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(10):
            loss.backward(retain_graph=True)
    assert len(fresh_tape) == 5


# ------------------------------------------------------------------ gradcheck

def test_gradcheck_leaves_a_models_parameters_in_their_flat_buffer():
    import optim
    model = nn.Sequential([nn.Dense(3, activation="tanh", dtype=np.float64, input_shape=(2,)),
                           nn.Dense(1, dtype=np.float64)])
    x = engine.tensor(np.random.default_rng(0).standard_normal((4, 2)))
    params = model.parameters()
    arrays = [p.data for p in params]
    assert engine.gradcheck(lambda *_: model(x), params)
    assert all(p.data is array for p, array in zip(params, arrays))
    opt = optim.SGD(params, lr=0.5)
    before = model(x).numpy().copy()
    model(x).sum().backward()
    opt.step()   # updates the flat buffer: the model must see it
    assert not np.allclose(model(x).numpy(), before)
