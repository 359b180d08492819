"""Callbacks: code that ``engine.fit.fit`` runs between training steps.

    history = fit(model, loader, opt, loss_fn, epochs=50, test_loader=test_loader,
                  callbacks=[EarlyStopping(monitor="test_loss", patience=3),
                             ModelCheckpoint("best.npz", monitor="test_acc", mode="max",
                                             save_best_only=True)])

A callback subclasses ``Callback`` and overrides any of its hooks. Before the first hook
``fit`` sets ``callback.run``, its ``engine.fit.Run``: the model, the optimizer, the number
of epochs, the history so far, ``stop_training`` (set it to end training after the current
epoch) and ``save_checkpoint(path, config)``. Each hook receives one dict of logs:

- ``on_train_begin``: ``{"epochs", "start_epoch", "steps"}`` (``steps``: batches per epoch,
  None for a loader without ``len``);
- ``on_epoch_begin``: ``{"epoch"}`` (epochs count from 1, as in the records);
- ``on_step_end``: ``{"epoch", "step", "steps", "rows", "loss", "seconds", "steps_run"}``:
  the step's index from 0, the batch's samples, the step's loss **Tensor** (reading it,
  ``.item()``, waits for the device: the progress bar does it every ``PROGRESS_EVERY``
  steps), the seconds since the epoch began, and how many steps this call covers. A
  callback that needs to see only every n-th step says so with ``step_interval = n``: when
  every watching callback allows it, ``fit`` replays up to n steps at once (one CUDA graph
  launch) and calls ``on_step_end`` once for them, with ``step`` the last one's index,
  ``rows`` all their samples and ``loss`` the last one's loss;
- ``on_epoch_end``: the epoch's record (``engine.fit.RECORD_KEYS``), already in the history;
- ``on_train_end``: ``{"history", "error"}``, however training ends: ``error`` is the
  exception that ends it, or None.

Callbacks run between steps, never inside one: the step (forward, loss, backward, the
gradient all-reduce, clipping, the optimizer step) is one function that ``engine.capture``
can record and replay. The progress bar (``ProgressBar``), the epoch line (``PrintMetrics``)
and the JSON log (``JsonLog``) are callbacks too: ``fit(progress=False, verbose=False)``
drops the built-in ones, so another bar or logger can take their place. ``TensorBoard``
writes the records, the learning rate and the training loss as TensorBoard event files.
"""
import contextlib
import importlib
import json
import math
import os
import time

from tqdm import tqdm

from engine import distributed as dist
from engine.archive import probe_writable
from engine.file_safety import check_write_target

PROGRESS_EVERY = 20   # steps between two loss reads for the progress bar (each one a sync)
# the bar without tqdm's batches/s and elapsed time: at 80 columns it keeps a bar of about
# 15 characters and the postfix (loss, samples/s) whole, for "epoch 10/10" and 469/469 steps
BAR_FORMAT = "{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{remaining}]{postfix}"
MODES = ("auto", "min", "max")
TENSORBOARD_HINT = "pip install 'numba-engine[formats]'"


class Callback:
    """The hooks ``fit`` calls; each does nothing unless a subclass overrides it."""

    run = None   # the engine.fit.Run of the fit call, set before on_train_begin
    step_interval = 1   # on_step_end needs to see every step (see the module docstring)

    def on_train_begin(self, logs):
        pass

    def on_epoch_begin(self, logs):
        pass

    def on_step_end(self, logs):
        pass

    def on_epoch_end(self, logs):
        pass

    def on_train_end(self, logs):
        pass


# ------------------------------------------------------------------ watching a metric

