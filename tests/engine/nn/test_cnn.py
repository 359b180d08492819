"""The convolutional layers of engine.nn and their functional twins: shapes inferred at add
time, summary rows, save/load and state_dict with BatchNorm's running statistics, the
train/eval switch, bad input naming the layer, and a small CNN that learns (CPU; one tiny
``cuda`` test for the simulator). The kernels themselves are tested in tests/ops/test_conv.py."""
import numpy as np
import pytest

import data
import engine
import optim
from engine import nn
from engine.losses import cross_entropy
from engine.train import evaluate, fit


def tiny_cnn(dtype=np.float32):
    """The API page's network, shrunk to 1x8x8 images and few channels."""
    return nn.Sequential([
        nn.Reshape((1, 8, 8), input_shape=(8, 8)),
        nn.Conv2D(4, 3, padding="same", activation="relu", dtype=dtype),
        nn.MaxPool2D(2),
        nn.Conv2D(6, 3, padding="same", activation="relu", dtype=dtype),
        nn.BatchNorm(dtype=dtype),
        nn.AvgPool2D(2),
        nn.Flatten(),
        nn.Dense(3, dtype=dtype),
    ])


def stripes(count, seed=0):
    """8x8 images of one of three classes: a horizontal bar, a vertical bar, or a diagonal,
    at a random offset, with noise."""
    rng = np.random.default_rng(seed)
    labels = np.arange(count) % 3
    images = rng.normal(0, 0.3, (count, 8, 8)).astype(np.float32)
    for image, label, offset in zip(images, labels, rng.integers(1, 7, count)):
        if label == 0:
            image[offset, 1:7] += 2
        elif label == 1:
            image[1:7, offset] += 2
        else:
            image[np.arange(8), np.arange(8)] += 2
    return images, labels


def test_shapes_are_inferred_at_add_time_and_summarised():
    model = tiny_cnn()
    assert [layer.output_shape for layer in model.layers] == [
        (1, 8, 8), (4, 8, 8), (4, 4, 4), (6, 4, 4), (6, 4, 4), (6, 2, 2), (24,), (3,)]
    text = model.summary()
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.split() and line.split()[-1].replace(",", "").isdigit()}
    conv2 = 6 * 4 * 9 + 6
    assert rows["conv2d_1"][2:] == ["(None,", "6,", "4,", "4)", f"{conv2}"]
    assert rows["batchnorm"][-1] == "24"   # weight, bias and both running statistics
    trainable = 4 * 9 + 4 + conv2 + 2 * 6 + 24 * 3 + 3
    assert f"Trainable params: {trainable:,}" in text
    assert "Non-trainable params: 12" in text   # running mean and variance, 6 each
    assert f"Total params: {trainable + 12:,}" in text
    assert model(engine.randn(5, 8, 8, seed=1)).shape == (5, 3)


def test_conv2d_layer_options_give_torch_s_output_shapes():
    cases = [(nn.Conv2D(5, (3, 2), stride=2, padding=1), (5, 4, 5)),
             (nn.Conv2D(4, 3, dilation=2, groups=2), (4, 3, 5)),
             (nn.Conv2D(3, 2, padding="same"), (3, 7, 9)),
             (nn.MaxPool2D(3, stride=2, padding=1), (2, 4, 5)),
             (nn.AvgPool2D((2, 3)), (2, 3, 3))]
    for layer, shape in cases:
        model = nn.Sequential([nn.Reshape((2, 7, 9), input_shape=(126,)), layer])
        assert model.output_shape == shape, layer
        assert model(engine.randn(2, 126, seed=0)).shape == (2,) + shape


def test_conv2d_layer_equals_the_functional_op_with_its_activation():
    layer = nn.Conv2D(4, 3, stride=2, padding=1, activation="tanh")
    x = engine.randn(2, 3, 7, 9, seed=3)
    y = layer(x)
    expected = engine.conv2d(x, layer.weight, layer.bias, stride=2, padding=1).tanh()
    np.testing.assert_allclose(y.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)
    assert layer.weight.shape == (4, 3, 3, 3)   # torch's layout


def test_conv2d_weights_have_he_variance_for_relu_and_zero_bias():
    engine.manual_seed(0)
    layer = nn.Conv2D(64, 5, activation="relu")
    layer.build((16, 9, 9))
    fan_in = 16 * 5 * 5
    assert layer.weight.numpy().std() == pytest.approx(np.sqrt(2 / fan_in), rel=0.05)
    assert not layer.bias.numpy().any()


