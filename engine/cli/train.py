"""The command ``python -m engine.train``: train an MLP or a CNN on MNIST or Fashion-MNIST.

It answers ``--help`` and arguments that do not parse before it imports Numba
(``answer_at_once``), checks its arguments and every output path before any work, loads the
data, builds the model (``--model mlp``, the default, or ``cnn``; both start with
``Rescaling`` and ``Normalization``, so the saved model and the ONNX export take raw images),
optimizer and schedule, calls ``engine.fit.fit`` (with early stopping on the test loss when
asked), saves a checkpoint after every epoch (to ``DATASET-MODEL.npz`` unless ``--save`` or
``--no-save`` say otherwise), plots the curves and exports the model as ONNX. Bad input
exits with status 2 and one line on stderr, never a traceback; a write that fails during
training (a full disk, a folder gone read-only) exits with status 1 and one line that says
which checkpoint is intact; so does a training loss that turns NaN or infinite
(``callbacks.TerminateOnNaN``: that epoch is never saved). A GPU out of memory
(``engine.OutOfMemoryError``) is one line and status 1 too, as is the host's
``MemoryError`` (an MLP too large for the machine's memory is refused before it is built:
``engine.cli.memory_estimate``); Ctrl-C (status 130) and SIGTERM (143) say which epoch the
checkpoint holds.

``mpiexec -n N python -m engine.train --distributed`` trains data-parallel
(``engine.distributed``): ``--batch-size`` is the global batch, each rank trains on its
``1/N`` of it, so a run trains as one process with that batch would. Only rank 0 prints,
shows progress, logs, plots, saves and exports; every rank reads a ``--resume`` checkpoint.
How the ranks start together, so that a bad input on any rank ends every rank at the same
point with one line, is ``engine.cli.distributed_start``. A write failing on rank 0 during
training ends every rank (``engine.distributed.abort``; MPICH adds its own line saying so).

This is the CLI wing's training command (``engine/train.py`` runs its ``main``). The library
loop lives in ``engine.fit``, the checkpoints in ``engine.checkpoint``, the model recipes in
``engine.models``, the data recipes (a data set by name, its pixel statistics) in
``data.datasets``: this module parses, checks and wires. Beside it, for it alone:
``engine.cli.arguments`` (the parser, answered before Numba loads), ``engine.cli.failures``
(the one-line failures), ``engine.cli.output_paths`` (the files it writes: checked first, the
curves and the ONNX export written last), ``engine.cli.memory_estimate`` (``--hidden``),
``engine.cli.resumed_checkpoint`` (``--resume``), ``engine.cli.run_header`` (the lines a run
starts with) and ``engine.cli.training_curves`` (``--plot``).
"""
import functools
import math
import os
import sys
import types

import numpy as np

import data
import engine
import optim
from data.datasets import load_dataset, pixel_statistics
from engine import distributed as dist
from engine.callbacks import PROGRESS_EVERY, EarlyStopping, TensorBoard, TerminateOnNaN
from engine.checkpoint import save_checkpoint
from engine.cli.arguments import (DATASETS, MODELS, OPTIMIZERS, SCHEDULES,  # noqa: F401
                                  build_parser, resolve_defaults)
from engine.cli.gpt_run import GPT_DATASETS, check_gpt_arguments, prepare_gpt
from engine.cli.distributed_start import (agree_on_the_start, fail_every_rank, join_world,
                                          on_every_rank, refuse_ranks_without_distributed)
from engine.cli.failures import (PROG, BadInput, Diverged, Interrupted, OutputFailure,
                                 Terminated, describe_os_error, intact_after_failure,
                                 kept_after_interrupt, report, report_interrupt,
                                 sigterm_interrupts)