class _Monitor:
    """Which value of the records to watch, and what counts as better."""

    def __init__(self, owner, monitor, mode, min_delta=0.0):
        if mode not in MODES:
            raise ValueError(f"{owner}: mode must be one of {MODES}, got {mode!r}")
        if not (isinstance(min_delta, (int, float)) and math.isfinite(min_delta)
                and min_delta >= 0):
            raise ValueError(f"{owner}: min_delta must be a finite number >= 0, got "
                             f"{min_delta!r}")
        self.owner, self.monitor, self.min_delta = owner, monitor, float(min_delta)
        # "auto": accuracies grow, everything else (losses) shrinks, as in Keras
        self.mode = mode if mode != "auto" else ("max" if "acc" in monitor else "min")
        self.best = None

    def check_run(self, run):
        """Raise ValueError at the start of training unless ``run`` records the monitor."""
        if self.monitor not in run.record_keys:
            raise ValueError(f"{self.owner}: monitor {self.monitor!r} is not in the epoch "
                             f"records, which hold {', '.join(run.record_keys)}")
        if self.monitor.startswith("test_") and not run.evaluates:
            raise ValueError(f"{self.owner}: monitor {self.monitor!r} needs "
                             "fit(..., test_loader=...)")

    def value(self, record):
        value = record[self.monitor]
        if value is None:
            raise ValueError(f"{self.owner}: the record of epoch {record['epoch']} has no "
                             f"{self.monitor} (None); monitor another value")
        return value

    def improves(self, value):
        """Whether ``value`` beats the best so far by more than ``min_delta`` (a NaN never
        does); the first value always does."""
        if self.best is None:
            return not math.isnan(value)
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta


class EarlyStopping(Callback):
    """Stop training once ``monitor`` has not improved for ``patience`` epochs (at least one).

    An epoch improves on the best so far when its value is lower (``mode="min"``) or higher
    (``"max"``) by more than ``min_delta``; ``"auto"`` takes ``"max"`` for accuracies and
    ``"min"`` otherwise. With ``restore_best_weights`` the model gets the weights of its best
    epoch back when training ends without an error (a host copy of the weights is kept at
    every improvement). A resumed run (``fit(..., history=...)``) reads the best value and
    the epochs since from the history, so patience runs on from where the run stopped; the
    weights of an epoch before the resume are not in memory, so those are not restored.
    ``stopped_epoch``, ``best`` and ``best_epoch`` say what happened."""

    def __init__(self, monitor="test_loss", patience=0, min_delta=0.0, mode="auto",
                 restore_best_weights=False, verbose=True):
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 0:
            raise ValueError(f"EarlyStopping: patience must be an integer >= 0, got "
                             f"{patience!r}")
        self._monitor = _Monitor("EarlyStopping", monitor, mode, min_delta)
        self.monitor, self.patience = monitor, patience
        self.restore_best_weights, self.verbose = bool(restore_best_weights), verbose

    @property
    def best(self):
        return self._monitor.best

    def on_train_begin(self, logs):
        self._monitor.check_run(self.run)
        self._monitor.best = self.best_epoch = self.stopped_epoch = None
        self.best_weights, self.wait = None, 0
        for record in self.run.history:   # a resumed run: the epochs trained before it
            if record.get(self.monitor) is not None:   # (older records have no test_loss)
                self._observe(record)
        if self.wait >= max(self.patience, 1):
            self._stop(self.run.history[-1]["epoch"])

    def on_epoch_end(self, logs):
        self._observe(logs)
        if self.restore_best_weights and self.best_epoch == logs["epoch"]:
            self.best_weights = self.run.model.state_dict()
        if self.wait >= max(self.patience, 1):
            self._stop(logs["epoch"])

    def on_train_end(self, logs):
        if (logs["error"] is None and self.best_weights is not None
                and self.run.history and self.run.history[-1]["epoch"] != self.best_epoch):
            self.run.model.load_state_dict(self.best_weights)
            if self.verbose:
                print(f"early stopping: restored the weights of epoch {self.best_epoch}",
                      flush=True)

    def _observe(self, record):
        value = self._monitor.value(record)
        if self._monitor.improves(value):
            self._monitor.best, self.best_epoch, self.wait = value, record["epoch"], 0
        else:
            self.wait += 1

    def _stop(self, epoch):
        self.stopped_epoch = epoch
        self.run.stop_training = True
        if self.verbose:
            best = "none" if self.best is None else f"{self.best:.4f}"
            print(f"early stopping after epoch {epoch}: {self.monitor} has not improved for "
                  f"{self.wait} epoch(s) (best {best} at epoch {self.best_epoch})", flush=True)


