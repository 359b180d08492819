"""engine.interop.torch.load_state_dict: a torch state_dict (tensors or NumPy arrays, torch's
keys and layouts) into the equivalent engine model, checked by running both on one input;
torch's wording for missing, unexpected and mis-shaped entries."""
import numpy as np
import pytest
torch = pytest.importorskip("torch")

import engine
from engine import nn
from engine.interop.torch import load_state_dict


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.norm = torch.nn.BatchNorm2d(4)
        self.flatten = torch.nn.Flatten()
        self.stack = torch.nn.Sequential(torch.nn.Linear(4 * 6 * 6, 16), torch.nn.ReLU(),
                                         torch.nn.Linear(16, 3))

    def forward(self, x):
        return self.stack(self.flatten(torch.relu(self.norm(self.conv(x)))))


class EngineNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.norm = nn.BatchNorm2d(4)
        self.flatten = nn.Flatten()
        self.stack = nn.Sequential(nn.Linear(4 * 6 * 6, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x):
        return self.stack(self.flatten(engine.relu(self.norm(self.conv(x)))))


def _trained_torch_net():
    torch.manual_seed(0)
    net = TorchNet()
    net.train()
    with torch.no_grad():   # running statistics away from their start
        net(torch.randn(8, 1, 8, 8))
    return net.eval()


@pytest.mark.parametrize("as_numpy", [False, True])
def test_a_torch_state_dict_loads_into_the_ported_model(as_numpy):
    net = _trained_torch_net()
    state = net.state_dict()
    if as_numpy:
        state = {key: value.numpy() for key, value in state.items()}
    model = EngineNet()
    model.build((1, 8, 8))
    result = load_state_dict(model, state)
    assert result == ([], [])
    model.eval()
    x = np.random.default_rng(1).standard_normal((5, 1, 8, 8)).astype(np.float32)
    expected = net(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(model(x).numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(model.stack[0].weight.numpy(), state["stack.0.weight"].T)


def test_it_loads_before_the_first_call_as_torch_does():
    """torch's layer names make their parameters at construction; a state_dict loads then."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    load_state_dict(model, reference.state_dict())
    x = np.ones((3, 4), np.float32)
    np.testing.assert_allclose(model(x).numpy(), reference(torch.from_numpy(x)).detach().numpy(),
                               rtol=1e-6, atol=1e-6)


def test_layer_norm_embedding_and_attention():
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(11, 8)
    norm = torch.nn.LayerNorm(8)
    attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)

    class Small(nn.Model):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(11, 8)
            self.norm = nn.LayerNorm()
            self.attention = nn.MultiHeadAttention(2)

        def forward(self, ids):
            return self.attention(self.norm(self.embedding(ids)))

    model = Small()
    ids = np.array([[1, 4, 2, 9], [0, 3, 3, 10]], np.int64)
    model(ids)
    state = {**{f"embedding.{k}": v for k, v in embedding.state_dict().items()},
             **{f"norm.{k}": v for k, v in norm.state_dict().items()},
             **{f"attention.{k}": v for k, v in attention.state_dict().items()}}
    load_state_dict(model, state)
    with torch.no_grad():
        h = norm(embedding(torch.from_numpy(ids)))
        expected = attention(h, h, h, need_weights=False)[0].numpy()
    np.testing.assert_allclose(model(ids).numpy(), expected, rtol=1e-5, atol=1e-5)


def test_missing_unexpected_and_size_mismatch_in_torchs_words():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    before = model[0].weight.numpy().copy()
    state = {"0.weight": np.zeros((8, 4), np.float32), "0.bias": np.zeros(8, np.float32),
             "2.weight": np.zeros((3, 8), np.float32), "3.bias": np.zeros(2, np.float32)}
    with pytest.raises(RuntimeError) as error:
        load_state_dict(model, state)
    text = str(error.value)
    assert text.startswith("Error(s) in loading state_dict for Sequential:")
    assert 'Missing key(s) in state_dict: "2.bias".' in text
    assert 'Unexpected key(s) in state_dict: "3.bias".' in text
    assert ("size mismatch for 2.weight: copying a param with shape torch.Size([3, 8]) from "
            "checkpoint, the shape in current model is torch.Size([2, 8]).") in text
    np.testing.assert_array_equal(model[0].weight.numpy(), before)   # nothing written


def test_strict_false_loads_what_matches_and_names_the_rest():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    weight = np.arange(32, dtype=np.float32).reshape(8, 4)
    result = load_state_dict(model, {"0.weight": weight, "9.weight": weight}, strict=False)
    assert result.missing_keys == ["0.bias", "2.weight", "2.bias"]
    assert result.unexpected_keys == ["9.weight"]
    np.testing.assert_array_equal(model[0].weight.numpy(), weight.T)


def test_torch_modules_own_load_state_dict_reads_the_engine_keys_back():
    """The keys are torch's: a state_dict the engine names this way loads into torch."""
    from engine.interop.state_dict import torch_keys
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    state = {key: torch.from_numpy(np.ascontiguousarray(t.numpy().T if transposed
                                                        else t.numpy()))
             for key, _, t, transposed in torch_keys(model)}
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    reference.load_state_dict(state)   # strict: raises on any other key or shape


def test_loading_into_a_model_not_built_names_load_state_dict():
    """A model whose weights need its first call is refused by the function the user called
    (it named ``parameters``, which it called on the way)."""
    with pytest.raises(RuntimeError, match=r"\.load_state_dict: the model is not built yet"):
        load_state_dict(nn.Sequential([nn.Dense(3)]), {})
