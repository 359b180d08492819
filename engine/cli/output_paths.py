"""The files ``python -m engine.train`` writes, checked before any work: every output path
goes through ``check_output`` (the one check of a path the command writes: a name the file
system takes, not a directory, in a folder that exists and takes new files), no two outputs
name one file, the checkpoint's name is one a checkpoint can have (``.npz``, not a format
that holds a model alone), and the package that writes each file is installed; else a
``BadInput`` that names the flag, the path and the fix. After training,
``write_after_training`` writes the curves and the ONNX export."""
import importlib.util
import os

from engine import onnx as onnx_export
from engine.archive import probe_writable
from engine.checkpoint import model_only_suffix
from engine.cli.failures import BadInput, OutputFailure, describe_os_error
from engine.cli.training_curves import plot_format, plot_formats, plot_history

# what a file's atomic write adds to its path for the temporary file it writes first
# (engine.archive: "." + at most 200 characters of the name + ".<pid>.<random>.partial")
TEMPORARY_ROOM = 40


def checkpoint_path(args):
    """Where the run saves its checkpoint: ``--save``, else the ``--resume`` file, else
    ``DATASET-MODEL.npz`` in the current folder; None with ``--no-save``."""
    if args.no_save:
        return None
    return args.save or args.resume or f"{args.dataset}-{args.model}.npz"


def _nearest_existing(path):
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _file_system_limit(folder, name):
    """``os.pathconf(folder, name)``, or None where the system does not say."""
    try:
        return os.pathconf(folder, name)
    except (OSError, ValueError, AttributeError):   # no pathconf (Windows), or no limit
        return None


def check_name_lengths(flag, path):
    """Raise ``BadInput`` when a name in ``path`` is longer than its file system allows
    (``PC_NAME_MAX``, asked of the nearest folder that exists) or the whole path, with the
    room its temporary file needs, is longer than ``PC_PATH_MAX``: else the write would fail
    after training."""
    absolute = os.path.abspath(path)
    existing = _nearest_existing(absolute)
    path_max = _file_system_limit(existing, "PC_PATH_MAX")
    length = len(os.fsencode(absolute))
    if path_max and length + TEMPORARY_ROOM >= path_max:
        raise BadInput(f"{flag} {path}: the path is {length} bytes long, too long for the "
                       f"file system ({path_max} bytes with the {TEMPORARY_ROOM} of the file's "
                       f"temporary name); give a shorter one")
    folder = os.sep
    for name in absolute.split(os.sep):
        if not name:
            continue
        name_max = _file_system_limit(_nearest_existing(folder), "PC_NAME_MAX")
        size = len(os.fsencode(name))
        if name_max and size > name_max:
            shown = name if len(name) <= 24 else name[:20] + "..."
            raise BadInput(f"{flag} {path}: the name {shown} is {size} bytes long, longer "
                           f"than the {name_max} the file system allows; give a shorter one")
        folder = os.path.join(folder, name)


def check_output(flag, path, appending=False, folder=False):
    """Raise ``BadInput`` unless the command can write ``path``: the one check of every path
    it writes. A file (``appending``: extended in place) must not be a directory and must
    sit in a folder that exists and takes new files; a ``folder`` (``--tensorboard``) must
    be a folder that takes new files, or one that can be made in one."""
    check_name_lengths(flag, path)
    if folder:
        _check_folder(flag, path)
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise BadInput(f"{flag} {path}: is a directory; give a file name")
    if not os.path.isdir(parent):
        raise BadInput(f"{flag} {path}: {parent} is not a directory" if os.path.exists(parent)
                       else f"{flag} {path}: the directory {parent} does not exist")
    try:
        probe_writable(path, appending)
    except OSError as error:
        raise BadInput(f"{flag} {path}: cannot be written ({describe_os_error(error)})") \
            from None


def _check_folder(flag, path):
    existing = _nearest_existing(os.path.abspath(path))   # it takes the new folders
    if not os.path.isdir(existing):
        raise BadInput(f"{flag} {path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise BadInput(f"{flag} {path}: {existing} cannot be written")


def _checkpoint_output(args):
    """``(flag, path, how the message names it)`` of the checkpoint the run saves, or None."""
    path = checkpoint_path(args)
    if path is None:
        return None
    if args.save:
        return "--save", path, f"--save {path}"
    if args.resume:
        return "--resume", path, f"--resume {path} (a resumed run saves its checkpoint there)"
    return "--save", path, f"the checkpoint {path} (the default of --save)"


def check_checkpoint_name(args):
    """A checkpoint holds the optimizer's state and the history: an ``.npz`` file, never a
    name of a format that holds a model alone (``.safetensors``, ``.onnx``)."""
    output = _checkpoint_output(args)
    suffix = output and model_only_suffix(output[1])
    if not suffix:
        return
    flag, path, _ = output
    resumed = (" a resumed run saves its checkpoint there, and" if flag == "--resume" else "")
    remedy = ("give --save a name ending in .npz" if flag == "--resume"
              else "give a name ending in .npz")
    model_alone = (" (--export-onnx PATH writes the model as ONNX)" if suffix == ".onnx"
                   else "")
    raise BadInput(f"{flag} {path}:{resumed} a training checkpoint (the model, the "
                   f"optimizer's state, the history) is an .npz file, not {suffix}; "
                   f"{remedy}{model_alone}")


def check_distinct_outputs(args):
    """No two outputs name one file (the ONNX export would overwrite the checkpoint, which
    the command would then say to resume)."""
    checkpoint = _checkpoint_output(args)
    outputs = ([(checkpoint[2], checkpoint[1])] if checkpoint else []) + [
        (f"{flag} {path}", path) for flag, path in (
            ("--plot", args.plot), ("--log-json", args.log_json),
            ("--export-onnx", args.export_onnx)) if path]
    seen = {}
    for described, path in outputs:
        same = seen.get(os.path.realpath(path))
        if same is not None:
            raise BadInput(f"{described}: is the file of {same} too; give each output a "
                           "file of its own")
        seen[os.path.realpath(path)] = described


def check_outputs(args):
    """The output paths can be written, name files of their own, the checkpoint's name is an
    ``.npz`` one, and the packages that write them are installed."""
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise BadInput("--plot needs matplotlib, an optional extra: "
                       "pip install -e '.[plot]'")
    if args.plot and plot_format(args.plot) not in plot_formats():
        raise BadInput(f"--plot {args.plot}: matplotlib writes no {plot_format(args.plot)!r} "
                       f"files (it writes {', '.join(sorted(plot_formats()))})")
    if args.export_onnx and importlib.util.find_spec("onnx") is None:
        raise BadInput("--export-onnx needs the onnx package, an optional extra: "
                       "pip install -e '.[onnx]'")
    if args.tensorboard and importlib.util.find_spec("tensorboardX") is None:
        raise BadInput("--tensorboard needs the tensorboardX package, an optional extra: "
                       "pip install 'numba-engine[formats]'")
    check_checkpoint_name(args)
    check_distinct_outputs(args)
    # a resumed run without --save writes its --resume file: checked below, named so
    saved_to = None if args.resume and not args.save else checkpoint_path(args)
    for flag, path in (("--save", saved_to), ("--plot", args.plot),
                       ("--log-json", args.log_json), ("--export-onnx", args.export_onnx)):
        if path:
            check_output(flag, path, appending=flag == "--log-json")
    if args.tensorboard:
        check_output("--tensorboard", args.tensorboard, folder=True)
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
