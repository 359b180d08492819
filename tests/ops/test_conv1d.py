"""Conv1D: ``engine.conv1d`` and ``nn.Conv1D`` (NCL, torch's layout) against
``torch.nn.functional.conv1d`` in float64, under ``check_op``, saved and loaded, and exported
to ONNX. Both run conv2d's kernels on height-1 views (``nn._Conv``, the rank-generic base)."""
import numpy as np
import pytest
import torch

import engine
from engine import nn
from tests.support.op_check import Case, check_op

RNG = np.random.default_rng(7)
# (x shape, w shape, keyword arguments): stride, padding, dilation, groups, "same" with an
# even kernel (torch pads one more on the right)
CONFIGS = [
    ((2, 3, 9), (4, 3, 3), {}),
    ((2, 4, 12), (6, 2, 3), dict(stride=2, padding=2, dilation=2, groups=2)),
    ((1, 2, 8), (3, 2, 4), dict(padding="same")),
    ((3, 1, 5), (2, 1, 5), dict(padding="valid")),
]


def _torch_conv1d(x, w, b, **kwargs):
    return torch.nn.functional.conv1d(torch.tensor(x), torch.tensor(w), torch.tensor(b),
                                      **kwargs).numpy()


@pytest.mark.filterwarnings("ignore:Using padding=.same. with even kernel")
@pytest.mark.parametrize("x_shape, w_shape, kwargs", CONFIGS)
def test_conv1d_and_its_gradients_match_torch_in_float64(x_shape, w_shape, kwargs):
    x, w, b = (RNG.standard_normal(s) for s in (x_shape, w_shape, (w_shape[0],)))
    ours = [engine.tensor(a, requires_grad=True) for a in (x, w, b)]
    theirs = [torch.tensor(a, requires_grad=True) for a in (x, w, b)]
    y = engine.conv1d(*ours, **kwargs)
    yt = torch.nn.functional.conv1d(*theirs, **kwargs)
    weights = RNG.standard_normal(yt.shape)
    (y * engine.tensor(weights)).sum().backward()
    (yt * torch.tensor(weights)).sum().backward()
    np.testing.assert_allclose(y.numpy(), yt.detach().numpy(), rtol=1e-12, atol=1e-13)
    for name, mine, reference in zip("xwb", ours, theirs):
        np.testing.assert_allclose(mine.grad.numpy(), reference.grad.numpy(), rtol=1e-12,
                                   atol=1e-13, err_msg=f"grad {name}")


# one case per device: the simulator runs conv2d's CUDA plans (~50 s a case)
CASE = Case("conv2d", ((2, 3, 7), (4, 3, 3), (4,)),
            lambda x, w, b: engine.conv1d(x, w, b, stride=2, padding=1),
            lambda x, w, b: _torch_conv1d(x, w, b, stride=2, padding=1))


def test_conv1d_under_check_op(device):
    check_op(CASE, device)


def test_conv1d_names_itself_in_its_errors():
    x = engine.tensor(RNG.standard_normal((2, 3, 4)))
    with pytest.raises(ValueError, match=r"conv1d: expects x \(N, C, L\)"):
        engine.conv1d(x, engine.tensor(RNG.standard_normal((4, 3, 3, 3))))
    with pytest.raises(ValueError, match=r"conv1d \(conv2d over \(N, C, 1, L\) views\): .*"
                                         r"padded input \(1x4\) is smaller than the dilated "
                                         r"kernel \(1x5\)"):
        engine.conv1d(x, engine.tensor(RNG.standard_normal((4, 3, 5))))
    with pytest.raises(ValueError, match="conv1d: stride must be an int or a tuple of 1"):
        engine.conv1d(x, engine.tensor(RNG.standard_normal((4, 3, 3))), stride=(1, 2))


def test_conv1d_layer_matches_torch_conv1d_with_its_weights():
    layer = nn.Conv1D(6, 3, stride=2, padding=1, dilation=2, groups=2, activation="tanh",
                      dtype=np.float64)
    layer.build((4, 12))
    assert layer.weight.shape == (6, 2, 3) and layer.compute_output_shape((4, 12)) == (6, 5)
    x = RNG.standard_normal((3, 4, 12))
    y = layer(engine.tensor(x)).numpy()
    reference = np.tanh(_torch_conv1d(x, layer.weight.numpy(), layer.bias.numpy(), stride=2,
                                      padding=1, dilation=2, groups=2))
    np.testing.assert_allclose(y, reference, rtol=1e-12, atol=1e-13)


