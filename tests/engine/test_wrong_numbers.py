"""Issue 47, "silently wrong numbers": each case here gave a wrong number (or lost one) without
an error before its fix; each is checked against torch's answer or against the exact value."""
import threading

import numpy as np
import pytest

import engine
from engine import nn
from tests.support.op_check import Case, check_op
from tests.support.training_step import training_step


# ------------------------------------------------------------------ a reduction over size-1 axes

@pytest.mark.parametrize("reduce, shape, axis", [
    ("sum", (4, 1), 1),          # a Dense(1) scorer squeezed by .sum(-1)
    ("sum", (4, 1), -1),
    ("mean", (2, 3, 1, 1), (2, 3)),   # a 1x1 global average
    ("sum", (1, 5), 0),
    ("mean", (3, 1, 2), 1),
])
def test_a_reduction_over_size_one_axes_passes_each_gradient_element_back(device, reduce, shape,
                                                                          axis):
    x = engine.tensor(np.zeros(shape), device=device, requires_grad=True)
    out = getattr(x, reduce)(axis=axis)
    g = np.arange(1.0, out.size + 1).reshape(out.shape)
    out.backward(engine.tensor(g, dtype=np.float32, device=device))
    # every reduced axis has size 1: the gradient is g itself, element by element (it was
    # g's first element everywhere)
    np.testing.assert_array_equal(x.grad.numpy(), g.reshape(shape))


def test_expand_reads_the_same_shape_layout_element_by_element():
    from ops import reduce as rd
    g = np.arange(6.0).reshape(3, 2, 1)
    np.testing.assert_array_equal(rd.expand(g, (3, 2, 1), (2,), scale=0.5), g * 0.5)


# ------------------------------------------------------------------ engine.max(a, b) with a Tensor b

def _ties(rng):   # ties and a broadcast: the gradient halves on the tied elements
    a = rng.uniform(-2, 2, size=(3, 4))
    b = rng.uniform(-2, 2, size=(4,))
    a[1, 2] = b[2]
    return [a, b]


CASES = [
    Case("maximum", ((3, 4), (3, 4)), engine.maximum, np.maximum),
    Case("maximum", ((2, 1, 3), (4, 1)), lambda a, b: engine.max(a, b), np.maximum),
    Case("minimum", ((3, 4), (4,)), engine.minimum, np.minimum),
    Case("minimum", ((5,), ()), lambda a, b: a.min(b), np.minimum),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_elementwise_extrema(case, device):
    check_op(case, device)


@pytest.mark.torch
@pytest.mark.parametrize("name", ["max", "min", "maximum", "minimum"])
def test_elementwise_extrema_match_torch_with_ties_and_nan(name):
    torch = pytest.importorskip("torch")
    a, b = _ties(np.random.default_rng(0))
    a[0, 0], b[3] = np.nan, np.nan
    g = np.random.default_rng(1).standard_normal((3, 4))
    ea, eb = (engine.tensor(v, dtype=np.float64, requires_grad=True) for v in (a, b))
    out = getattr(engine, name)(ea, eb)
    out.backward(engine.tensor(g))
    ta, tb = (torch.tensor(v, requires_grad=True) for v in (a, b))
    expected = getattr(torch, name)(ta, tb)
    expected.backward(torch.tensor(g))
    np.testing.assert_array_equal(out.numpy(), expected.detach().numpy())
    np.testing.assert_array_equal(ea.grad.numpy(), ta.grad.numpy())
    np.testing.assert_array_equal(eb.grad.numpy(), tb.grad.numpy())


def test_max_with_an_empty_tensor_is_no_longer_the_input():
    a = engine.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match=r"maximum: shapes \(2,\) and \(0,\) cannot be broadcast"):
        engine.max(a, engine.tensor(np.zeros(0, np.float32)))
    with pytest.raises(TypeError, match="elementwise max"):
        engine.max(a, engine.tensor([3.0, 0.0]), keepdims=True)


# ------------------------------------------------------------------ backwards on several threads

