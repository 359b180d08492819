"""Models beyond a stack of layers: layers that hold layers (tracked attributes, LayerList,
Parameter), nn.Model with any forward, freezing, nested Sequentials, files, capture."""
import os

import numpy as np
import pytest

import engine
import optim
from engine import data, nn
from engine.fit import fit
from tests.support.training_step import cross_entropy_step


class Residual(nn.Layer):
    def __init__(self, width, **kwargs):
        super().__init__(**kwargs)
        self.inner = nn.Dense(width, activation="relu")
        self.outer = nn.Dense(width)

    def forward(self, x):
        return x + self.outer(self.inner(x))


@nn.register
class ResNet(nn.Model):
    def __init__(self, width=16, depth=2, classes=3, **kwargs):
        super().__init__(**kwargs)
        self.width, self.depth, self.classes = width, depth, classes
        self.stem = nn.Dense(width)
        self.blocks = nn.LayerList([Residual(width) for _ in range(depth)])
        self.gain = nn.Parameter((width,), initializer="ones")
        self.head = nn.Sequential([nn.Dropout(0.25), nn.Dense(classes)])

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x * self.gain)

    def get_config(self):
        return {"width": self.width, "depth": self.depth, "classes": self.classes}


def _data(n=64, features=5, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5)


def _model(seed=0, **kwargs):
    engine.manual_seed(seed)
    model = ResNet(**kwargs)
    model.build((5,))
    return model


def test_attributes_are_tracked_with_dotted_names():
    model = _model()
    names = [name for name, _ in model.named_parameters()]
    assert names == ["gain", "stem.weight", "stem.bias",
                     "blocks.0.inner.weight", "blocks.0.inner.bias",
                     "blocks.0.outer.weight", "blocks.0.outer.bias",
                     "blocks.1.inner.weight", "blocks.1.inner.bias",
                     "blocks.1.outer.weight", "blocks.1.outer.bias",
                     "head.dense.weight", "head.dense.bias"]
    assert [p for _, p in model.named_parameters()] == model.parameters()
    assert [name for name, _ in model.named_buffers()] == ["head.dropout.seed",
                                                          "head.dropout.masks_drawn"]
    layers = dict(model.named_layers())
    assert isinstance(layers["blocks.1.outer"], nn.Dense) and "head.dropout" in layers
    # one flat buffer holds every parameter, each a view
    (buffer,) = model.flat_buffers()
    assert buffer.size == sum(p.size for p in model.parameters())
    assert all(p.flat is buffer for p in model.parameters())
    model.eval()
    assert not any(layer.training for _, layer in model.named_layers())
    model.train()
    assert all(layer.training for _, layer in model.named_layers())


def test_summary_counts_every_parameter_and_the_output_shape():
    text = _model().summary()
    total = 16 + (5 * 16 + 16) + 2 * 2 * (16 * 16 + 16) + (16 * 3 + 3)
    assert f"Total params: {total:,}" in text and "(None, 3)" in text
    assert "blocks: layerlist (LayerList)" in text


def test_first_call_builds_and_a_model_trains():
    engine.manual_seed(1)
    model = ResNet()
    with pytest.raises(RuntimeError, match="not built yet.*model.build"):
        model.parameters()
    x, y = _data()
    assert model(x).shape == (64, 3) and model.output_shape == (3,)
    step = cross_entropy_step(model, optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                              nn.CrossEntropyLoss())
    losses = [step(x, y).item() for _ in range(20)]
    assert losses[-1] < 0.6 * losses[0]


def test_shared_layers_count_once():
    class Tied(nn.Model):
        def __init__(self):
            super().__init__()
            self.dense = nn.Dense(4)
            self.again = self.dense

        def forward(self, x):
            return self.again(self.dense(x))

    model = Tied()
    model(np.ones((2, 4), np.float32))
    assert [name for name, _ in model.named_parameters()] == ["dense.weight", "dense.bias"]


