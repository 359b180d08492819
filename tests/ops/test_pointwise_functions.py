"""The public functions generated from ops.pointwise.TABLE: engine.<name>, engine.functional's
and Tensor's, one per parameter-free entry with a doc. A new entry adds its reference here;
SiLU, the entry added last, is also checked against torch in float64 with the layers that
take it by name (``check_op`` covers its op on both devices: CASES)."""
import inspect

import numpy as np
import pytest

import engine
from engine import functional, nn
from ops.pointwise import TABLE
from tests.support.op_check import Case, check_op

REFERENCES = {
    "neg": np.negative, "exp": np.exp, "log": np.log, "sqrt": np.sqrt,
    "relu": lambda a: np.maximum(a, 0), "sigmoid": lambda a: 1 / (1 + np.exp(-a)),
    "tanh": np.tanh, "abs": np.abs, "silu": lambda a: a / (1 + np.exp(-a)),
}


def test_every_entry_with_a_doc_is_generated_and_has_a_reference():
    """A NumPy reference here, or torch's module (tests/ops/test_activation_table.py)."""
    documented = {entry.name for entry in TABLE if entry.doc}
    with_torch = {entry.name for entry in TABLE if entry.doc and entry.torch}
    assert set(functional.POINTWISE) == documented == set(REFERENCES) | with_torch


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_the_generated_function_method_and_engine_name(name):
    values = np.array([-2.5, -0.5, 0.25, 1.0, 3.0])
    x = engine.tensor(values, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        expected = REFERENCES[name](values)
    function = getattr(engine, name)
    assert function is getattr(functional, name) is getattr(engine.Tensor, name)
    for result in (function(x), getattr(x, name)()):
        np.testing.assert_allclose(result.numpy(), expected, rtol=1e-12, equal_nan=True)
    assert str(inspect.signature(function)) == "(x)"
    assert function.__name__ == name and "elementwise" in function.__doc__


def test_engine_finds_a_generated_name_it_does_not_list(monkeypatch):
    """A new entry needs no line in engine/__init__.py: a name the lazy table lacks is looked
    up among the generated functions."""
    monkeypatch.delitem(engine._LAZY_SOURCE, "tanh")
    monkeypatch.delitem(vars(engine), "tanh", raising=False)
    assert engine.tanh is functional.POINTWISE["tanh"]
    assert "tanh" in dir(engine)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_function'"):
        engine.no_such_function


# ------------------------------------------------------------------ SiLU

CASES = [Case("silu", ((7,),), lambda a: a.silu(), REFERENCES["silu"], low=-6, high=6)]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_op(case, device):
    check_op(case, device)


# both sides of 0, exp(-x) overflowing and underflowing
X = np.concatenate([np.linspace(-6, 6, 25), [-800.0, -40.0, 40.0, 800.0]])


def test_silu_and_its_gradient_match_torch_in_float64():
    import torch
    x = engine.tensor(X, dtype=np.float64, requires_grad=True)
    y = x.silu()
    (y * engine.tensor(X[::-1].copy())).sum().backward()
    xt = torch.tensor(X, requires_grad=True)
    yt = torch.nn.functional.silu(xt)
    (yt * torch.tensor(X[::-1].copy())).sum().backward()
    np.testing.assert_allclose(y.numpy(), yt.detach().numpy(), rtol=1e-14, atol=1e-300)
    np.testing.assert_allclose(x.grad.numpy(), xt.grad.numpy(), rtol=1e-13, atol=1e-300)


def test_dense_and_activation_layers_take_silu_as_torch_does(tmp_path):
    import torch
    inputs = np.random.default_rng(3).uniform(-4, 4, size=(4, 6))
    model = nn.Sequential([nn.Dense(5, activation="silu", input_shape=(6,), dtype=np.float64),
                           nn.Dense(3, dtype=np.float64), nn.Activation("silu")])
    x = engine.tensor(inputs, requires_grad=True)
    y = model(x)
    y.sum().backward()
    first, second = model[0], model[1]
    xt = torch.tensor(inputs, requires_grad=True)
    w1, w2 = (torch.tensor(layer.weight.numpy(), requires_grad=True) for layer in (first, second))
    b1, b2 = (torch.tensor(layer.bias.numpy() + 0.0, requires_grad=True)
              for layer in (first, second))
    silu = torch.nn.functional.silu
    yt = silu(silu(xt @ w1 + b1) @ w2 + b2)
    yt.sum().backward()
    np.testing.assert_allclose(y.numpy(), yt.detach().numpy(), rtol=1e-12, atol=1e-14)
    for mine, theirs in ((x.grad, xt.grad), (first.weight.grad, w1.grad),
                         (second.bias.grad, b2.grad)):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-12, atol=1e-13)
    assert first.kernel_initializer is engine.init.he_normal   # relu-like, as gelu
    model.save(tmp_path / "m.npz")
    np.testing.assert_array_equal(nn.load(tmp_path / "m.npz")(engine.tensor(inputs)).numpy(),
                                  y.numpy())


def test_silu_names_its_missing_onnx_operator(tmp_path):
    pytest.importorskip("onnx")
    model = nn.Sequential([nn.Dense(3, activation="silu", input_shape=(2,))])
    with pytest.raises(ValueError, match="ONNX has no operator for its activation 'silu'"):
        engine.onnx.export(model, tmp_path / "m.onnx")


@pytest.mark.gpu
def test_silu_on_a_large_tensor_matches_torch_on_the_gpu():
    import torch
    x = np.random.default_rng(5).uniform(-12, 12, (1024, 4097)).astype(np.float32)
    t = engine.tensor(x, device="cuda", requires_grad=True)
    y = t.silu()
    y.sum().backward()
    xt = torch.tensor(x, device="cuda", requires_grad=True)
    yt = torch.nn.functional.silu(xt)
    yt.sum().backward()
    np.testing.assert_allclose(y.numpy(), yt.detach().cpu().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(t.grad.numpy(), xt.grad.cpu().numpy(), rtol=1e-5, atol=1e-6)
