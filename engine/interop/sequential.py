"""An ``nn.Sequential`` from a list of layer descriptions, as the importers of other formats
(``engine.onnx.load``, ``engine.interop.torch.from_sequential``) read them: each a dict
``{"class_name": str, "config": dict, "weights": {entry: array}}``, with the class names,
configs and weight entries of ``nn.Sequential.get_config`` and ``state_dict``.

The model is built as ``nn.load`` builds one (``Sequential.from_config``: no initialiser
runs, the engine's random generator is left as it was) and its weights are loaded by
``load_state_dict``, so an imported model is one ``model.save`` can write and ``nn.load``
read back."""
import numpy as np

from engine import nn
from ops import pointwise

# the layers that take dtype=
WEIGHTED = ("Dense", "Conv1D", "Conv2D", "BatchNorm", "Embedding", "LayerNorm")
# the activations each layer computes inside its kernel (Conv2D's fused epilogue has no softmax)
CONV_FUSED = tuple(name for name in pointwise.ACTIVATIONS if name is not None)
FUSED = {"Dense": tuple(a for a in nn.ACTIVATIONS if a is not None),
         "Conv1D": CONV_FUSED, "Conv2D": CONV_FUSED}


def layer(class_name, config, **weights):
    return {"class_name": class_name, "config": config, "weights": weights}


def fuse_activations(layers):
    """``layers`` with each Activation after a Dense or Conv2D without one moved into that
    layer's kernel (the same function, one kernel instead of two). A leaky_relu of negative
    slope (torch and ONNX allow one) stays an Activation of its own: a fused kernel takes
    the derivative from the output's sign, which a negative slope flips."""
    fused = []
    for entry in layers:
        previous = fused[-1] if fused else None
        if (entry["class_name"] == "Activation" and previous is not None
                and previous["class_name"] in FUSED
                and previous["config"].get("activation") is None
                and entry["config"]["activation"] in FUSED[previous["class_name"]]
                and entry["config"].get("alpha", 0.0) >= 0):
            previous["config"].update(entry["config"])
            continue
        fused.append(entry)
    return fused


def build(layers, input_shape, dtype, name, where):
    """The ``nn.Sequential`` of ``layers`` for inputs of ``input_shape`` (without the batch),
    its parameters and statistics of ``dtype``; a ValueError starting with ``where`` when
    a layer refuses its config or its weights' shapes."""
    dtype = np.dtype(dtype)
    if not layers:
        raise ValueError(f"{where}: nothing to build, no layers")
    for entry in layers:
        if entry["class_name"] in WEIGHTED and dtype != np.float32:
            entry["config"]["dtype"] = dtype.name
    layers[0]["config"]["input_shape"] = list(input_shape)
    config = {"format": "engine.nn.Sequential", "version": nn.FORMAT_VERSION, "name": name,
              "layers": [{"class_name": entry["class_name"], "config": entry["config"]}
                         for entry in layers]}
    try:
        model = nn.Sequential.from_config(config)
        model.load_state_dict({f"{built.name}.{key}": np.asarray(array, dtype)
                               for built, entry in zip(model.layers, layers)
                               for key, array in entry["weights"].items()})
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None
    return model