def test_untracked_weights_are_refused_at_assignment():
    class Holder(nn.Layer):
        pass

    holder = Holder()
    with pytest.raises(TypeError, match=r"Holder.layers: a list of layers.*nn.LayerList"):
        holder.layers = [nn.Dense(3), nn.Dense(4)]
    with pytest.raises(TypeError, match=r"Holder.parts: a dict .*nn.LayerList"):
        holder.parts = {"a": nn.Dense(3)}
    with pytest.raises(TypeError, match=r"Holder.w: a plain Tensor \(shape \(3, 2\)\).*"
                                        r"nn.Parameter\(tensor\).*register_buffer\('w'"):
        holder.w = engine.randn(3, 2, requires_grad=True)
    holder.w = nn.Parameter(engine.randn(3, 2))
    holder.register_buffer("count", engine.zeros(1))
    holder.count = engine.ones(1)   # a registered buffer may be replaced
    assert [n for n, _ in holder.named_parameters()] == ["w"]
    assert [n for n, _ in holder.named_buffers()] == ["count"]

    class Early(nn.Layer):
        def __init__(self):
            self.dense = nn.Dense(2)

    with pytest.raises(AttributeError, match="before super\\(\\).__init__\\(\\)"):
        Early()


def test_parameter_from_a_shape_or_values():
    engine.manual_seed(0)
    p = nn.Parameter((4, 3))
    limit = np.sqrt(6 / (4 + 3))
    assert p.shape == (4, 3) and p.dtype == np.float32 and p.requires_grad
    assert np.abs(p.numpy()).max() <= limit
    assert (nn.Parameter(5, initializer="zeros").numpy() == 0).all()
    q = nn.Parameter(np.arange(3.0), dtype=np.float64)
    assert q.dtype == np.float64 and q.numpy().tolist() == [0, 1, 2]
    assert q.requires_grad_(False) is q and not q.requires_grad