def test_functional_batch_norm_as_torch_without_running_statistics():
    x = engine.randn(6, 3, 4, 5, seed=2) * 3 + 1
    y = engine.batch_norm(x, None, None, bias=engine.ones(3), training=True).numpy()
    np.testing.assert_allclose(y.mean(axis=(0, 2, 3)), 1, atol=1e-5)
    np.testing.assert_allclose(y.std(axis=(0, 2, 3)), 1, rtol=1e-3)
    with pytest.raises(ValueError, match="pass running_mean and running_var"):
        engine.batch_norm(x, None, None)


def test_batch_norm_switches_with_train_and_eval():
    model = nn.Sequential([nn.BatchNorm(momentum=0.5, input_shape=(3,))])
    norm = model.layers[0]
    x = engine.tensor(np.array([[1.0, 2, 3], [3, 6, 9]], np.float32))
    y = model(x).numpy()
    np.testing.assert_allclose(y, [[-1, -1, -1], [1, 1, 1]], atol=1e-3)   # batch statistics
    np.testing.assert_allclose(norm.running_mean.numpy(), [1, 2, 3])       # 0.5 of (2, 4, 6)
    np.testing.assert_allclose(norm.running_var.numpy(), [1.5, 4.5, 9.5])  # unbiased: 2, 8, 18
    model.eval()
    expected = (x.numpy() - [1, 2, 3]) / np.sqrt(np.array([1.5, 4.5, 9.5]) + 1e-5)
    np.testing.assert_allclose(model(x).numpy(), expected, rtol=1e-5)
    np.testing.assert_allclose(norm.running_mean.numpy(), [1, 2, 3])       # not updated
    model.train()
    model(x)
    np.testing.assert_allclose(norm.running_mean.numpy(), [1.5, 3, 4.5])


def test_running_statistics_are_buffers_not_parameters():
    model = tiny_cnn()
    names = [name for name, _ in model.named_parameters()]
    assert "batchnorm.weight" in names and "batchnorm.running_mean" not in names
    assert [name for name, _ in model.named_buffers()] == ["batchnorm.running_mean",
                                                           "batchnorm.running_var"]
    optimizer = optim.SGD(model.parameters(), lr=0.1)
    cross_entropy(model(engine.randn(4, 8, 8, seed=0)), np.arange(4) % 3).backward()
    optimizer.step()
    for _, buffer in model.named_buffers():
        assert not buffer.requires_grad and buffer.grad is None


def test_save_and_load_round_trip_the_running_statistics(tmp_path):
    model = tiny_cnn()
    for seed in range(3):   # training steps move the running statistics off zeros and ones
        model(engine.randn(4, 8, 8, seed=seed))
    path = tmp_path / "cnn.npz"
    model.save(path)
    loaded = nn.load(path)
    assert repr(loaded) == repr(model)
    state, reloaded = model.state_dict(), loaded.state_dict()
    assert state.keys() == reloaded.keys()
    assert state["batchnorm.running_mean"].any()
    for name, value in state.items():
        np.testing.assert_array_equal(reloaded[name], value, err_msg=name)
    x = engine.randn(3, 8, 8, seed=9)
    np.testing.assert_array_equal(loaded.eval()(x).numpy(), model.eval()(x).numpy())
    snapshot = state["batchnorm.running_mean"].copy()
    model.train()(engine.randn(4, 8, 8, seed=5))   # a state_dict is a copy: training moves on
    np.testing.assert_array_equal(state["batchnorm.running_mean"], snapshot)
    assert not np.array_equal(model.state_dict()["batchnorm.running_mean"], snapshot)


def test_load_state_dict_writes_buffers_in_place_and_checks_them():
    model = tiny_cnn()
    norm = model.layers[4]
    buffer = norm.running_var.data
    state = model.state_dict()
    state["batchnorm.running_var"] = np.full(6, 2.0)
    model.load_state_dict(state)
    assert norm.running_var.data is buffer
    np.testing.assert_array_equal(norm.running_var.numpy(), np.full(6, 2, np.float32))
    state["batchnorm.running_mean"] = np.zeros(5)
    with pytest.raises(ValueError, match="'batchnorm.running_mean' has shape"):
        model.load_state_dict(state)
    del state["batchnorm.running_mean"]
    with pytest.raises(KeyError, match="batchnorm.running_mean"):
        model.load_state_dict(state)


def test_float64_layers():
    model = tiny_cnn(np.float64)
    assert {p.dtype for p in model.parameters()} == {np.dtype(np.float64)}
    assert model(engine.randn(2, 8, 8, dtype=np.float64, seed=0)).dtype == np.float64
    assert nn.Conv2D(2, 3, dtype=np.float64).get_config()["dtype"] == "float64"


