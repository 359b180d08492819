"""The names ``python -m engine.train`` writes under, checked before any work: names and a
path the file system takes (``check_name_lengths``), a checkpoint name of a format that can
hold one (``check_checkpoint_name``), and no two outputs naming one file
(``check_distinct_outputs``); else a ``BadInput`` that names the flag, the path and the
fix."""
import os

from engine.checkpoint import model_only_suffix
from engine.cli.failures import BadInput

# what a file's atomic write adds to its path for the temporary file it writes first
# (engine.archive: "." + at most 200 characters of the name + ".<pid>.<random>.partial")
TEMPORARY_ROOM = 40


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
    path_max = _file_system_limit(_nearest_existing(absolute), "PC_PATH_MAX")
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


def _checkpoint_flag(args, path):
    """``(flag, how a message names the checkpoint)`` of the file the run saves to."""
    if args.save:
        return "--save", f"--save {path}"
    if args.resume:
        return "--resume", f"--resume {path} (a resumed run saves its checkpoint there)"
    return "--save", f"the checkpoint {path} (the default of --save)"


def check_checkpoint_name(args, path):
    """A checkpoint (``path``, None with ``--no-save``) holds the optimizer's state and the
    history: an ``.npz`` file, never a name of a format that holds a model alone
    (``.safetensors``, ``.onnx``)."""
    suffix = path and model_only_suffix(path)
    if not suffix:
        return
    flag, _ = _checkpoint_flag(args, path)
    resumed = " a resumed run saves its checkpoint there, and" if flag == "--resume" else ""
    remedy = ("give --save a name ending in .npz" if flag == "--resume"
              else "give a name ending in .npz")
    onnx = " (--export-onnx PATH writes the model as ONNX)" if suffix == ".onnx" else ""
    raise BadInput(f"{flag} {path}:{resumed} a training checkpoint (the model, the "
                   f"optimizer's state, the history) is an .npz file, not {suffix}; "
                   f"{remedy}{onnx}")


def check_distinct_outputs(args, checkpoint):
    """No two outputs name one file (``checkpoint``: the file the run saves to, or None): the
    ONNX export would overwrite the checkpoint, which the command would then say to
    resume."""
    outputs = [(_checkpoint_flag(args, checkpoint)[1], checkpoint)] if checkpoint else []
    outputs += [(f"{flag} {path}", path) for flag, path in (
        ("--plot", args.plot), ("--log-json", args.log_json),
        ("--export-onnx", args.export_onnx)) if path]
    seen = {}
    for described, path in outputs:
        same = seen.get(os.path.realpath(path))
        if same is not None:
            raise BadInput(f"{described}: is the file of {same} too; give each output a "
                           "file of its own")
        seen[os.path.realpath(path)] = described
