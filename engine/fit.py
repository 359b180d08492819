"""The training loop (``fit``, ``evaluate``) and the training state it resumes from
(checkpoints).

``fit`` runs epochs of forward, loss, backward, optional gradient clipping and an optimizer
step, and returns one record per epoch. Each batch's loss and correct predictions are added
up on the batch's own device by one small kernel (``ops.metrics``) and read back once at the
end of the epoch, so a GPU step never waits for the host; the progress bar reads one loss
every ``PROGRESS_EVERY`` steps. Per-step losses, when asked for, are kept as the steps' own
loss arrays and read once at the end of the epoch.

A checkpoint is a ``model.save`` file (architecture and weights under their names) plus
entries under ``nn.TRAINING_PREFIX``: the optimizer state, epoch, history, the run's
configuration and the engine's RNG state, encoded by ``engine.archive`` and written
atomically. Reading one checks every value, so a damaged or crafted file is a ``ValueError``
saying what is wrong, never a crash later in training.
"""
import json
import time
import weakref

import numpy as np
from tqdm import tqdm

import optim
from engine import archive, nn
from engine.autograd import no_grad
from engine.random import generator
from engine.step_capture import capture as engine_capture
from engine.tensor import Tensor, tensor
from ops.device import to_host
from ops.metrics import RunningMetrics

PROGRESS_EVERY = 20   # steps between two loss reads for the progress bar (each one a sync)
RECORD_KEYS = ("epoch", "loss", "train_acc", "test_acc", "seconds", "samples_per_s")
# the bar without tqdm's batches/s and elapsed time: at 80 columns it keeps a bar of about
# 15 characters and the postfix (loss, samples/s) whole, for "epoch 10/10" and 469/469 steps
BAR_FORMAT = "{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{remaining}]{postfix}"


# ------------------------------------------------------------------ the loop

def _storage(value):
    """The host or device array behind a Tensor (labels may also come as NumPy arrays)."""
    return value.data if isinstance(value, Tensor) else np.asarray(value)


def _length(loader):
    try:
        return len(loader)
    except TypeError:   # a plain iterable: no total for the bar, buffers grow as needed
        return None


def progress_bar(total, epoch, epochs, **options):
    """The tqdm bar of one epoch (``total`` steps, None when unknown), on stderr unless
    ``options`` say otherwise."""
    return tqdm(total=total, desc=f"epoch {epoch}/{epochs}", unit="batch", leave=False,
                dynamic_ncols=True, bar_format=BAR_FORMAT, **options)


def show_progress(bar, loss, samples_per_s):
    bar.set_postfix_str(f"loss {loss:.4f}, {samples_per_s:.0f} samples/s", refresh=False)


def evaluate(model, loader):
    """Classification accuracy (a fraction) of ``model`` over ``loader``, in eval mode and
    without recording; the model's train/eval mode is restored afterwards."""
    was_training = getattr(model, "training", True)
    model.eval()
    try:
        metrics = None
        with no_grad():
            for inputs, labels in loader:
                logits = model(inputs)
                metrics = metrics or RunningMetrics(logits.device)
                metrics.add(None, logits.data, _storage(labels))
        return metrics.read()[1] if metrics is not None else None
    finally:
        if was_training:
            model.train()


def _read_losses(arrays):
    """One float64 array of the steps' loss arrays (host or device, one element each)."""
    if not arrays:
        return np.zeros(0)
    return np.concatenate([np.ravel(to_host(array)) for array in arrays]).astype(np.float64)


def _train_step(model, optimizer, loss_fn, parameters, clip_norm, metrics):
    """The function of one training step that ``fit`` captures (``engine.capture``): on the
    GPU its replay is one CUDA graph launch, the loss and accuracy summed on the device."""
    def train_step(inputs, labels):
        optimizer.zero_grad()
        logits = model(inputs)
        loss = loss_fn(logits, labels)
        loss.backward()
        if clip_norm:
            optim.clip_grad_norm_(parameters, clip_norm)
        optimizer.step()
        metrics.add(loss.data, logits.data, labels.data)
        return loss
    return train_step


_steps = weakref.WeakKeyDictionary()   # optimizer -> (what the step was made for, step, metrics)


def _step_for(model, optimizer, loss_fn, parameters, clip_norm, capture):
    """The training step and its metrics; a captured one is kept for the next ``fit`` call of
    the same model, optimizer, loss and clipping (its recordings then carry over: a loop of
    one-epoch ``fit`` calls records once)."""
    made_for = (id(model), loss_fn, float(clip_norm), capture, tuple(id(p) for p in parameters),
                parameters[0].device if parameters else "cpu")
    kept = _steps.get(optimizer)
    if kept is not None and kept[0] == made_for:
        return kept[1], kept[2]
    metrics = RunningMetrics(parameters[0].device if parameters else "cpu")
    step = _train_step(model, optimizer, loss_fn, parameters, clip_norm, metrics)
    if capture:
        step = engine_capture(step)
        _steps[optimizer] = (made_for, step, metrics)
    return step, metrics