from engine.cli.memory_estimate import check_model_fits
from engine.cli.output_paths import check_outputs, checkpoint_path, write_after_training
from engine.cli.resumed_checkpoint import read_resumed, restore_resumed
from engine.cli.run_header import print_header
from engine.fit import append_record, fit
from engine.losses import cross_entropy
from engine.models import build_model, parse_widths, preprocessing
from engine.random import manual_seed
from ops.device import check_device
from ops.matmul_precision import PRECISIONS


def parse_hidden(text):
    try:
        return parse_widths(text)
    except ValueError as error:
        raise BadInput(f"--hidden {error}") from None


# --augment's names and their default numbers (pixels of shift, padding of crop)
AUGMENTATIONS = {"shift": 2, "crop": 2, "flip": None}


def parse_augment(text):
    """``--augment``'s ``[(name, number or None)]`` (empty without the flag)."""
    if not text:
        return []
    chosen = []
    for part in text.split(","):
        name, _, number = part.strip().partition("=")
        if name not in AUGMENTATIONS:
            raise BadInput(f"--augment: unknown augmentation {name!r}: expected "
                           f"{', '.join(AUGMENTATIONS)} (comma-separated)")
        default = AUGMENTATIONS[name]
        if number and default is None:
            raise BadInput(f"--augment: {name} takes no number, got {part!r}")
        try:
            value = int(number) if number else default
        except ValueError:
            value = -1
        if value is not None and value < 0:
            raise BadInput(f"--augment: {part!r} needs a whole number of pixels >= 0")
        chosen.append((name, value))
    return chosen


def augmentation(chosen, image_shape, seed):
    """The loader's transform for ``--augment``'s ``chosen`` list, or None; each
    augmentation gets its own seed from ``seed``."""
    if chosen and len(image_shape) != 2:
        raise BadInput(f"--augment: needs images (height, width), got samples of shape "
                       f"{tuple(image_shape)}")
    transforms = []
    for index, (name, value) in enumerate(chosen):
        own_seed = seed * 16 + index
        if name == "shift":
            transforms.append(data.RandomShift(value, seed=own_seed))
        elif name == "crop":
            transforms.append(data.RandomCrop(tuple(image_shape), padding=value, seed=own_seed))
        else:
            transforms.append(data.RandomFlip(0.5, seed=own_seed))
    if not transforms:
        return None
    return transforms[0] if len(transforms) == 1 else data.Compose(transforms)


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


def check_arguments(args, outputs=True):
    """Every argument check that needs no data; raises ``BadInput`` naming the problem.
    ``outputs=False`` (the ranks of a distributed run other than 0, which write nothing)
    leaves out the output paths and the packages that write them."""
    if args.dataset not in DATASETS:
        raise BadInput(f"unknown dataset {args.dataset!r}: expected one of {', '.join(DATASETS)}")
    if args.model not in MODELS:
        raise BadInput(f"unknown model {args.model!r}: expected one of {', '.join(MODELS)}")
    if (args.model == "gpt") != (args.dataset in GPT_DATASETS):
        raise BadInput(f"--model {args.model} --dataset {args.dataset}: the gpt trains on text "
                       f"({', '.join(GPT_DATASETS)}), the mlp and cnn on images")
    if args.optimizer not in OPTIMIZERS:
        raise BadInput(f"unknown optimizer {args.optimizer!r}: expected one of "
                       f"{', '.join(OPTIMIZERS)}")
    if args.matmul_precision not in PRECISIONS:
        raise BadInput(f"unknown --matmul-precision {args.matmul_precision!r}: expected one "
                       f"of {', '.join(PRECISIONS)}")
    if args.schedule not in SCHEDULES:
        raise BadInput(f"unknown schedule {args.schedule!r}: expected one of "
                       f"{', '.join(SCHEDULES)}")
    for flag, value in (("--epochs", args.epochs), ("--batch-size", args.batch_size),
                        ("--limit", args.limit), ("--threads", args.threads),
                        ("--early-stopping", args.early_stopping),
                        ("--accumulate", args.accumulate)):
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
    if args.no_save and args.save:
        raise BadInput(f"--no-save and --save {args.save} contradict each other; give one")
    if args.no_save and args.resume:
        raise BadInput("--no-save with --resume: a resumed run saves to its checkpoint (or "
                       "to --save PATH); leave out --no-save")
    if args.model == "gpt":
        check_gpt_arguments(args)
    if outputs:
        check_outputs(args)
    args.hidden = parse_hidden(args.hidden)
    args.augment = parse_augment(args.augment)
    try:
        args.device = check_device(args.device)
    except (ValueError, RuntimeError) as error:
        raise BadInput(f"--device: {error}") from None


