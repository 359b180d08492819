"""Training: the library loop (``fit``, ``evaluate``) and the command ``python -m engine.train``.

``fit`` runs epochs of forward, loss, backward, optional gradient clipping and an optimizer
step, and returns one record per epoch. Each batch's loss and correct predictions are added
up on the batch's own device by one small kernel (``ops.metrics``) and read back once at the
end of the epoch, so a GPU step never waits for the host; the progress bar reads one loss
every ``PROGRESS_EVERY`` steps.

The command is a thin wrapper: it checks its arguments, loads and standardises the data,
builds the MLP, optimizer and schedule, and calls ``fit``. Bad input exits with one line on
stderr, never a traceback.
"""
import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
import zipfile

import numpy as np
from tqdm import tqdm

import data
import optim
from engine import nn
from engine.autograd import no_grad
from engine.losses import cross_entropy
from engine.random import generator, manual_seed
from engine.tensor import Tensor
from ops.device import check_device, to_host
from ops.metrics import RunningMetrics

PROGRESS_EVERY = 20   # steps between two loss reads for the progress bar (each one a sync)
RECORD_KEYS = ("epoch", "loss", "train_acc", "test_acc", "seconds", "samples_per_s")


# ------------------------------------------------------------------ the library loop

def _storage(value):
    """The host or device array behind a Tensor (labels may also come as NumPy arrays)."""
    return value.data if isinstance(value, Tensor) else np.asarray(value)


def _length(loader):
    try:
        return len(loader)
    except TypeError:   # a plain iterable: no total for the bar, buffers grow as needed
        return None


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


def _train_epoch(model, loader, optimizer, loss_fn, parameters, clip_norm, bar):
    model.train()
    metrics = None
    start = time.perf_counter()
    for step, (inputs, labels) in enumerate(loader):
        optimizer.zero_grad()
        logits = model(inputs)
        loss = loss_fn(logits, labels)
        loss.backward()
        if clip_norm:
            optim.clip_grad_norm_(parameters, clip_norm)
        optimizer.step()
        metrics = metrics or RunningMetrics(logits.device)
        metrics.add(loss.data, logits.data, _storage(labels))
        if bar is not None:
            bar.update(1)
            if step % PROGRESS_EVERY == 0:   # the one host sync every PROGRESS_EVERY steps
                rate = (step + 1) * logits.shape[0] / max(time.perf_counter() - start, 1e-9)
                bar.set_postfix(loss=f"{loss.item():.4f}", samples_s=f"{rate:.0f}",
                                refresh=False)
    loss, train_acc, rows = metrics.read() if metrics else (None, None, 0)   # waits for the GPU
    seconds = time.perf_counter() - start
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


def fit(model, loader, optimizer, loss_fn, epochs, test_loader=None, scheduler=None,
        clip_norm=0.0, on_epoch_end=(), progress=True, verbose=True, log_json=None,
        start_epoch=0, history=None):
    """Train ``model`` for epochs ``start_epoch + 1 .. epochs``; returns the list of records.

    Each step: ``optimizer.zero_grad()``, ``loss_fn(model(x), y).backward()``, gradient
    clipping to ``clip_norm`` (0: none), ``optimizer.step()``. After each epoch:
    ``scheduler.step()``, test accuracy on ``test_loader``, then the record
    ``{"epoch", "loss", "train_acc", "test_acc", "seconds", "samples_per_s"}`` (accuracies as
    fractions, None when the labels are not class indices; ``seconds`` is training time
    only) is appended to ``history`` (a list, extended in place; a new one by default),
    printed (``verbose``), appended as one JSON line to ``log_json`` and passed to each of
    ``on_epoch_end`` (a callable or a list of them). ``progress`` shows a tqdm bar per epoch
    on stderr."""
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
    for epoch in range(start_epoch + 1, epochs + 1):
        bar = (tqdm(total=_length(loader), desc=f"epoch {epoch}/{epochs}", unit="batch",
                    leave=False, dynamic_ncols=True) if progress else None)
        try:
            record = _train_epoch(model, loader, optimizer, loss_fn, parameters, clip_norm, bar)
        finally:
            if bar is not None:
                bar.close()
        if scheduler is not None:
            scheduler.step()
        record = {"epoch": epoch, **record,
                  "test_acc": evaluate(model, test_loader) if test_loader is not None else None}
        record = {key: record[key] for key in RECORD_KEYS}
        history.append(record)
        if verbose:
            print(format_record(record, epochs), flush=True)
        if log_json:
            with open(log_json, "a") as log:
                log.write(json.dumps(record) + "\n")
        for callback in callbacks:
            callback(record)
    return history