@pytest.mark.parametrize("make", [
    lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1),
    lambda ps: optim.Adam(ps, lr=0.01, weight_decay=0.1),
    lambda ps: optim.AdamW(ps, lr=0.01),
    lambda ps: optim.RMSprop(ps, lr=0.01),
])
def test_frozen_parameters_never_move(make):
    model = _model()
    x, y = _data()
    opt = make(model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()   # momentum and state exist for every parameter now
    model.blocks[0].trainable = False
    model.gain.requires_grad_(False)
    frozen = [p for _, p in model.blocks[0].named_parameters()] + [model.gain]
    before = [p.numpy().copy() for p in frozen]
    moving = model.stem.weight.numpy().copy()
    for _ in range(3):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    assert all(np.array_equal(b, p.numpy()) for b, p in zip(before, frozen))
    assert not np.array_equal(moving, model.stem.weight.numpy())
    assert "Trainable params" in model.summary()


def test_trainable_false_before_building_freezes_the_new_weights():
    engine.manual_seed(0)
    model = ResNet()
    model.stem.trainable = False
    model.build((5,))
    assert not model.stem.weight.requires_grad and model.blocks[0].inner.weight.requires_grad


def test_dense_takes_any_rank():
    engine.manual_seed(0)
    dense = nn.Dense(4, activation="tanh")
    x = engine.randn(2, 3, 5)
    y = dense(x)
    assert y.shape == (2, 3, 4)
    flat = dense(engine.tensor(x.numpy().reshape(6, 5)))
    np.testing.assert_array_equal(y.numpy().reshape(6, 4), flat.numpy())
    # gradients too, in float64 by finite differences
    dense64 = nn.Dense(3, dtype=np.float64)
    x64 = engine.tensor(np.random.default_rng(0).standard_normal((2, 3, 4)), dtype=np.float64,
                        requires_grad=True)
    dense64(x64)
    assert engine.gradcheck(lambda a, w, b: (dense64(a) ** 2).sum(),
                            [x64, dense64.weight, dense64.bias])


def test_sequential_inside_sequential():
    engine.manual_seed(0)
    inner = nn.Sequential([nn.Dense(8, activation="relu", input_shape=(4,)), nn.Dense(8)])
    outer = nn.Sequential([inner, nn.Dense(2)])
    assert outer.output_shape == (2,)
    assert [n for n, _ in outer.named_parameters()] == [
        "sequential.dense.weight", "sequential.dense.bias", "sequential.dense_1.weight",
        "sequential.dense_1.bias", "dense.weight", "dense.bias"]
    assert len(outer.flat_buffers()) == 1 and inner.flat_buffers() == []
    late = nn.Sequential([nn.Sequential([nn.Dense(3), nn.Dense(3)]), nn.Dense(1)])
    assert late(np.ones((2, 5), np.float32)).shape == (2, 1)


def test_state_dict_round_trip_and_files(tmp_path):
    model, x = _model(), _data()[0]
    model.eval()
    expected = model(x).numpy()
    other = _model(seed=9)
    other.load_state_dict(model.state_dict())
    other.eval()
    np.testing.assert_array_equal(other(x).numpy(), expected)
    for name in ("m.npz", "m.safetensors"):
        model.save(tmp_path / name)
        loaded = nn.load(tmp_path / name)
        assert type(loaded) is ResNet and loaded.depth == 2
        loaded.eval()
        np.testing.assert_array_equal(loaded(x).numpy(), expected)


def test_a_nested_sequential_saves_and_loads(tmp_path):
    engine.manual_seed(0)
    model = nn.Sequential([nn.Sequential([nn.Dense(6, activation="relu", input_shape=(5,))]),
                           nn.Dense(2)])
    x = _data()[0]
    model.save(tmp_path / "s.npz")
    np.testing.assert_array_equal(nn.load(tmp_path / "s.npz")(x).numpy(), model(x).numpy())


def test_an_unregistered_model_is_refused_before_writing(tmp_path):
    class Plain(nn.Model):
        def __init__(self, units):
            super().__init__()
            self.dense = nn.Dense(units)

        def forward(self, x):
            return self.dense(x)

    model = Plain(3)
    model(np.ones((1, 2), np.float32))
    with pytest.raises(TypeError, match="not registered.*@nn.register.*get_config"):
        model.save(tmp_path / "p.npz")
    nn.register(Plain)
    with pytest.raises(TypeError, match=r"Plain\(\*\*get_config\(\)\) fails"):
        model.save(tmp_path / "p.npz")   # its get_config lacks the units
    assert os.listdir(tmp_path) == []


def _capture_residual(device, rows=48, width=16, steps=5):
    x, y = _data(n=rows)
    results = []
    for captured in (False, True):
        model = _model(width=width).to(device)
        opt = optim.Adam(model.parameters(), lr=0.01)
        step = cross_entropy_step(model, opt, nn.CrossEntropyLoss())
        step = engine.capture(step) if captured else step
        xb, yb = engine.tensor(x, device=device), engine.tensor(y, device=device)
        losses = [step(xb, yb).numpy().copy() for _ in range(steps)]
        model.blocks[1].trainable = False   # the host decided otherwise: a new recording
        losses += [step(xb, yb).numpy().copy() for _ in range(3)]
        if captured:
            assert step.replayed == steps - 2 + 1 and step.recordings == 2
        results.append((losses, model.state_dict()))
    (eager, eager_state), (replayed, replayed_state) = results
    assert all(np.array_equal(a, b) for a, b in zip(eager, replayed))
    assert all(np.array_equal(eager_state[k], replayed_state[k]) for k in eager_state)


def test_capture_replays_a_residual_model_bit_for_bit():
    _capture_residual("cpu")


@pytest.mark.cuda
def test_capture_replays_a_residual_model_bit_for_bit_cuda():
    _capture_residual("cuda", rows=5, width=3, steps=3)


def test_fit_trains_a_model_with_any_forward():
    x, y = _data(n=256)
    model = _model()
    loader = data.DataLoader(x, y, batch_size=32, shuffle=True, seed=0)
    history = fit(model, loader, optim.Adam(model.parameters(), lr=0.01),
                  nn.CrossEntropyLoss(), epochs=4, progress=False, verbose=False)
    assert history[-1]["loss"] < 0.7 * history[0]["loss"]
    assert fit.last_eager_reason is None
