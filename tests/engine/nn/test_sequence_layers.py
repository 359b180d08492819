"""nn.MultiHeadAttention against torch's nn.MultiheadAttention, the sequence layers'
conversions both ways (engine.interop), save and load, and a captured training step of a
small attention block equal to the eager one."""
import numpy as np
import pytest

import engine
import optim
from engine import nn
from tests.support.training_step import cross_entropy_step


def test_attention_layer_shapes_parameters_and_bad_widths():
    layer = nn.MultiHeadAttention(2, causal=True)
    x = engine.tensor(np.random.default_rng(0).standard_normal((3, 5, 4)), dtype=np.float32)
    y = layer(x)
    assert y.shape == (3, 5, 4)
    assert [(n, p.shape) for n, p in layer.named_parameters()] == [
        ("in_proj.weight", (4, 12)), ("in_proj.bias", (12,)), ("out_proj.weight", (4, 4)),
        ("out_proj.bias", (4,))]
    y.sum().backward()
    assert all(p.grad is not None for _, p in layer.named_parameters())
    with pytest.raises(ValueError, match="MultiHeadAttention: the width 4 is not divisible by "
                                         "num_heads 3"):
        nn.MultiHeadAttention(3)(x)
    assert [n for n, _ in nn.MultiHeadAttention(2, use_bias=False).named_parameters()] == []
    bare = nn.MultiHeadAttention(2, use_bias=False)
    bare(x)
    assert [n for n, _ in bare.named_parameters()] == ["in_proj.weight", "out_proj.weight"]