class ModelCheckpoint(Callback):
    """Write a training checkpoint to ``path`` after every epoch, or with ``save_best_only``
    only after an epoch whose ``monitor`` beats every earlier one (``mode`` as for
    ``EarlyStopping``). The file is the one ``python -m engine.train --save`` writes, through
    ``engine.archive`` (atomically: a failed write leaves the previous file): ``nn.load``
    reads its model, and with the command's ``config`` (``{"dataset", "hidden",
    "optimizer", "schedule"}``) ``--resume`` continues it. The path is checked writable
    when training begins. ``saved_epoch`` is the epoch last written, ``best`` its value."""

    def __init__(self, path, monitor="test_loss", mode="auto", save_best_only=False,
                 config=None, verbose=False):
        self.path = os.fspath(path)
        self._monitor = _Monitor("ModelCheckpoint", monitor, mode)
        self.monitor, self.save_best_only = monitor, bool(save_best_only)
        self.config, self.verbose = config, verbose
        self.saved_epoch = None

    @property
    def best(self):
        return self._monitor.best

    def on_train_begin(self, logs):
        if self.save_best_only:
            self._monitor.check_run(self.run)
        self._monitor.best, self.saved_epoch = None, None
        try:
            probe_writable(self.path)
        except OSError as error:
            raise OSError(error.errno, f"ModelCheckpoint: {self.path} cannot be written "
                                       f"({error.strerror or error})") from None

    def on_epoch_end(self, logs):
        if self.save_best_only:
            value = self._monitor.value(logs)
            if not self._monitor.improves(value):
                return
            self._monitor.best = value
        self.run.save_checkpoint(self.path, self.config)
        self.saved_epoch = logs["epoch"]
        if self.verbose:
            print(f"checkpoint of epoch {logs['epoch']} written to {self.path}", flush=True)


class TerminateOnNaN(Callback):
    """Stop training at the first non-finite (NaN or infinite) training loss, as Keras's
    callback: the step's epoch ends there, unrecorded, so no later callback sees it (a
    ``ModelCheckpoint`` keeps the file of the last finished epoch) and ``fit`` returns the
    records of the finished epochs. One line names the epoch, the step and the loss.

    Each check reads the step's loss, a host sync; ``step_interval=n`` reads every n-th
    step's (on the GPU, n steps then replay as one graph launch): a loss that turned
    non-finite is then seen up to n - 1 steps later, which the line says. Over several
    ranks every check agrees across them (one all-reduce of a flag), so all stop at the same
    step. ``stopped_epoch``, ``stopped_step`` and ``loss`` say where it stopped (None when it
    did not)."""

    def __init__(self, step_interval=1, verbose=True):
        if not isinstance(step_interval, int) or isinstance(step_interval, bool) or \
                step_interval < 1:
            raise ValueError(f"TerminateOnNaN: step_interval must be an integer >= 1, got "
                             f"{step_interval!r}")
        self.step_interval, self.verbose = step_interval, verbose
        self.stopped_epoch = self.stopped_step = self.loss = None

    def on_train_begin(self, logs):
        self.stopped_epoch = self.stopped_step = self.loss = None

    def on_step_end(self, logs):
        loss = float(logs["loss"].item())
        bad = not math.isfinite(loss)
        if dist.several_ranks():   # a rank stopping alone would leave the others waiting
            bad = dist.mean_over_ranks([float(bad)])[0] > 0
        if not bad:
            return
        self.stopped_epoch, self.stopped_step, self.loss = logs["epoch"], logs["step"], loss
        self.run.stop_training = True
        if self.verbose:
            seen = "" if logs.get("steps_run", 1) == 1 else \
                f" (the last of {logs['steps_run']} steps run since the previous check)"
            what = f"the training loss is {loss}"
            if dist.several_ranks():
                what = (f"{what} on rank {dist.rank()}" if not math.isfinite(loss) else
                        f"another rank's training loss is non-finite")
            print(f"terminate on NaN: {what} at epoch "
                  f"{logs['epoch']}, step {logs['step']}{seen}; training stopped, that epoch "
                  "is not recorded and no checkpoint of it is written", flush=True)


