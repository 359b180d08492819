"""Weights between a torch module tree and the engine model ported from it
(engine.interop.torch.copy_from_module / copy_to_module)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import engine  # noqa: E402
from engine import nn  # noqa: E402
from engine.interop.torch import copy_from_module, copy_to_module  # noqa: E402


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.flatten = torch.nn.Flatten()
        self.scale = torch.nn.Parameter(torch.rand(12, dtype=torch.float64) + 0.5)
        self.stack = torch.nn.Sequential(torch.nn.Linear(12, 8, dtype=torch.float64),
                                         torch.nn.ReLU(),
                                         torch.nn.BatchNorm1d(8, dtype=torch.float64),
                                         torch.nn.Linear(8, 3, dtype=torch.float64))
        self.skip = torch.nn.Linear(12, 3, dtype=torch.float64)

    def forward(self, x):
        x = self.flatten(x) * self.scale
        return self.stack(x) + self.skip(x)


class EngineNet(nn.Model):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.scale = nn.Parameter(np.ones(12))
        self.stack = nn.Sequential(nn.Dense(8, dtype=np.float64), nn.Activation("relu"),
                                   nn.BatchNorm(dtype=np.float64), nn.Dense(3, dtype=np.float64))
        self.skip = nn.Dense(3, dtype=np.float64)

    def forward(self, x):
        x = self.flatten(x) * self.scale
        return self.stack(x) + self.skip(x)


def test_a_ported_module_tree_computes_what_torch_computes():
    torch.manual_seed(0)
    module = TorchNet()
    x = np.random.default_rng(0).standard_normal((6, 3, 4))
    module(torch.from_numpy(x))   # moves the running statistics off their start
    module.eval()
    model = EngineNet()
    model.build((3, 4), dtype=np.float64)
    copy_from_module(model, module)
    model.eval()
    expected = module(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(model(engine.tensor(x, dtype=np.float64)).numpy(), expected,
                               rtol=1e-12, atol=1e-12)
    other = copy_to_module(model, TorchNet()).eval()
    np.testing.assert_array_equal(other(torch.from_numpy(x)).detach().numpy(), expected)


def test_a_different_structure_is_refused_naming_the_pair():
    model = EngineNet()
    model.build((12,), dtype=np.float64)
    wrong = torch.nn.Sequential(torch.nn.Linear(12, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="engine layer '' .*torch module '0' \\(Linear"):
        copy_from_module(model, wrong)
    with pytest.raises(RuntimeError, match="build the engine model first"):
        copy_from_module(EngineNet(), TorchNet())


def test_an_engine_model_with_any_forward_runs_inside_torch_autograd():
    from engine.interop.torch import as_function
    model = EngineNet()
    model.build((12,), dtype=np.float64)
    model.eval()
    hybrid = as_function(model)
    assert len(list(hybrid.parameters())) == len(model.parameters()) == 9
    x = torch.randn(4, 12, dtype=torch.float64, requires_grad=True)
    out = hybrid(x)
    out.sum().backward()
    np.testing.assert_array_equal(out.detach().numpy(),
                                  model(engine.tensor(x.detach().numpy())).numpy())
    assert x.grad.shape == (4, 12) and model.scale.grad is not None