def test_conv1d_model_trains_saves_and_loads(tmp_path):
    engine.manual_seed(0)
    model = nn.Sequential([nn.Conv1D(5, 3, padding="same", activation="gelu",
                                     input_shape=(2, 10)),
                           nn.Conv1D(4, 2, stride=2, activation="relu"), nn.Flatten(),
                           nn.Dense(3)])
    assert model.output_shape == (3,)
    x = engine.tensor(RNG.standard_normal((4, 2, 10)), dtype=np.float32)
    loss = (model(x) * model(x)).mean()
    loss.backward()
    assert all(np.abs(p.grad.numpy()).sum() > 0 for p in model.parameters())
    model.save(tmp_path / "m.npz")
    loaded = nn.load(tmp_path / "m.npz")
    assert [type(layer).__name__ for layer in loaded.layers][:2] == ["Conv1D", "Conv1D"]
    np.testing.assert_array_equal(loaded(x).numpy(), model(x).numpy())


@pytest.mark.parametrize("make, match", [
    (lambda: nn.Conv1D(4, (3, 3)), r"Conv1D: kernel_size must be an int or a tuple of 1"),
    (lambda: nn.Conv1D(4, 3, padding="same", stride=2), "padding='same' needs stride 1"),
    (lambda: nn.Sequential([nn.Conv1D(4, 3, input_shape=(2, 5, 5))]),
     r"Conv1D takes inputs of shape \(None, channels, length\).*nn.Reshape\(\(channels, "
     r"length\)\)"),
    (lambda: nn.Sequential([nn.Conv1D(4, 7, input_shape=(2, 5))]),
     r"Conv1D: the padded input \(5\) is smaller than the dilated kernel \(7\)"),
])
def test_conv1d_layer_refuses_bad_geometry_at_add_time(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_conv1d_exports_to_onnx_and_runs_in_onnxruntime(tmp_path):
    onnxruntime = pytest.importorskip("onnxruntime")
    model = nn.Sequential([nn.Conv1D(4, 4, padding="same", activation="relu",
                                     input_shape=(3, 9)),
                           nn.Conv1D(2, 3, stride=2, dilation=2, activation="gelu")])
    path = tmp_path / "conv1d.onnx"
    engine.onnx.export(model, path)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = RNG.standard_normal((2, 3, 9)).astype(np.float32)
    out, = session.run(None, {"input": x})
    np.testing.assert_allclose(out, model(engine.tensor(x)).numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_conv1d_reads_back_from_onnx(tmp_path, dtype):
    pytest.importorskip("onnx")
    model = nn.Sequential([nn.Conv1D(4, 4, padding="same", input_shape=(3, 9), dtype=dtype),
                           nn.Activation("relu"),
                           nn.Conv1D(2, 3, stride=2, padding=1, groups=2, dtype=dtype)])
    path = tmp_path / "conv1d.onnx"
    engine.onnx.export(model, path)
    loaded = engine.onnx.load(path)
    assert [type(layer).__name__ for layer in loaded.layers] == ["Conv1D", "Conv1D"]
    assert loaded.layers[0].activation == "relu"   # the Activation fused back into the conv
    x = engine.tensor(RNG.standard_normal((2, 3, 9)), dtype=dtype)
    np.testing.assert_allclose(loaded(x).numpy(), model(x).numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
def test_conv1d_on_a_long_signal_matches_torch_on_the_gpu():
    x = RNG.standard_normal((16, 32, 4096)).astype(np.float32)
    w = RNG.standard_normal((64, 16, 5)).astype(np.float32) * 0.1
    ours = [engine.tensor(a, device="cuda", requires_grad=True) for a in (x, w)]
    # the reference in float64: cuDNN's float32 convolutions default to TF32 (about 1e-3)
    theirs = [torch.tensor(a.astype(np.float64), device="cuda", requires_grad=True)
              for a in (x, w)]
    y = engine.conv1d(*ours, padding=2, groups=2)
    yt = torch.nn.functional.conv1d(*theirs, padding=2, groups=2)
    y.sum().backward()
    yt.sum().backward()
    np.testing.assert_allclose(y.numpy(), yt.detach().cpu().numpy(), rtol=1e-4, atol=1e-4)
    for mine, reference in zip(ours, theirs):
        np.testing.assert_allclose(mine.grad.numpy(), reference.grad.cpu().numpy(),
                                   rtol=1e-3, atol=1e-3)