class LearningRateScheduler(Callback):
    """Set the learning rate as training goes. ``schedule`` is either a scheduler of
    ``optim.lr_scheduler`` or a function ``schedule(epoch, lr) -> lr`` (Keras's form; ``epoch``
    counts from 1, as the records do) whose value every parameter group of the optimizer
    trains the epoch at. A scheduler is stepped as torch's documentation steps it: after
    every epoch (``fit(scheduler=...)`` does the same); ``OneCycleLR`` after every batch
    (so each step runs at its own rate, replayed one step at a time); ``ReduceLROnPlateau``
    after every epoch with the record's ``monitor`` value (default: ``"test_loss"`` when
    ``fit`` has a test loader, else the training ``"loss"``)."""

    def __new__(cls, schedule, monitor=None):
        if cls is LearningRateScheduler and getattr(schedule, "per_batch", False):
            cls = _BatchScheduler   # the one kind that watches steps (fit replays it step by step)
        return super().__new__(cls)

    def __init__(self, schedule, monitor=None):
        if not (hasattr(schedule, "step") or callable(schedule)):
            raise TypeError("LearningRateScheduler: schedule must be an optim.lr_scheduler "
                            f"scheduler or a function (epoch, lr) -> lr, got {schedule!r}")
        self.schedule, self.monitor = schedule, monitor
        self.per_batch = getattr(schedule, "per_batch", False)

    def on_epoch_begin(self, logs):
        if hasattr(self.schedule, "step"):
            return
        for group in self.run.optimizer.param_groups:
            lr = self.schedule(logs["epoch"], group["lr"])
            if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
                raise ValueError(f"LearningRateScheduler: schedule({logs['epoch']}, "
                                 f"{group['lr']}) returned {lr!r}, not a finite rate >= 0")
            group["lr"] = float(lr)

    def on_epoch_end(self, logs):
        if not hasattr(self.schedule, "step") or self.per_batch:
            return
        if getattr(self.schedule, "needs_metric", False):
            monitor = self.monitor or ("test_loss" if self.run.evaluates else "loss")
            if logs.get(monitor) is None:
                raise KeyError(f"LearningRateScheduler: the record has no {monitor!r} to give "
                               f"{type(self.schedule).__name__}; records have "
                               f"{sorted(key for key in logs if logs[key] is not None)}")
            self.schedule.step(logs[monitor])
        else:
            self.schedule.step()


class _BatchScheduler(LearningRateScheduler):
    """A ``LearningRateScheduler`` over a per-batch scheduler (``OneCycleLR``)."""

    def on_step_end(self, logs):
        self.schedule.step()


class History(Callback):
    """The records of the last fit call: ``records`` (a list, as ``fit`` returns) and
    ``history`` (``{key: [value per epoch]}``, Keras's form), ``epochs`` (their numbers)."""

    def on_train_begin(self, logs):
        self.records = []

    def on_epoch_end(self, logs):
        self.records.append(dict(logs))

    @property
    def history(self):
        keys = self.records[0].keys() if self.records else ()
        return {key: [record[key] for record in self.records] for key in keys if key != "epoch"}

    @property
    def epochs(self):
        return [record["epoch"] for record in self.records]


# ------------------------------------------------------------------ progress and logs

class EpochBar(tqdm):
    """tqdm whose time left is measured from the end of its first update: the epoch's first
    step compiles (Numba's kernels, a captured graph) and made the first estimate many times
    the epoch (``[17:11]`` for an epoch of 3.5 s). It reads ``?`` until a second update."""
    _first = None   # (steps, time) at the end of the first update; tqdm draws before that

    def update(self, n=1):
        shown = super().update(n)
        if self._first is None:
            self._first = (self.n, time.monotonic())
        return shown

    @property
    def format_dict(self):
        values = super().format_dict
        if self._first is None or self.n == self._first[0]:
            values["rate"] = 0   # tqdm shows "?" for an unknown rate
        else:
            elapsed = max(time.monotonic() - self._first[1], 1e-9)
            values["rate"] = (self.n - self._first[0]) / elapsed
        return values


def progress_bar(total, epoch, epochs, **options):
    """The bar of one epoch (``total`` steps, None when unknown), on stderr unless
    ``options`` say otherwise; its time left leaves out the first step (``EpochBar``)."""
    return EpochBar(total=total, desc=f"epoch {epoch}/{epochs}", unit="batch", leave=False,
                    dynamic_ncols=True, bar_format=BAR_FORMAT, **options)


def show_progress(bar, loss, samples_per_s):
    bar.set_postfix_str(f"loss {loss:.4f}, {samples_per_s:.0f} samples/s", refresh=False)


