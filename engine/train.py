"""The command ``python -m engine.train``: train an MLP on MNIST or Fashion-MNIST.

It checks its arguments and every output path before any work, loads and standardises the
data, builds the MLP, optimizer and schedule, calls ``engine.fit.fit`` and plots the curves.
Bad input exits with status 2 and one line on stderr, never a traceback; a write that fails
during training (a full disk, a folder gone read-only) exits with status 1 and one line
that says which checkpoint is intact.

The library loop lives in ``engine.fit``; ``fit``, ``evaluate`` and the checkpoint functions
are re-exported here (``from engine.train import fit, evaluate`` is public API).
"""
import argparse
import importlib.util
import math
import os
import sys

import numpy as np

import data
import engine
import optim
from engine import nn
from engine.archive import atomic_write, probe_writable
from engine.fit import (RECORD_KEYS, append_record, evaluate, fit, format_record,  # noqa: F401
                        read_checkpoint, restore_checkpoint, save_checkpoint)
from engine.losses import cross_entropy
from engine.random import manual_seed
from ops.device import check_device

DATASETS = ("mnist", "fashion-mnist")
OPTIMIZERS = ("adam", "adamw", "sgd")
SCHEDULES = ("cosine", "constant")
PROG = "engine-train"


class BadInput(Exception):
    """A problem with the command's input; reported as one line, exit status 2."""


class OutputFailure(Exception):
    """A write that failed during or after training; reported as one line, exit status 1."""


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
        "atomically after each epoch (default: the --resume file when resuming, else none)")
    add("--resume", metavar="PATH", help="continue from a --save checkpoint up to --epochs, "
        "with the checkpoint's optimizer settings, saving to PATH unless --save says otherwise")
    add("--plot", metavar="PATH", help="image of the per-step training loss and per-epoch "
        "accuracy, PNG unless PATH ends in another matplotlib format (needs matplotlib)")
    add("--log-json", metavar="PATH", help="append one JSON object per epoch")
    add("--limit", type=int, metavar="N", help="use only the first N samples of each split "
        "(quick checks)")
    add("--threads", type=int, metavar="N", help="threads of the CPU matrix products (BLAS), "
        "set with engine.set_num_threads (default: the engine's, see engine.blas_threads)")
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


def cosine_schedule(optimizer, epochs, start_epoch=0):
    """Epoch ``e`` (from 1) trains at ``initial_lr * (1 + cos(pi * (e - 1) / epochs)) / 2``,
    down to 0 after the last epoch: a closed form of the epoch (``LambdaLR``), so from the
    epoch a run resumes at, its rates are those of an uninterrupted run of ``epochs``, bit
    for bit, also when the resumed run asks for more epochs than the checkpoint's. (The
    chainable ``CosineAnnealingLR`` continues from the rate the checkpoint holds: a finished
    run resumed for more epochs would stay at its final rate, 0.)"""
    return optim.lr_scheduler.LambdaLR(
        optimizer, lambda epoch: (1 + math.cos(math.pi * epoch / epochs)) / 2,
        last_epoch=start_epoch - 1)


def _plot_format(path):
    return os.path.splitext(path)[1].lstrip(".").lower() or "png"


def _plot_formats():
    from matplotlib.backend_bases import FigureCanvasBase
    return set(FigureCanvasBase.get_supported_filetypes())


def _describe(error):
    """An OSError in words, without the temporary file name a failed atomic write names."""
    return error.strerror or str(error)


