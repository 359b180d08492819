"""Zero-copy exchange with other libraries, and the autograd bridge to PyTorch both ways.

The bridge tests check the chain rule itself: gradients through the bridge equal the
gradients of the same computation written in plain torch, scale with the upstream gradient
(so nothing inside invents a loss), and pass finite-difference checks in float64.
"""
import importlib.util

import numpy as np
import pytest

import engine
from engine.parameter import FlatBuffer, Parameter
from ops.registry import REGISTRY

HAS_TORCH = importlib.util.find_spec("torch") is not None
if HAS_TORCH:
    import torch
    from engine.interop.torch import as_function, from_module, from_torch, to_torch


class AffineTanh:
    """``tanh(x @ W + b)`` from engine Parameters, written with broadcasting and a sum so it
    exercises the bridge with nothing but the core ops."""

    def __init__(self, n_in, n_out, dtype=np.float64, seed=0):
        rng = np.random.default_rng(seed)
        self.weight = Parameter(rng.standard_normal((n_in, n_out)).astype(dtype))
        self.bias = Parameter(rng.standard_normal(n_out).astype(dtype))

    def parameters(self):
        return [self.weight, self.bias]

    def __call__(self, x):
        n, k = x.shape
        return ((x.reshape(n, k, 1) * self.weight).sum(axis=1) + self.bias).tanh()


def torch_reference(model, x):
    """The same computation as ``model`` in plain torch, on copies of its parameters."""
    weight = torch.tensor(model.weight.numpy(), requires_grad=True)
    bias = torch.tensor(model.bias.numpy(), requires_grad=True)
    return torch.tanh(x @ weight + bias), weight, bias


# ------------------------------------------------------------------ zero-copy exchange

def test_numpy_views_a_cpu_tensor_without_copy():
    t = engine.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    view = np.asarray(t)
    assert np.shares_memory(view, t.data)
    view[0, 0] = 42
    assert t.numpy()[0, 0] == 42
    assert np.asarray(t, dtype=np.float64).dtype == np.float64   # a converting copy
    with pytest.raises(ValueError, match="copy=False"):
        np.asarray(t, dtype=np.float64, copy=False)


def test_from_dlpack_shares_memory_with_numpy():
    array = np.arange(12, dtype=np.float64).reshape(3, 4)
    t = engine.from_dlpack(array)
    assert np.shares_memory(t.data, array) and t.dtype == np.float64 and t.shape == (3, 4)
    array[1, 2] = -1
    assert t.numpy()[1, 2] == -1


def test_from_dlpack_refuses_what_it_cannot_view():
    with pytest.raises(ValueError, match="not C-contiguous"):
        engine.from_dlpack(np.ones((3, 4), np.float32).T)
    with pytest.raises(TypeError, match="float16"):
        engine.from_dlpack(np.ones(3, np.float16))
    with pytest.raises(TypeError, match="builtins.list exposes neither"):
        engine.from_dlpack([1.0, 2.0])


@pytest.mark.cuda
def test_from_dlpack_wraps_a_numba_device_array_as_is():
    from numba import cuda
    array = cuda.to_device(np.arange(5, dtype=np.float32))
    t = engine.from_dlpack(array)
    assert t.data is array and t.device == "cuda"
    copied = engine.tensor(array)
    assert copied.data is not array and np.array_equal(copied.numpy(), np.arange(5))
    with pytest.raises(TypeError, match="lives on cuda"):
        np.asarray(t)


@pytest.mark.torch
def test_torch_and_engine_share_cpu_memory_both_ways():
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    t = engine.from_dlpack(x)
    assert np.shares_memory(t.data, x.numpy())
    t.data[0, 1] = 7
    assert x[0, 1] == 7

    y = torch.from_dlpack(t)   # our __dlpack__
    assert y.data_ptr() == t.data.ctypes.data
    assert to_torch(t).data_ptr() == t.data.ctypes.data
    assert from_torch(x).data.ctypes.data == x.data_ptr()
    with pytest.raises(ValueError, match="torch.Tensor of shape \\(3, 2\\) is not C-contiguous"):
        from_torch(x.t())


@pytest.mark.torch
def test_engine_tensor_copies_a_torch_tensor():
    x = torch.arange(4, dtype=torch.float32)
    t = engine.tensor(x)
    assert np.array_equal(t.numpy(), [0, 1, 2, 3]) and not np.shares_memory(t.data, x.numpy())


@pytest.mark.gpu
@pytest.mark.torch
def test_torch_and_engine_share_cuda_memory_both_ways():
    x = torch.arange(6, dtype=torch.float32, device="cuda").reshape(2, 3)
    t = engine.from_dlpack(x)   # through x.__cuda_array_interface__, wrapped once
    assert t.device == "cuda"
    assert t.__cuda_array_interface__["data"][0] == x.data_ptr()
    t.data[0, 1] = 7   # a Numba device array: writes go to torch's memory
    assert float(x[0, 1]) == 7

    y = torch.from_dlpack(t)   # our __dlpack__ on CUDA
    assert y.data_ptr() == x.data_ptr() and y.device.type == "cuda"
    assert to_torch(t).data_ptr() == x.data_ptr()
    assert t.__dlpack_device__() == (2, torch.cuda.current_device())

    engine_made = engine.ones(3, 5, device="cuda")
    viewed = torch.as_tensor(engine_made, device="cuda")   # our __cuda_array_interface__
    assert viewed.data_ptr() == engine_made.__cuda_array_interface__["data"][0]


