"""ONNX import of graphs that are not chains into a ``GraphModel``: the traced export's GPT and
attention, torch's MultiheadAttention, against onnxruntime and the originals (ONNX's node
cases: test_onnx_graph_cases.py); trained, saved and loaded back; refused naming the node."""
import collections
import warnings

import numpy as np
import pytest

import engine
from engine import nn, optim
from engine import onnx as engine_onnx
from engine.losses import cross_entropy
from engine.models import build_gpt

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import helper  # noqa: E402


def _onnxruntime(path, feeds):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _gpt():
    engine.manual_seed(0)
    return build_gpt(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.0)


def test_the_gpt_imports_and_computes_what_onnxruntime_and_the_original_compute(tmp_path):
    model, path = _gpt(), tmp_path / "gpt.onnx"
    ids = np.random.default_rng(0).integers(0, 11, (3, 8))
    engine_onnx.export(model, path, example=ids[:2])
    loaded = engine_onnx.load(path)
    assert isinstance(loaded, engine_onnx.GraphModel)
    (expected,) = _onnxruntime(path, {"input": ids})   # 3 rows: the batch stays open
    got = loaded.eval()(engine.tensor(ids)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, model.eval()(engine.tensor(ids)).numpy(), rtol=1e-5,
                               atol=1e-5)
    kinds = collections.Counter(type(layer).__name__ for layer in loaded.layers)
    assert kinds == {"Embedding": 2, "LayerNorm": 5, "Dense": 8}
    activations = [entry["config"].get("activation") for entry in loaded.layer_configs]
    assert activations.count("gelu") == 2   # each MLP's GELU runs in its Dense's kernel
    # the head reads the token table transposed: one parameter, as in the original
    assert loaded.aliases["tokens.weight"] == [0, "weight"]
    assert sum(p.size for p in loaded.parameters()) == sum(p.size for p in model.parameters())


def test_the_imported_gpt_trains_with_the_original_s_gradients(tmp_path):
    model, path = _gpt(), tmp_path / "gpt.onnx"
    ids = np.random.default_rng(1).integers(0, 11, (2, 8))
    engine_onnx.export(model, path, example=ids)
    loaded = engine_onnx.load(path)
    weights = engine.tensor(np.random.default_rng(2).standard_normal((2, 8, 11)).astype(
        np.float32))
    for network in (model, loaded):
        network.eval()
        (network(engine.tensor(ids)) * weights).sum().backward()
    for name, parameter in model.named_parameters():
        imported = loaded._value({}, name)   # the layer's parameter, or the graph's own
        assert any(imported is trained for trained in loaded.parameters()), name
        np.testing.assert_allclose(imported.grad.numpy(), parameter.grad.numpy(), rtol=1e-4,
                                   atol=1e-5, err_msg=name)


def test_the_imported_gpt_trains_captured_as_eagerly(tmp_path):
    ids = np.random.default_rng(22).integers(0, 11, (4, 8))
    engine_onnx.export(_gpt(), tmp_path / "gpt.onnx", example=ids)
    x, y = engine.tensor(ids), engine.tensor(np.roll(ids, -1, axis=1).reshape(-1))
    runs = []
    for capture in (False, True):
        model = engine_onnx.load(tmp_path / "gpt.onnx")
        opt = optim.Adam(model.parameters(), lr=1e-2)

        def step(xb, yb):
            opt.zero_grad()
            loss = cross_entropy(model(xb).reshape(-1, 11), yb)
            loss.backward()
            opt.step()
            return loss
        run = engine.capture(step) if capture else step
        runs.append(([run(x, y).item() for _ in range(5)], model.state_dict()))
        assert getattr(run, "eager_reason", None) is None   # every later call replayed
    (eager, eager_state), (captured, captured_state) = runs
    assert captured == eager and eager[-1] < eager[0]
    for name, value in eager_state.items():
        np.testing.assert_array_equal(captured_state[name], value, err_msg=name)


