"""The model file's format: its keys and version, the readers of ``.npz`` and
``.safetensors`` model files (arrays and JSON text only, never pickles), and the checks of
the architecture a file declares, made before any of it is allocated."""
import math
import os

import numpy as np

from engine import archive
from engine.file_safety import SizeBudget
from engine.nn.convolutional import _Conv
from engine.nn.layers import BatchNorm, Dense


FORMAT_VERSION = 1
CONFIG_KEY = "__config__"
TRAINING_PREFIX = "train/"   # what `python -m engine.train --save` adds beside the model
MODEL_FILE = "a model file written by model.save"
LAYER_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))   # what the kernels compute in


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


def check_layer_dtype(index, class_name, config):
    """A ValueError unless the ``dtype`` a layer's config names (if any) is one the layers
    compute in (``LAYER_DTYPES``): "O" or "float16" would otherwise reach a kernel."""
    if "dtype" not in config:
        return
    try:
        dtype = np.dtype(config["dtype"])
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype not in LAYER_DTYPES:   # (np.dtype(None) is float64)
        raise ValueError(f"layer {index} ({class_name}): dtype {config['dtype']!r} is not one "
                         f"the layers compute in ({', '.join(map(str, LAYER_DTYPES))})")


def _parameter_bytes(layer, input_shape):
    """The bytes of the parameters and float buffers a built-in ``layer`` makes for inputs
    of ``input_shape`` (its build's rule, computed without building); 0 for a layer without
    any or whose state its config already holds (Normalization), None for a registered
    layer of the user's (its own code decides)."""
    if isinstance(layer, Dense):
        values = (input_shape[0] + 1) * layer.units
    elif isinstance(layer, _Conv):
        values = layer.filters * (input_shape[0] // layer.groups * math.prod(layer.kernel_size)
                                  + layer.use_bias)
    elif isinstance(layer, BatchNorm):
        values = 4 * input_shape[0]   # weight, bias and the two running statistics
    elif type(layer).__module__.startswith("engine.nn."):
        return 0
    else:
        return None
    return values * layer.dtype.itemsize


def check_architecture(layers, weights):
    """Charge the parameters of ``layers`` (not built; the model a config describes) to
    the bytes of ``weights`` (the arrays the file holds, which must fill them) before any
    layer is built: a ValueError naming the layer whose parameters the file cannot hold, so
    a small file that declares a huge model is refused in linear time, allocating nothing.
    Checking stops at a registered layer of the user's (its parameters are unknown until it
    is built; ``load_state_dict`` compares them then) and at a shape a layer refuses (its
    build names the mismatch)."""
    held = sum(np.asarray(value).nbytes for value in weights.values())
    budget = SizeBudget("the file's weights", held)
    shape = layers[0].input_shape if layers else None
    for index, layer in enumerate(layers):
        if shape is None:
            return
        try:
            output_shape = layer.compute_output_shape(shape)
        except (TypeError, ValueError):
            return
        nbytes = _parameter_bytes(layer, shape)
        if nbytes is None:
            return
        budget.charge(nbytes, f"layer {index} ({type(layer).__name__}) of the architecture, "
                              f"on inputs {shape},")
        shape = output_shape
