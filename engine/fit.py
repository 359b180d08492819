"""The training loop: ``Trainer``, ``fit`` and ``evaluate``.

A ``Trainer(model, optimizer, loss_fn)`` owns one training: its step and what it keeps from
one ``fit`` call to the next. ``trainer.fit(loader, epochs)`` runs epochs of training steps
and returns one record per epoch; ``fit(model, loader, optimizer, loss_fn, epochs)`` is the
same loop through a ``Trainer`` it makes (or reuses, see ``fit``). A step is forward, loss,
backward, the gradient all-reduce of a distributed run, optional gradient clipping and an
optimizer step, in one function (``_train_step``) that the trainer captures
(``engine.capture``) and keeps: callbacks (``engine.callbacks``) run between steps, never
inside one. Each batch's loss and correct predictions are added up on the batch's own device
by one small kernel (``ops.metrics``) and read back once at the end of the epoch, so a GPU
step never waits for the host; the progress bar reads one loss every ``PROGRESS_EVERY``
steps. Per-step losses, when asked for, are kept as the steps' own loss arrays and read once
at the end of the epoch.

With ``distributed=True`` every rank of ``engine.distributed`` runs ``fit`` on its shard of
each global batch: the gradients are averaged after each backward, and the epoch's training
loss, accuracy, seconds and samples/s are the whole world's (means over the ranks; samples/s
their sum), so every rank holds the same records and every callback decides alike.

The checkpoints a run resumes from are ``engine.checkpoint``'s; its functions are
re-exported here, as they were before they had a module of their own.
"""
import math
import time

import numpy as np

from engine import distributed as dist
from engine.autograd import no_grad
from engine.callbacks import (PROGRESS_EVERY, Callback, JsonLog,  # noqa: F401 (re-exported)
                              LearningRateScheduler, PrintMetrics, ProgressBar, append_record,
                              format_record, progress_bar, show_progress)
from engine.checkpoint import (CHECKPOINT_KEY, RECORD_KEYS,  # noqa: F401 (re-exported)
                               read_checkpoint, restore_checkpoint, save_checkpoint)
from engine.step_capture import capture as engine_capture
from engine.tensor import Tensor, tensor
from ops.device import to_host
from ops.metrics import RunningMetrics

WORLD_MEANS = ("loss", "train_acc", "seconds", "samples_per_s")   # averaged over the ranks
# ------------------------------------------------------------------ the loop

def _storage(value):
    """The host or device array behind a Tensor (labels may also come as NumPy arrays)."""
    return value.data if isinstance(value, Tensor) else np.asarray(value)


def _length(loader):
    try:
        return len(loader)
    except TypeError:   # a plain iterable: no total for the bar, buffers grow as needed
        return None


def evaluate(model, loader, loss_fn=None):
    """Classification accuracy (a fraction) of ``model`` over ``loader``, in eval mode and
    without recording; with ``loss_fn``, ``(mean loss per sample, accuracy)``. The accuracy
    is None when the labels are not class indices, both are None for an empty loader. The
    model's train/eval mode is restored afterwards."""
    if isinstance(loader, (tuple, list)) and len(loader) == 2 and all(
            hasattr(part, "shape") for part in loader):
        raise TypeError("evaluate: got a pair of arrays (x, y); pass a loader of batches, "
                        "e.g. evaluate(model, data.DataLoader(x, y, batch_size=256))")
    was_training = getattr(model, "training", True)
    model.eval()
    try:
        metrics = None
        with no_grad():
            for inputs, labels in loader:
                logits = model(inputs)
                loss = None if loss_fn is None else loss_fn(logits, labels).data
                metrics = metrics or RunningMetrics(logits.device)
                metrics.add(loss, logits.data, _storage(labels))
        loss, accuracy, _ = metrics.read() if metrics is not None else (None, None, 0)
        return accuracy if loss_fn is None else (loss, accuracy)
    finally:
        if was_training:
            model.train()


def _read_losses(arrays):
    """One float64 array of the steps' loss arrays (host or device, one element each)."""
    if not arrays:
        return np.zeros(0)
    return np.concatenate([np.ravel(to_host(array)) for array in arrays]).astype(np.float64)