class MaskedAttention(nn.Model):
    """Attention with a float mask of its own: the export writes it as an added constant."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.q, self.k, self.v = nn.Dense(4), nn.Dense(4), nn.Dense(4)

    def forward(self, x):
        mask = np.where(np.random.default_rng(0).random((5, 5)) < 0.3, -1e4, 0.5)
        return engine.scaled_dot_product_attention(self.q(x), self.k(x), self.v(x),
                                                   attn_mask=mask.astype(np.float32))


def test_attention_s_composition_is_read_as_one_fused_op(tmp_path):
    model, path = _gpt(), tmp_path / "gpt.onnx"
    ids = np.random.default_rng(19).integers(0, 11, (2, 8))
    engine_onnx.export(model, path, example=ids)
    fused = [node for node in engine_onnx.load(path).nodes if node[1] == "engine.attention"]
    assert len(fused) == 2 and all(node[4]["causal"] for node in fused)   # no mask kept
    engine.manual_seed(20)
    masked, path = MaskedAttention(), tmp_path / "masked.onnx"
    x = np.random.default_rng(21).standard_normal((2, 5, 6)).astype(np.float32)
    engine_onnx.export(masked, path, example=x)
    loaded = engine_onnx.load(path)
    (node,) = [node for node in loaded.nodes if node[1] == "engine.attention"]
    assert not node[4]["causal"] and node[2][3]   # the mask read as the file stores it
    (expected,) = _onnxruntime(path, {"input": x})
    np.testing.assert_allclose(loaded(engine.tensor(x)).numpy(), expected, rtol=1e-5,
                               atol=1e-5)


class Attention(nn.Model):
    """A pre-norm self-attention block and a head: residual Add, LayerNorm, attention."""

    def __init__(self, causal=False, **kwargs):
        super().__init__(**kwargs)
        self.causal = causal
        self.norm = nn.LayerNorm()
        self.attention = nn.MultiHeadAttention(2, causal=causal)
        self.head = nn.Dense(3)

    def forward(self, x):
        return self.head(x + self.attention(self.norm(x)))

    def get_config(self):
        return {"causal": self.causal}


@pytest.mark.parametrize("causal", [False, True])
def test_multi_head_attention_imports_and_matches(tmp_path, causal):
    engine.manual_seed(3)
    model, path = Attention(causal), tmp_path / "attention.onnx"
    x = np.random.default_rng(4).standard_normal((3, 5, 8)).astype(np.float32)
    proto = engine_onnx.export(model, path, example=x)
    operators = {node.op_type for node in proto.graph.node}
    assert {"MatMul", "Transpose", "Softmax", "Gather"} <= operators
    loaded = engine_onnx.load(path).eval()
    (expected,) = _onnxruntime(path, {"input": x})
    got = loaded(engine.tensor(x)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, model.eval()(engine.tensor(x)).numpy(), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.cuda
def test_an_imported_attention_graph_runs_and_trains_on_cuda_as_on_the_cpu(tmp_path):
    engine.manual_seed(12)
    model, path = Attention(causal=True), tmp_path / "attention.onnx"
    x = np.random.default_rng(13).standard_normal((1, 3, 4)).astype(np.float32)
    engine_onnx.export(model, path, example=x)
    results = []
    for device in ("cpu", "cuda"):
        loaded = engine_onnx.load(path).to(device)
        y = loaded(engine.tensor(x, device=device))
        y.sum().backward()
        results.append((y.numpy(), [p.grad.numpy() for p in loaded.parameters()]))
    (cpu, cpu_grads), (cuda, cuda_grads) = results
    np.testing.assert_allclose(cuda, cpu, rtol=1e-5, atol=1e-6)
    for on_cuda, on_cpu in zip(cuda_grads, cpu_grads):
        np.testing.assert_allclose(on_cuda, on_cpu, rtol=1e-4, atol=1e-6)


def _torch_attention_file(path, exporter):
    """A torch module around a causal ``torch.nn.MultiheadAttention`` (its mask becomes
    Where or an additive mask, a masked_fill Greater and Where) written by torch's exporter:
    the TorchScript one with the batch fixed ("fixed") or open ("dynamic"), or the
    torch.export-based one ("dynamo", the batch open); the module."""
    torch = pytest.importorskip("torch")

    class TorchAttention(torch.nn.Module):   # causal by a bool mask; a masked_fill
        def __init__(self):
            super().__init__()
            self.attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = torch.nn.Linear(8, 3)
            self.register_buffer("mask", torch.ones(5, 5, dtype=torch.bool).triu(1))

        def forward(self, x):
            y, _ = self.attention(x, x, x, attn_mask=self.mask, need_weights=False)
            return self.head(torch.relu(y).masked_fill(x > 1.0, 0.0) + x)

    torch.manual_seed(0)
    module = TorchAttention().eval()
    x = torch.randn(2, 5, 8)
    options = {"fixed": {"dynamo": False},
               "dynamic": {"dynamo": False, "dynamic_axes": {"input": {0: "batch"},
                                                             "output": {0: "batch"}}},
               "dynamo": {"dynamo": True, "verbose": False,
                          "dynamic_shapes": ({0: torch.export.Dim("batch")},)}}[exporter]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, (x,), str(path), input_names=["input"],
                              output_names=["output"], opset_version=18, **options)
    except Exception as error:   # an exporter that needs what is not installed here
        pytest.skip(f"torch.onnx.export ({exporter}) failed here: {type(error).__name__}: "
                    f"{error}")
    return torch, module


@pytest.mark.parametrize("exporter", ["fixed", "dynamic", "dynamo"])
def test_torch_multihead_attention_exported_by_torch_imports_and_matches(tmp_path, exporter):
    path = tmp_path / "torch_attention.onnx"
    torch, module = _torch_attention_file(path, exporter)
    loaded = engine_onnx.load(path).eval()
    batch = 2 if exporter == "fixed" else 4   # the fixed graph's Reshapes hold its batch of 2
    x = np.random.default_rng(5).standard_normal((batch, 5, 8)).astype(np.float32)
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    got = loaded(engine.tensor(x)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    (runtime,) = _onnxruntime(path, {"input": x})
    np.testing.assert_allclose(got, runtime, rtol=1e-5, atol=1e-5)
    expected_size = sum(p.numel() for p in module.parameters())
    if exporter == "dynamo":   # its optimiser drops the out projection's bias, all zeros
        stored = {tensor.name for tensor in onnx.load(path).graph.initializer}
        bias = module.attention.out_proj.bias
        assert "attention.out_proj.bias" not in stored and not bias.any()
        expected_size -= bias.numel()
    assert sum(p.size for p in loaded.parameters()) == expected_size


def test_a_torch_residual_convnet_imports_with_its_layers(tmp_path):
    """torch stores a fresh BatchNorm's running variance and mean as Identity copies of its
    equal weight and bias: the BatchNorm layer holds them all."""
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.norm = torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
            self.conv2, self.pool = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.MaxPool2d(2)
            self.head = torch.nn.Linear(36, 5)

        def forward(self, x):
            h = torch.relu(self.norm(self.conv1(x)))
            return self.head(torch.flatten(self.pool(h + self.conv2(h)), 1))

    torch.manual_seed(1)
    module, path = Net().eval(), tmp_path / "convnet.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randn(2, 2, 6, 6),), str(path), dynamo=False,
                          input_names=["input"], output_names=["output"],
                          dynamic_axes={"input": {0: "n"}, "output": {0: "n"}},
                          do_constant_folding=False)
    loaded = engine_onnx.load(path).eval()
    assert [type(layer).__name__ for layer in loaded.layers] == [
        "Conv2D", "BatchNorm", "Conv2D", "MaxPool2D", "Dense"]
    x = np.random.default_rng(16).standard_normal((3, 2, 6, 6)).astype(np.float32)
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(loaded(engine.tensor(x)).numpy(), expected, rtol=1e-5,
                               atol=1e-5)
    assert sum(p.size for p in loaded.parameters()) == sum(
        p.numel() for p in module.parameters())


class Residual(nn.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stem, self.block, self.head = nn.Dense(6), nn.Dense(6, "tanh"), nn.Dense(2)

    def forward(self, x):
        return self.head(self.stem(x) + self.block(self.stem(x)))


@pytest.mark.parametrize("suffix", ["safetensors", "npz"])
def test_an_imported_graph_saves_and_loads_with_its_outputs(tmp_path, suffix):
    gpt, gpt_path = _gpt(), tmp_path / "gpt.onnx"
    ids = np.random.default_rng(6).integers(0, 11, (2, 8))
    engine_onnx.export(gpt, gpt_path, example=ids)
    engine.manual_seed(7)
    residual, residual_path = Residual(), tmp_path / "residual.onnx"
    x = np.random.default_rng(8).standard_normal((4, 3)).astype(np.float32)
    engine_onnx.export(residual, residual_path, example=x)
    for path, given in ((gpt_path, ids), (residual_path, x)):
        imported = engine_onnx.load(path).eval()
        saved = tmp_path / f"{path.stem}.{suffix}"
        imported.save(saved)
        reloaded = nn.load(saved).eval()
        assert type(reloaded) is engine_onnx.GraphModel
        assert reloaded.aliases == imported.aliases
        np.testing.assert_array_equal(reloaded(engine.tensor(given)).numpy(),
                                      imported(engine.tensor(given)).numpy())


def test_a_fixed_shape_torch_graph_saves_and_loads(tmp_path):
    path = tmp_path / "torch_attention.onnx"
    _torch_attention_file(path, "fixed")
    imported = engine_onnx.load(path).eval()
    imported.save(tmp_path / "attention.safetensors")
    reloaded = nn.load(tmp_path / "attention.safetensors").eval()
    x = np.random.default_rng(9).standard_normal((2, 5, 8)).astype(np.float32)
    np.testing.assert_array_equal(reloaded(engine.tensor(x)).numpy(),
                                  imported(engine.tensor(x)).numpy())
    # the file fixed the batch at 2 in its Reshape targets: another batch names the node
    with pytest.raises(ValueError, match=r"node '/attention/Reshape.*' \(Reshape\)"):
        imported(engine.tensor(x[:1]))


class Shared(nn.Model):   # two inputs through one Dense: two Gemms of the same weights

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.shared, self.norm = nn.Dense(5, activation="relu"), nn.LayerNorm()

    def forward(self, a, b):
        return self.norm(self.shared(a) * self.shared(b)) - b[:, :5]


def test_two_inputs_through_one_shared_layer_import_into_one_layer(tmp_path):
    engine.manual_seed(14)
    model, path = Shared(), tmp_path / "shared.onnx"
    rng = np.random.default_rng(15)
    a, b = (rng.standard_normal((3, 6)).astype(np.float32) for _ in range(2))
    engine_onnx.export(model, path, example=(a, b))
    loaded = engine_onnx.load(path).eval()
    assert [type(layer).__name__ for layer in loaded.layers] == ["Dense", "LayerNorm"]
    got = loaded(engine.tensor(a), engine.tensor(b)).numpy()
    np.testing.assert_allclose(got, model.eval()(engine.tensor(a), engine.tensor(b)).numpy(),
                               rtol=1e-5, atol=1e-6)
    (expected,) = _onnxruntime(path, {"input_0": a, "input_1": b})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


class Arithmetic(nn.Model):   # the export's Clip, Pow, SiLU's Mul, ReduceSum, ReduceMax

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.a, self.b = nn.Dense(4), nn.Dense(4)

    def forward(self, x):
        y = self.a(x)
        return (engine.clip(y * self.b(x), -0.5, 0.7) ** 2 - y.max(axis=-1, keepdims=True)
                + engine.silu(y).sum(axis=1, keepdims=True))


def test_the_export_s_arithmetic_imports_and_matches(tmp_path):
    engine.manual_seed(17)
    model, path = Arithmetic(), tmp_path / "arithmetic.onnx"
    x = np.random.default_rng(18).standard_normal((3, 5)).astype(np.float32)
    proto = engine_onnx.export(model, path, example=x)
    assert {"Clip", "Pow", "ReduceSum", "ReduceMax"} <= {n.op_type for n in proto.graph.node}
    got = engine_onnx.load(path).eval()(engine.tensor(x)).numpy()
    np.testing.assert_allclose(got, model.eval()(engine.tensor(x)).numpy(), rtol=1e-5,
                               atol=1e-6)


def _graph_file(path, nodes, inputs, initializers=None):
    values = [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape)
              for name, shape in inputs]
    graph = helper.make_graph(nodes, "g", values,
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                              [onnx.numpy_helper.from_array(array, name)
                               for name, array in (initializers or {}).items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_an_unsupported_node_names_its_operator_and_what_is_read(tmp_path):
    path = _graph_file(tmp_path / "einsum.onnx",
                       [helper.make_node("MatMul", ["a", "b"], ["p"], name="product"),
                        helper.make_node("Einsum", ["p", "a"], ["y"], name="the_einsum",
                                         equation="ij,ij->ij")],
                       [("a", [2, 2]), ("b", [2, 2])])
    with pytest.raises(ValueError, match=r"node 'the_einsum' \(Einsum\): operator 'Einsum' "
                                         r"is not supported; the graph importer reads .*"
                                         r"MatMul.*Softmax.*Transpose.*Where"):
        engine_onnx.load(path)


def test_two_inputs_and_a_transpose_chain_import(tmp_path):
    weight = np.random.default_rng(10).standard_normal((3, 4)).astype(np.float32)
    path = _graph_file(tmp_path / "two.onnx",
                       [helper.make_node("Transpose", ["a"], ["t"], perm=[0, 2, 1]),
                        helper.make_node("MatMul", ["t", "b"], ["m"]),
                        helper.make_node("MatMul", ["m", "w"], ["z"]),
                        helper.make_node("Where", ["mask", "z", "fill"], ["y"])],
                       [("a", [None, 3, 2]), ("b", [None, 3, 3])],
                       {"w": weight, "mask": np.array([True, False, True, True]),
                        "fill": np.array(-1.0, np.float32)})
    loaded = engine_onnx.load(path)
    rng = np.random.default_rng(11)
    a, b = (rng.standard_normal(shape).astype(np.float32) for shape in ((5, 3, 2), (5, 3, 3)))
    (expected,) = _onnxruntime(path, {"a": a, "b": b})
    np.testing.assert_allclose(loaded(engine.tensor(a), engine.tensor(b)).numpy(), expected,
                               rtol=1e-5, atol=1e-5)
    assert [p.shape for p in loaded.parameters()] == [(3, 4)]   # w: a MatMul's weight