def build_optimizer(name, parameters, lr, momentum, weight_decay):
    """``optim.OPTIMIZERS[name]`` with the command's flags; --momentum is SGD's (the others
    keep torch's defaults: RMSprop no momentum)."""
    _, class_name = optim.OPTIMIZERS[name]
    sgd_only = {"momentum": momentum} if name == "sgd" else {}
    return getattr(optim, class_name)(parameters, lr=lr, weight_decay=weight_decay, **sgd_only)


# ------------------------------------------------------------------ the training

def train_as_asked(args):
    """Check, prepare and train as ``args`` say; returns the history."""
    is_root = join_world(args) if args.distributed else True
    setup = on_every_rank(lambda: prepare(args, is_root), args.distributed)
    if args.distributed:
        agree_on_the_start(setup, is_root)
    return train(args, setup, is_root)


def prepare(args, is_root):
    """Everything before training that needs no other rank: checks, the checkpoint, the
    data, the model, optimizer, schedule and loaders."""
    check_arguments(args, outputs=is_root)
    if args.model == "gpt":
        return prepare_gpt(args)
    rank, ranks = (dist.rank(), dist.world_size()) if args.distributed else (0, 1)
    if args.batch_size % ranks:
        raise BadInput(f"--batch-size {args.batch_size}: with --distributed it is the global "
                       f"batch, split evenly over the ranks; give a multiple of {ranks}")
    engine.set_float32_matmul_precision(args.matmul_precision)
    if args.threads is not None:
        try:
            engine.set_num_threads(args.threads)
        except (ValueError, RuntimeError) as error:
            raise BadInput(f"--threads {args.threads}: {error}") from None
    config = {"dataset": args.dataset, "model": args.model, "optimizer": args.optimizer,
              "schedule": args.schedule}
    if args.model == "mlp":
        config["hidden"] = list(args.hidden)
    if args.augment:   # only when asked: older checkpoints resume as before
        config["augment"] = [list(item) for item in args.augment]
    checkpoint = read_resumed(args, config)
    try:
        (x_train, y_train), (x_test, y_test) = load_dataset(args.dataset, args.data_dir,
                                                            args.limit)
    except ValueError as error:
        raise BadInput(str(error)) from None
    manual_seed(args.seed)
    classes = int(max(y_train.max(), y_test.max())) + 1
    check_model_fits(args, x_train.shape[1:], classes)
    # the model takes the images as they ship (its first layers scale and standardise them
    # with the training images' statistics), so the saved file and the ONNX export take them
    normalize = pixel_statistics(x_train)
    try:
        model = build_model(args.model, x_train.shape[1:], args.hidden, classes,
                            preprocessing(x_train, normalize))
    except ValueError as error:   # a cnn on samples that are not images
        raise BadInput(f"--model {error}") from None
    model = model.to(args.device)
    optimizer = build_optimizer(args.optimizer, model.parameters(), args.lr, args.momentum,
                                args.weight_decay)
    start_epoch, history = restore_resumed(args, checkpoint, model, optimizer)
    scheduler = (cosine_schedule(optimizer, args.epochs, start_epoch)
                 if args.schedule == "cosine" else None)
    # the pixel values as they are (0-255, as float32: the loader would scale uint8 to
    # [0, 1], which the model's Rescaling does); the loaders convert once
    train_loader = data.DataLoader(_pixels(x_train), y_train,
                                   batch_size=args.batch_size // ranks, shuffle=True,
                                   seed=args.seed, device=args.device, shard=(rank, ranks),
                                   transform=augmentation(args.augment, x_train.shape[1:],
                                                          args.seed))
    train_loader.epoch = start_epoch   # shuffling is keyed by (seed, epoch): resumes exactly
    # a seed, though it never shuffles: without one a loader draws it from the engine's
    # generator, after restore_checkpoint set that, and a resumed run's dropout masks would
    # no longer be the uninterrupted run's
    test_loader = data.DataLoader(_pixels(x_test), y_test, batch_size=1000, seed=args.seed,
                                  device=args.device)
    return types.SimpleNamespace(
        checkpoint=checkpoint, config=config, model=model, optimizer=optimizer,
        scheduler=scheduler, start_epoch=start_epoch, history=history, ranks=ranks,
        loss_fn=cross_entropy, epochs=args.epochs, callbacks=[], prints_records=True,
        train_loader=train_loader, test_loader=test_loader, classes=classes, normalize=normalize,
        data=(x_train.shape, str(x_train.dtype), y_train.shape, x_test.shape, y_test.shape,
              classes, normalize))