class ProgressBar(Callback):
    """A tqdm bar per epoch (stderr unless ``options`` say otherwise, e.g. ``file=``) with
    the loss and samples/s, reading one loss every ``every`` steps (each read a sync)."""

    def __init__(self, every=PROGRESS_EVERY, **options):
        self.every, self.options = every, options
        self.step_interval = every   # so fit may replay that many steps per graph launch
        self.bar = None

    def on_epoch_begin(self, logs):
        self._close()
        self.bar, self.rows = progress_bar(self.run.steps, logs["epoch"], self.run.epochs,
                                           **self.options), 0

    def on_step_end(self, logs):
        runs = logs.get("steps_run", 1)
        self.bar.update(runs)
        self.rows += logs["rows"]
        if runs > 1 or logs["step"] % self.every == 0:
            show_progress(self.bar, logs["loss"].item(), self.rows / max(logs["seconds"], 1e-9))

    def on_epoch_end(self, logs):
        self._close()

    def on_train_end(self, logs):
        self._close()

    def _close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def format_record(record, epochs):
    """One metrics line, like ``epoch 2/5  train loss 0.0951 acc 97.12%  test loss 0.0832
    acc 97.40%  4.1 s  14630 samples/s`` (the test part only when there is a test set)."""
    def number(value):
        return "-" if value is None else f"{value:.4f}"

    def percent(value):
        return "-" if value is None else f"{100 * value:.2f}%"
    parts = [f"epoch {record['epoch']}/{epochs}",
             f"train loss {number(record['loss'])} acc {percent(record['train_acc'])}"]
    test_loss, test_acc = record.get("test_loss"), record.get("test_acc")
    if test_loss is not None or test_acc is not None:
        parts.append(f"test loss {number(test_loss)} acc {percent(test_acc)}")
    parts += [f"{record['seconds']:.1f} s", f"{record['samples_per_s'] or 0:.0f} samples/s"]
    return "  ".join(parts)


class PrintMetrics(Callback):
    """Print ``format_record`` of every epoch on stdout."""

    def on_epoch_end(self, logs):
        print(format_record(logs, self.run.epochs), flush=True)


def append_record(path, record):
    """Append ``record`` to ``path`` as one JSON line (a log grows in place: each line is
    written whole by one ``write``, and earlier lines are never rewritten). A FIFO or device
    in its place is refused (``engine.file_safety``)."""
    check_write_target(path)
    with open(path, "a") as log:
        log.write(json.dumps(record) + "\n")


class JsonLog(Callback):
    """Append every epoch's record to ``path`` as one JSON line."""

    def __init__(self, path):
        self.path = os.fspath(path)

    def on_epoch_end(self, logs):
        append_record(self.path, logs)


class _Sink:
    """A file that takes every write and keeps nothing."""

    def write(self, data):
        return len(data)

    def flush(self):
        pass

    def close(self):
        pass


def _summary_writer():
    try:
        return importlib.import_module("tensorboardX").SummaryWriter
    except ImportError as error:
        raise ImportError(f"TensorBoard: writing event files needs the tensorboardX package "
                          f"({error}); {TENSORBOARD_HINT}") from None