def _in_threads(count, work):
    barrier = threading.Barrier(count)
    errors = []

    def run(k):
        try:
            barrier.wait()
            work(k)
        except BaseException as error:   # reported by the test, not lost in the thread
            errors.append(error)
    threads = [threading.Thread(target=run, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_backwards_on_several_threads_lose_no_gradient_of_a_shared_leaf():
    w = engine.tensor(np.zeros(64), requires_grad=True)

    def work(k):
        for _ in range(50):
            (w * 1.0).sum().backward()
    _in_threads(8, work)
    np.testing.assert_array_equal(w.grad.numpy(), np.full(64, 400.0))   # 180-318 before


def test_backwards_on_several_threads_sum_every_batchs_gradient_into_the_flat_buffer():
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((256, 128)) for _ in range(4)]
    model = nn.Sequential([nn.Dense(256, activation="relu", input_shape=(128,)), nn.Dense(64)])
    model.to(np.float64)

    def loss(batch):
        return (model(engine.tensor(batch, dtype=np.float64)) ** 2).mean()

    expected = {}
    for batch in batches:
        loss(batch).backward()
    for name, p in model.named_parameters():
        expected[name] = p.grad.numpy().copy()
    for trial in range(10):
        for p in model.parameters():
            p.grad = None   # zero_grad: every slot stale, so backwards are handed the slots
        _in_threads(4, lambda k: loss(batches[k]).backward())
        for name, p in model.named_parameters():
            np.testing.assert_allclose(p.grad.numpy(), expected[name], rtol=1e-12, atol=1e-12,
                                       err_msg=f"trial {trial}: {name}")


# ------------------------------------------------------------------ optimizer.step() between backwards

INPLACE = "modified by an inplace operation"


def _retained_loss(model):
    x = engine.tensor(np.random.default_rng(0).standard_normal((5, 4)), dtype=np.float32)
    loss = (model(x) ** 2).mean()
    loss.backward(retain_graph=True)
    return loss


@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
def test_a_step_between_two_backwards_of_a_retained_graph_raises(optimizer):
    import optim
    model = nn.Sequential([nn.Dense(3, input_shape=(4,)), nn.Dense(2)])
    opt = getattr(optim, optimizer)(model.parameters(), lr=0.1)
    loss = _retained_loss(model)
    opt.step()
    grads = [p.grad.numpy().copy() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=INPLACE + ".*dense"):
        loss.backward()   # it used the updated weights
    for p, g in zip(model.parameters(), grads):
        np.testing.assert_array_equal(p.grad.numpy(), g)   # nothing was computed


def test_a_step_of_a_plain_tensor_counts_as_a_write():
    import optim
    w = engine.tensor(np.ones((4, 2)), requires_grad=True)
    x = engine.tensor(np.ones((3, 4)))
    loss = (x @ w).sum()
    loss.backward(retain_graph=True)
    optim.SGD([w], lr=0.1).step()
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward()


def test_a_graph_made_after_the_step_backwards_as_before():
    import optim
    model = nn.Sequential([nn.Dense(3, input_shape=(4,))])
    opt = optim.SGD(model.parameters(), lr=0.1)
    _retained_loss(model)
    opt.step()
    _retained_loss(model).backward()   # versions are taken at the forward: no error


def test_a_replayed_step_counts_as_a_write_too():
    import optim
    model = nn.Sequential([nn.Dense(3, input_shape=(4,))])
    opt = optim.SGD(model.parameters(), lr=0.1)
    x = engine.tensor(np.ones((5, 4), np.float32))
    captured = engine.capture(training_step(opt, lambda batch: (model(batch) ** 2).mean()))
    for _ in range(3):   # eager, recording, replay
        captured(x)
    loss = _retained_loss(model)
    replayed = captured.replayed
    captured(x)          # a replay: no Python runs the update, its sync counts the write
    assert captured.replayed == replayed + 1
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward()


# ------------------------------------------------------------------ files

def test_a_scalar_normalization_round_trips_through_safetensors(tmp_path):
    pytest.importorskip("safetensors")
    model = nn.Sequential([nn.Normalization(mean=0.5, variance=4.0, input_shape=(3,)),
                           nn.Dense(2)])
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    expected = model(x).numpy()
    model.save(tmp_path / "m.safetensors")
    loaded = nn.load(tmp_path / "m.safetensors")
    assert loaded.state_dict()["normalization.mean"].shape == ()
    np.testing.assert_array_equal(loaded(x).numpy(), expected)


def test_an_npz_with_two_entries_of_one_name_is_refused(tmp_path):
    import zipfile
    model = nn.Sequential([nn.Dense(2, input_shape=(3,))])
    path = tmp_path / "m.npz"
    model.save(path)
    with zipfile.ZipFile(path) as archive:
        entries = [(info, archive.read(info)) for info in archive.infolist()]
    name, data = next((info.filename, data) for info, data in entries
                      if info.filename.startswith("dense"))
    doubled = tmp_path / "doubled.npz"
    with zipfile.ZipFile(doubled, "w") as archive, pytest.warns(UserWarning, match="Duplicate"):
        for info, content in entries:
            archive.writestr(info, content)
        archive.writestr(name, data)   # the same entry again: np.load reads the second
    with pytest.raises(ValueError, match=rf"doubled\.npz.*two entries are named '{name}'"):
        nn.load(doubled)


# ------------------------------------------------------------------ engine.interop.torch

def _same_as_torch(module, input_shape, model=None):
    torch = pytest.importorskip("torch")
    from engine.interop import torch as interop
    model = interop.from_sequential(module, input_shape) if model is None else model
    x = np.random.default_rng(0).standard_normal((2, *input_shape)).astype(np.float32)
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(model(x).numpy(), expected, rtol=1e-5, atol=1e-6)
    return model


@pytest.mark.torch
def test_from_sequential_softmax_without_dim_follows_torchs_implicit_dim():
    torch = pytest.importorskip("torch")
    from engine.interop import torch as interop
    torch.manual_seed(0)
    conv = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.Softmax())
    # torch's implicit dim of a 4-D input is 1, the channels: the engine's softmax is over
    # the last axis, so the import refuses instead of normalising the rows
    with pytest.warns(UserWarning, match="Implicit dimension"), pytest.raises(
            ValueError, match=r"module 1 .*dim=None, which torch reads as dim=1 for a 4-d "
                              r"input.*last axis"):
        interop.from_sequential(conv, (2, 5, 5))
    dense = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Softmax())
    with pytest.warns(UserWarning, match="Implicit dimension"):
        _same_as_torch(dense, (3,))   # 2-D: dim 1 is the last axis
    _same_as_torch(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Softmax(dim=1)), (3,))