def _pixels(images):
    """uint8 images as float32 of the same values, which the loader uses as given."""
    return images.astype(np.float32) if images.dtype == np.uint8 else images


def train(args, setup, is_root):
    """Train ``setup``'s model as ``args`` say; rank 0 alone prints and writes."""
    model, optimizer, start_epoch = setup.model, setup.optimizer, setup.start_epoch
    history = setup.history
    if is_root:
        print_header(args, setup)
    save_path = checkpoint_path(args)   # a resumed run goes on saving where it came from
    saved = {"epoch": start_epoch, "path": args.resume} if setup.checkpoint else {"epoch": None}

    def intact():
        return intact_after_failure(saved["epoch"], saved.get("path"), save_path)

    def save(record):
        try:
            save_checkpoint(save_path, model, optimizer, record["epoch"], history, setup.config)
        except OSError as error:
            raise OutputFailure(f"--save {save_path}: cannot write the checkpoint of epoch "
                                f"{record['epoch']} ({describe_os_error(error)}); "
                                f"{intact()}") from None
        saved.update(epoch=record["epoch"], path=save_path)

    def log(record):
        try:
            append_record(args.log_json, record)
        except OSError as error:
            raise OutputFailure(f"--log-json {args.log_json}: cannot append the record of "
                                f"epoch {record['epoch']} ({describe_os_error(error)}); "
                                f"{intact()}") from None

    stopping = ([EarlyStopping("test_loss", patience=args.early_stopping,
                               restore_best_weights=True, verbose=is_root)]
                if args.early_stopping else [])
    writers = [save] * bool(save_path) + [log] * bool(args.log_json) if is_root else []
    # the loss every PROGRESS_EVERY steps: the steps the progress bar reads it at anyway
    boards = ([TensorBoard(args.tensorboard, PROGRESS_EVERY)] if args.tensorboard and is_root
              else [])
    step_losses = [] if args.plot and is_root else None
    # the epoch of a non-finite loss is never saved. On the CPU every step's loss is read (a
    # read costs nothing there); on a GPU every PROGRESS_EVERY-th, which the progress bar
    # reads anyway, so the captured steps between them still replay as one graph launch
    terminate = TerminateOnNaN(step_interval=1 if args.device == "cpu" else PROGRESS_EVERY,
                               verbose=False)
    clip = (functools.partial(optim.clip_grad_norm_, max_norm=args.clip_norm)
            if args.clip_norm else None)
    try:
        fit(model, setup.train_loader, optimizer, setup.loss_fn, setup.epochs,
            test_loader=setup.test_loader, scheduler=setup.scheduler, clip=clip,
            callbacks=[terminate] + stopping + boards + setup.callbacks * is_root,
            on_epoch_end=writers, progress=is_root and not args.no_progress,
            verbose=is_root and setup.prints_records, start_epoch=start_epoch,
            history=history, step_losses=step_losses, capture=not args.no_capture,
            distributed=args.distributed, accumulate_steps=args.accumulate)
    except OSError as error:   # the event files: every other write fails as OutputFailure
        failure = boards[0].failure if boards else None
        if failure is None:
            raise
        reason = os.strerror(failure.errno) if failure.errno else describe_os_error(error)
        raise OutputFailure(f"--tensorboard {args.tensorboard}: cannot write the event files "
                            f"({reason}); {intact()}") from None
    except KeyboardInterrupt as stop:   # Ctrl-C, or SIGTERM (Terminated)
        raise Interrupted(kept_after_interrupt(saved["epoch"], saved.get("path"), save_path),
                          terminated=isinstance(stop, Terminated)) from None
    if terminate.stopped_epoch is not None:
        loss = (f"the training loss is {terminate.loss}" if not math.isfinite(terminate.loss)
                else "another rank's training loss is non-finite")
        raise Diverged(f"{loss} at epoch {terminate.stopped_epoch}, step "
                       f"{terminate.stopped_step}: training stopped there (a lower --lr or "
                       f"--clip-norm may help); {intact()}", shown=is_root)
    if is_root and save_path and args.model == "gpt":
        print(f"model saved to {save_path} (step {saved['epoch'] * args.eval_every}): "
              f"python -m engine.generate {save_path} --prompt 'ROMEO:' samples from it; "
              f"--resume {save_path} --steps N trains on", flush=True)
    elif is_root and save_path:
        print(f"model saved to {save_path} (epoch {saved['epoch']}): "
              f"engine.nn.load({save_path!r}) gives the model, which takes the images as the "
              f"data set ships them; --resume {save_path} --epochs N trains on", flush=True)
    if is_root:
        write_after_training(args, model, history, step_losses,
                             stopping[0].best_epoch if stopping else None, intact)
    return history


