"""Version counters: a backward through a value written in place after it was saved raises
torch's error before any gradient is touched; writes the backward does not depend on stay
allowed, as in torch."""
import numpy as np
import pytest

import engine
from engine import nn
from optim import SGD

INPLACE = "modified by an inplace operation"


def test_a_saved_operand_written_after_the_forward_raises_and_computes_nothing(device):
    w = engine.tensor([1.0, 2.0], device=device, requires_grad=True)
    c = engine.tensor([3.0, 4.0], device=device)
    loss = (w * c).sum()
    c[0] = 100.0   # the case: the backward used to give w.grad == [100, 4]
    with pytest.raises(RuntimeError, match=INPLACE + r".*input 1 of mul \(input shapes "
                                           r"\(2,\), \(2,\)\).*float32 tensor of shape "
                                           r"\(2,\), is at version 1; expected version 0"):
        loss.backward()
    assert w.grad is None


def test_a_matmul_operand_written_after_the_forward_raises(device):
    a = engine.tensor(np.ones((2, 3)), device=device, requires_grad=True)
    b = engine.tensor(np.ones((3, 2)), device=device)
    loss = (a @ b).sum()
    b[0, 0] = 5.0
    with pytest.raises(RuntimeError, match=INPLACE + r".*input 1 of matmul \(input shapes "
                                           r"\(2, 3\), \(3, 2\)\)"):
        loss.backward()
    assert a.grad is None


def test_writes_through_views_count_in_their_base():
    b = engine.tensor(np.ones((3, 2)))
    rows, flat = b[1:3], b.reshape(6)   # views made before the forward
    a = engine.tensor(np.ones((2, 3)), requires_grad=True)
    loss = (a @ b).sum()
    rows[0] = 5.0
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward(retain_graph=True)
    a2 = engine.tensor(np.ones((2, 3)), requires_grad=True)
    loss = (a2 @ b).sum()
    flat[5] = 2.0
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward()
    assert b._version == rows._version == flat._version == 2


def test_a_write_through_detach_after_the_forward_raises(device):
    w = engine.tensor([1.0, 2.0], device=device, requires_grad=True)
    c = engine.tensor([3.0, 4.0], device=device)
    loss = (w * c).sum()
    w.detach()[0] = 10.0
    with pytest.raises(RuntimeError, match=INPLACE + r".*input 0 of mul"):
        loss.backward()


def test_a_saved_output_written_after_the_forward_raises():
    w = engine.tensor([1.0, 2.0], requires_grad=True)
    y = w.exp()   # exp's backward reads its output
    loss = y.sum()
    y.detach()[0] = 0.0
    with pytest.raises(RuntimeError, match=INPLACE + r".*the output of exp"):
        loss.backward()


def test_a_layer_input_written_after_the_forward_raises():
    layer = nn.Dense(3)
    x = engine.tensor(np.ones((4, 5), np.float32))
    loss = layer(x).sum()
    x[0] = 7.0
    with pytest.raises(RuntimeError, match=INPLACE + r".*input 0 of dense"):
        loss.backward()


def test_writes_the_backward_does_not_read_are_allowed_as_in_torch():
    w = engine.tensor([1.0, 2.0], requires_grad=True)
    c = engine.tensor([3.0, 4.0])
    loss = (w + c).sum()   # add saves neither operand
    c[0] = 100.0
    loss.backward()
    np.testing.assert_array_equal(w.grad.numpy(), [1.0, 1.0])
    c2 = engine.tensor([3.0, 4.0])
    c2[0] = 9.0   # a write before the forward is simply the value used
    loss = (w * c2).sum()
    loss.backward()
    np.testing.assert_array_equal(w.grad.numpy(), [1.0 + 9.0, 1.0 + 4.0])


def test_a_copy_has_a_version_of_its_own():
    b = engine.tensor([1.0, 2.0, 3.0])
    picked, copied = b[[0, 2]], engine.tensor(b)   # an advanced index copies
    a = engine.tensor([1.0, 1.0], requires_grad=True)
    loss = (a * picked).sum() + (engine.tensor([1.0, 1.0, 1.0], requires_grad=True)
                                 * copied).sum()
    b[0] = 50.0
    loss.backward()
    np.testing.assert_array_equal(a.grad.numpy(), [1.0, 3.0])
    assert (b._version, picked._version, copied._version) == (1, 0, 0)


def test_a_retained_graph_checks_again_on_its_second_backward():
    w = engine.tensor([1.0, 2.0], requires_grad=True)
    c = engine.tensor([3.0, 4.0])
    loss = (w * c).sum()
    loss.backward(retain_graph=True)
    c[1] = 0.0
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward()
    np.testing.assert_array_equal(w.grad.numpy(), [3.0, 4.0])   # the first backward only


def test_optimizer_steps_and_writes_between_steps_stay_allowed():
    engine.manual_seed(3)
    model = nn.Sequential([nn.Dense(4, activation="relu", input_shape=(4,)), nn.Dense(2)])
    x = engine.tensor(np.linspace(-1, 1, 24, dtype=np.float32).reshape(6, 4))
    optimizer = SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        optimizer.zero_grad()
        loss = (model(x) * model(x)).mean()
        loss.backward()
        optimizer.step()   # updates the parameters in place, through their flat buffer
        model.parameters()[0].detach()[0, 0] = 0.5   # between steps: no graph saved it
    assert model.parameters()[0].numpy()[0, 0] == 0.5


@pytest.mark.cuda
def test_device_arrays_share_memory_by_their_bytes():
    """What the backward asks of an op's kept arrays on the GPU (simulator: host arrays
    underneath)."""
    from ops.memory import empty, shares_memory
    a, b = empty((10,), np.float32, "cuda"), empty((10,), np.float32, "cuda")
    assert shares_memory(a, a) and shares_memory(a, a[2:5]) and shares_memory(a[2:5], a[4:8])
    assert not shares_memory(a[0:2], a[2:4]) and not shares_memory(a, b)
    assert not shares_memory(a, np.zeros(10, np.float32))


def test_host_arrays_share_memory_by_their_bytes():
    from ops.memory import shares_memory
    a = np.zeros(10)
    assert shares_memory(a, a[2:5].reshape(3, 1)) and not shares_memory(a[:2], a[2:])
    assert not shares_memory(a, np.zeros(10))


def test_loading_weights_after_the_forward_raises_as_in_torch():
    model = nn.Sequential([nn.Dense(3, input_shape=(4,), dtype=np.float64), nn.BatchNorm(
        dtype=np.float64)])
    x = engine.tensor(np.linspace(-1, 1, 20).reshape(5, 4))
    loss = model(x).sum()
    model.load_state_dict(model.state_dict())   # the same values, written in place
    with pytest.raises(RuntimeError, match=INPLACE + r".*input 3 of batch_norm .*, or "
                                           r"load_state_dict\)"):
        loss.backward()   # the last op first: BatchNorm's weight
    model(x).sum().backward()   # a graph built after the load is fine