def _train_step(model, optimizer, loss_fn, parameters, clip, metrics, distributed):
    """The function of one training step that ``fit`` captures (``engine.capture``): on the
    GPU its replay is one CUDA graph launch, the loss and accuracy summed on the device.
    With ``distributed`` the gradients are averaged over the ranks between backward and
    ``clip`` (``engine.distributed.all_reduce_gradients``).

    ``train_step(x, y)`` trains on one batch. ``train_step(x1, y1, x2, y2, ...)`` accumulates
    the gradients of its n batches, each loss scaled by 1/n, into one optimizer step: the
    update of one step on the n batches together (for equal batch sizes and a mean loss),
    and its loss is the mean of theirs."""
    def train_step(*batches):
        optimizer.zero_grad()
        pairs = [batches[i:i + 2] for i in range(0, len(batches), 2)]
        outputs = []
        for inputs, labels in pairs:
            logits = model(inputs)
            loss = loss_fn(logits, labels)
            (loss if len(pairs) == 1 else loss * (1.0 / len(pairs))).backward()
            outputs.append((loss, logits, labels))
        if distributed:
            dist.all_reduce_gradients(model)
        if clip is not None:
            clip(parameters)
        optimizer.step()
        for loss, logits, labels in outputs:
            metrics.add(loss.data, logits.data, labels.data)
        if len(outputs) == 1:
            return outputs[0][0]
        with no_grad():
            return sum(loss for loss, _, _ in outputs[1:]) + outputs[0][0] * 0 \
                if False else _mean([loss for loss, _, _ in outputs])
    return train_step


def _mean(losses):
    total = losses[0]
    for loss in losses[1:]:
        total = total + loss
    return total * (1.0 / len(losses))


def _cursor_step(cursor, train_step):
    """``train_step`` on batches at the loader's device cursor (``data.loader.EpochCursor``):
    the step fetches its own batches, so a replay of several steps in one graph launch walks
    the epoch by itself. Its arguments are ``count, seek`` per batch: ``seek`` is -1, or
    where the cursor must jump first (a sharded last batch; the position is the same every
    epoch, so the recording of that step holds it)."""
    def train_step_at_cursor(*plan):
        batches = []
        for count, seek in zip(plan[::2], plan[1::2]):
            if seek >= 0:
                cursor.seek(seek)
            batches += cursor.next_batch(count)
        return train_step(*batches)
    return train_step_at_cursor


def _epoch_cursor(loader, capture):
    """The loader's device cursor when the captured step can fetch its own batches (a
    loader with an ``epoch_cursor()``, ``data.DataLoader``'s, and no per-batch
    ``transform`` but a device-keyed one), else None: the loop iterates the loader."""
    if (capture and callable(getattr(loader, "epoch_cursor", None))
            and getattr(loader, "fetches_on_device", False)):
        return loader.epoch_cursor()
    return None


class Run:
    """What callbacks see of the ``fit`` call that runs them (``callback.run``): ``model``,
    ``optimizer``, ``epochs``, ``start_epoch``, ``steps`` (batches per epoch, or None),
    ``history`` (the records so far, this run's appended after each epoch), ``evaluates``
    (a test loader was given), ``record_keys``, and ``stop_training``: set it to end
    training once the current epoch is over, or, set in ``on_step_end``, at once: that
    epoch then gets no record and no ``on_epoch_end`` (so no checkpoint of it). In a
    distributed run, a callback that stops inside an epoch makes every rank agree first
    (``TerminateOnNaN`` does), or the others wait in the next all-reduce."""

    record_keys = RECORD_KEYS

    def __init__(self, model, optimizer, epochs, start_epoch, steps, history, evaluates):
        self.model, self.optimizer = model, optimizer
        self.epochs, self.start_epoch, self.steps = epochs, start_epoch, steps
        self.history, self.evaluates = history, evaluates
        self.stop_training = False

    def save_checkpoint(self, path, config=None):
        """Write the training checkpoint of the last finished epoch to ``path``
        (``save_checkpoint``: the format of ``python -m engine.train --save``)."""
        epoch = self.history[-1]["epoch"] if self.history else self.start_epoch
        save_checkpoint(path, self.model, self.optimizer, epoch, self.history, config)


def _overrides(callback, hook):
    return getattr(type(callback), hook) is not getattr(Callback, hook)


