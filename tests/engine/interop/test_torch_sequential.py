"""``engine.interop.torch.from_sequential`` and ``to_sequential``: a ``torch.nn.Sequential``
and the engine ``nn.Sequential`` it converts to (or from) compute the same outputs in
float64, in train mode (BatchNorm on the batch's statistics, the running statistics updated
alike, the same gradients) and in eval mode; unsupported modules are named.

Needs PyTorch (the torch extra); skipped without it."""
import numpy as np
import pytest

import engine
from engine import nn

torch = pytest.importorskip("torch", reason="needs PyTorch: pip install -e '.[torch]'")
from engine.interop.torch import from_sequential, to_sequential  # noqa: E402

t = torch.nn
# torch's own note on its zero-padded copy for padding="same" with an even kernel
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
ATOL = 1e-12   # float64: the same sums in another order


def _mlp():
    return t.Sequential(t.Flatten(), t.Linear(12, 9), t.ReLU(), t.Linear(9, 8),
                        t.LeakyReLU(0.2), t.BatchNorm1d(8, momentum=0.3), t.Linear(8, 6),
                        t.Sigmoid(), t.Sequential(t.Linear(6, 5, bias=False), t.Tanh()),
                        t.Dropout(0.0), t.Identity(), t.Linear(5, 4), t.Softmax(dim=-1))


def _cnn():
    return t.Sequential(t.Unflatten(1, (2, 7, 6)), t.Conv2d(2, 4, 2, padding="same"), t.ReLU(),
                        t.Conv2d(4, 4, 3, stride=2, padding=1, groups=2, bias=False),
                        t.Tanh(), t.BatchNorm2d(4, eps=1e-3), t.MaxPool2d(2, stride=1, padding=1),
                        t.Conv2d(4, 3, 2, dilation=(1, 2), padding=(1, 0)),
                        t.AvgPool2d(3, stride=1, padding=1), t.Flatten(), t.Linear(36, 5))


NETWORKS = {"mlp": (_mlp, (3, 4)), "cnn": (_cnn, (84,))}


def _inputs(shape, batch=6, seed=0):
    return np.random.default_rng(seed).normal(size=(batch,) + shape)


@pytest.mark.parametrize("network", sorted(NETWORKS))
def test_from_sequential_matches_torch_in_train_and_eval_mode(network):
    make, shape = NETWORKS[network]
    torch.manual_seed(0)
    module = make().double()
    model = from_sequential(module, shape)
    assert model.training and model.input_shape == shape
    # train mode: batch statistics, the running ones updated, the same gradients
    x = _inputs(shape)
    expected = module(torch.from_numpy(x).requires_grad_())
    (expected ** 2).sum().backward()
    got = model(engine.tensor(x))
    (got ** 2).sum().backward()
    np.testing.assert_allclose(got.numpy(), expected.detach().numpy(), rtol=0, atol=ATOL)
    first = next(m for m in module.modules() if isinstance(m, (t.Linear, t.Conv2d)))
    grad = first.weight.grad.numpy()
    np.testing.assert_allclose(model.layers[1].weight.grad.numpy(),
                               grad.T if isinstance(first, t.Linear) else grad,
                               rtol=1e-10, atol=ATOL)
    norm = next(m for m in module.modules() if isinstance(m, t.modules.batchnorm._BatchNorm))
    stats = {name: value for name, value in model.state_dict().items() if "running" in name}
    np.testing.assert_allclose(stats["batchnorm.running_mean"], norm.running_mean.numpy(),
                               rtol=0, atol=ATOL)
    np.testing.assert_allclose(stats["batchnorm.running_var"], norm.running_var.numpy(),
                               rtol=0, atol=ATOL)
    # eval mode: the running statistics
    module.eval()
    model.eval()
    for batch in (1, 37):
        x = _inputs(shape, batch, seed=batch)
        with torch.no_grad():
            expected = module(torch.from_numpy(x)).numpy()
        with engine.no_grad():
            np.testing.assert_allclose(model(engine.tensor(x)).numpy(), expected, rtol=0,
                                       atol=ATOL)


def test_activations_fuse_and_float32_stays_float32():
    model = from_sequential(_mlp(), (3, 4))
    kinds = [(type(layer).__name__, getattr(layer, "activation", None))
             for layer in model.layers]
    assert kinds == [("Flatten", None), ("Dense", "relu"), ("Dense", "leaky_relu"),
                     ("BatchNorm", None), ("Dense", "sigmoid"), ("Dense", "tanh"),
                     ("Dropout", None), ("Dense", "softmax")]
    assert {p.dtype for p in model.parameters()} == {np.dtype(np.float32)}
    assert model.layers[3].momentum == pytest.approx(0.3)
    np.testing.assert_array_equal(model.state_dict()["dense_3.bias"], np.zeros(5, np.float32))


