"""Differential testing of ``engine.capture``: random training programs, run eagerly and
captured from the same seed, must give the same losses, errors, weights and optimizer state
bit for bit (or the captured one runs eagerly and says why).

A program draws a model (Dense stacks, Dropout, BatchNorm; or an ``nn.Model`` of residual
blocks in an ``nn.LayerList``, frozen through ``trainable`` on a nested block), an optimizer
and its options, a schedule, clipping, a warm-up count, and a list of calls with events
between them: partial batches, freezing and unfreezing a layer, train/eval switches, a
learning rate written by hand, a call with a bad label, a call that raises before
``opt.step()``. Some programs read the loss on the host inside the step (``if loss.item() >
...``): those must run eagerly with a reason. The harness reads every returned loss on the host, as a training loop does, so a
bad label raises at the same point on CUDA in both runs.
"""
import random

import numpy as np
import pytest

import engine
import optim
from engine import nn
from engine.losses import cross_entropy
from ops.cuda import SIMULATOR

FEATURES, CLASSES = 5, 3


class Raised(Exception):
    pass


def _program(seed):
    rng = random.Random(seed)
    layers = rng.choice([(), (6,), (7, 4)])
    program = {
        "layers": layers,
        "dropout": bool(layers) and rng.random() < 0.4,
        "batchnorm": bool(layers) and rng.random() < 0.3,
        "optimizer": rng.choice(["sgd", "momentum", "nesterov", "dampened", "adam", "adamw"]),
        "weight_decay": rng.choice([0.0, 0.0, 0.05]),
        "clip": rng.choice([None, None, "norm", "value"]),
        "schedule": rng.choice([None, "step", "cosine"]),
        "warmup": rng.choice([0, 1, 1, 2]),
        "host_read": rng.random() < 0.15,
        "calls": [],
    }
    # drawn apart, so the programs of earlier seeds stay what they were
    program["residual"] = bool(layers) and random.Random(seed + 7919).random() < 0.5
    frozen = False
    for call in range(rng.randint(7, 13)):
        events = set()
        if rng.random() < 0.15 and layers:
            events.add("unfreeze" if frozen else "freeze")
            frozen = not frozen
        if rng.random() < 0.12 and (program["dropout"] or program["batchnorm"]):
            events.add("eval" if rng.random() < 0.5 else "train")
        if rng.random() < 0.15:
            events.add("lr")
        if rng.random() < 0.08:
            events.add("bad_label")
        if call == 0 and rng.random() < 0.3:
            # the first call warms up or records, never replays: a Python branch of a later
            # call would be frozen by a replay, as documented
            events.add("raise")
        rows = rng.choice([6, 6, 6, 4])
        program["calls"].append((rows, events))
    return program


def _optimizer(program, params):
    kind, decay = program["optimizer"], program["weight_decay"]
    if kind == "adam":
        return optim.Adam(params, lr=0.02, weight_decay=decay)
    if kind == "adamw":
        return optim.AdamW(params, lr=0.02, weight_decay=decay or 0.01)
    momentum = {"sgd": 0.0, "momentum": 0.9, "nesterov": 0.9, "dampened": 0.8}[kind]
    return optim.SGD(params, lr=0.1, momentum=momentum, nesterov=kind == "nesterov",
                     dampening=0.3 if kind == "dampened" else 0.0, weight_decay=decay)


class _Block(nn.Layer):
    """``x + outer(inner(x))``, BatchNorm and Dropout between when the program has them."""

    def __init__(self, width, program):
        super().__init__()
        self.inner = nn.Dense(width, activation="relu")
        self.between = nn.Sequential([nn.BatchNorm()] * program["batchnorm"]
                                     + [nn.Dropout(0.3)] * program["dropout"])
        self.outer = nn.Dense(width)

    def forward(self, x):
        h = self.inner(x)
        return x + self.outer(self.between(h) if self.between.layers else h)


class _Residual(nn.Model):
    def __init__(self, program):
        super().__init__()
        width = program["layers"][0]
        self.stem = nn.Dense(width)
        self.blocks = nn.LayerList([_Block(width, program) for _ in program["layers"]])
        self.head = nn.Dense(CLASSES)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _run(program, device, captured, seed):
    engine.manual_seed(seed)
    if program["residual"]:
        return _run_model(program, device, captured, seed, _Residual(program))
    layers = [nn.Flatten(input_shape=(FEATURES,))]
    for width in program["layers"]:
        layers.append(nn.Dense(width, activation="relu"))
        if program["batchnorm"]:
            layers.append(nn.BatchNorm())
        if program["dropout"]:
            layers.append(nn.Dropout(0.3))
    layers.append(nn.Dense(CLASSES))
    return _run_model(program, device, captured, seed, nn.Sequential(layers))


