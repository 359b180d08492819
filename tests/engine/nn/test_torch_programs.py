"""Small training programs written the PyTorch way, run side by side in the engine and in
torch: the same architecture, torch's initial weights copied in
(``engine.interop.torch.load_state_dict``), the same data. Each step's loss must match
torch's, and the optimizer must hold the Parameters the model runs: a program that trains
nothing, or something else than torch, without an error is the failure these catch."""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import engine  # noqa: E402
from engine import nn, optim  # noqa: E402
from engine.interop.torch import load_state_dict  # noqa: E402

tnn = torch.nn
RTOL = 1e-4


def batch(features=8, classes=4, count=6, seed=0):
    """One batch of inputs and integer labels, as NumPy arrays."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((count, features)).astype(np.float32)
    return x, rng.integers(0, classes, count)


class Side:
    """One framework's half of a program: its model, optimizer and batch."""

    def __init__(self, model, optimizer, x, y, framework):
        self.model, self.optimizer, self.framework = model, optimizer, framework
        self.x, self.y = framework.tensor(x), framework.tensor(y)

    def loss(self, x=None, y=None):
        loss_fn = (nn if self.framework is engine else tnn).CrossEntropyLoss()
        return loss_fn(self.model(self.x if x is None else x), self.y if y is None else y)

    def step(self, zero_grad=None):
        """torch's loop body: zero_grad (``optimizer.zero_grad()`` unless given), forward,
        backward, step; returns the loss."""
        (zero_grad or self.optimizer.zero_grad)()
        loss = self.loss()
        loss.backward()
        self.optimizer.step()
        return loss.item()


def pair(make_engine, make_torch, optimizer=None, x=None, y=None, strict=True):
    """The engine's and torch's sides of a program: models from the two factories (torch's
    weights copied into the engine's), each with ``optimizer(framework, model)`` (SGD lr
    0.1 by default) and the same batch."""
    if x is None:
        x, y = batch()
    torch.manual_seed(0)
    reference = make_torch()
    model = make_engine()
    load_state_dict(model, reference.state_dict(), strict=strict)
    optimizer = optimizer or (lambda framework, m: framework.SGD(m.parameters(), lr=0.1))
    return (Side(model, optimizer(optim, model), x, y, engine),
            Side(reference, optimizer(torch.optim, reference), x, y, torch))


def assert_same_losses(ours, theirs):
    np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=1e-6)
    assert ours[-1] < ours[0] - 1e-3, f"the loss did not move: {ours}"


def train_both(engine_side, torch_side, steps=3):
    """``steps`` steps on both sides, each loss compared with torch's; checks that every
    optimizer group holds the model's own Parameters."""
    ours = [engine_side.step() for _ in range(steps)]
    theirs = [torch_side.step() for _ in range(steps)]
    assert_same_losses(ours, theirs)
    held = {id(p) for group in engine_side.optimizer.param_groups for p in group["params"]}
    assert held <= {id(p) for p in engine_side.model.parameters()}
    return ours


# ------------------------------------------------------------------ the models, twice