@pytest.mark.parametrize("layers, message", [
    ([nn.Flatten(input_shape=(8, 8)), nn.Conv2D(2, 3)],
     r"Conv2D takes inputs of shape \(None, channels, height, width\), got \(None, 64\); "
     r"add nn.Reshape"),
    ([nn.Reshape((1, 4, 4), input_shape=(16,)), nn.Conv2D(2, 5)],
     r"padded input \(4x4\) is smaller than the dilated kernel \(5x5\)"),
    ([nn.Reshape((3, 4, 4), input_shape=(48,)), nn.Conv2D(2, 3, groups=2)],
     r"filters \(2\) must divide by groups|3 input channels must divide by groups"),
    ([nn.Reshape((1, 3, 3), input_shape=(9,)), nn.MaxPool2D(4)],
     r"pool_size 4 does not fit in the padded input \(3x3\)"),
    ([nn.Reshape((1, 5, 5), input_shape=(24,))],
     r"cannot reshape \(None, 24\) \(24 values per sample\) to \(None, 1, 5, 5\)"),
    ([nn.Flatten(input_shape=(2, 3, 4, 5)), nn.Reshape((-1, 2, 3, 4)), nn.BatchNorm()],
     r"BatchNorm takes inputs of shape \(None, features\)"),
])
def test_a_layer_that_cannot_take_its_input_fails_at_add_time(layers, message):
    with pytest.raises(ValueError, match=message):
        nn.Sequential(layers)


@pytest.mark.parametrize("make, message", [
    (lambda: nn.Conv2D(0, 3), "filters must be a positive int"),
    (lambda: nn.Conv2D(4, 3, activation="softmax"), "unknown activation 'softmax'"),
    (lambda: nn.Conv2D(4, 3, stride=2, padding="same"), "padding='same' needs stride 1"),
    (lambda: nn.Conv2D(4, (3, 3, 3)), "kernel_size must be an int or a pair"),
    (lambda: nn.Conv2D(4, 3, activation="leaky_relu", alpha=-0.1), "alpha must be >= 0"),
    (lambda: nn.MaxPool2D(2, padding=2), "padding 2 must be at most half of pool_size 2"),
    (lambda: nn.AvgPool2D(0), "pool_size must be >= 1"),
    (lambda: nn.BatchNorm(momentum=1.5), r"momentum must be a number in \[0, 1\]"),
    (lambda: nn.BatchNorm(eps=0), "eps must be a number > 0"),
    (lambda: nn.Reshape((1, -1, -1)), "one of them may be -1"),
])
def test_bad_layer_arguments_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_errors_at_call_time_name_the_layer_and_shapes():
    norm = nn.BatchNorm()
    with pytest.raises(ValueError, match=r"batchnorm BatchNorm\(.*\): batch_norm: training "
                                         r"needs more than one value per channel, got x \(1, 3\)"):
        norm(engine.randn(1, 3, seed=0))
    conv = nn.Conv2D(2, 3)
    conv(engine.randn(1, 1, 5, 5, seed=0))
    with pytest.raises(TypeError, match=r"conv2d Conv2D\(.*\): input dtype float64"):
        conv(engine.randn(1, 1, 5, 5, dtype=np.float64, seed=0))


def test_a_small_cnn_learns_stripes_and_its_checkpoint_resumes(tmp_path):
    images, labels = stripes(192)
    test_images, test_labels = stripes(96, seed=1)
    model = tiny_cnn()
    optimizer = optim.Adam(model.parameters(), lr=0.02)
    loader = data.DataLoader(images, labels, batch_size=32, shuffle=True, seed=0)
    test_loader = data.DataLoader(test_images, test_labels, batch_size=96)
    history = fit(model, loader, optimizer, cross_entropy, 4, test_loader=test_loader,
                  progress=False, verbose=False)
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]
    assert history[-1]["test_acc"] >= 0.9
    assert evaluate(model, test_loader) == history[-1]["test_acc"]   # eval: running stats
    assert model.training   # evaluate restores train mode


@pytest.mark.cuda
def test_a_tiny_cnn_step_on_cuda_matches_the_cpu():
    images, labels = stripes(4)
    results = {}
    for device in ("cpu", "cuda"):
        engine.manual_seed(0)
        model = nn.Sequential([
            nn.Reshape((1, 8, 8), input_shape=(8, 8)),
            nn.Conv2D(2, 3, padding="same", activation="relu"),
            nn.MaxPool2D(2), nn.BatchNorm(), nn.AvgPool2D(2), nn.Flatten(), nn.Dense(3),
        ]).to(device)
        assert all(buffer.device == device for _, buffer in model.named_buffers())
        optimizer = optim.SGD(model.parameters(), lr=0.1)
        loss = cross_entropy(model(engine.tensor(images, device=device)),
                             engine.tensor(labels, device=device))
        loss.backward()
        optimizer.step()
        results[device] = (loss.item(), model.state_dict())
        model.to("cpu")   # the running statistics move back with the weights
        np.testing.assert_array_equal(model.layers[3].running_var.numpy(),
                                      results[device][1]["batchnorm.running_var"])
    assert results["cuda"][0] == pytest.approx(results["cpu"][0], rel=1e-5)
    for name, value in results["cpu"][1].items():
        np.testing.assert_allclose(results["cuda"][1][name], value, rtol=1e-4, atol=1e-6,
                                   err_msg=name)


