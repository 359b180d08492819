"""The parameter store: packing into flat buffers, and the gradient-slot protocol."""
import numpy as np
import pytest

import engine
import optim
from engine import nn
from engine.parameter import FlatBuffer, Parameter, ParameterStore
from ops.device import to_device
from ops.launch import LaunchRecorder


def _parameters(device="cpu"):
    rng = np.random.default_rng(0)
    shapes_and_dtypes = [((2, 3), np.float32), ((4,), np.float64), ((3,), np.float32),
                         ((2, 2), np.float64)]
    return [Parameter(to_device(rng.standard_normal(shape).astype(dtype), device))
            for shape, dtype in shapes_and_dtypes]


def test_store_packs_one_buffer_per_dtype_in_order_of_first_appearance():
    params = _parameters()
    values = [p.numpy().copy() for p in params]
    store = ParameterStore(params)
    assert len(store) == 2 and list(store) == store.buffers
    float32, float64 = store
    assert float32.dtype == np.float32 and float32.params == [params[0], params[2]]
    assert float64.dtype == np.float64 and float64.params == [params[1], params[3]]
    assert [float32.offsets, float64.offsets] == [[0, 6], [0, 4]]
    for p, value in zip(params, values):
        np.testing.assert_array_equal(p.numpy(), value)   # packing keeps the values
        assert np.shares_memory(p.data, p.flat.data)       # ... and makes each a view


def test_store_host_values_and_load_copy_one_buffer_at_a_time():
    params = _parameters()
    store = ParameterStore(params)
    values = store.host_values()
    assert all(not np.shares_memory(values[id(p)], p.data) for p in params)   # copies
    store.load({id(p): np.full(p.shape, k, np.float64) for k, p in enumerate(params)})
    assert [float(p.numpy().reshape(-1)[0]) for p in params] == [0, 1, 2, 3]
    np.testing.assert_array_equal(values[id(params[0])], _parameters()[0].numpy())


def test_sequential_delegates_packing_to_its_store():
    model = nn.Sequential([nn.Dense(3, input_shape=(2,)), nn.Dense(4, dtype=np.float64)])
    assert isinstance(model._flat, ParameterStore)
    assert model.flat_buffers() == model._flat.buffers
    model.add(nn.Dense(2, dtype=np.float64))   # repacks: one store over all parameters
    assert [b.size for b in model.flat_buffers()] == [9, 16 + 10]
    assert all(p.flat in model.flat_buffers() for p in model.parameters())


def test_a_parameter_not_packed_keeps_a_gradient_of_its_own():
    p = Parameter(np.ones(3))
    assert p.flat is None and p.grad is None
    (p * 2).sum().backward()
    np.testing.assert_array_equal(p.grad.numpy(), [2, 2, 2])
    p.grad = None
    assert p.grad is None


def test_slot_protocol_stale_then_overwritten_then_added(device):
    p, q = Parameter(to_device(np.ones(3), device)), Parameter(to_device(np.ones(2), device))
    flat = FlatBuffer([p, q])
    assert p.grad is None and flat.gradient_destination(p._slot) is flat._slots[p._slot]
    (p * 3).sum().backward()
    assert flat.gradient_destination(p._slot) is None          # valid now: backward adds
    assert not flat.grads_valid() and q.grad is None
    np.testing.assert_array_equal(p.grad.numpy(), [3, 3, 3])
    (p * 2).sum().backward()
    np.testing.assert_array_equal(p.grad.numpy(), [5, 5, 5])
    np.testing.assert_array_equal(engine.Tensor(flat.grad).numpy()[:3], [5, 5, 5])
    p.grad = None                                                # zero_grad: marks it stale
    (p * 4).sum().backward()
    np.testing.assert_array_equal(p.grad.numpy(), [4, 4, 4])   # overwritten, not added
    q.grad = np.array([7.0, 8.0])
    assert flat.grads_valid()
    np.testing.assert_array_equal(engine.Tensor(flat.grad).numpy(), [4, 4, 4, 7, 8])


def test_zero_grad_launches_nothing():
    model = nn.Sequential([nn.Dense(3, input_shape=(2,))])
    opt = optim.SGD(model.parameters(), lr=0.1)
    engine.losses.mse(model(np.ones((4, 2), np.float32)), np.zeros((4, 3))).backward()
    (flat,) = model.flat_buffers()
    assert flat.grads_valid()
    with LaunchRecorder() as recorder:
        opt.zero_grad()
    assert recorder.runs == [] and not flat.grads_valid()
    assert all(p.grad is None for p in model.parameters())


def test_moving_to_the_device_it_is_on_copies_nothing():
    p, q = Parameter(np.ones(2)), Parameter(np.ones(3))
    store = ParameterStore([p, q])
    (p.sum() + q.sum()).backward()
    (flat,) = store
    data, grad = flat.data, flat.grad
    assert store.to("cpu") is store
    assert flat.data is data and flat.grad is grad and flat.grads_valid()


@pytest.mark.cuda
def test_moving_a_store_moves_gradients_only_when_all_are_valid():
    p, q = Parameter(np.ones(2)), Parameter(np.ones(3))
    store = ParameterStore([p, q])
    (p.sum() + 2 * q.sum()).backward()
    store.to("cuda")
    assert p.device == q.device == "cuda" and p.flat.device == "cuda"
    np.testing.assert_array_equal(q.grad.numpy(), [2, 2, 2])
    p.grad = None
    store.to("cpu")
    assert p.grad is None and q.grad is None and p.device == "cpu"


def test_the_optimizer_flat_path_runs_one_update_over_the_store_buffer():
    model = nn.Sequential([nn.Dense(3, input_shape=(2,)), nn.Dense(2)])
    opt = optim.Adam(model.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        engine.losses.mse(model(np.ones((4, 2), np.float32)), np.zeros((4, 2))).backward()
        with LaunchRecorder() as recorder:
            opt.step()
    # the step count's advance on the device, then one update of every parameter
    assert [run.kernel.name for run in recorder.runs] == ["advance_steps", "adam"]