class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TorchMlp(tnn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = tnn.Linear(8, 16), tnn.ReLU(), tnn.Linear(16, 4)

    forward = Mlp.forward


class TiedMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.fc2.weight = self.fc1.weight

    def forward(self, x):
        return self.out(self.fc2(self.fc1(x).tanh()))


class TorchTiedMlp(tnn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.out = tnn.Linear(8, 8), tnn.Linear(8, 8), tnn.Linear(8, 4)
        self.fc2.weight = self.fc1.weight

    forward = TiedMlp.forward


class Stack(nn.Module):
    """A ModuleList of Linears, a Sequential inside, a Module, a Parameter used directly."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.inner = Mlp()
        self.scale = nn.Parameter(engine.ones(8))

    def forward(self, x):
        for block in self.blocks:
            x = block(x).relu()
        return self.inner(self.body(x) * self.scale)


class TorchStack(tnn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = tnn.ModuleList([tnn.Linear(8, 8) for _ in range(2)])
        self.body = tnn.Sequential(tnn.Linear(8, 8), tnn.Tanh())
        self.inner = TorchMlp()
        self.scale = tnn.Parameter(torch.ones(8))

    forward = Stack.forward


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.bn(self.fc1(x)).relu())


class TorchNormed(tnn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = tnn.Linear(8, 16), tnn.BatchNorm1d(16), tnn.Linear(16, 4)

    forward = Normed.forward


def flat_mlp(framework=nn):
    return framework.Sequential(framework.Flatten(), framework.Linear(8, 8), framework.ReLU(),
                                framework.Linear(8, 4))


OPTIMIZERS = {
    "sgd": lambda framework, m: framework.SGD(m.parameters(), lr=0.1),
    "nesterov": lambda framework, m: framework.SGD(m.parameters(), lr=0.1, momentum=0.9,
                                                   nesterov=True, weight_decay=1e-2),
    "adam": lambda framework, m: framework.Adam(m.parameters(), lr=0.01, weight_decay=1e-2),
    "adamw": lambda framework, m: framework.AdamW(m.parameters(), lr=0.01),
}


# ------------------------------------------------------------------ the programs that match

@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("program", ["module", "flatten first", "nested"])
def test_torch_s_models_train_as_in_torch(program, optimizer):
    """torch: a Module of Linears, ``nn.Sequential(nn.Flatten(), nn.Linear(8, 8), ...)`` on
    2x4 inputs, and a Module holding a ModuleList, a Sequential, a Module and a Parameter
    used in forward; each optimizer made from ``model.parameters()`` before the first
    forward."""
    x, y = batch()
    make_engine, make_torch = {"module": (Mlp, TorchMlp),
                               "flatten first": (flat_mlp, lambda: flat_mlp(tnn)),
                               "nested": (Stack, TorchStack)}[program]
    if program == "flatten first":
        x = x.reshape(-1, 2, 4)
    ours, theirs = pair(make_engine, make_torch, OPTIMIZERS[optimizer], x, y)
    train_both(ours, theirs)
    assert {id(p) for p in ours.optimizer.param_groups[0]["params"]} == \
        {id(p) for p in ours.model.parameters()}


# ------------------------------------------------------------------ weight tying

def test_tying_two_linears_in_init_shares_one_parameter():
    """torch: ``self.fc2.weight = self.fc1.weight`` in ``__init__``, then SGD. The engine's
    Linear made its weight only when built, so both were None there and each got its own:
    the model trained two matrices where torch trains one, and nothing said so."""
    ours, theirs = pair(TiedMlp, TorchTiedMlp)   # torch's state_dict lists the tie twice
    assert ours.model.fc2.weight is ours.model.fc1.weight
    assert len(ours.model.parameters()) == len(list(theirs.model.parameters())) == 5
    train_both(ours, theirs, steps=4)


def test_a_checkpoint_with_two_values_for_one_tie_is_refused():
    torch.manual_seed(0)
    saved = TorchTiedMlp().state_dict()
    tied = [key for key in saved if key.endswith("weight") and key != "fc1.weight"
            and saved[key].data_ptr() == saved["fc1.weight"].data_ptr()]
    assert tied
    saved[tied[0]] = saved[tied[0]] + 1
    with pytest.raises(RuntimeError, match=f"{tied[0]} and fc1.weight are one tied parameter"):
        load_state_dict(TiedMlp(), saved)


# ------------------------------------------------------------------ copies of a model

def test_a_deep_copy_of_a_trained_model_trains():
    """torch: ``student = copy.deepcopy(model)`` after a first forward, then an optimizer
    over the copy. The copy's Parameters were arrays apart from the copy's flat buffer, so
    its optimizer moved the buffer and the loss never moved."""
    ours, theirs = pair(Mlp, TorchMlp)
    ours.loss(), theirs.loss()   # the engine packs the parameters at the first call
    ours = Side(copy.deepcopy(ours.model), None, *batch(), engine)
    theirs = Side(copy.deepcopy(theirs.model), None, *batch(), torch)
    ours.optimizer = optim.SGD(ours.model.parameters(), lr=0.1, momentum=0.9)
    theirs.optimizer = torch.optim.SGD(theirs.model.parameters(), lr=0.1, momentum=0.9)
    train_both(ours, theirs)


def test_a_deep_copied_target_network_loads_the_trained_weights():
    """torch's DQN habit: ``target = copy.deepcopy(policy)``, train the policy, then
    ``target.load_state_dict(policy.state_dict())``. The load wrote the copy's flat buffer,
    which the copy's Parameters no longer viewed: the target kept its old outputs."""
    ours, _ = pair(Mlp, TorchMlp)
    ours.loss()
    target = copy.deepcopy(ours.model)
    for _ in range(2):
        ours.step()
    target.load_state_dict(ours.model.state_dict())
    np.testing.assert_array_equal(target(ours.x).numpy(), ours.model(ours.x).numpy())
    for copied, trained in zip(target.parameters(), ours.model.parameters()):
        assert copied is not trained and copied.flat is target.flat_buffers()[0]


def test_a_pickled_model_keeps_its_gradients_and_trains():
    """``pickle.loads(pickle.dumps(model))`` (what multiprocessing does to a model), and a
    deep copy taken between backward and step: the copy's gradients are its buffer's."""
    import pickle
    ours, _ = pair(Mlp, TorchMlp)
    ours.loss().backward()
    for copied in (pickle.loads(pickle.dumps(ours.model)), copy.deepcopy(ours.model)):
        for p, original in zip(copied.parameters(), ours.model.parameters()):
            np.testing.assert_array_equal(p.grad.numpy(), original.grad.numpy())
        before = Side(copied, optim.SGD(copied.parameters(), lr=0.1), *batch(), engine)
        assert before.step() > before.step()


# ------------------------------------------------------------------ a layer in two models

class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).tanh()


class Classifier(nn.Module):
    def __init__(self, encoder, classes):
        super().__init__()
        self.encoder, self.head = encoder, nn.Linear(8, classes)

    def forward(self, x):
        return self.head(self.encoder(x))


def test_two_models_sharing_an_encoder_save_and_load_its_live_weights():
    """torch: one ``encoder`` module in two models (pre-training, then a second task), each
    trained in turn, then ``first.state_dict()`` saved and loaded back. Once the second
    model packed the shared weights, the first one's state_dict read its own stale copy of
    them, its load_state_dict wrote that copy, and ``first.to(device)`` bound it back."""
    x, y = batch()
    encoder = Encoder()
    first, second = (Side(Classifier(encoder, 4), None, x, y, engine) for _ in range(2))
    for side in (first, second):   # the second's first call packs the encoder anew
        side.optimizer = optim.SGD(side.model.parameters(), lr=0.5)
        side.step(), side.step()
    saved = first.model.state_dict()
    np.testing.assert_array_equal(saved["encoder.fc.weight"], encoder.fc.weight.numpy())
    expected = first.model(first.x).numpy()
    fresh = Classifier(Encoder(), 4)
    fresh(first.x)
    fresh.load_state_dict(saved)
    np.testing.assert_array_equal(fresh(first.x).numpy(), expected)

    second.step()
    first.model.load_state_dict(saved)   # back to the saved encoder, for both models
    np.testing.assert_array_equal(first.model(first.x).numpy(), expected)
    second.step()
    trained = encoder.fc.weight.numpy().copy()
    first.model.to("cpu")
    np.testing.assert_array_equal(encoder.fc.weight.numpy(), trained)
    assert encoder.fc.weight.flat is first.model.flat_buffers()[0]


# ------------------------------------------------------------------ saving and resuming

def adam(framework, model):
    return framework.Adam(model.parameters(), lr=0.01)


@pytest.mark.parametrize("optimizer_first", [False, True])
def test_resuming_from_state_dicts_mid_training(optimizer_first):
    """torch: train two steps, keep ``model.state_dict()`` and ``optimizer.state_dict()``,
    then ``model = Net(); model.load_state_dict(...)``, a new Adam and its
    ``load_state_dict``, and train on; the model loads before its first call (it refused,
    "not built yet"), and the optimizer may come before the model's load."""
    ours, theirs = pair(Mlp, TorchMlp, adam)
    losses = [[side.step() for _ in range(2)] for side in (ours, theirs)]
    for side, make in ((ours, Mlp), (theirs, TorchMlp)):
        model_state = copy.deepcopy(side.model.state_dict())
        optimizer_state = copy.deepcopy(side.optimizer.state_dict())
        side.model = make()
        framework = optim if side is ours else torch.optim
        if not optimizer_first:
            side.model.load_state_dict(model_state)
        side.optimizer = adam(framework, side.model)
        side.optimizer.load_state_dict(optimizer_state)
        if optimizer_first:
            side.model.load_state_dict(model_state)
    for side, done in zip((ours, theirs), losses):
        done += [side.step() for _ in range(3)]
    assert_same_losses(*losses)


def test_loading_into_a_model_whose_head_was_replaced():
    """torch's fine-tuning habit: after the first call, ``model.fc2 = nn.Linear(16, 4)``,
    then ``model.load_state_dict(saved)`` loads the new head too (it raised a KeyError
    naming an object id: the old head's Parameters were still in the flat buffer)."""
    ours, _ = pair(Mlp, TorchMlp)
    ours.loss()
    saved = ours.model.state_dict()
    ours.model.fc2 = nn.Linear(16, 4)
    ours.model.load_state_dict(saved)
    np.testing.assert_array_equal(ours.model.fc2.weight.numpy(), saved["fc2.weight"])
    np.testing.assert_array_equal(ours.model.state_dict()["fc2.bias"], saved["fc2.bias"])


# ------------------------------------------------------------------ zeroing gradients

class Branches(nn.Module):
    """Its second Linear joins only on odd calls: the even steps' backward misses it."""

    def __init__(self):
        super().__init__()
        self.main, self.extra, self.calls = nn.Linear(8, 4), nn.Linear(8, 4), 0

    def forward(self, x):
        self.calls += 1
        return self.main(x) + self.extra(x) if self.calls % 2 else self.main(x)


class TorchBranches(tnn.Module):
    def __init__(self):
        super().__init__()
        self.main, self.extra, self.calls = tnn.Linear(8, 4), tnn.Linear(8, 4), 0

    forward = Branches.forward


def sgd_momentum(framework, model):
    return framework.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.05)