def _train_epoch(loader, step, metrics, bar, step_losses):
    metrics.reset()
    losses = [] if step_losses is not None else None
    start = time.perf_counter()
    for index, (inputs, labels) in enumerate(loader):
        if not isinstance(labels, Tensor):   # labels may come as NumPy arrays
            labels = tensor(labels, device=inputs.device)
        loss = step(inputs, labels)
        if losses is not None:
            losses.append(loss.data)   # kept, not read: read once after the epoch
        if bar is not None:
            bar.update(1)
            if index % PROGRESS_EVERY == 0:   # the one host sync every PROGRESS_EVERY steps
                rate = (index + 1) * inputs.shape[0] / max(time.perf_counter() - start, 1e-9)
                show_progress(bar, loss.item(), rate)
    loss, train_acc, rows = metrics.read()   # waits for the GPU
    seconds = time.perf_counter() - start
    if losses is not None:
        step_losses.append(_read_losses(losses))
    return {"loss": loss, "train_acc": train_acc, "seconds": seconds,
            "samples_per_s": rows / seconds if seconds > 0 else None}


def format_record(record, epochs):
    """One metrics line, like
    ``epoch 2/5  loss 0.0951  train 97.12%  test 97.40%  4.1 s  14630 samples/s``."""
    def percent(value):
        return "-" if value is None else f"{100 * value:.2f}%"
    loss = "-" if record["loss"] is None else f"{record['loss']:.4f}"
    rate = record["samples_per_s"] or 0
    return (f"epoch {record['epoch']}/{epochs}  loss {loss}  train {percent(record['train_acc'])}  "
            f"test {percent(record['test_acc'])}  {record['seconds']:.1f} s  {rate:.0f} samples/s")


def append_record(path, record):
    """Append ``record`` to ``path`` as one JSON line."""
    with open(path, "a") as log:
        log.write(json.dumps(record) + "\n")


def fit(model, loader, optimizer, loss_fn, epochs, test_loader=None, scheduler=None,
        clip_norm=0.0, on_epoch_end=(), progress=True, verbose=True, log_json=None,
        start_epoch=0, history=None, step_losses=None, capture=True):
    """Train ``model`` for epochs ``start_epoch + 1 .. epochs``; returns the list of records.

    Each step: ``optimizer.zero_grad()``, ``loss_fn(model(x), y).backward()``, gradient
    clipping to ``clip_norm`` (0: none), ``optimizer.step()``. After each epoch:
    ``scheduler.step()``, test accuracy on ``test_loader``, then the record
    ``{"epoch", "loss", "train_acc", "test_acc", "seconds", "samples_per_s"}`` (accuracies as
    fractions, None when the labels are not class indices; ``seconds`` is training time
    only) is appended to ``history`` (a list, extended in place; a new one by default),
    printed (``verbose``), appended as one JSON line to ``log_json`` and passed to each of
    ``on_epoch_end`` (a callable or a list of them). ``progress`` shows a tqdm bar per epoch
    on stderr. ``step_losses``, a list, receives per epoch one float64 array of the batch
    losses of its steps, read at the end of the epoch (no host sync per step).

    ``capture`` (the default) runs the step through ``engine.capture``: the first step of each
    batch shape runs eagerly, the second is recorded, the others replay it (one CUDA graph
    launch on the GPU); the results are the eager ones bit for bit. A step that cannot be
    captured (Dropout, for one) runs eagerly; ``fit.last_eager_reason`` says why."""
    if not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"fit: epochs must be a positive integer, got {epochs!r}")
    if not isinstance(start_epoch, int) or not 0 <= start_epoch <= epochs:
        raise ValueError(f"fit: start_epoch must be between 0 and epochs={epochs}, "
                         f"got {start_epoch!r}")
    if clip_norm < 0:
        raise ValueError(f"fit: clip_norm must be >= 0 (0 turns clipping off), got {clip_norm}")
    callbacks = [on_epoch_end] if callable(on_epoch_end) else list(on_epoch_end or ())
    history = [] if history is None else history
    parameters = model.parameters()
    step, metrics = _step_for(model, optimizer, loss_fn, parameters, clip_norm, capture)
    for epoch in range(start_epoch + 1, epochs + 1):
        bar = progress_bar(_length(loader), epoch, epochs) if progress else None
        model.train()
        try:
            record = _train_epoch(loader, step, metrics, bar, step_losses)
        finally:
            if bar is not None:
                bar.close()
        fit.last_eager_reason = getattr(step, "eager_reason", None)
        if scheduler is not None:
            scheduler.step()
        record = {"epoch": epoch, **record,
                  "test_acc": evaluate(model, test_loader) if test_loader is not None else None}
        record = {key: record[key] for key in RECORD_KEYS}
        history.append(record)
        if verbose:
            print(format_record(record, epochs), flush=True)
        if log_json:
            append_record(log_json, record)
        for callback in callbacks:
            callback(record)
    return history