def _run_model(program, device, captured, seed, model):
    model = model.to(device)
    model.build((FEATURES,))
    opt = _optimizer(program, model.parameters())
    schedule = {None: None,
                "step": lambda: optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
                "cosine": lambda: optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5),
                }[program["schedule"]]
    schedule = schedule() if schedule else None
    raise_now = [False]

    def step(x, y):
        opt.zero_grad()
        loss = cross_entropy(model(x), y)
        loss.backward()
        if raise_now[0]:
            raise Raised("before opt.step()")
        if program["clip"] == "norm":
            optim.clip_grad_norm_(model.parameters(), 0.5)
        elif program["clip"] == "value":
            optim.clip_grad_value_(model.parameters(), 0.05)
        if program["host_read"]:
            if loss.item() < 1e9:   # a branch on a device value: the step must run eagerly
                opt.step()
        else:
            opt.step()
        return loss

    if captured:
        step = engine.capture(step, warmup=program["warmup"])
    rng = np.random.default_rng(seed)
    frozen = (model.blocks[0] if program["residual"] else
              next(layer for layer in model.layers if isinstance(layer, nn.Dense)))
    outcomes = []
    for rows, events in program["calls"]:
        x = rng.standard_normal((rows, FEATURES))
        y = rng.integers(0, CLASSES, rows)
        if "bad_label" in events:
            y[rows // 2] = CLASSES + 4
        if "freeze" in events or "unfreeze" in events:
            frozen.trainable = "unfreeze" in events   # a nested block of a residual model
        if "eval" in events:
            model.eval()
        if "train" in events:
            model.train()
        if "lr" in events:
            opt.param_groups[0]["lr"] *= 0.7
        raise_now[0] = "raise" in events
        try:
            loss = step(engine.tensor(x, dtype=np.float32, device=device),
                        engine.tensor(y, device=device))
            outcomes.append(float(loss))   # the host read a training loop makes
        except (Raised, ValueError) as error:
            outcomes.append(type(error).__name__)
        if schedule is not None:
            schedule.step()
    return outcomes, model.state_dict(), opt.state_dict(), step


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, z) for x, z in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)
    return a == b


def check_program(seed, device):
    program = _program(seed)
    if device == "cuda" and not SIMULATOR:
        # On a GPU the bad-label flag is read without a sync (ops/loss.py): the ValueError
        # comes in the bad call's backward or at the next call as the kernels' timing falls,
        # so which call aborts differs from run to run, eager or captured (2 of 240 programs
        # differed on the H200 under 14 test processes). The simulator runs kernels
        # synchronously; test_capture's bad-label test covers a replay on the GPU.
        program["calls"] = [(rows, events - {"bad_label"}) for rows, events in program["calls"]]
    eager = _run(program, device, False, seed)
    captured = _run(program, device, True, seed)
    step = captured[3]
    assert _same(eager[0], captured[0]), (program, eager[0], captured[0])
    assert _same(eager[1], captured[1]), program
    assert _same(eager[2], captured[2]), program
    if program["host_read"]:
        assert step.eager_reason and "read on the host" in step.eager_reason
        assert step.recordings == 0
    else:
        assert step.eager_reason is None, (program, step.eager_reason)
    return program, step


@pytest.mark.parametrize("seed", range(40))
def test_random_programs_captured_equal_eager_cpu(seed):
    check_program(seed, "cpu")


def test_the_random_programs_reach_every_event():
    """The 40 CI programs replay, switch modes, freeze, change lr, raise and read the host."""
    programs = [_program(seed) for seed in range(40)]
    events = set().union(*(e for p in programs for _, e in p["calls"]))
    assert events == {"freeze", "unfreeze", "eval", "train", "lr", "bad_label", "raise"}
    assert {p["optimizer"] for p in programs} == {"sgd", "momentum", "nesterov", "dampened",
                                                  "adam", "adamw"}
    assert any(p["host_read"] for p in programs) and any(p["warmup"] == 0 for p in programs)
    assert {p["clip"] for p in programs} == {None, "norm", "value"}
    residual = [p for p in programs if p["residual"]]
    assert any("freeze" in e for p in residual for _, e in p["calls"])
    assert any(p["dropout"] for p in residual) and any(p["batchnorm"] for p in residual)


@pytest.mark.cuda
@pytest.mark.parametrize("seed", [3, 11] if SIMULATOR else range(40))
def test_random_programs_captured_equal_eager_cuda(seed):
    check_program(seed, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(40, 240))
def test_many_random_programs_captured_equal_eager_gpu(seed):
    check_program(seed, "cuda")