def check_output(flag, path, appending=False):
    """Raise ``BadInput`` unless ``path`` can be written (``appending``: extended in place):
    not a directory, in a folder that exists and takes new files."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise BadInput(f"{flag} {path}: is a directory; give a file name")
    if not os.path.isdir(folder):
        raise BadInput(f"{flag} {path}: {folder} is not a directory" if os.path.exists(folder)
                       else f"{flag} {path}: the directory {folder} does not exist")
    try:
        probe_writable(path, appending)
    except OSError as error:
        raise BadInput(f"{flag} {path}: cannot be written ({_describe(error)})") from None


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
                        ("--limit", args.limit), ("--threads", args.threads)):
        if value is not None and value < 1:
            raise BadInput(f"{flag} must be a positive integer, got {value}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise BadInput(f"--lr must be a positive finite number, got {args.lr}")
    for flag, value in (("--weight-decay", args.weight_decay), ("--clip-norm", args.clip_norm),
                        ("--momentum", args.momentum), ("--seed", args.seed)):
        if not (value >= 0 and math.isfinite(value)):
            raise BadInput(f"{flag} must be a finite number >= 0, got {value}")
    if args.resume and not os.path.isfile(args.resume):
        raise BadInput(f"--resume {args.resume}: no such file")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise BadInput("--plot needs matplotlib, an optional extra: "
                       "pip install 'numba-engine[plot]'")
    if args.plot and _plot_format(args.plot) not in _plot_formats():
        raise BadInput(f"--plot {args.plot}: matplotlib writes no {_plot_format(args.plot)!r} "
                       f"files (it writes {', '.join(sorted(_plot_formats()))})")
    for flag, path in (("--save", args.save), ("--plot", args.plot),
                       ("--log-json", args.log_json)):
        if path:
            check_output(flag, path, appending=flag == "--log-json")
    if args.resume and not args.save:
        try:
            check_output("--resume", args.resume)
        except BadInput as error:
            raise BadInput(f"{error}; a resumed run saves there unless --save names another "
                           "file") from None
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
    except (OSError, ValueError) as error:
        where = f" from {data_dir}" if data_dir else ""
        raise BadInput(f"cannot load {name}{where}: {error}") from None
    where = f"{name} in {data_dir}" if data_dir else name
    for split, images in (("training", x_train), ("test", x_test)):
        if images.size == 0:
            raise BadInput(f"{where}: the {split} images {images.shape} hold no samples")
    if x_train.shape[1:] != x_test.shape[1:]:
        raise BadInput(f"{where}: training images {x_train.shape[1:]} and test images "
                       f"{x_test.shape[1:]} differ in shape")
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


def plot_history(history, path, step_losses=()):
    """Write the curves to ``path`` atomically and return the matplotlib Figure: left, the
    training loss of every step (``step_losses``: one array per epoch, for the last
    ``len(step_losses)`` epochs of ``history``) with each epoch's mean; right, the train and
    test accuracy per epoch. Epochs are integer ticks; step ``i`` of ``n`` in epoch ``e``
    sits at ``e - 1 + (i + 1) / n``."""
    from matplotlib.figure import Figure   # no pyplot: no global state, no GUI backend
    from matplotlib.ticker import MaxNLocator
    figure = Figure(figsize=(10, 4), dpi=100)
    loss_axes, accuracy_axes = figure.subplots(1, 2)
    epochs = [record["epoch"] for record in history]
    trained = epochs[len(epochs) - len(step_losses):]
    if len(step_losses):
        steps = np.concatenate([epoch - 1 + np.arange(1, len(losses) + 1) / max(len(losses), 1)
                                for epoch, losses in zip(trained, step_losses)])
        loss_axes.plot(steps, np.concatenate(step_losses), linewidth=0.6, alpha=0.7,
                       label="per step")
    if all(record["loss"] is not None for record in history):
        loss_axes.plot(epochs, [record["loss"] for record in history], marker="o",
                       label="epoch mean")
    loss_axes.set(title="training loss", xlabel="epoch", ylabel="cross-entropy")
    for key, label in (("train_acc", "train"), ("test_acc", "test")):
        values = [record[key] for record in history]
        if all(value is not None for value in values):
            accuracy_axes.plot(epochs, [100 * value for value in values], marker="o", label=label)
    accuracy_axes.set(title="accuracy per epoch", xlabel="epoch", ylabel="accuracy (%)")
    for axes in (loss_axes, accuracy_axes):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        if axes.lines:
            axes.legend()
    figure.tight_layout()
    with atomic_write(path) as file:
        figure.savefig(file, format=_plot_format(path))
    return figure


def _intact(saved_epoch, saved_path, save_path):
    """What a failed write leaves the user, in words."""
    if saved_epoch is not None:
        return f"the checkpoint of epoch {saved_epoch} in {saved_path} is intact"
    if save_path and os.path.exists(save_path):
        return f"{save_path} is as it was before this run"
    return "no checkpoint was written" + ("" if save_path else " (no --save)")


def run(args):
    check_arguments(args)
    if args.threads is not None:
        try:
            engine.set_num_threads(args.threads)
        except (ValueError, RuntimeError) as error:
            raise BadInput(f"--threads {args.threads}: {error}") from None
    checkpoint = None
    if args.resume:
        try:
            checkpoint = read_checkpoint(args.resume)
        except (OSError, ValueError) as error:
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
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as error:
            raise BadInput(f"--resume {args.resume}: does not fit this model: {error}") from None
        if start_epoch >= args.epochs:
            raise BadInput(f"--resume {args.resume}: already trained for {start_epoch} epochs; "
                           f"ask for more with --epochs (now {args.epochs})")
    scheduler = (cosine_schedule(optimizer, args.epochs, start_epoch)
                 if args.schedule == "cosine" else None)
    # standardised with the training images' statistics; the loaders convert once
    normalize = pixel_statistics(x_train)
    train_loader = data.DataLoader(x_train, y_train, batch_size=args.batch_size, shuffle=True,
                                   seed=args.seed, device=args.device, normalize=normalize)
    train_loader.epoch = start_epoch   # shuffling is keyed by (seed, epoch): resumes exactly
    # a seed, though it never shuffles: without one a loader draws it from the engine's
    # generator, after restore_checkpoint set that, and a resumed run's dropout masks would
    # no longer be the uninterrupted run's
    test_loader = data.DataLoader(x_test, y_test, batch_size=1000, seed=args.seed,
                                  device=args.device, normalize=normalize)

    widths = "-".join(str(w) for w in (int(np.prod(x_train.shape[1:])),) + args.hidden + (classes,))
    n_parameters = sum(p.size for p in model.parameters())
    print(f"{args.dataset}: {len(x_train)} train / {len(x_test)} test samples; MLP {widths} "
          f"({n_parameters} parameters); {args.optimizer} lr {args.lr:g} {args.schedule}, "
          f"batch {args.batch_size}, device {args.device}"
          + (f"; resuming after epoch {start_epoch}" if start_epoch else ""), flush=True)

    save_path = args.save or args.resume   # a resumed run goes on saving where it came from
    saved = {"epoch": start_epoch, "path": args.resume} if checkpoint else {"epoch": None}

    def intact():
        return _intact(saved["epoch"], saved.get("path"), save_path)

    def save(record):
        try:
            save_checkpoint(save_path, model, optimizer, record["epoch"], history, config)
        except OSError as error:
            raise OutputFailure(f"--save {save_path}: cannot write the checkpoint of epoch "
                                f"{record['epoch']} ({_describe(error)}); {intact()}") from None
        saved.update(epoch=record["epoch"], path=save_path)

    def log(record):
        try:
            append_record(args.log_json, record)
        except OSError as error:
            raise OutputFailure(f"--log-json {args.log_json}: cannot append the record of "
                                f"epoch {record['epoch']} ({_describe(error)}); "
                                f"{intact()}") from None

    step_losses = [] if args.plot else None
    history = fit(model, train_loader, optimizer, cross_entropy, args.epochs,
                  test_loader=test_loader, scheduler=scheduler, clip_norm=args.clip_norm,
                  on_epoch_end=[save] * bool(save_path) + [log] * bool(args.log_json),
                  progress=not args.no_progress, start_epoch=start_epoch, history=history,
                  step_losses=step_losses)
    if args.plot:
        try:
            plot_history(history, args.plot, step_losses)
        except OSError as error:
            raise OutputFailure(f"--plot {args.plot}: cannot write the curves "
                                f"({_describe(error)}); {intact()}") from None
        print(f"curves written to {args.plot}")
    return history


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except BadInput as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        sys.exit(2)
    except OutputFailure as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