def _train_epoch(run, epoch, loader, step, metrics, callbacks, step_losses, cursor, accumulate):
    """One epoch of steps, the callbacks' ``on_step_end`` after each; the record's training
    part, or None when a callback set ``run.stop_training`` in ``on_step_end``. With a
    ``cursor`` the step fetches its own batches, and up to the callbacks' ``step_interval``
    steps run as one replay (one graph launch on CUDA)."""
    metrics.reset()
    losses = [] if step_losses is not None else None
    watchers = [callback for callback in callbacks if _overrides(callback, "on_step_end")]
    start = time.perf_counter()
    steps = (_loader_steps(loader, step, accumulate) if cursor is None else
             _cursor_steps(cursor, step, _steps_per_replay(watchers, losses), accumulate))
    for index, runs, rows, loss in steps:
        if losses is not None:
            losses.append(loss.data)   # kept, not read: read once after the epoch
        if watchers:
            logs = {"epoch": epoch, "step": index, "steps": run.steps, "rows": rows,
                    "loss": loss, "seconds": time.perf_counter() - start, "steps_run": runs}
            for callback in watchers:
                callback.on_step_end(logs)
            if run.stop_training:   # (TerminateOnNaN) the epoch ends here, unrecorded
                return None
    loss, train_acc, rows = metrics.read()   # waits for the GPU
    seconds = time.perf_counter() - start
    if losses is not None:
        step_losses.append(_read_losses(losses))
    return {"loss": loss, "train_acc": train_acc, "seconds": seconds,
            "samples_per_s": rows / seconds if seconds > 0 else None}


def _loader_steps(loader, step, accumulate):
    """The epoch's optimizer steps over the loader's batches, ``accumulate`` batches each
    (the last group may have fewer): ``(index, 1, rows, loss)`` per step."""
    group, rows, index = [], 0, -1
    for inputs, labels in loader:
        if not isinstance(labels, Tensor):   # labels may come as NumPy arrays
            labels = tensor(labels, device=inputs.device)
        group += [inputs, labels]
        rows += inputs.shape[0]
        if len(group) == 2 * accumulate:
            index += 1
            yield index, 1, rows, step(*group)
            group, rows = [], 0
    if group:
        yield index + 1, 1, rows, step(*group)


def _cursor_steps(cursor, step, per_replay, accumulate):
    """The epoch's optimizer steps at the device cursor, ``accumulate`` batches each (the
    last group may have fewer), up to ``per_replay`` steps of the same plan per replay of the
    captured ``step``, never past a multiple of ``per_replay``: ``(index of the last step,
    steps run, their rows, the last loss)`` per replay."""
    spans = cursor.start_epoch()
    plans = []
    expected = spans[0][0] if spans else 0   # start_epoch put the cursor on the first batch
    for first in range(0, len(spans), accumulate):
        plan = []
        for start, count in spans[first:first + accumulate]:
            plan += [count, -1 if start == expected else start]
            expected = start + cursor.stride
        plans.append((tuple(plan), sum(count for _, count in spans[first:first + accumulate])))
    per_replay = per_replay or len(plans)   # no callback watches steps: the epoch at once
    index = 0
    while index < len(plans):
        plan, rows = plans[index]
        runs = 1
        while (runs < per_replay - index % per_replay and index + runs < len(plans)
               and plans[index + runs][0] == plan):
            runs += 1
        loss = step.repeat(runs, *plan)
        index += runs
        yield index - 1, runs, runs * rows, loss


def _steps_per_replay(watchers, losses):
    """How many steps may run between two ``on_step_end`` calls: every step when the losses
    of all steps are kept, else the smallest ``step_interval`` of the callbacks watching."""
    if losses is not None:
        return 1
    return min([callback.step_interval for callback in watchers], default=None)


def _world_record(record):
    """``record`` with the ranks' means of ``WORLD_MEANS`` (a value that is None on any rank
    stays None) and samples/s summed over the ranks."""
    values = [math.nan if record[key] is None else record[key] for key in WORLD_MEANS]
    means = dict(zip(WORLD_MEANS, dist.mean_over_ranks(values)))
    means["samples_per_s"] *= dist.world_size()
    return {**record, **{key: None if math.isnan(value) else value
                         for key, value in means.items()}}