@pytest.mark.parametrize("layers", [
    [nn.Reshape((2, 7, 9), input_shape=(126,)),
     nn.Conv2D(4, (3, 2), stride=2, padding=1, activation="tanh"), nn.BatchNorm(),
     nn.MaxPool2D(2, padding=1), nn.Flatten(), nn.BatchNorm(), nn.Dense(3)],
    [nn.Reshape((2, 7, 9), input_shape=(126,)),
     nn.Conv2D(4, 2, padding="same", dilation=2, groups=2, use_bias=False,
               activation="leaky_relu"),
     nn.AvgPool2D(3, stride=2, padding=1), nn.Flatten()],
], ids=["conv-batchnorm-maxpool", "same-even-kernel-groups-avgpool"])
def test_the_layers_export_to_onnx_and_run_as_in_the_engine(tmp_path, layers):
    pytest.importorskip("onnx", reason="needs onnx: pip install -e '.[onnx]'")
    onnxruntime = pytest.importorskip("onnxruntime", reason="needs onnxruntime")
    model = nn.Sequential(layers)
    for seed in range(3):   # running statistics away from zeros and ones
        model(engine.randn(5, 126, seed=seed))
    model.eval()
    x = np.random.default_rng(0).normal(size=(5, 126)).astype(np.float32)
    path = tmp_path / "cnn.onnx"
    model.export_onnx(path)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (outputs,) = session.run(None, {"input": x})
    np.testing.assert_allclose(outputs, model(engine.tensor(x)).numpy(), atol=1e-5)


def test_a_captured_cnn_step_equals_the_eager_one_bit_for_bit():
    """BatchNorm updates its running statistics in place inside a replayed step, as eager."""
    images, labels = stripes(96)
    outcomes = []
    for capture in (True, False):
        engine.manual_seed(0)
        model = tiny_cnn()
        loader = data.DataLoader(images, labels, batch_size=32, shuffle=True, seed=0)
        history = fit(model, loader, optim.Adam(model.parameters(), lr=0.01), cross_entropy,
                      2, progress=False, verbose=False, capture=capture)
        assert fit.last_eager_reason is None   # the captured steps were replayed
        outcomes.append(([record["loss"] for record in history], model.state_dict()))
    (captured_losses, captured), (eager_losses, eager) = outcomes
    assert captured_losses == eager_losses
    for name, value in eager.items():
        np.testing.assert_array_equal(captured[name], value, err_msg=name)


@pytest.mark.gpu
def test_the_cli_cnn_captured_on_the_gpu_equals_its_eager_fit_bit_for_bit():
    """The network of ``--model cnn`` at batch 128 with a short last batch (the conv GEMMs'
    batch is read from the arrays): its captured fit replays what eager runs, bit for bit."""
    from engine.models import build_cnn
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (300, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, 300)
    outcomes = []
    for capture in (True, False):
        engine.manual_seed(0)
        model = build_cnn((28, 28), 10).to("cuda")
        loader = data.DataLoader(images, labels, batch_size=128, shuffle=True, seed=0,
                                 device="cuda", normalize=(0.13, 0.31))
        history = fit(model, loader, optim.Adam(model.parameters()), cross_entropy, 2,
                      progress=False, verbose=False, capture=capture)
        if capture:
            assert fit.last_eager_reason is None
        outcomes.append(([record["loss"] for record in history], model.state_dict()))
    (captured_losses, captured), (eager_losses, eager) = outcomes
    assert captured_losses == eager_losses
    for name, value in eager.items():
        np.testing.assert_array_equal(captured[name], value, err_msg=name)


def test_bench_cnn_jax_rows_train_the_same_network():
    """bench.cnn's JAX rows start from the engine's weights and see its batches: the same
    test accuracy, nearly (fp32 sums in other orders)."""
    pytest.importorskip("jax", reason="needs jax: pip install -e '.[bench]'")
    from bench import cnn
    result = cnn.run("cpu", 1, 128, eager=False)
    rows = result["results"]
    for name in ("jax", "jax scan"):
        assert rows[name]["s_per_epoch"] > 0 and rows[name]["version"]
        assert abs(rows[name]["test_acc"] - rows["engine"]["test_acc"]) <= 2 / 128, name
    assert "| JAX " in cnn.format_table(result)