def parse_arguments(argv):
    """``argv`` parsed; a ``BadInput`` naming what does not parse. In a process started by
    ``mpiexec -n N`` (N > 1) such an error, or a run without ``--distributed`` (every process
    would train alone and write the same files), ends every rank together
    (``fail_every_rank``)."""
    try:
        args = build_parser().parse_args(argv)
    except BadInput as error:
        if any(len(word) > 3 and "--distributed".startswith(word) for word in argv):
            fail_every_rank(error)
        raise
    if not args.distributed:
        refuse_ranks_without_distributed()
    return resolve_defaults(args)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        with sigterm_interrupts():
            train_as_asked(parse_arguments(argv))
    except BadInput as error:   # raised on every rank of a distributed run alike
        report(error)
        sys.exit(2)
    except dist.RankMismatch as mismatch:   # diverged replicas: raised on every rank alike
        report(BadInput(str(mismatch), shown=dist.rank() == 0))
        sys.exit(1)
    except OutputFailure as error:   # rank 0 alone writes: end the others too
        report(error)
        dist.abort(1)
    except Diverged as error:   # every rank stopped at the same step
        report(error)
        sys.exit(1)
    except engine.OutOfMemoryError as error:   # this rank alone may have failed: end them all
        rank = f"rank {dist.rank()}: " if dist.several_ranks() else ""
        print(f"{rank}{PROG}: error: {error} (--batch-size)", file=sys.stderr, flush=True)
        dist.abort(1)
    except MemoryError as error:   # the host's: numpy's message says what was asked
        rank = f"rank {dist.rank()}: " if dist.several_ranks() else ""
        print(f"{rank}{PROG}: error: out of memory: {error} (a smaller --hidden or "
              f"--batch-size)", file=sys.stderr, flush=True)
        dist.abort(1)
    except KeyboardInterrupt as interrupt:   # Interrupted says what the checkpoint holds
        sys.exit(report_interrupt(interrupt))

