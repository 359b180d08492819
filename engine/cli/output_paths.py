"""The files ``python -m engine.train`` writes, checked before any work: each path goes through
``check_output`` (the one check of a path the command writes: names the file system takes,
not a directory, in a folder that exists and takes new files), no two outputs name one file,
the checkpoint's name is an ``.npz`` one (``engine.cli.output_names``), and the package that
writes it is installed; else a ``BadInput`` that names the flag, the path and the fix. After
training, ``write_after_training`` writes the curves and the ONNX export."""
import importlib.util
import os

from engine import onnx as onnx_export
from engine.archive import probe_writable
from engine.cli.failures import BadInput, OutputFailure, describe_os_error
from engine.cli.output_names import (check_checkpoint_name, check_distinct_outputs,
                                     check_name_lengths)
from engine.cli.training_curves import plot_format, plot_formats, plot_history


def checkpoint_path(args):
    """Where the run saves its checkpoint: ``--save``, else the ``--resume`` file, else
    ``DATASET-MODEL.npz`` in the current folder; None with ``--no-save``."""
    if args.no_save:
        return None
    return args.save or args.resume or f"{args.dataset}-{args.model}.npz"


def check_output(flag, path, appending=False, log_dir=False):
    """Raise ``BadInput`` unless ``path`` can be written (``appending``: extended in place):
    the one check of every path the command writes. Its names must be ones the file system
    takes; a file must not be a directory and must sit in a folder that exists and takes new
    files; a ``log_dir`` (``--tensorboard``'s folder) is checked by ``check_log_dir``."""
    check_name_lengths(flag, path)
    if log_dir:
        check_log_dir(path)
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise BadInput(f"{flag} {path}: is a directory; give a file name")
    if not os.path.isdir(folder):
        raise BadInput(f"{flag} {path}: {folder} is not a directory" if os.path.exists(folder)
                       else f"{flag} {path}: the directory {folder} does not exist")
    try:
        probe_writable(path, appending)
    except OSError as error:
        raise BadInput(f"{flag} {path}: cannot be written ({describe_os_error(error)})") \
            from None


def check_log_dir(path):
    """Raise ``BadInput`` unless tensorboardX is installed and ``path`` is a folder that takes
    new files, or can be made in one."""
    if importlib.util.find_spec("tensorboardX") is None:
        raise BadInput("--tensorboard needs the tensorboardX package, an optional extra: "
                       "pip install 'numba-engine[formats]'")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):   # the nearest folder that exists takes the new ones
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise BadInput(f"--tensorboard {path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise BadInput(f"--tensorboard {path}: {existing} cannot be written")


def check_outputs(args):
    """The output paths can be written, name files of their own (a checkpoint an ``.npz``
    one), and the packages that write them are installed."""
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise BadInput("--plot needs matplotlib, an optional extra: "
                       "pip install -e '.[plot]'")
    if args.plot and plot_format(args.plot) not in plot_formats():
        raise BadInput(f"--plot {args.plot}: matplotlib writes no {plot_format(args.plot)!r} "
                       f"files (it writes {', '.join(sorted(plot_formats()))})")
    if args.export_onnx and importlib.util.find_spec("onnx") is None:
        raise BadInput("--export-onnx needs the onnx package, an optional extra: "
                       "pip install -e '.[onnx]'")
    check_checkpoint_name(args, checkpoint_path(args))
    check_distinct_outputs(args, checkpoint_path(args))
    # a resumed run without --save writes its --resume file: checked below, named so
    saved_to = None if args.resume and not args.save else checkpoint_path(args)
    for flag, path in (("--save", saved_to), ("--plot", args.plot),
                       ("--log-json", args.log_json), ("--export-onnx", args.export_onnx)):
        if path:
            check_output(flag, path, appending=flag == "--log-json")
    if args.tensorboard:
        check_output("--tensorboard", args.tensorboard, log_dir=True)
    if args.resume and not args.save:
        try:
            check_output("--resume", args.resume)
        except BadInput as error:
            raise BadInput(f"{error}; a resumed run saves there unless --save names another "
                           "file") from None


def write_after_training(args, model, history, step_losses, best_epoch, intact):
    """``--plot`` and ``--export-onnx``, each said in a line; a write that fails is an
    ``OutputFailure`` that ends with ``intact()`` (what the checkpoint holds).
    ``best_epoch``: the epoch whose weights early stopping restored, or None."""
    if args.plot:
        try:
            plot_history(history, args.plot, step_losses)
        except OSError as error:
            raise OutputFailure(f"--plot {args.plot}: cannot write the curves "
                                f"({describe_os_error(error)}); {intact()}") from None
        print(f"curves written to {args.plot}")
    if args.export_onnx:
        try:
            onnx_export.export(model, args.export_onnx)
        except OSError as error:
            raise OutputFailure(f"--export-onnx {args.export_onnx}: cannot write the model "
                                f"({describe_os_error(error)}); {intact()}") from None
        restored = best_epoch is not None and best_epoch != history[-1]["epoch"]
        print(f"ONNX model written to {args.export_onnx}"
              + (f" (the weights of epoch {best_epoch}, the best test loss)" if restored else "")
              + "; it takes the images as the data set ships them (uint8 0-255), as the "
              "saved model does")
