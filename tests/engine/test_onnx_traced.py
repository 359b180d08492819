"""ONNX export traced from the ops a forward runs (``engine.onnx.export(..., example=...)``):
models beyond a chain (residual blocks, two inputs, a shared layer, the GPT) export, and
onnxruntime computes what the engine's forward computes."""
import numpy as np
import pytest

import engine
from engine import nn
from engine import onnx as engine_onnx
from engine.models import build_gpt

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")


def _run(proto, feeds):
    session = ort.InferenceSession(proto.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


class Residual(nn.Model):
    """Two inputs, a shared Dense used twice, residual adds, a LayerNorm and a GELU."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.shared = nn.Dense(8, activation="relu")
        self.mix = nn.Dense(8)
        self.norm = nn.LayerNorm()
        self.head = nn.Dense(3, activation="gelu")

    def forward(self, a, b):
        x = self.shared(a) + self.shared(b)          # one layer, two calls
        x = x + self.mix(engine.tanh(x)) * 0.5       # a residual around a block
        x = engine.silu(x) / 2.0 + 1.0 - (-x).exp().sqrt()
        x = self.norm(x)
        return self.head(x) + x[:, :3]


def test_a_residual_model_with_two_inputs_and_a_shared_layer_matches(tmp_path):
    engine.manual_seed(0)
    model = Residual()
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((5, 8)).astype(np.float32) for _ in range(2))
    expected = model.eval()(engine.tensor(a), engine.tensor(b)).numpy()
    model.train()
    proto = engine_onnx.export(model, tmp_path / "residual.onnx",
                               example=(engine.tensor(a), engine.tensor(b)))
    assert model.training   # the export ran eval mode and gave the mode back
    (got,) = _run(proto, {"input_0": a, "input_1": b})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    stored = {tensor.name for tensor in proto.graph.initializer}
    # the shared layer's weight is stored once, under its dotted name
    assert {"shared.weight", "shared.bias", "mix.weight", "norm.weight"} <= stored
    operators = [node.op_type for node in proto.graph.node]
    assert operators.count("Gemm") == 4 and "LayerNormalization" in operators
    # the file is the proto
    assert onnx.load(tmp_path / "residual.onnx").graph.node[0].op_type == operators[0]


@pytest.mark.parametrize("opset", [17, 20])
def test_the_gpt_exports_and_matches(opset):
    engine.manual_seed(0)
    model = build_gpt(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=8)
    ids = np.random.default_rng(2).integers(0, 11, (2, 6)).astype(np.int64)
    model.eval()
    expected = model(engine.tensor(ids)).numpy()
    # traced on other ids: the graph reads its input, not the example's values
    proto = engine_onnx.to_onnx(model, opset=opset, example=engine.tensor(np.zeros_like(ids)))
    (got,) = _run(proto, {"input": ids})
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    operators = {node.op_type for node in proto.graph.node}
    assert {"Gather", "LayerNormalization", "MatMul", "Softmax"} <= operators
    assert ("Gelu" in operators) == (opset >= 20)
    # the tied head reads the token table stored once
    names = [tensor.name for tensor in proto.graph.initializer]
    assert names.count("tokens.weight") == 1


def test_a_multi_head_attention_block_matches_with_a_float64_model():
    engine.manual_seed(0)
    block = nn.MultiHeadAttention(2, causal=False, dtype=np.float64)
    x = np.random.default_rng(3).standard_normal((3, 4, 6))
    expected = block.eval()(engine.tensor(x)).numpy()
    proto = engine_onnx.to_onnx(block, example=engine.tensor(x))
    (got,) = _run(proto, {"input": x})
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


def test_a_convnet_model_with_a_skip_matches():
    class Skip(nn.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.conv = nn.Conv2D(3, 3, padding="same", activation="relu")
            self.norm = nn.BatchNorm()
            self.pool = nn.MaxPool2D(2)
            self.flat = nn.Flatten()
            self.out = nn.Dense(4)

        def forward(self, x):
            x = self.norm(self.conv(x)) + x
            return engine.softmax(self.out(self.flat(self.pool(x))))

    engine.manual_seed(0)
    model = Skip()
    x = np.random.default_rng(4).standard_normal((2, 3, 6, 6)).astype(np.float32)
    model(engine.tensor(x))   # a training step's statistics, so eval differs from train
    expected = model.eval()(engine.tensor(x)).numpy()
    proto = engine_onnx.to_onnx(model, example=x)
    (got,) = _run(proto, {"input": x})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert {"Conv", "BatchNormalization", "MaxPool", "Softmax"} <= {
        node.op_type for node in proto.graph.node}


def test_an_op_without_an_onnx_declaration_names_the_op_and_the_layer(tmp_path):
    class Sorted(nn.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.inner = Picks()

        def forward(self, x):
            return self.inner(x)

    class Picks(nn.Model):
        def forward(self, x):
            return engine.topk(x, 2)[0]

    # topk runs take_along_rows, which declares no ONNX node (ONNX's TopK would be its own)
    with pytest.raises(ValueError, match="op 'take_along_rows' \\(run by layer 'inner'\\) "
                                         "declares no ONNX node"):
        engine_onnx.export(Sorted(), tmp_path / "m.onnx", example=np.ones((2, 5), np.float32))
    assert not list(tmp_path.iterdir())


def test_a_model_without_an_example_is_told_to_give_one(tmp_path):
    with pytest.raises(TypeError, match="example=x"):
        engine_onnx.export(Residual(), tmp_path / "m.onnx")


class Block(nn.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner, self.outer = nn.Dense(6, activation="relu"), nn.Dense(6)

    def forward(self, x):
        return x + self.outer(self.inner(x))


class Residuals(nn.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stem, self.blocks = nn.Dense(6), nn.LayerList([Block(), Block()])
        self.head = nn.Dense(2, activation="sigmoid")

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_graph_with_residual_adds_imports_back_and_matches(tmp_path):
    engine.manual_seed(0)
    model = Residuals()
    x = np.random.default_rng(5).standard_normal((4, 3)).astype(np.float32)
    path = tmp_path / "residual.onnx"
    proto = engine_onnx.export(model, path, example=x)
    joins = [node for node in proto.graph.node if node.op_type == "Add"]
    assert len(joins) == 2
    loaded = engine_onnx.load(path)
    assert isinstance(loaded, nn.Model)
    loaded.eval()
    (expected,) = _run(proto, {"input": x})
    np.testing.assert_allclose(loaded(engine.tensor(x)).numpy(), expected, rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(loaded(engine.tensor(x)).numpy(),
                               model.eval()(engine.tensor(x)).numpy(), rtol=1e-5, atol=1e-6)
    assert sum(p.size for p in loaded.parameters()) == sum(p.size for p in model.parameters())


def test_a_graph_joining_by_a_product_imports_and_matches(tmp_path):
    class Product(nn.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.a, self.b = nn.Dense(3), nn.Dense(3)

        def forward(self, x):
            return self.a(x) * self.b(x)

    engine.manual_seed(0)
    model, path = Product(), tmp_path / "product.onnx"
    x = np.random.default_rng(4).standard_normal((2, 4)).astype(np.float32)
    engine_onnx.export(model, path, example=x)
    loaded = engine_onnx.load(path)
    np.testing.assert_allclose(loaded(engine.tensor(x)).numpy(),
                               model(engine.tensor(x)).numpy(), rtol=1e-6, atol=1e-6)


def test_a_sequential_traced_computes_what_its_layer_by_layer_export_computes():
    engine.manual_seed(0)
    model = nn.Sequential([nn.Conv2D(4, 3, input_shape=(2, 7, 7), activation="leaky_relu"),
                           nn.AvgPool2D(2, padding=1), nn.Flatten(),
                           nn.Dense(5, activation="sigmoid"), nn.Dropout(0.5),
                           nn.Dense(3, activation="softmax")])
    x = np.random.default_rng(6).standard_normal((3, 2, 7, 7)).astype(np.float32)
    (by_layers,) = _run(engine_onnx.to_onnx(model), {"input": x})
    traced = engine_onnx.to_onnx(model, example=x)
    (got,) = _run(traced, {"input": x})
    np.testing.assert_allclose(got, by_layers, rtol=1e-5, atol=1e-6)
    assert [n.op_type for n in traced.graph.node if n.op_type in ("Conv", "Gemm")] == [
        "Conv", "Gemm", "Gemm"]


def test_the_batch_dimension_stays_open_where_only_reshape_targets_follow_it():
    engine.manual_seed(0)
    model = build_gpt(vocab_size=7, block_size=4, n_layer=1, n_head=2, n_embd=4)
    model.eval()
    proto = engine_onnx.to_onnx(model, example=np.zeros((2, 4), np.int64))
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    ids = np.random.default_rng(7).integers(0, 7, (5, 4)).astype(np.int64)   # 5, not 2
    (got,) = _run(proto, {"input": ids})
    np.testing.assert_allclose(got, model(engine.tensor(ids)).numpy(), rtol=1e-4, atol=1e-5)


def test_a_graph_that_depends_on_the_batch_otherwise_keeps_the_example_shapes():
    class Batchwise(nn.Model):   # a constant made to the batch's size: the shapes stay fixed
        def forward(self, x):
            ramp = np.arange(x.shape[0] * x.shape[1], dtype=np.float32).reshape(x.shape)
            return x * x.sum(axis=0) + engine.tensor(ramp)

    x = np.random.default_rng(8).standard_normal((3, 2)).astype(np.float32)
    proto = engine_onnx.to_onnx(Batchwise(), example=x)
    dims = [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [3, 2]
    (got,) = _run(proto, {"input": x})
    np.testing.assert_allclose(got, Batchwise()(engine.tensor(x)).numpy(), rtol=1e-6)


def test_indexing_by_integers_and_slices_exports_and_an_index_array_is_named(tmp_path):
    class Slices(nn.Model):
        def forward(self, x):
            return x[1:3, ::2].sum(axis=1) + x[::-1][:2, 0]

    class Picks(nn.Model):
        def forward(self, x):
            return x[np.array([0, 2])]

    x = np.random.default_rng(9).standard_normal((4, 5)).astype(np.float32)
    (got,) = _run(engine_onnx.to_onnx(Slices(), example=x), {"input": x})
    np.testing.assert_allclose(got, Slices()(engine.tensor(x)).numpy(), rtol=1e-6)
    with pytest.raises(ValueError, match="op 'index' in layer 'picks': index: only integers "
                                         "and slices export"):
        engine_onnx.export(Picks(), tmp_path / "p.onnx", example=x)