@pytest.mark.torch
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("use_bias", [True, False])
def test_attention_layer_matches_torch_both_ways(causal, use_bias):
    import torch
    from engine.interop.sequence import from_torch, to_torch
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(8, 2, bias=use_bias, batch_first=True,
                                         dtype=torch.float64)
    if use_bias:   # torch starts its biases at zero: make them count
        torch.nn.init.normal_(theirs.in_proj_bias)
        torch.nn.init.normal_(theirs.out_proj.bias)
    ours = from_torch(theirs)
    ours.causal = causal
    x = np.random.default_rng(1).standard_normal((3, 6, 8))
    mask = torch.nn.Transformer.generate_square_subsequent_mask(6, dtype=torch.float64) \
        if causal else None
    xt = torch.tensor(x, requires_grad=True)
    expected, _ = theirs(xt, xt, xt, need_weights=False, attn_mask=mask, is_causal=causal)
    xe = engine.tensor(x, requires_grad=True)
    out = ours(xe)
    np.testing.assert_allclose(out.numpy(), expected.detach().numpy(), rtol=1e-10, atol=1e-12)
    g = np.random.default_rng(2).standard_normal(out.shape)
    (out * engine.tensor(g)).sum().backward()
    (expected * torch.tensor(g)).sum().backward()
    np.testing.assert_allclose(xe.grad.numpy(), xt.grad.numpy(), rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(ours.in_weight.grad.numpy(), theirs.in_proj_weight.grad.numpy().T,
                               rtol=1e-9, atol=1e-11)
    back = to_torch(ours)
    again, _ = back(xt, xt, xt, need_weights=False, attn_mask=mask, is_causal=causal)
    np.testing.assert_allclose(again.detach().numpy(), expected.detach().numpy(), rtol=1e-12)


@pytest.mark.torch
def test_embedding_and_layer_norm_convert_alone_and_in_sequentials():
    import torch
    from engine.interop import torch as interop
    from engine.interop.sequence import from_torch, to_torch
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(11, 6, padding_idx=3, dtype=torch.float64)
    norm = torch.nn.LayerNorm(6, eps=1e-3, dtype=torch.float64)
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(norm.bias)
    ids = np.random.default_rng(0).integers(0, 11, (4, 5))
    expected = norm(embedding(torch.tensor(ids))).detach().numpy()
    ours_norm = from_torch(norm)
    got = ours_norm(from_torch(embedding)(ids)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    model = interop.from_sequential(torch.nn.Sequential(embedding, norm, torch.nn.Flatten(),
                                                        torch.nn.Linear(30, 2,
                                                                        dtype=torch.float64)),
                                    input_shape=(5,))
    sequential = model(engine.tensor(ids)).numpy()
    back = interop.to_sequential(model)
    np.testing.assert_allclose(back(torch.tensor(ids)).detach().numpy(), sequential, rtol=1e-12)
    assert isinstance(to_torch(ours_norm), torch.nn.LayerNorm)
    with pytest.raises(ValueError, match="max_norm, scale_grad_by_freq and sparse"):
        from_torch(torch.nn.Embedding(3, 2, max_norm=1.0))


def test_sequence_layers_save_and_load(tmp_path):
    engine.manual_seed(0)
    model = nn.Sequential([nn.Embedding(9, 4, input_shape=(5,)), nn.LayerNorm(eps=1e-4),
                           nn.MultiHeadAttention(2, causal=True), nn.Flatten(), nn.Dense(3)])
    ids = engine.tensor(np.random.default_rng(0).integers(0, 9, (2, 5)))
    expected = model(ids).numpy()
    model.save(tmp_path / "m.npz")
    loaded = nn.load(tmp_path / "m.npz")
    np.testing.assert_array_equal(loaded(ids).numpy(), expected)
    assert [type(layer).__name__ for layer in loaded.layers][:3] == [
        "Embedding", "LayerNorm", "MultiHeadAttention"]


def _block(device, dropout):
    engine.manual_seed(0)
    model = nn.Sequential([nn.Embedding(7, 4, input_shape=(4,)), nn.LayerNorm(),
                           nn.MultiHeadAttention(2, causal=True, dropout=dropout),
                           nn.Flatten(), nn.Dense(7)])
    return model.to(device), optim.Adam(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_captured_attention_step_equals_eager(device, dropout):
    from ops.cuda import SIMULATOR
    if device == "cuda" and SIMULATOR and not dropout:
        pytest.skip("the dropout case reaches every kernel branch in the slow simulator")
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(2):
        ids = rng.integers(0, 7, (3, 4))
        ids[:, :2] = 5   # a bucket of 6 ids: the simulator's embedding gradient scans for it
        batches.append((engine.tensor(ids, device=device),
                        engine.tensor(rng.integers(0, 7, 3), device=device)))
    results = []
    for captured in (False, True):
        model, opt = _block(device, dropout)
        step = cross_entropy_step(model, opt)
        step = engine.capture(step) if captured else step
        losses = [step(x, y).item() for x, y in batches * 2]
        results.append((losses, [np.array(v).tobytes() for v in model.state_dict().values()]))
    assert results[0] == results[1]
    assert step.replayed >= 2


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_embedding_and_layer_norm_export_to_onnx_and_load_back(tmp_path, dtype):
    onnxruntime = pytest.importorskip("onnxruntime")
    engine.manual_seed(0)
    model = nn.Sequential([nn.Embedding(9, 4, input_shape=(5,)), nn.LayerNorm(eps=1e-3),
                           nn.Flatten(), nn.Dense(3)]).to(dtype)
    ids = np.random.default_rng(0).integers(0, 9, (2, 5))
    model.eval()
    expected = model(engine.tensor(ids)).numpy()   # predict() casts its input to floats
    model.export_onnx(tmp_path / "m.onnx")
    session = onnxruntime.InferenceSession(str(tmp_path / "m.onnx"))
    (got,) = session.run(None, {"input": ids})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    loaded = nn.load(tmp_path / "m.onnx")
    assert [type(layer).__name__ for layer in loaded.layers] == ["Embedding", "LayerNorm",
                                                                 "Flatten", "Dense"]
    np.testing.assert_allclose(np.asarray(loaded(engine.tensor(ids)).numpy()), expected,
                               rtol=1e-6, atol=1e-6)
