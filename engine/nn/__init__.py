"""Keras-style layers and the ``Sequential`` model.

Shapes are inferred when a layer is added: the first layer declares ``input_shape=`` (without
the batch dimension) and every later layer is built from its predecessor's output shape, so
a layer that cannot take that shape fails at ``add`` time, not in the middle of training.

A built model keeps its parameters in one flat data buffer and one flat gradient buffer per
device and dtype (``engine.parameter.FlatBuffer``); each Parameter is a view. Optimizers run
one kernel over each buffer and ``model.to(device)`` moves each in one copy.

``model.save(path)`` writes one ``.npz``: the architecture as JSON text under
``CONFIG_KEY`` and the weights by name, through ``engine.archive.atomic_write`` (an
interrupted save leaves the previous file intact). ``load`` reads it with
``engine.archive.read_npz``: arrays and text only, never pickles, so a model file can never
run code, and any damage is a ``ValueError`` naming the file. ``load`` rebuilds the layers
by class name from ``LAYERS``: the built-in ones and those a user registers with
``@nn.register``.

The package: ``engine.nn.layers`` (``Layer`` and the layers), ``engine.nn.convolutional``
(the convolution layers of any rank), ``engine.nn.model`` (``Sequential`` and ``load``) and
``engine.nn.serialization`` (the model file's format). Every public name is here.
"""
import importlib

from engine.nn.convolutional import Conv1D, Conv2D, _Conv  # noqa: F401
from engine.nn.layers import (ACTIVATIONS, Activation, AvgPool2D, BatchNorm, Dense,  # noqa: F401
                              Dropout, Flatten, Layer, MaxPool2D, Normalization, Rescaling,
                              Reshape, batch_shape)
from engine.nn.layers import LayerList, Parameter  # noqa: F401
from engine.nn.layers import Input, InputLayer  # noqa: F401
from engine.nn.keras_methods import (CategoricalCrossentropy, History,  # noqa: F401
                                     SparseCategoricalCrossentropy)
from engine.nn.model import LAYERS, Model, Sequential, load, register  # noqa: F401
from engine.nn.sequence import Embedding, LayerNorm, MultiHeadAttention  # noqa: F401
from engine.nn.torch_layers import (GELU, AvgPool2d, BatchNorm1d, BatchNorm2d,  # noqa: F401
                                    Conv2d, LeakyReLU, Linear, MaxPool2d, Module, ModuleList,
                                    ReLU, Sigmoid, Softmax, Tanh)
from engine.nn.serialization import (CONFIG_KEY, FORMAT_VERSION, MODEL_FILE,  # noqa: F401
                                     TRAINING_PREFIX)
from ops import pointwise as _pointwise

# ------------------------------------------------------------------ losses

_LOSSES = ("CrossEntropyLoss", "BCELoss", "MSELoss")


# PyTorch's names that the engine spells its own (Keras's) way
TORCH_EQUIVALENTS = {   # (those torch_layers provides under torch's own names are gone)
    "Conv1d": "nn.Conv1D(filters, kernel_size, stride=1, padding='valid')",
}
# and every other activation torch has a module for (ops.pointwise.TABLE: SiLU, ...)
TORCH_EQUIVALENTS.update({entry.torch: f"nn.Activation('{entry.name}')"
                          for entry in _pointwise.TABLE
                          if entry.torch and entry.torch not in TORCH_EQUIVALENTS})


# Keras's names that the engine spells otherwise, or does without
KERAS_EQUIVALENTS = {
    "MaxPooling2D": "nn.MaxPool2D(pool_size) (channels first), or engine.keras.layers."
                    "MaxPooling2D (Keras's channels-last default)",
    "AveragePooling2D": "nn.AvgPool2D(pool_size) (channels first), or engine.keras.layers."
                        "AveragePooling2D (Keras's channels-last default)",
    "GlobalAveragePooling2D": "nn.AvgPool2D(pool_size=(height, width)) then nn.Flatten(), or "
                              "engine.keras.layers.GlobalAveragePooling2D",
    "BatchNormalization": "nn.BatchNorm() (torch's momentum convention: 1 - Keras's), or "
                          "engine.keras.layers.BatchNormalization",
}


def __getattr__(name):
    """``nn.CrossEntropyLoss`` and friends are ``engine.losses``'s, imported on first use;
    PyTorch's and Keras's names of layers the engine spells otherwise name the engine's."""
    if name in _LOSSES:
        return getattr(importlib.import_module("engine.losses"), name)
    equivalent = TORCH_EQUIVALENTS.get(name) or KERAS_EQUIVALENTS.get(name)
    if equivalent:
        raise AttributeError(f"module 'engine.nn' has no attribute {name!r}; the engine's "
                             f"equivalent is {equivalent}")
    raise AttributeError(f"module 'engine.nn' has no attribute {name!r}")
