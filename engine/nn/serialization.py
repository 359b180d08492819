"""The model file's format: its keys and version, and the readers of ``.npz`` and
``.safetensors`` model files (arrays and JSON text only, never pickles)."""
import os

from engine import archive


FORMAT_VERSION = 1
CONFIG_KEY = "__config__"
TRAINING_PREFIX = "train/"   # what `python -m engine.train --save` adds beside the model
MODEL_FILE = "a model file written by model.save"


def _is_safetensors(path):
    return os.fspath(path).lower().endswith(".safetensors")


def _read_safetensors(path):
    """The config text and the weights of a safetensors model file."""
    state, metadata = archive.read_safetensors(path, MODEL_FILE)
    if CONFIG_KEY not in metadata:
        raise ValueError(f"{path!r} holds weights ({len(state)} arrays) but no architecture "
                         f"(metadata {CONFIG_KEY!r}): build the model and call "
                         "model.load_state_dict(safetensors.numpy.load_file(path))")
    return metadata[CONFIG_KEY], state


def _read_npz(path):
    """The config text and the weights of an ``.npz`` model file or checkpoint."""
    entries = archive.read_npz(path, MODEL_FILE,
                               keep=lambda name: not name.startswith(TRAINING_PREFIX))
    config = archive.text_entry(entries, CONFIG_KEY, path, MODEL_FILE)
    return config, {key: value for key, value in entries.items() if key != CONFIG_KEY}