@pytest.mark.torch
@pytest.mark.parametrize("first", ["linear", "conv"])
def test_from_sequential_leaky_relu_of_negative_slope_computes_torchs(first):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    layer, shape = ((torch.nn.Linear(3, 4), (3,)) if first == "linear"
                    else (torch.nn.Conv2d(2, 3, 3), (2, 5, 5)))
    module = torch.nn.Sequential(layer, torch.nn.LeakyReLU(-0.3))
    model = _same_as_torch(module, shape)
    x = engine.tensor(np.random.default_rng(1).standard_normal((2, *shape)), dtype=np.float32)
    model(x).sum().backward()   # the gradient too: the unfused leaky_relu reads its input
    tx = torch.from_numpy(x.numpy())
    module(tx).sum().backward()
    np.testing.assert_allclose(model.layers[0].weight.grad.numpy(),
                               layer.weight.grad.numpy().T if first == "linear"
                               else layer.weight.grad.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.torch
@pytest.mark.parametrize("activation", ["gelu", "silu"])
def test_to_sequential_converts_gelu_and_silu_and_back(activation):
    pytest.importorskip("torch")
    from engine.interop import torch as interop
    model = nn.Sequential([nn.Dense(4, activation=activation, input_shape=(3,)),
                           nn.Activation(activation)])
    module = interop.to_sequential(model)   # was KeyError
    _same_as_torch(module, (3,), model)
    _same_as_torch(module, (3,))            # and back through from_sequential


# ------------------------------------------------------------------ ONNX import

def _onnx_graph(nodes, constants, input_shape, dtype=np.float32, opset=17):
    onnx = pytest.importorskip("onnx")
    from onnx import helper, numpy_helper
    element = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(
        [helper.make_node(op, inputs, outputs, **attributes)
         for op, inputs, outputs, attributes in nodes], "g",
        [helper.make_tensor_value_info("x", element, [None, *input_shape])],
        [helper.make_tensor_value_info("y", element, None)],
        [numpy_helper.from_array(np.asarray(value, dtype), name)
         for name, value in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _import_and_run(tmp_path, proto, x):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    path = str(tmp_path / "m.onnx")
    onnx.save(proto, path)
    expected = ort.InferenceSession(path).run(None, {"x": x})[0]
    model = engine.onnx.load(path)
    return model(engine.tensor(x, dtype=x.dtype)).numpy(), expected


@pytest.mark.parametrize("divisor", [-2.0, 3.0, 0.1, -0.7, [0.5, 0.25, 4.0], [-0.5, -3.0, -4.0]])
def test_onnx_div_by_a_constant_imports_as_the_exact_division(tmp_path, divisor):
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    proto = _onnx_graph([("Div", ["x", "c"], ["y"], {})], {"c": divisor}, (3,))
    got, expected = _import_and_run(tmp_path, proto, x)
    np.testing.assert_array_equal(got, expected)   # -2 lost its sign before


@pytest.mark.parametrize("divisor, what", [(1e-8, r"\[1e-08\]"), (0.0, r"\[0.0\]"),
                                           ([2.0, -2.0, 1.0], r"\[2.0, -2.0, 1.0\]")])
def test_onnx_div_without_an_exact_layer_is_refused(tmp_path, divisor, what):
    proto = _onnx_graph([("Div", ["x", "c"], ["y"], {})], {"c": divisor}, (3,))
    path = str(tmp_path / "m.onnx")
    pytest.importorskip("onnx").save(proto, path)
    with pytest.raises(ValueError, match=r"node .*\(Div\): divides by the constant " + what):
        engine.onnx.load(path)   # 1e-8 was floored to 1e-7


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
@pytest.mark.parametrize("size", [7, 8, 9])
def test_onnx_conv_same_padding_follows_the_input_size(tmp_path, auto_pad, size):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2, size, size)).astype(np.float32)
    proto = _onnx_graph([("Conv", ["x", "w"], ["y"], {"auto_pad": auto_pad, "strides": [2, 2],
                                                      "kernel_shape": [3, 3]})],
                        {"w": rng.standard_normal((3, 2, 3, 3))}, (2, size, size))
    # ONNX pads a total of (ceil(n / 2) - 1) * 2 + 3 - n: 1 for an even side, split
    # (0, 1) by SAME_UPPER and (1, 0) by SAME_LOWER; 0 or 2 (1, 1) for an odd one
    if auto_pad == "SAME_UPPER" and size % 2 == 0:
        path = str(tmp_path / "m.onnx")
        pytest.importorskip("onnx").save(proto, path)
        with pytest.raises(ValueError, match=r"pads \[0, 0, 1, 1\] .*no symmetric padding"):
            engine.onnx.load(path)   # was read as 1 on each side: wrong numbers
        return
    got, expected = _import_and_run(tmp_path, proto, x)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_onnx_float64_graph_keeps_its_dtype(tmp_path):
    x = np.random.default_rng(0).standard_normal((4, 3))
    proto = _onnx_graph([("Mul", ["x", "s"], ["a"], {}), ("Add", ["a", "o"], ["b"], {}),
                         ("Sub", ["b", "m"], ["c"], {}), ("Div", ["c", "d"], ["y"], {})],
                        {"s": 3.0, "o": 0.25, "m": 0.1, "d": 1.5}, (3,), dtype=np.float64)
    got, expected = _import_and_run(tmp_path, proto, x)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_engines_own_export_reads_back_gelu_and_float64(tmp_path, dtype):
    pytest.importorskip("onnx")
    model = nn.Sequential([nn.Rescaling(0.5, input_shape=(3,)), nn.Normalization(0.2, 4.0),
                           nn.Dense(4, activation="gelu"), nn.Activation("gelu")])
    model.to(dtype)
    model.export_onnx(tmp_path / "m.onnx")   # opset 17: GELU as its erf composition
    loaded = engine.onnx.load(tmp_path / "m.onnx")
    x = engine.tensor(np.random.default_rng(0).standard_normal((5, 3)), dtype=dtype)
    np.testing.assert_allclose(loaded(x).numpy(), model(x).numpy(), rtol=1e-6, atol=1e-7)
    assert [type(layer).__name__ for layer in loaded.layers] == [
        "Rescaling", "Normalization", "Dense", "Activation"]