@pytest.mark.parametrize("owner, set_to_none", [("optimizer", False), ("model", True),
                                                 ("model", False)])
def test_zero_grad_spelled_torch_s_ways(owner, set_to_none):
    """torch: ``optimizer.zero_grad(set_to_none=False)``, ``model.zero_grad()`` and
    ``model.zero_grad(set_to_none=False)`` (they raised TypeError and AttributeError). With
    zeros instead of None, torch still moves the branch the backward missed (momentum,
    decay), and so must the engine."""
    ours, theirs = pair(Branches, TorchBranches, sgd_momentum)
    losses = []
    for side in (ours, theirs):
        zero_grad = getattr(side.optimizer if owner == "optimizer" else side.model,
                            "zero_grad")
        losses.append([side.step(lambda: zero_grad(set_to_none=set_to_none))
                       for _ in range(4)])   # the last one misses the branch
        assert (side.model.extra.bias.grad is None) == set_to_none
    assert_same_losses(*losses)


# ------------------------------------------------------------------ writing p.data

@pytest.mark.parametrize("optimizer", [sgd_momentum, adam])
def test_assigning_parameter_data_mid_training(optimizer):
    """torch: ``for p in model.parameters(): p.data = p.data * 0.5`` between steps (a
    custom re-initialisation, an EMA's copy), then the same optimizer trains on. The
    engine's ``p.data`` was the Parameter's view of the flat buffer; the assignment made it
    an array of its own, and the optimizer stepped the buffer: the loss stopped moving."""
    ours, theirs = pair(Mlp, TorchMlp, optimizer)
    losses = []
    for side in (ours, theirs):
        done = [side.step() for _ in range(2)]
        for p in side.model.parameters():
            p.data = p.data * 0.5
        done += [side.step() for _ in range(3)]
        losses.append(done)
    assert_same_losses(*losses)
    state = ours.model.state_dict()
    for name, p in theirs.model.named_parameters():
        expected = p.detach().numpy()
        np.testing.assert_allclose(state[name], expected.T if name.endswith("weight")
                                   else expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ between the steps

def test_train_eval_and_to_between_steps_with_batch_norm():
    """torch: ``model.train()``, a step, ``model.eval()`` and a validation loss under
    ``no_grad``, then ``model = model.to("cpu")``, every step; BatchNorm's running
    statistics and the losses follow torch's."""
    ours, theirs = pair(Normed, TorchNormed, OPTIMIZERS["nesterov"])
    losses = [[], []]
    for _ in range(3):
        for side, done, framework in ((ours, losses[0], engine), (theirs, losses[1], torch)):
            side.model.train()
            done.append(side.step())
            side.model.eval()
            with framework.no_grad():
                done.append(side.loss().item())
            side.model = side.model.to("cpu")
    np.testing.assert_allclose(*losses, rtol=RTOL, atol=1e-6)
    np.testing.assert_allclose(ours.model.bn.running_var.numpy(),
                               theirs.model.bn.running_var.numpy(), rtol=1e-5)


SCHEDULERS = {
    "StepLR": lambda lr_scheduler, o: lr_scheduler.StepLR(o, 2, gamma=0.5),
    "CosineAnnealingLR": lambda lr_scheduler, o: lr_scheduler.CosineAnnealingLR(o, 4),
    "LambdaLR": lambda lr_scheduler, o: lr_scheduler.LambdaLR(o, lambda epoch: 0.7 ** epoch),
    "OneCycleLR": lambda lr_scheduler, o: lr_scheduler.OneCycleLR(o, 0.5, total_steps=6),
}


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
def test_two_param_groups_under_a_scheduler(scheduler):
    """torch: ``SGD([{"params": model.fc1.parameters()}, {"params": model.fc2.parameters(),
    "lr": 0.05}], lr=0.2, momentum=0.9)`` and a scheduler stepped after each step."""
    def two_groups(framework, model):
        return framework.SGD([{"params": model.fc1.parameters()},
                              {"params": model.fc2.parameters(), "lr": 0.05}],
                             lr=0.2, momentum=0.9)

    ours, theirs = pair(Mlp, TorchMlp, two_groups)
    losses = []
    for side, lr_scheduler in ((ours, optim.lr_scheduler), (theirs, torch.optim.lr_scheduler)):
        side.scheduler = SCHEDULERS[scheduler](lr_scheduler, side.optimizer)
        done = []
        for _ in range(5):
            done.append(side.step())
            side.scheduler.step()
        losses.append(done)
    assert_same_losses(*losses)
    np.testing.assert_allclose(ours.scheduler.get_last_lr(), theirs.scheduler.get_last_lr())


def test_reduce_lr_on_plateau():
    """torch: ``ReduceLROnPlateau(optimizer, patience=0, factor=0.5)``, stepped with a
    validation loss that does not improve."""
    ours, theirs = pair(Mlp, TorchMlp)
    losses = []
    for side, lr_scheduler in ((ours, optim.lr_scheduler), (theirs, torch.optim.lr_scheduler)):
        scheduler = lr_scheduler.ReduceLROnPlateau(side.optimizer, patience=0, factor=0.5)
        done = []
        for _ in range(4):
            done.append(side.step())
            scheduler.step(1.0)
        losses.append(done)
    assert_same_losses(*losses)
    assert ours.optimizer.param_groups[0]["lr"] == theirs.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("when", ["before the optimizer", "after two steps"])
def test_freezing_a_layer(when):
    """torch: ``for p in model.fc1.parameters(): p.requires_grad_(False)`` before
    ``optimizer = SGD(model.parameters(), momentum=0.9, weight_decay=0.1)`` or after two
    steps of it: the frozen layer never moves again (no decay, no momentum)."""
    ours, theirs = pair(Mlp, TorchMlp, lambda framework, m: framework.SGD(
        m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1))
    losses = []
    for side in (ours, theirs):
        done = [] if when.startswith("before") else [side.step() for _ in range(2)]
        for p in side.model.fc1.parameters():
            p.requires_grad_(False)
        frozen = np.array(side.model.fc1.weight.detach().numpy(), copy=True)
        done += [side.step() for _ in range(3)]
        np.testing.assert_array_equal(side.model.fc1.weight.detach().numpy(), frozen)
        losses.append(done)
    assert_same_losses(*losses)


def test_unfreezing_into_a_new_param_group():
    """torch's fine-tuning: train the head alone, then unfreeze the body and
    ``optimizer.add_param_group({"params": model.fc1.parameters(), "lr": 1e-3})``."""
    def head_only(framework, model):
        for p in model.fc1.parameters():
            p.requires_grad_(False)
        return framework.Adam(model.fc2.parameters(), lr=0.01)

    ours, theirs = pair(Mlp, TorchMlp, head_only)
    losses = []
    for side in (ours, theirs):
        done = [side.step() for _ in range(2)]
        for p in side.model.fc1.parameters():
            p.requires_grad_(True)
        side.optimizer.add_param_group({"params": side.model.fc1.parameters(), "lr": 1e-3})
        losses.append(done + [side.step() for _ in range(3)])
    assert_same_losses(*losses)


def test_clipping_the_gradient_norm():
    """torch: ``nn.utils.clip_grad_norm_(model.parameters(), 0.1)`` between backward and
    step (the engine's is ``optim.clip_grad_norm_``): its returned norms and the losses
    are torch's."""
    ours, theirs = pair(Mlp, TorchMlp, lambda framework, m: framework.SGD(m.parameters(), 0.5))
    norms, losses = [[], []], [[], []]
    for side, utils, seen, done in ((ours, optim, norms[0], losses[0]),
                                    (theirs, tnn.utils, norms[1], losses[1])):
        for _ in range(3):
            side.optimizer.zero_grad()
            loss = side.loss()
            loss.backward()
            seen.append(float(utils.clip_grad_norm_(side.model.parameters(), 0.1)))
            side.optimizer.step()
            done.append(loss.item())
    np.testing.assert_allclose(*norms, rtol=RTOL)
    assert_same_losses(*losses)


@pytest.mark.parametrize("how", ["two half batches", "one graph twice"])
def test_accumulating_gradients_over_two_backwards(how):
    """torch: two ``loss.backward()`` calls before one step, on two half batches (each
    loss halved) or on one graph with ``retain_graph=True``."""
    ours, theirs = pair(Mlp, TorchMlp, OPTIMIZERS["nesterov"])
    losses = []
    for side in (ours, theirs):
        done = []
        for _ in range(3):
            side.optimizer.zero_grad()
            if how == "two half batches":
                for half in (slice(0, 3), slice(3, 6)):
                    loss = side.loss(side.x[half], side.y[half]) / 2
                    loss.backward()
            else:
                loss = side.loss()
                loss.backward(retain_graph=True)
                loss.backward()
            side.optimizer.step()
            done.append(loss.item())
        losses.append(done)
    assert_same_losses(*losses)


# ------------------------------------------------------------------ convolutions

class ConvNet(nn.Module):
    """torch's MNIST example in small: Conv2d, BatchNorm2d, MaxPool2d, Flatten, Linear."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3)
        self.pool, self.head = nn.MaxPool2d(2), nn.Sequential(nn.Flatten(), nn.Linear(12, 4))

    def forward(self, x):
        return self.head(self.pool(self.bn(self.conv(x)).relu()))


class TorchConvNet(tnn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = tnn.Conv2d(1, 3, 3, padding=1), tnn.BatchNorm2d(3)
        self.pool, self.head = tnn.MaxPool2d(2), tnn.Sequential(tnn.Flatten(), tnn.Linear(12, 4))

    forward = ConvNet.forward


@pytest.mark.parametrize("make_engine, make_torch", [
    (ConvNet, TorchConvNet),
    (lambda: nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
                           nn.Linear(12, 4)),
     lambda: tnn.Sequential(tnn.Conv2d(1, 3, 3), tnn.BatchNorm2d(3), tnn.ReLU(),
                            tnn.Flatten(), tnn.Linear(12, 4)))], ids=["module", "sequential"])
def test_a_conv_net_takes_its_optimizer_before_the_first_call(make_engine, make_torch):
    """torch: ``model = Net(); optimizer = optim.SGD(model.parameters(), ...)`` for a net of
    Conv2d and BatchNorm2d (``parameters()`` raised "not built yet": their parameters were
    made by the first call), then training."""
    x, y = batch(features=16)
    x = x.reshape(-1, 1, 4, 4)
    torch.manual_seed(0)
    reference, model = make_torch(), make_engine()
    ours = Side(model, OPTIMIZERS["nesterov"](optim, model), x, y, engine)
    load_state_dict(model, reference.state_dict())   # after: the optimizer's are the same
    theirs = Side(reference, OPTIMIZERS["nesterov"](torch.optim, reference), x, y, torch)
    train_both(ours, theirs)


@pytest.mark.parametrize("vocabulary", [8, 11])
def test_nanogpt_s_head_tied_to_its_embedding_is_refused_with_the_remedy(vocabulary):
    """nanoGPT's ``self.lm_head.weight = self.wte.weight``: the engine's Linear holds its
    weight as (in, out), torch's transposed, so with a square table the tie ran silently as
    x @ E where torch computes x @ E.T (and the Embedding's table was None in __init__)."""
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(vocabulary, 8)
            assert self.wte.weight is not None   # made by the constructor, as torch's
            self.lm_head = nn.Linear(8, vocabulary)
            self.lm_head.weight = self.wte.weight

        def forward(self, ids):
            return self.lm_head(self.wte(ids))

    with pytest.raises(TypeError, match=r"Linear.weight: this Parameter is Embedding.weight.*"
                                        r"x @ self.tok_emb.weight.T"):
        Head()


def test_a_head_using_its_embedding_in_forward_trains_as_torch_s_tie():
    """The remedy the refusal names: ``logits = h @ wte.weight.T``, one Parameter."""
    def model_pair():
        class Tied(nn.Module):
            def __init__(self):
                super().__init__()
                self.wte = nn.Embedding(8, 8)

            def forward(self, ids):
                return self.wte(ids) @ self.wte.weight.T

        class TorchTied(tnn.Module):
            def __init__(self):
                super().__init__()
                self.wte = tnn.Embedding(8, 8)
                self.lm_head = tnn.Linear(8, 8, bias=False)
                self.lm_head.weight = self.wte.weight

            def forward(self, ids):
                return self.lm_head(self.wte(ids))

        torch.manual_seed(0)
        reference = TorchTied()
        model = Tied()
        model.wte.weight.data = reference.wte.weight.detach().numpy().copy()
        return model, reference

    model, reference = model_pair()
    ids = np.random.default_rng(0).integers(0, 8, (3, 5))
    optimizer = optim.SGD(model.parameters(), lr=0.5)
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(3):
        loss = nn.CrossEntropyLoss()(model(engine.tensor(ids)).reshape(-1, 8),
                                     engine.tensor(ids.reshape(-1)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_loss = tnn.CrossEntropyLoss()(reference(torch.from_numpy(ids)).reshape(-1, 8),
                                            torch.from_numpy(ids.reshape(-1)))
        torch_loss.backward()
        torch_optimizer.step()
        torch_optimizer.zero_grad()
        np.testing.assert_allclose(loss.item(), torch_loss.item(), rtol=RTOL)