# ------------------------------------------------------------------ engine inside torch

@pytest.mark.torch
def test_as_function_passes_torch_gradcheck_in_float64():
    hybrid = as_function(AffineTanh(3, 4))
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    # the parameters are inputs too: gradcheck nudges them in place, in the engine's memory
    assert torch.autograd.gradcheck(lambda x, *params: hybrid(x), (x, *hybrid.parameters()))


@pytest.mark.torch
def test_as_function_gradients_equal_plain_torch_and_follow_grad_output():
    model = AffineTanh(4, 3)
    hybrid = as_function(model)
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(6, 3, dtype=torch.float64)

    expected, weight, bias = torch_reference(model, x)
    assert torch.allclose(hybrid(x), expected)
    expected.backward(upstream)
    grad_x = x.grad.clone()
    x.grad = None

    # twice the upstream gradient must give twice the gradients: the chain rule, no own loss
    hybrid(x).backward(2 * upstream)
    view_weight, view_bias = hybrid.parameters()
    assert torch.allclose(x.grad, 2 * grad_x)
    assert torch.allclose(view_weight.grad, 2 * weight.grad)
    assert torch.allclose(view_bias.grad, 2 * bias.grad)


@pytest.mark.torch
def test_as_function_used_twice_in_one_graph_accumulates_in_torch():
    model = AffineTanh(3, 3)
    hybrid = as_function(model)
    x = torch.randn(4, 3, dtype=torch.float64)
    hybrid(hybrid(x)).sum().backward()

    weight = torch.tensor(model.weight.numpy(), requires_grad=True)
    bias = torch.tensor(model.bias.numpy(), requires_grad=True)

    def layer(h):
        return torch.tanh(h @ weight + bias)
    layer(layer(x)).sum().backward()
    assert torch.allclose(hybrid.engine_views[0].grad, weight.grad)
    assert torch.allclose(hybrid.engine_views[1].grad, bias.grad)


@pytest.mark.torch
def test_as_function_backward_on_another_thread_and_twice_with_retain_graph():
    import threading
    hybrid = as_function(AffineTanh(3, 2))
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    out = hybrid(x).sum()
    assert len(engine.autograd.current_tape()) == 0   # each call records on a tape of its own
    out.backward(retain_graph=True)
    once = x.grad.clone()
    # torch runs CUDA backwards on its device threads; any thread must find the forward's tape
    worker = threading.Thread(target=out.backward)
    worker.start()
    worker.join()
    assert torch.allclose(x.grad, 2 * once)


@pytest.mark.torch
def test_one_torch_optimizer_updates_the_engine_parameters_in_place():
    model = AffineTanh(3, 2, dtype=np.float32)
    conv = torch.nn.Linear(5, 3)
    hybrid = torch.nn.Sequential(conv, as_function(model))
    optimizer = torch.optim.SGD(hybrid.parameters(), lr=0.5)
    assert len(optimizer.param_groups[0]["params"]) == 4   # torch's two and the engine's two

    before = model.weight.numpy().copy()
    linear_before = conv.weight.detach().clone()
    hybrid(torch.randn(8, 5)).square().mean().backward()
    view_weight = hybrid[1].engine_views[0]
    step = 0.5 * view_weight.grad.numpy()
    optimizer.step()
    assert np.allclose(model.weight.numpy(), before - step)   # the engine model itself moved
    assert not torch.equal(conv.weight, linear_before)