class TensorBoard(Callback):
    """Write TensorBoard event files into ``log_dir`` (made when training begins), through
    the ``tensorboardX`` package (the formats extra): after each epoch its record's values
    (``epoch/loss``, ``epoch/train_acc``, ``epoch/test_loss``, ``epoch/test_acc``,
    ``epoch/seconds``, ``epoch/samples_per_s``; None values left out) and the learning rate
    it trained at (``epoch/learning_rate``, read from the optimizer's first parameter group
    when the epoch begins: put a ``LearningRateScheduler`` before this callback), at step
    ``epoch``.

    ``update_freq`` (Keras's argument): ``"epoch"``, only those; ``"batch"`` or an integer
    ``n``, also the training loss every ``n`` steps (``batch/loss``, at the step's number
    counted over the whole run; reading a loss waits for the device, so ``fit`` replays up to
    ``n`` steps between two reads). ``tensorboard --logdir LOG_DIR`` shows the curves. The
    files are flushed after every epoch and closed when training ends. In a distributed run
    give it to rank 0 only, as the other writers. A write that fails (a full disk) raises one
    ``OSError`` naming ``log_dir``, kept in ``failure``; the writer is then let go without
    another try, so neither the end of training nor the interpreter's exit fails again."""

    def __new__(cls, *args, **kwargs):
        # fit runs every replay unwatched (a whole epoch in one graph launch) unless a
        # callback's class overrides on_step_end: only a step-logging one does (copy and
        # pickle call __new__ without arguments: they keep the class)
        update_freq = kwargs.get("update_freq", args[1] if len(args) > 1 else "epoch")
        if cls is TensorBoard and update_freq != "epoch":
            cls = _StepLoggingTensorBoard
        return super().__new__(cls)

    def __init__(self, log_dir, update_freq="epoch"):
        if update_freq == "batch":
            update_freq = 1
        if update_freq != "epoch" and not (isinstance(update_freq, int)
                                           and not isinstance(update_freq, bool)
                                           and update_freq >= 1):
            raise ValueError(f"TensorBoard: update_freq must be 'epoch', 'batch' or a positive "
                             f"number of steps, got {update_freq!r}")
        self.log_dir, self.update_freq = os.fspath(log_dir), update_freq
        self._writer_class = _summary_writer()   # a missing package fails before training
        self.writer = self.failure = None

    def on_train_begin(self, logs):
        try:
            check_write_target(self.log_dir, directory=True)
            os.makedirs(self.log_dir, exist_ok=True)
        except OSError as error:
            self.failure = OSError(error.errno, f"TensorBoard: {self.log_dir} cannot be made "
                                                f"({error.strerror or error})")
            raise self.failure from None
        self.writer = self._write(self._writer_class, self.log_dir)
        steps = logs["steps"]
        self.global_step = logs["start_epoch"] * steps if steps else 0   # a resumed run goes on

    def on_epoch_begin(self, logs):
        self.learning_rate = self.run.optimizer.param_groups[0]["lr"]

    def on_epoch_end(self, logs):
        epoch = logs["epoch"]

        def write():
            for key, value in logs.items():
                if key != "epoch" and value is not None:
                    self.writer.add_scalar(f"epoch/{key}", value, epoch)
            self.writer.add_scalar("epoch/learning_rate", self.learning_rate, epoch)
            self.writer.flush()
        self._write(write)

    def on_train_end(self, logs):
        if self.writer is None:
            return
        try:
            self._write(self.writer.close)
        except OSError:
            if logs.get("error") is None:   # else the error that ended training is the news
                raise
        self.writer = None

    def _write(self, write, *args):
        """``write(*args)``; a write that fails lets the writer go (``_let_go``) and raises
        an ``OSError`` that names the folder."""
        try:
            return write(*args)
        except OSError as error:
            self._let_go()
            self.failure = OSError(error.errno, f"TensorBoard: cannot write the event files "
                                                f"in {self.log_dir} ({error.strerror or error})")
            raise self.failure from None

    def _let_go(self):
        """After a failed write: tensorboardX's writers would flush the bytes the disk
        refused again, each time failing, at the end of training, in their thread and at
        the interpreter's exit. Each writer is pointed at a sink and closed, which stops its
        thread; only then is its file closed (its thread may be inside a write to it: closed
        first, the thread failed with "write to closed file", seen once in CI). The bytes
        the disk refused are dropped; the files keep what was written before."""
        writer, self.writer = self.writer, None
        for file_writer in list((getattr(writer, "all_writers", None) or {}).values()):
            events = getattr(file_writer, "event_writer", None)
            records = getattr(getattr(events, "_ev_writer", None), "_py_recordio_writer", None)
            if records is None or not hasattr(records, "_writer"):
                continue   # another tensorboardX than 2.6's: left as it is
            file, records._writer = records._writer, _Sink()
            with contextlib.suppress(OSError):
                events.close()   # flushes into the sink, joins the thread
            with contextlib.suppress(OSError):
                file.close()   # raises the failed flush again, and closes


class _StepLoggingTensorBoard(TensorBoard):
    """``TensorBoard`` with ``update_freq`` a number of steps: ``on_step_end`` writes the
    loss whenever the steps one call covers pass a multiple of ``update_freq``."""

    def __init__(self, log_dir, update_freq="epoch"):
        super().__init__(log_dir, update_freq)
        self.step_interval = self.update_freq

    def on_step_end(self, logs):
        before, self.global_step = self.global_step, self.global_step + logs["steps_run"]
        if self.global_step // self.update_freq > before // self.update_freq:
            self.writer.add_scalar("batch/loss", logs["loss"].item(), self.global_step)