fit.last_eager_reason = None


# ------------------------------------------------------------------ checkpoints

CHECKPOINT_KEY = nn.TRAINING_PREFIX + "checkpoint"   # the training state's JSON skeleton
CHECKPOINT_FILE = "a training checkpoint written by --save"


def save_checkpoint(path, model, optimizer, epoch=0, history=(), config=None):
    """Write model and optimizer state, the epoch counter, history, ``config`` and the
    engine's RNG state to ``path`` (an .npz) with ``engine.archive.atomic_write``. A schedule
    needs no state of its own: it is a function of the epoch.

    The file is a ``model.save`` file (architecture and weights under their names) plus
    entries under ``train/``: the training state as JSON and its arrays."""
    arrays = {}
    state = {"optimizer": optimizer.state_dict(), "epoch": epoch, "history": list(history),
             "config": config or {}, "rng": generator().bit_generator.state}
    skeleton = json.dumps(archive.encode(state, arrays))
    archive.write_npz(path, {
        nn.CONFIG_KEY: np.array(json.dumps(model.get_config())), **model.state_dict(),
        CHECKPOINT_KEY: np.array(skeleton),
        **{nn.TRAINING_PREFIX + name: array for name, array in arrays.items()}})


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_training_state(state):
    """Raise ValueError naming the first value ``save_checkpoint`` cannot have written."""
    if not isinstance(state, dict):
        raise ValueError(f"the training state is a {type(state).__name__}, not a dict")
    missing = [key for key in ("optimizer", "epoch", "history", "config", "rng")
               if key not in state]
    if missing:
        raise ValueError(f"the training state lacks {missing}")
    epoch, history = state["epoch"], state["history"]
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
    if not isinstance(history, list):
        raise ValueError(f"history must be a list of epoch records, got a "
                         f"{type(history).__name__}")
    for record in history:
        if not isinstance(record, dict) or tuple(record) != RECORD_KEYS:
            raise ValueError(f"a history record must have the keys {RECORD_KEYS}, got "
                             f"{record!r:.120}")
        if not (_is_number(record["epoch"]) and isinstance(record["epoch"], int)
                and 1 <= record["epoch"] <= epoch):
            raise ValueError(f"a history record's epoch must be 1..{epoch}, got "
                             f"{record['epoch']!r:.40}")
        bad = [key for key in RECORD_KEYS[1:]
               if record[key] is not None and not _is_number(record[key])]
        if bad:
            raise ValueError(f"history record {record['epoch']}: {bad[0]} is "
                             f"{record[bad[0]]!r:.40}, not a number")
    for key in ("optimizer", "config", "rng"):
        if not isinstance(state[key], dict):
            raise ValueError(f"{key} must be a dict, got a {type(state[key]).__name__}")
    try:   # the state a fresh generator of the same kind accepts is one ours will
        type(generator().bit_generator)().state = state["rng"]
    except (TypeError, ValueError, KeyError, OverflowError) as error:
        raise ValueError(f"rng is not a {type(generator().bit_generator).__name__} state "
                         f"({type(error).__name__}: {error})") from None


def read_checkpoint(path):
    """The state ``save_checkpoint`` wrote, as host NumPy arrays: ``{"model", "optimizer",
    "epoch", "history", "config", "rng"}``. A damaged or crafted file (a flipped byte, a
    negative or text epoch, history that is not a list of records, nesting deeper than
    ``archive.MAX_DEPTH``) is a ``ValueError`` naming the file and the problem."""
    stored = archive.read_npz(path, CHECKPOINT_FILE)
    if CHECKPOINT_KEY not in stored:
        raise ValueError(f"{path!r} is an .npz but not a training checkpoint (engine.train)")
    arrays = {name[len(nn.TRAINING_PREFIX):]: array for name, array in stored.items()
              if name.startswith(nn.TRAINING_PREFIX) and name != CHECKPOINT_KEY}
    text = archive.text_entry(stored, CHECKPOINT_KEY, path, CHECKPOINT_FILE)
    try:
        state = archive.decode(archive.loads_json(text, "the training state"), arrays)
        _check_training_state(state)
    except ValueError as error:
        raise ValueError(f"{path!r} is not {CHECKPOINT_FILE} ({error})") from None
    state["model"] = {name: array for name, array in stored.items()
                      if name != nn.CONFIG_KEY and not name.startswith(nn.TRAINING_PREFIX)}
    return state


def restore_checkpoint(state, model, optimizer):
    """Load a checkpoint's states into ``model``, ``optimizer`` and the engine's RNG; returns
    ``(epoch, history)`` to continue from."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    generator().bit_generator.state = state["rng"]
    return state["epoch"], state["history"]