@pytest.mark.torch
def test_as_function_trains_an_engine_nn_model_with_torch_loss():
    head = engine.nn.Sequential([engine.nn.Dense(8, activation="relu", input_shape=(4,)),
                                 engine.nn.Dense(3)])
    hybrid = as_function(head)
    optimizer = torch.optim.Adam(hybrid.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=generator)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.cross_entropy(hybrid(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert np.shares_memory(np.asarray(head.parameters()[0]), hybrid.engine_views[0].detach().numpy())


@pytest.mark.torch
def test_as_function_inference_records_nothing():
    hybrid = as_function(AffineTanh(3, 2))
    with torch.no_grad():
        out = hybrid(torch.randn(4, 3, dtype=torch.float64))
    assert out.grad_fn is None and len(engine.autograd.current_tape()) == 0


@pytest.mark.torch
def test_as_function_mismatched_dtype_names_both_sides():
    hybrid = as_function(AffineTanh(3, 2, dtype=np.float32))
    with pytest.raises(TypeError, match="torch input 0 is float64 but the engine model "
                                        "is float32"):
        hybrid(torch.randn(4, 3, dtype=torch.float64))
    with pytest.raises(TypeError, match="torch dtype torch.float16"):
        hybrid(torch.randn(4, 3).half())


@pytest.mark.torch
def test_as_function_refuses_a_model_moved_after_wrapping_or_not_built():
    model = AffineTanh(3, 2)
    hybrid = as_function(model)
    hybrid(torch.randn(2, 3, dtype=torch.float64))
    hybrid.float()   # torch replaces its parameters' storage with float32 copies
    with pytest.raises(RuntimeError, match="no longer shares memory"):
        hybrid(torch.randn(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="not built yet"):
        as_function(engine.nn.Sequential([engine.nn.Dense(3)]))


# ------------------------------------------------------------------ torch inside the engine

def small_torch_module():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


@pytest.mark.torch
def test_from_module_passes_engine_gradcheck():
    wrapped = from_module(small_torch_module().double())
    x = engine.randn(5, 3, dtype=np.float64, requires_grad=True)
    assert engine.gradcheck(lambda x, *params: wrapped(x), (x, *wrapped.parameters()))


@pytest.mark.torch
def test_from_module_gradients_follow_the_tape_grad_out():
    module = small_torch_module().double()
    wrapped = from_module(module)
    values = np.random.default_rng(0).standard_normal((5, 3))
    x = engine.tensor(values, requires_grad=True)
    upstream = np.random.default_rng(1).standard_normal((5, 2))
    (wrapped(x) * engine.tensor(upstream)).sum().backward()

    reference_x = torch.tensor(values, requires_grad=True)
    module(reference_x).backward(torch.tensor(upstream))
    assert np.allclose(x.grad.numpy(), reference_x.grad.numpy())
    for p, (name, torch_parameter) in zip(wrapped.parameters(), module.named_parameters()):
        assert np.allclose(p.grad.numpy(), torch_parameter.grad.numpy()), name


@pytest.mark.torch
def test_one_engine_optimizer_trains_the_torch_module():
    import optim
    module = small_torch_module()
    wrapped = from_module(module)
    for p, torch_parameter in zip(wrapped.parameters(), module.parameters()):
        assert np.shares_memory(p.data, torch_parameter.detach().numpy())
    head = engine.nn.Sequential([engine.nn.Dense(2, input_shape=(2,))])
    optimizer = optim.SGD([{"params": wrapped.parameters()}, {"params": head.parameters()}],
                          lr=0.1)
    x = engine.randn(16, 3)
    target = engine.randn(16, 2)
    before = module[0].weight.detach().clone()
    losses = []
    for _ in range(20):
        loss = ((head(wrapped(x)) - target) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert not torch.equal(module[0].weight, before)   # torch's module sees our updates


@pytest.mark.torch
def test_from_module_is_an_op_outside_the_registry_and_records_only_with_grad():
    from engine.interop.torch import TorchModuleOp
    assert TorchModuleOp.name not in REGISTRY
    wrapped = from_module(small_torch_module())
    with engine.no_grad():
        out = wrapped(engine.randn(2, 3))
    assert not out.requires_grad and len(engine.autograd.current_tape()) == 0


@pytest.mark.torch
def test_from_module_mismatched_dtype_names_both_sides():
    wrapped = from_module(small_torch_module())
    with pytest.raises(TypeError, match="torch module Sequential is float32 but engine "
                                        "input 0 is float64"):
        wrapped(engine.randn(2, 3, dtype=np.float64))


@pytest.mark.cuda
@pytest.mark.torch
def test_from_module_mismatched_device_names_both_sides():
    wrapped = from_module(small_torch_module())
    with pytest.raises(ValueError, match="torch module Sequential is on cpu but engine "
                                         "input 0 is on cuda"):
        wrapped(engine.randn(2, 3, device="cuda"))


@pytest.mark.gpu
@pytest.mark.torch
def test_bridges_on_cuda_in_float64():
    model = AffineTanh(3, 4)
    FlatBuffer(model.parameters()).to("cuda")   # move first, then wrap
    hybrid = as_function(model)
    x = torch.randn(5, 3, dtype=torch.float64, device="cuda", requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, *params: hybrid(x), (x, *hybrid.parameters()))
    with pytest.raises(ValueError, match="torch input 0 is on cpu but the engine model "
                                         "is on cuda"):
        hybrid(torch.randn(5, 3, dtype=torch.float64))

    wrapped = from_module(small_torch_module().double().cuda())
    engine_x = engine.randn(5, 3, dtype=np.float64, device="cuda", requires_grad=True)
    assert engine.gradcheck(lambda x, *params: wrapped(x), (engine_x, *wrapped.parameters()))


# ------------------------------------------------------------------ the hybrid MNIST example

@pytest.mark.torch
def test_hybrid_mnist_loss_falls_on_a_subset():
    from bench import hybrid_mnist
    import data
    (x_train, y_train), _ = data.mnist.load()
    x = hybrid_mnist.as_batches(x_train[:384])
    y = torch.from_numpy(y_train[:384].astype(np.int64))
    model = hybrid_mnist.build_model(seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    first = hybrid_mnist.train_epoch(model, optimizer, x, y, 32, generator)
    last = hybrid_mnist.train_epoch(model, optimizer, x, y, 32, generator)
    assert last < 0.7 * first   # measured: 2.05 -> 0.84