def _check_shard(loader):
    shard, expected = getattr(loader, "shard", None), (dist.rank(), dist.world_size())
    if shard is not None and shard != expected:
        raise ValueError(f"fit(distributed=True): the loader's shard is {shard}, this rank's "
                         f"is {expected}: give the DataLoader shard=(dist.rank(), "
                         "dist.world_size())")


def _agree_on_stopping(run, epoch, distributed):
    """Whether to stop; in a distributed run every rank must decide alike (a rank that
    stopped alone would leave the others waiting in the next all-reduce)."""
    if distributed:
        dist.check_agreement(f"stopping training after epoch {epoch}", run.stop_training)
    return run.stop_training


def _callbacks(callbacks, progress, verbose, log_json):
    """The built-in callbacks that ``progress``, ``verbose`` and ``log_json`` ask for, then
    ``callbacks`` (checked to be Callback objects)."""
    for callback in callbacks:
        if not isinstance(callback, Callback):
            raise TypeError(f"fit: callbacks must be engine.callbacks.Callback objects, got "
                            f"{callback!r}; a plain function goes in on_epoch_end=")
    built_in = [ProgressBar() if progress else None, PrintMetrics() if verbose else None,
                JsonLog(log_json) if log_json else None]
    return [callback for callback in built_in if callback is not None] + list(callbacks)