@pytest.mark.parametrize("network", sorted(NETWORKS))
def test_to_sequential_matches_the_engine_model_and_converts_back(network):
    make, shape = NETWORKS[network]
    torch.manual_seed(1)
    model = from_sequential(make().double(), shape)
    model(engine.tensor(_inputs(shape, 9)))   # running statistics away from 0 and 1
    module = to_sequential(model)
    assert module.training
    again = from_sequential(module, shape)   # before the forwards below update statistics
    assert again.get_config() == model.get_config()
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(again.state_dict()[name], value, err_msg=name)
    x = _inputs(shape, 7, seed=3)
    np.testing.assert_allclose(module(torch.from_numpy(x)).detach().numpy(),
                               model(engine.tensor(x)).numpy(), rtol=0, atol=ATOL)
    model.eval()
    module.eval()
    with torch.no_grad(), engine.no_grad():
        np.testing.assert_allclose(module(torch.from_numpy(x)).numpy(),
                                   model(engine.tensor(x)).numpy(), rtol=0, atol=ATOL)


def test_engine_layers_map_to_torch_modules():
    model = nn.Sequential([nn.Reshape((1, 4, 4), input_shape=(16,)),
                           nn.Conv2D(2, 3, padding="valid", activation="leaky_relu", alpha=0.3),
                           nn.Flatten(), nn.Dropout(0.25), nn.Dense(3, activation="softmax")])
    module = to_sequential(model.eval())
    assert [type(m).__name__ for m in module] == ["Unflatten", "Conv2d", "LeakyReLU",
                                                  "Flatten", "Dropout", "Linear", "Softmax"]
    assert not module.training and module[2].negative_slope == pytest.approx(0.3)
    assert module[4].p == 0.25 and module[1].weight.dtype == torch.float32


class Scale(t.Module):
    def forward(self, x):
        return 2 * x


@pytest.mark.parametrize("module, words", [
    (t.PReLU(), r"module 1 PReLU\(.*\): PReLU has no engine layer; converted: Linear, Conv2d"),
    (t.GELU(approximate="tanh"), r"module 1 GELU\(.*\): approximate='tanh'"),
    (Scale(), r"module 1 Scale\(\): Scale has no engine layer"),
    (t.Softmax(dim=0), r"module 1 Softmax\(dim=0\): .*give dim=-1"),
    (t.Flatten(start_dim=2), r"module 1 Flatten.*start_dim=1, end_dim=-1"),
    (t.BatchNorm1d(12, momentum=None), r"module 1 BatchNorm1d.*momentum a number"),
])
def test_unsupported_modules_are_named(module, words):
    with pytest.raises(ValueError, match="from_sequential: " + words):
        from_sequential(t.Sequential(t.Flatten(), module), (3, 4))


def test_unsupported_pooling_and_padding_are_named():
    with pytest.raises(ValueError, match=r"module 1 MaxPool2d.*ceil_mode=True"):
        from_sequential(t.Sequential(t.Unflatten(1, (1, 4, 4)), t.MaxPool2d(2, ceil_mode=True)),
                        (16,))
    with pytest.raises(ValueError, match=r"module 1 AvgPool2d.*count_include_pad=True"):
        from_sequential(t.Sequential(t.Unflatten(1, (1, 4, 4)),
                                     t.AvgPool2d(3, padding=1, count_include_pad=False)), (16,))
    with pytest.raises(ValueError, match=r"module 1 Conv2d.*padding_mode 'reflect'"):
        from_sequential(t.Sequential(t.Unflatten(1, (1, 4, 4)),
                                     t.Conv2d(1, 1, 3, padding=1, padding_mode="reflect")),
                        (16,))
    with pytest.raises(ValueError, match=r"from_sequential: load_state_dict: 'dense.weight' "
                                         r"has shape \(5, 2\), the model expects \(12, 2\)"):
        from_sequential(t.Sequential(t.Flatten(), t.Linear(5, 2)), (3, 4))   # 12 features
    with pytest.raises(TypeError, match="expected a torch.nn.Sequential, got Linear"):
        from_sequential(t.Linear(2, 2), (2,))


@pytest.mark.gpu
def test_a_converted_model_on_the_gpu_matches_torch_on_the_gpu():
    torch.manual_seed(0)
    module = _cnn().double().cuda()
    model = from_sequential(module.cpu(), (84,)).to("cuda")
    module.cuda()
    x = _inputs((84,), 512)
    got = model(engine.tensor(x, device="cuda")).numpy()
    expected = module(torch.from_numpy(x).cuda()).detach().cpu().numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-10)


@pytest.mark.cuda
def test_a_converted_model_moves_to_the_cuda_device():
    """A tiny model, for Numba's simulator on a CPU machine."""
    torch.manual_seed(0)
    module = t.Sequential(t.Linear(2, 3), t.Tanh(), t.Linear(3, 2))
    model = from_sequential(module, (2,)).to("cuda")
    x = _inputs((2,), 3).astype(np.float32)
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(model(engine.tensor(x, device="cuda")).numpy(), expected,
                               rtol=0, atol=1e-6)
    assert to_sequential(model)[0].weight.device.type == "cpu"