# ------------------------------------------------------------------ checkpoints

def _pack(value, arrays):
    """A JSON-able skeleton of ``value``; every array moves into ``arrays`` under a key."""
    if isinstance(value, dict):
        return {"dict": [[_pack(k, arrays), _pack(v, arrays)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return {"tuple" if isinstance(value, tuple) else "list": [_pack(v, arrays) for v in value]}
    if hasattr(value, "shape") and hasattr(value, "dtype"):   # NumPy, device array or Tensor
        if isinstance(value, np.generic):
            return value.item()
        key = f"array{len(arrays)}"
        arrays[key] = value.numpy() if hasattr(value, "numpy") else to_host(value)
        return {"array": key}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"checkpoint: cannot store a {type(value).__name__} ({value!r})")


def _unpack(skeleton, arrays):
    if isinstance(skeleton, dict):
        if "dict" in skeleton:
            return {_unpack(k, arrays): _unpack(v, arrays) for k, v in skeleton["dict"]}
        if "array" in skeleton:
            return arrays[skeleton["array"]]
        if "tuple" in skeleton:
            return tuple(_unpack(v, arrays) for v in skeleton["tuple"])
        return [_unpack(v, arrays) for v in skeleton["list"]]
    return skeleton


TRAINING_PREFIX = nn.TRAINING_PREFIX   # checkpoint entries beyond the model file's, which nn.load skips
CHECKPOINT_KEY = TRAINING_PREFIX + "checkpoint"


def save_checkpoint(path, model, optimizer, epoch=0, history=(), config=None):
    """Write model and optimizer state, the epoch counter, history, ``config`` and the
    engine's RNG state to ``path`` (an .npz) atomically: a temporary file renamed over the
    target. A schedule needs no state of its own: it is a function of the epoch.

    The file is a ``model.save`` file (architecture and weights under their names) plus
    entries under ``train/``: the training state as JSON and its arrays."""
    arrays = {}
    state = {"optimizer": optimizer.state_dict(), "epoch": epoch, "history": list(history),
             "config": config or {}, "rng": generator().bit_generator.state}
    skeleton = json.dumps(_pack(state, arrays))
    entries = {nn.CONFIG_KEY: np.array(json.dumps(model.get_config())), **model.state_dict(),
               CHECKPOINT_KEY: np.array(skeleton),
               **{TRAINING_PREFIX + name: array for name, array in arrays.items()}}
    directory = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".checkpoint-", suffix=".npz")
    try:
        with os.fdopen(handle, "wb") as file:
            np.savez(file, **entries)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def read_checkpoint(path):
    """The state ``save_checkpoint`` wrote, as host NumPy arrays: ``{"model", "optimizer",
    "epoch", "history", "config", "rng"}``."""
    with open(path, "rb") as file:
        if file.read(4) != b"PK\x03\x04":   # np.load would talk about pickles instead
            raise ValueError(f"{path} is not a checkpoint written by --save (not an .npz archive)")
    with np.load(path, allow_pickle=False) as stored:
        if CHECKPOINT_KEY not in stored.files:
            raise ValueError(f"{path} is an .npz but not a training checkpoint (engine.train)")
        arrays = {name[len(TRAINING_PREFIX):]: stored[name] for name in stored.files
                  if name.startswith(TRAINING_PREFIX) and name != CHECKPOINT_KEY}
        state = _unpack(json.loads(str(stored[CHECKPOINT_KEY])), arrays)
        state["model"] = {name: stored[name] for name in stored.files
                          if name != nn.CONFIG_KEY and not name.startswith(TRAINING_PREFIX)}
        return state


def restore_checkpoint(state, model, optimizer):
    """Load a checkpoint's states into ``model``, ``optimizer`` and the engine's RNG; returns
    ``(epoch, history)`` to continue from."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    generator().bit_generator.state = state["rng"]
    return state["epoch"], state["history"]


# ------------------------------------------------------------------ the command

DATASETS = ("mnist", "fashion-mnist")
OPTIMIZERS = ("adam", "adamw", "sgd")
SCHEDULES = ("cosine", "constant")
PROG = "engine-train"


class BadInput(Exception):
    """A problem with the command's input; reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line, like every other bad input (no usage dump)
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser():
    parser = _Parser(prog=PROG, description="Train an MLP on MNIST or Fashion-MNIST with the "
                     "Numba engine. Defaults: MNIST, 784-256-128-10 ReLU, Adam 2e-3 with a "
                     "cosine schedule, batch 128, 5 epochs (98.25% test accuracy on the CPU).")
    add = parser.add_argument
    add("--dataset", default="mnist", help=f"{' or '.join(DATASETS)} (default mnist)")
    add("--data-dir", metavar="DIR", help="folder of the four IDX files (mnist: default the "
        "copy shipped with the project; fashion-mnist: /usr/share/datasets/fashion-mnist)")
    add("--device", default="auto", help="cpu, cuda, or auto: cuda when a GPU is usable "
        "(default auto)")
    add("--epochs", type=int, default=5, help="total epochs, counting resumed ones (default 5)")
    add("--batch-size", type=int, default=128, help="training batch size (default 128)")
    add("--hidden", default="256,128", help="hidden layer widths, comma-separated, each "
        "followed by ReLU (default 256,128)")
    add("--optimizer", default="adam", help=f"{', '.join(OPTIMIZERS)} (default adam)")
    add("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    add("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    add("--schedule", default="cosine", help="learning rate over the epochs: cosine (from "
        "--lr down to 0 at the last epoch) or constant (default cosine)")
    add("--weight-decay", type=float, default=0.0, help="L2 penalty (adam, sgd) or decoupled "
        "decay (adamw) (default 0)")
    add("--clip-norm", type=float, default=0.0, help="clip the global gradient norm to this "
        "(default 0: off)")
    add("--seed", type=int, default=0, help="initialisation, shuffling and dropout (default 0)")
    add("--save", metavar="PATH", help="checkpoint (model, optimizer, epoch, history) written "
        "atomically after each epoch")
    add("--resume", metavar="PATH", help="continue from a --save checkpoint up to --epochs, "
        "with the checkpoint's optimizer settings")
    add("--plot", metavar="PATH", help="PNG of the loss and accuracy curves (needs matplotlib)")
    add("--log-json", metavar="PATH", help="append one JSON object per epoch")
    add("--limit", type=int, metavar="N", help="use only the first N samples of each split "
        "(quick checks)")
    add("--no-progress", action="store_true", help="no progress bar, metrics lines only")
    return parser


def parse_hidden(text):
    try:
        widths = tuple(int(part) for part in text.split(","))
    except ValueError:
        widths = ()
    if not widths or min(widths) < 1:
        raise BadInput(f"--hidden {text!r}: expected positive layer widths separated by "
                       "commas, like 256,128")
    return widths


def check_arguments(args):
    """Every argument check that needs no data; raises ``BadInput`` naming the problem."""
    if args.dataset not in DATASETS:
        raise BadInput(f"unknown dataset {args.dataset!r}: expected one of {', '.join(DATASETS)}")
    if args.optimizer not in OPTIMIZERS:
        raise BadInput(f"unknown optimizer {args.optimizer!r}: expected one of "
                       f"{', '.join(OPTIMIZERS)}")
    if args.schedule not in SCHEDULES:
        raise BadInput(f"unknown schedule {args.schedule!r}: expected one of "
                       f"{', '.join(SCHEDULES)}")
    for flag, value in (("--epochs", args.epochs), ("--batch-size", args.batch_size),
                        ("--limit", args.limit)):
        if value is not None and value < 1:
            raise BadInput(f"{flag} must be a positive integer, got {value}")
    if not args.lr > 0:
        raise BadInput(f"--lr must be positive, got {args.lr}")
    for flag, value in (("--weight-decay", args.weight_decay), ("--clip-norm", args.clip_norm),
                        ("--momentum", args.momentum), ("--seed", args.seed)):
        if not value >= 0:
            raise BadInput(f"{flag} must be >= 0, got {value}")
    for flag, path in (("--save", args.save), ("--plot", args.plot), ("--log-json", args.log_json)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise BadInput(f"{flag} {path}: the directory {os.path.dirname(os.path.abspath(path))} "
                           "does not exist")
    if args.resume and not os.path.isfile(args.resume):
        raise BadInput(f"--resume {args.resume}: no such file")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise BadInput("--plot needs matplotlib, an optional extra: "
                       "pip install 'numba-engine[plot]'")
    args.hidden = parse_hidden(args.hidden)
    try:
        args.device = check_device(args.device)
    except (ValueError, RuntimeError) as error:
        raise BadInput(f"--device: {error}") from None


def load_dataset(name, data_dir=None, limit=None):
    """``(x_train, y_train), (x_test, y_test)`` as the data set ships them (uint8 images),
    the first ``limit`` samples of each split."""
    module = data.mnist if name == "mnist" else data.fashion_mnist
    try:
        (x_train, y_train), (x_test, y_test) = (module.load(root=data_dir) if data_dir
                                                else module.load())
    except (OSError, ValueError, EOFError) as error:
        where = f" from {data_dir}" if data_dir else ""
        raise BadInput(f"cannot load {name}{where}: {error}") from None
    if limit:
        return (x_train[:limit], y_train[:limit]), (x_test[:limit], y_test[:limit])
    return (x_train, y_train), (x_test, y_test)


def pixel_statistics(images):
    """Mean and standard deviation of uint8 ``images`` scaled to [0, 1], exact, from a
    histogram (no float copy of the data set). Float images are taken as already scaled."""
    if images.dtype != np.uint8:
        mean, std = float(images.mean(dtype=np.float64)), float(images.std(dtype=np.float64))
        return mean, (std if std > 0 else 1.0)
    counts = np.bincount(images.reshape(-1), minlength=256).astype(np.float64)
    levels = np.arange(256) / 255.0
    mean = float(counts @ levels / counts.sum())
    std = float(np.sqrt(counts @ (levels - mean) ** 2 / counts.sum()))
    return mean, (std if std > 0 else 1.0)


def build_mlp(input_shape, hidden, classes):
    """Flatten, then a ReLU Dense layer per hidden width, then a linear Dense to ``classes``."""
    layers = [nn.Flatten(input_shape=tuple(input_shape))]
    layers += [nn.Dense(width, activation="relu") for width in hidden]
    layers.append(nn.Dense(classes))
    return nn.Sequential(layers)


def build_optimizer(name, parameters, lr, momentum, weight_decay):
    if name == "sgd":
        return optim.SGD(parameters, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adamw":
        return optim.AdamW(parameters, lr=lr, weight_decay=weight_decay)
    return optim.Adam(parameters, lr=lr, weight_decay=weight_decay)


def plot_history(history, path):
    """Loss and accuracy per epoch, side by side, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    epochs = [record["epoch"] for record in history]
    figure, (loss_axes, accuracy_axes) = plt.subplots(1, 2, figsize=(10, 4))
    loss_axes.plot(epochs, [record["loss"] for record in history], marker="o")
    loss_axes.set(title="training loss", xlabel="epoch", ylabel="cross-entropy")
    for key, label in (("train_acc", "train"), ("test_acc", "test")):
        values = [record[key] for record in history]
        if all(value is not None for value in values):
            accuracy_axes.plot(epochs, [100 * value for value in values], marker="o", label=label)
    accuracy_axes.set(title="accuracy", xlabel="epoch", ylabel="%")
    accuracy_axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def run(args):
    check_arguments(args)
    checkpoint = None
    if args.resume:
        try:
            checkpoint = read_checkpoint(args.resume)
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as error:
            raise BadInput(f"--resume {args.resume}: cannot read the checkpoint: {error}") from None
    config = {"dataset": args.dataset, "hidden": list(args.hidden), "optimizer": args.optimizer,
              "schedule": args.schedule}
    if checkpoint is not None and checkpoint["config"] != config:
        raise BadInput(f"--resume {args.resume}: the checkpoint was trained with "
                       f"{checkpoint['config']}, "
                       f"this run asks for {config}")

    (x_train, y_train), (x_test, y_test) = load_dataset(args.dataset, args.data_dir, args.limit)
    manual_seed(args.seed)
    classes = int(max(y_train.max(), y_test.max())) + 1
    model = build_mlp(x_train.shape[1:], args.hidden, classes).to(args.device)
    optimizer = build_optimizer(args.optimizer, model.parameters(), args.lr, args.momentum,
                                args.weight_decay)
    start_epoch, history = 0, []
    if checkpoint is not None:   # the checkpoint's optimizer hyper-parameters win over flags
        try:
            start_epoch, history = restore_checkpoint(checkpoint, model, optimizer)
        except (ValueError, KeyError, TypeError) as error:
            raise BadInput(f"--resume {args.resume}: does not fit this model: {error}") from None
        if start_epoch >= args.epochs:
            raise BadInput(f"--resume {args.resume}: already trained for {start_epoch} epochs; "
                           f"ask for more with --epochs (now {args.epochs})")
    # the cosine spans --epochs: a resumed run continues it, a longer one stretches it
    scheduler = (optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs,
                                                      last_epoch=start_epoch - 1)
                 if args.schedule == "cosine" else None)
    # standardised with the training images' statistics; the loaders convert once
    normalize = pixel_statistics(x_train)
    train_loader = data.DataLoader(x_train, y_train, batch_size=args.batch_size, shuffle=True,
                                   seed=args.seed, device=args.device, normalize=normalize)
    train_loader.epoch = start_epoch   # shuffling is keyed by (seed, epoch): resumes exactly
    test_loader = data.DataLoader(x_test, y_test, batch_size=1000, device=args.device,
                                  normalize=normalize)

    widths = "-".join(str(w) for w in (int(np.prod(x_train.shape[1:])),) + args.hidden + (classes,))
    n_parameters = sum(p.size for p in model.parameters())
    print(f"{args.dataset}: {len(x_train)} train / {len(x_test)} test samples; MLP {widths} "
          f"({n_parameters} parameters); {args.optimizer} lr {args.lr:g} {args.schedule}, "
          f"batch {args.batch_size}, device {args.device}"
          + (f"; resuming after epoch {start_epoch}" if start_epoch else ""), flush=True)

    def save(record):
        save_checkpoint(args.save, model, optimizer, record["epoch"], history, config)

    history = fit(model, train_loader, optimizer, cross_entropy, args.epochs,
                  test_loader=test_loader, scheduler=scheduler, clip_norm=args.clip_norm,
                  on_epoch_end=[save] if args.save else [], progress=not args.no_progress,
                  log_json=args.log_json, start_epoch=start_epoch, history=history)
    if args.plot:
        plot_history(history, args.plot)
        print(f"curves written to {args.plot}")
    return history


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except BadInput as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