class Trainer:
    """One training: ``model`` trained by ``optimizer`` on ``loss_fn``. The trainer owns the
    training step, captured (``engine.capture``) unless ``capture=False``, and its on-device
    metrics, and keeps them from one ``fit`` call to the next: a loop of one-epoch calls
    records its step once (as chainer's updater owns its step and a Keras model its compiled
    train function).

    ``clip``: gradient clipping, a function of the parameters run between backward and the
    optimizer step (``functools.partial(optim.clip_grad_norm_, max_norm=1.0)``), or None.
    ``distributed=True``: data-parallel over the ranks of ``engine.distributed`` (see
    ``fit``). ``eager_reason``: why the last epoch's step ran eagerly instead of replaying
    its recording (a host read in the loss, a distributed run's all-reduce), or None.
    ``train_step``: the captured step kept for the next call (an ``engine.capture`` object:
    ``recordings``, ``replayed``), None before the first ``fit`` or with ``capture=False``.
    ``accumulate_steps=k``: each optimizer step sums the gradients of k batches, each loss
    scaled by 1/k (the update of one step on the k batches together); an epoch's last group
    of j < k batches is stepped too, each of its losses scaled by 1/j. Callbacks, schedulers
    and checkpoints count optimizer steps, and one step of k batches is captured as one.

        trainer = Trainer(model, opt, cross_entropy)
        for epoch in range(1, 4):
            trainer.fit(loader, epochs=epoch, start_epoch=epoch - 1, progress=False)"""

    def __init__(self, model, optimizer, loss_fn, clip=None, capture=True, distributed=False,
                 accumulate_steps=1):
        if isinstance(accumulate_steps, bool) or not isinstance(accumulate_steps, int) \
                or accumulate_steps < 1:
            raise ValueError(f"Trainer: accumulate_steps must be an integer >= 1, got "
                             f"{accumulate_steps!r}")
        if clip is not None and not callable(clip):
            raise TypeError(f"Trainer: clip must be a function of the parameters, e.g. "
                            f"functools.partial(optim.clip_grad_norm_, max_norm=1.0), or "
                            f"None; got {clip!r}")
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.clip, self.capture, self.distributed = clip, capture, distributed
        self.accumulate_steps = accumulate_steps
        self.eager_reason = None
        self._kept = None   # (what the captured step was made for, step, metrics)

    @property
    def train_step(self):
        return None if self._kept is None else self._kept[1]

    def _step_for(self, parameters, cursor):
        """The training step and its metrics: the captured one kept from the last call when
        it was made for the same parameters, device and loader cursor."""
        device = parameters[0].device if parameters else "cpu"
        made_for = (tuple(id(p) for p in parameters), device, id(cursor))
        if self._kept is not None and self._kept[0] == made_for:
            return self._kept[1], self._kept[2]
        metrics = RunningMetrics(device)
        step = _train_step(self.model, self.optimizer, self.loss_fn, parameters, self.clip,
                           metrics, self.distributed)
        if cursor is not None:
            step = _cursor_step(cursor, step)
        if self.capture:
            step = engine_capture(step)
            self._kept = (made_for, step, metrics)
        return step, metrics

    def fit(self, loader, epochs, test_loader=None, scheduler=None, callbacks=(),
            on_epoch_end=(), progress=True, verbose=True, log_json=None, start_epoch=0,
            history=None, step_losses=None):
        """Train for epochs ``start_epoch + 1 .. epochs`` on ``loader``; returns the list of
        records. The arguments are ``fit``'s (whose docstring says what each does)."""
        if not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"fit: epochs must be a positive integer, got {epochs!r}")
        if not isinstance(start_epoch, int) or not 0 <= start_epoch <= epochs:
            raise ValueError(f"fit: start_epoch must be between 0 and epochs={epochs}, "
                             f"got {start_epoch!r}")
        model, distributed = self.model, self.distributed
        if distributed:
            _check_shard(loader)
        callbacks = _callbacks(callbacks, progress, verbose, log_json)
        functions = [on_epoch_end] if callable(on_epoch_end) else list(on_epoch_end or ())
        history = [] if history is None else history
        cursor = _epoch_cursor(loader, self.capture)
        step, metrics = self._step_for(model.parameters(), cursor)
        batches = _length(loader)
        steps = None if batches is None else -(-batches // self.accumulate_steps)
        if scheduler is not None and getattr(scheduler, "per_batch", False):
            callbacks.append(LearningRateScheduler(scheduler))   # stepped after every step
            scheduler = None
        run = Run(model, self.optimizer, epochs, start_epoch, steps, history,
                  test_loader is not None)
        for callback in callbacks:
            callback.run = run
        error = None
        try:
            for callback in callbacks:
                callback.on_train_begin({"epochs": epochs, "start_epoch": start_epoch,
                                         "steps": run.steps})
            epoch = start_epoch
            while epoch < epochs and not _agree_on_stopping(run, epoch, distributed):
                epoch += 1
                for callback in callbacks:
                    callback.on_epoch_begin({"epoch": epoch})
                model.train()
                record = _train_epoch(run, epoch, loader, step, metrics, callbacks,
                                      step_losses, cursor, self.accumulate_steps)
                self.eager_reason = getattr(step, "eager_reason", None)
                if record is None:   # stopped inside the epoch: no record, no on_epoch_end
                    break
                if distributed:
                    record = _world_record(record)
                test_loss, test_acc = (evaluate(model, test_loader, self.loss_fn)
                                       if test_loader is not None else (None, None))
                record.update(epoch=epoch, test_loss=test_loss, test_acc=test_acc)
                record = {key: record[key] for key in RECORD_KEYS}
                if scheduler is not None:   # ReduceLROnPlateau reads the record's loss
                    _step_scheduler(scheduler, record)
                history.append(record)
                for callback in callbacks:
                    callback.on_epoch_end(record)
                for function in functions:
                    function(record)
        except BaseException as failure:
            error = failure
            raise
        finally:
            for callback in callbacks:
                callback.on_train_end({"history": history, "error": error})
        return history


def _step_scheduler(scheduler, record):
    """One epoch's ``scheduler.step()``; ``ReduceLROnPlateau`` gets the test loss (the
    training loss without a test loader)."""
    if getattr(scheduler, "needs_metric", False):
        scheduler.step(record["test_loss"] if record["test_loss"] is not None
                       else record["loss"])
    else:
        scheduler.step()


# the attribute of an optimizer that holds the Trainer fit made for it: the two live and die
# together (a table keyed by optimizer would keep every Trainer, and so its optimizer, alive)
_FIT_TRAINER = "_trainer_of_fit"


def fit(model, loader, optimizer, loss_fn, epochs, test_loader=None, scheduler=None,
        clip=None, callbacks=(), on_epoch_end=(), progress=True, verbose=True, log_json=None,
        start_epoch=0, history=None, step_losses=None, capture=True, distributed=False,
        accumulate_steps=1):
    """Train ``model`` for epochs ``start_epoch + 1 .. epochs``; returns the list of records.
    ``Trainer(model, optimizer, loss_fn, clip, capture, distributed, accumulate_steps)
    .fit(loader, epochs, ...)`` with the other arguments; ``fit`` reuses the Trainer it made
    for ``optimizer`` at an earlier call with the same model, ``loss_fn``, ``clip``,
    ``capture``, ``distributed`` and ``accumulate_steps`` (kept with the optimizer), so a
    loop of one-epoch ``fit`` calls records its step once. ``accumulate_steps=k`` sums the
    gradients of k batches into each optimizer step (``Trainer``). ``fit.last_eager_reason`` is that Trainer's ``eager_reason`` after
    the last call.

    Each step: ``optimizer.zero_grad()``, ``loss_fn(model(x), y).backward()``, with
    ``distributed`` the gradient all-reduce, ``clip(parameters)`` when given (gradient
    clipping: ``functools.partial(optim.clip_grad_norm_, max_norm=1.0)``; the same object
    in a loop of ``fit`` calls lets them share one recorded step), ``optimizer.step()``.
    After each epoch: the test loss and accuracy on ``test_loader``, ``scheduler.step()``
    (``ReduceLROnPlateau``'s with the test loss, else the training loss; ``OneCycleLR`` is
    stepped after every optimizer step instead), then the record ``{"epoch", "loss", "train_acc", "test_loss", "test_acc", "seconds",
    "samples_per_s"}`` (accuracies as fractions, None when the labels are not class
    indices; test values None without a ``test_loader``; ``seconds`` is training time only)
    is appended to ``history`` (a list, extended in place; a new one by default) and passed
    to the callbacks' ``on_epoch_end``, then to each of ``on_epoch_end`` (a plain callable
    or a list of them). ``step_losses``, a list, receives per epoch one float64 array of the
    batch losses of its steps, read at the end of the epoch (no host sync per step).

    ``callbacks``: ``engine.callbacks.Callback`` objects (``EarlyStopping``,
    ``ModelCheckpoint``, ...), run after the built-in ones: ``progress`` adds a
    ``ProgressBar`` (a tqdm bar per epoch on stderr), ``verbose`` a ``PrintMetrics`` (the
    epoch line on stdout), ``log_json`` a ``JsonLog`` (one JSON line per epoch). A callback
    that sets ``run.stop_training`` ends training after the current epoch, or at once from
    ``on_step_end`` (``TerminateOnNaN``: the unfinished epoch is not recorded).

    ``capture`` (the default) runs the step through ``engine.capture``: the first step of
    each batch shape runs eagerly, the second is recorded, the others replay it; the results
    are the eager ones bit for bit. With a ``data.DataLoader`` (without a transform) the step
    fetches its own batch at the loader's device cursor, so the epoch's full batches (or
    the smallest ``step_interval`` of the callbacks that watch steps; every step when
    ``step_losses`` is given) replay at once: on the GPU one CUDA graph launch for them. A
    step that cannot be captured (a host read in the loss, a distributed run's all-reduce)
    runs eagerly; ``fit.last_eager_reason`` (``trainer.eager_reason``) says why.

    ``distributed=True``: data-parallel over the ranks of ``engine.distributed`` (module
    docstring), after ``init()``; every rank calls ``fit`` with the same model (after
    ``broadcast_model``) and its shard of the data (``DataLoader(..., shard=(rank,
    world_size))``), and evaluates the whole ``test_loader``. Print, log and save on one rank
    only (``progress``, ``verbose``, ``log_json``, checkpoint callbacks)."""
    trainer = getattr(optimizer, _FIT_TRAINER, None)
    if trainer is None or trainer.model is not model or (
            trainer.loss_fn, trainer.clip, trainer.capture, trainer.distributed,
            trainer.accumulate_steps) != (loss_fn, clip, capture, distributed, accumulate_steps):
        trainer = Trainer(model, optimizer, loss_fn, clip, capture, distributed,
                          accumulate_steps)
        if capture:   # what is kept is the captured step
            setattr(optimizer, _FIT_TRAINER, trainer)
    try:
        return trainer.fit(loader, epochs, test_loader, scheduler, callbacks, on_epoch_end,
                           progress, verbose, log_json, start_epoch, history, step_losses)
    finally:
        fit.last_eager_reason = trainer.eager_reason


fit.last_eager_reason = None   # why the step of the last fit call ran eagerly, or None
