"""GELU (torch's two forms) against ``torch.nn.functional.gelu`` in float64: the function,
the layers that take it by name, and its ONNX export. ``check_op`` covers the op itself
(tests/ops/test_core.py)."""
import numpy as np
import pytest
import torch

import engine
from engine import nn

X = np.random.default_rng(3).uniform(-5, 5, size=(4, 6))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_its_gradient_match_torch_in_float64(device, approximate):
    x = engine.tensor(X, dtype=np.float64, device=device, requires_grad=True)
    y = x.gelu(approximate=approximate)
    (y * engine.tensor(X[::-1].copy(), device=device)).sum().backward()
    xt = torch.tensor(X, requires_grad=True)
    yt = torch.nn.functional.gelu(xt, approximate=approximate)
    (yt * torch.tensor(X[::-1].copy())).sum().backward()
    np.testing.assert_allclose(y.numpy(), yt.detach().numpy(), rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(x.grad.numpy(), xt.grad.numpy(), rtol=1e-13, atol=1e-15)


def test_gelu_refuses_an_unknown_form():
    with pytest.raises(ValueError, match='gelu: approximate must be "none" or "tanh"'):
        engine.gelu(engine.tensor([1.0]), approximate="erf")


def _layer_grads(layer, x, device):
    """The layer's output and the gradients of x and of its parameters, in float64."""
    xt = engine.tensor(x, device=device, requires_grad=True)
    y = layer(xt)
    y.sum().backward()
    return y.numpy(), xt.grad.numpy(), [p.grad.numpy() for _, p in layer.named_parameters()]


def test_dense_with_gelu_matches_torch_linear_then_gelu(device):
    layer = nn.Dense(5, activation="gelu", dtype=np.float64)
    layer.build((6,), device)
    y, grad_x, (grad_w, grad_b) = _layer_grads(layer, X, device)
    xt = torch.tensor(X, requires_grad=True)
    w = torch.tensor(layer.weight.numpy(), requires_grad=True)
    b = torch.tensor(layer.bias.numpy() + 0.0, requires_grad=True)
    yt = torch.nn.functional.gelu(xt @ w + b)
    yt.sum().backward()
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-12, atol=1e-14)
    for mine, theirs in ((grad_x, xt.grad), (grad_w, w.grad), (grad_b, b.grad)):
        np.testing.assert_allclose(mine, theirs.numpy(), rtol=1e-12, atol=1e-13)
    assert layer.kernel_initializer is engine.init.he_normal   # relu-like, as the relu family


def test_conv2d_with_gelu_matches_torch_conv2d_then_gelu():
    images = np.random.default_rng(4).standard_normal((2, 3, 5, 6))
    layer = nn.Conv2D(4, 3, padding="same", activation="gelu", dtype=np.float64)
    layer.build((3, 5, 6))
    y, grad_x, (grad_w, grad_b) = _layer_grads(layer, images, "cpu")
    xt = torch.tensor(images, requires_grad=True)
    w = torch.tensor(layer.weight.numpy(), requires_grad=True)
    b = torch.tensor(layer.bias.numpy() + 0.0, requires_grad=True)
    yt = torch.nn.functional.gelu(torch.nn.functional.conv2d(xt, w, b, padding="same"))
    yt.sum().backward()
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-12, atol=1e-14)
    for mine, theirs in ((grad_x, xt.grad), (grad_w, w.grad), (grad_b, b.grad)):
        np.testing.assert_allclose(mine, theirs.numpy(), rtol=1e-12, atol=1e-13)


def test_activation_gelu_is_saved_and_loaded(tmp_path):
    model = nn.Sequential([nn.Dense(5, activation="gelu", input_shape=(6,)),
                           nn.Activation("gelu"), nn.Dense(2)])
    model.save(tmp_path / "m.npz")
    loaded = nn.load(tmp_path / "m.npz")
    x = engine.tensor(X, dtype=np.float32)
    np.testing.assert_array_equal(loaded(x).numpy(), model(x).numpy())


def test_conv_cpu_kernel_refuses_an_activation_code_it_has_no_loop_for():
    """An unlisted code used to compute the identity in silence."""
    from ops import conv_cpu
    from ops.pointwise import GELU
    x, w = np.ones(2 * 3 * 4 * 4), np.ones(2 * 3 * 3 * 3)
    meta = (2, 3, 4, 4, 2, 2, 2, 3, 3, 1, 1, 0, 0, 1, 1, 1, 0)
    with pytest.raises(ValueError, match="no fused CPU loop"):
        conv_cpu.conv2d_forward_cpu(x, w, w, np.empty(2 * 2 * 4), meta, GELU, 0.0)


@pytest.mark.parametrize("opset", [17, 20])
def test_gelu_exports_to_onnx_and_runs_in_onnxruntime(tmp_path, opset):
    """Opset 20 has a Gelu operator; before it the export writes the erf composition."""
    onnxruntime = pytest.importorskip("onnxruntime")
    model = nn.Sequential([nn.Dense(5, activation="gelu", input_shape=(6,)),
                           nn.Dense(3), nn.Activation("gelu")])
    path = tmp_path / "gelu.onnx"
    engine.onnx.export(model, path, opset=opset)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = X.astype(np.float32)
    out, = session.run(None, {"input": x})
    np.testing.assert_allclose(out, model(engine.tensor(x)).numpy(), rtol=1e-5, atol=1e-6)
    if opset >= 20:   # the operator reads back as the layer's activation
        loaded = engine.onnx.load(path)
        np.testing.assert_allclose(loaded(engine.tensor(x)).numpy(), out, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_on_a_large_tensor_matches_torch_on_the_gpu(approximate):
    x = np.random.default_rng(5).standard_normal((1024, 4097)).astype(np.float32)
    t = engine.tensor(x, device="cuda", requires_grad=True)
    t.gelu(approximate=approximate).sum().backward()
    xt = torch.tensor(x, device="cuda", requires_grad=True)
    torch.nn.functional.gelu(xt, approximate=approximate).sum().backward()
    np.testing.assert_allclose(t.gelu(approximate=approximate).numpy(),
                               torch.nn.functional.gelu(xt, approximate=approximate)
                               .detach().cpu().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(t.grad.numpy(), xt.grad.cpu().numpy(), rtol=1e-5, atol=1e-6)
