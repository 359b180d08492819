"""Training checkpoints: the state ``fit`` resumes from, in a file of its own.

A checkpoint is a ``model.save`` file (architecture and weights under their names) plus
entries under ``nn.TRAINING_PREFIX``: the optimizer state, epoch, history (``fit``'s epoch
records), the run's configuration and the engine's RNG state, encoded by ``engine.archive``
and written atomically. Reading one checks every value, so a damaged or crafted file is a
``ValueError`` saying what is wrong, never a crash later in training. A checkpoint is an
``.npz`` file: ``save_checkpoint`` refuses the names of the formats that hold a model alone
(``model_only_suffix``: ``.safetensors``, ``.onnx``), which a caller can ask before training.
"""
import json
import os

import numpy as np

from engine import archive, nn
from engine.random import generator

# the keys of an epoch record of fit (engine.fit), which a checkpoint's history holds
RECORD_KEYS = ("epoch", "loss", "train_acc", "test_loss", "test_acc", "seconds",
               "samples_per_s")
# the records of checkpoints written before test_loss was recorded
RECORD_KEYS_WITHOUT_TEST_LOSS = tuple(key for key in RECORD_KEYS if key != "test_loss")
CHECKPOINT_KEY = nn.TRAINING_PREFIX + "checkpoint"   # the training state's JSON skeleton
CHECKPOINT_FILE = "a training checkpoint written by --save"
# the suffixes of files that hold a model alone: a checkpoint written under one would lie
MODEL_ONLY_SUFFIXES = {".safetensors": "model.save(path)", ".onnx": "model.export_onnx(path)"}


def model_only_suffix(path):
    """The suffix of ``path`` when it names a format that holds a model alone
    (``MODEL_ONLY_SUFFIXES``), where a training checkpoint cannot go; else None."""
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    return suffix if suffix in MODEL_ONLY_SUFFIXES else None


def save_checkpoint(path, model, optimizer, epoch=0, history=(), config=None):
    """Write model and optimizer state, the epoch counter, history, ``config`` and the
    engine's RNG state to ``path`` (an .npz) with ``engine.archive.atomic_write``. A schedule
    needs no state of its own: it is a function of the epoch.

    The file is a ``model.save`` file (architecture and weights under their names) plus
    entries under ``train/``: the training state as JSON and its arrays."""
    suffix = model_only_suffix(path)
    if suffix is not None:
        raise ValueError(f"save_checkpoint: {os.fspath(path)}: a training checkpoint (the "
                         f"model, the optimizer's state, the history) is an .npz file, not "
                         f"{suffix}; save the model alone with {MODEL_ONLY_SUFFIXES[suffix]}")
    arrays = {}
    state = {"optimizer": optimizer.state_dict(), "epoch": epoch, "history": list(history),
             "config": config or {}, "rng": generator().bit_generator.state}
    skeleton = json.dumps(archive.encode(state, arrays))
    archive.write_npz(path, {
        nn.CONFIG_KEY: np.array(model._file_config()), **model.state_dict(),
        CHECKPOINT_KEY: np.array(skeleton),
        **{nn.TRAINING_PREFIX + name: array for name, array in arrays.items()}})


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _with_test_loss(record):
    """An epoch record of an older checkpoint, with its unrecorded test loss None."""
    return {key: record.get(key) for key in RECORD_KEYS}


def _check_training_state(state):
    """Raise ValueError naming the first value ``save_checkpoint`` cannot have written;
    records of checkpoints from before ``test_loss`` was recorded get it, as None."""
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
    for index, record in enumerate(history):
        if isinstance(record, dict) and tuple(record) == RECORD_KEYS_WITHOUT_TEST_LOSS:
            history[index] = record = _with_test_loss(record)
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
