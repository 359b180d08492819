"""``engine.onnx``: Sequential models as ONNX files, for onnxruntime and other ONNX engines.

    model.export_onnx("mlp.onnx")              # or engine.onnx.export(model, "mlp.onnx")
    session = onnxruntime.InferenceSession("mlp.onnx")
    logits, = session.run(None, {"input": images})   # float32 [batch, 28, 28] -> [batch, 10]

The graph has one input, ``input`` (``[batch, *model.input_shape]``, the batch dimension
open), and one output, ``output``; each layer becomes the ONNX operators that compute what
its forward pass computes in eval mode: ``Dense`` a ``Gemm`` (``x @ W + b``, ``W`` stored as
the engine holds it, ``(in, units)``) and its activation (``Relu``, ``LeakyRelu``,
``Sigmoid``, ``Tanh``, ``Softmax`` over the last axis), ``Activation`` that operator,
``Flatten`` a ``Flatten`` from axis 1, ``Dropout`` an ``Identity``; ``Conv2D`` a ``Conv``
(the weight in the layout both share, ``(filters, in / groups, kh, kw)``, the padding as
explicit ``pads``, so "same" with an even kernel keeps its extra row at the bottom) and its
activation, ``MaxPool2D`` a ``MaxPool``, ``AvgPool2D`` an ``AveragePool`` counting the
padded zeros, ``BatchNorm`` a ``BatchNormalization`` on its running statistics (eval
mode), ``Reshape`` a ``Reshape`` that keeps the batch dimension, ``Rescaling`` a ``Mul`` (and
an ``Add`` for an offset), ``Normalization`` a ``Sub`` and a ``Div``. A model that starts
with ``Rescaling`` takes ``uint8`` input (raw images, as ``python -m engine.train``'s models
do), cast by a first ``Cast`` node. A layer without an
exporter here is a ValueError naming it.
The weights are the model's, in its dtype (float32 or float64), as initializers. With
``normalize=(mean, std)`` the graph starts with ``(input - mean) / std``, the
standardisation of ``data.DataLoader(normalize=...)``: a model trained on standardised
images (``python -m engine.train`` trains so) then takes images as the loader does before
it, scaled to [0, 1].

The model is built with the ``onnx`` package's helpers (an optional extra: ``pip install
-e '.[onnx]'``), checked by ``onnx.checker`` with shape inference, and written
through ``engine.archive.atomic_write``: a failed export leaves an older file as it was.
"""
import importlib
import os

import numpy as np

import engine
from engine import archive

DEFAULT_OPSET = 17
MIN_OPSET = 13   # Softmax over one axis (the engine's softmax(axis=-1)) from opset 13 on
INPUT, OUTPUT = "input", "output"
INSTALL_HINT = "pip install -e '.[onnx]'"
ACTIVATIONS = {"relu": "Relu", "leaky_relu": "LeakyRelu", "sigmoid": "Sigmoid",
               "tanh": "Tanh", "softmax": "Softmax"}


def _onnx():
    try:
        return importlib.import_module("onnx")
    except ImportError as error:
        raise ImportError(f"engine.onnx needs the onnx package ({error}); {INSTALL_HINT}") \
            from None


class _Graph:
    """The nodes and initializers of the graph being built; ``value`` names what the last
    node computed, ``input_dtype`` is the graph input's."""

    def __init__(self, onnx, input_dtype):
        self.onnx, self.nodes, self.initializers = onnx, [], []
        self.value, self.input_dtype = INPUT, np.dtype(input_dtype)

    def weight(self, name, array):
        self.initializers.append(self.onnx.numpy_helper.from_array(np.asarray(array), name))
        return name

    def node(self, operator, name, extra_inputs=(), **attributes):
        output = f"{name}/{operator}"
        self.nodes.append(self.onnx.helper.make_node(
            operator, [self.value, *extra_inputs], [output], name=output, **attributes))
        self.value = output

    def activation(self, layer):
        if layer.activation is None:
            return
        attributes = ({"alpha": layer.alpha} if layer.activation == "leaky_relu"
                      else {"axis": -1} if layer.activation == "softmax" else {})
        self.node(ACTIVATIONS[layer.activation], layer.name, **attributes)


def _dense(graph, layer):
    weight = graph.weight(f"{layer.name}.weight", layer.weight.numpy())
    bias = graph.weight(f"{layer.name}.bias", layer.bias.numpy())
    graph.node("Gemm", layer.name, (weight, bias))
    graph.activation(layer)


def _flatten(graph, layer):
    graph.node("Flatten", layer.name, axis=1)


def _dropout(graph, layer):   # the identity in eval mode, which is what an export runs
    graph.node("Identity", layer.name)


def _conv2d(graph, layer):
    (top, bottom), (left, right) = layer.paddings
    weights = [graph.weight(f"{layer.name}.weight", layer.weight.numpy())]
    if layer.use_bias:
        weights.append(graph.weight(f"{layer.name}.bias", layer.bias.numpy()))
    graph.node("Conv", layer.name, weights, kernel_shape=list(layer.kernel_size),
               strides=list(layer.stride), dilations=list(layer.dilation), group=layer.groups,
               pads=[top, left, bottom, right])
    graph.activation(layer)


def _pool(operator, **attributes):
    def export(graph, layer):
        rows, columns = layer.padding
        graph.node(operator, layer.name, kernel_shape=list(layer.pool_size),
                   strides=list(layer.stride), pads=[rows, columns, rows, columns],
                   **attributes)
    return export


def _batch_norm(graph, layer):   # eval mode: the running statistics
    arrays = [(entry, getattr(layer, entry).numpy())
              for entry in ("weight", "bias", "running_mean", "running_var")]
    graph.node("BatchNormalization", layer.name,
               [graph.weight(f"{layer.name}.{entry}", array) for entry, array in arrays],
               epsilon=layer.eps)


def _reshape(graph, layer):   # 0 copies the input's (batch) dimension
    shape = graph.weight(f"{layer.name}.shape", np.array((0,) + layer.output_shape, np.int64))
    graph.node("Reshape", layer.name, (shape,))


def _rescaling(graph, layer):   # integer input: the graph's input is declared as such
    if graph.value == INPUT and graph.input_dtype.kind in "iu":
        graph.node("Cast", layer.name, to=graph.onnx.helper.np_dtype_to_tensor_dtype(
            layer.dtype))
    graph.node("Mul", layer.name, (graph.weight(f"{layer.name}.scale",
                                                np.asarray(layer.scale, layer.dtype)),))
    if layer.offset != 0.0:
        graph.node("Add", layer.name, (graph.weight(f"{layer.name}.offset",
                                                    np.asarray(layer.offset, layer.dtype)),))


def _normalization(graph, layer):   # Keras's floor on the standard deviation, as forward
    mean, variance = (getattr(layer, entry).numpy() for entry in ("mean", "variance"))
    std = np.maximum(np.sqrt(variance), np.asarray(layer.STD_FLOOR, variance.dtype))
    graph.node("Sub", layer.name, (graph.weight(f"{layer.name}.mean", mean),))
    graph.node("Div", layer.name, (graph.weight(f"{layer.name}.std", std),))


EXPORTERS = {"Dense": _dense, "Activation": lambda graph, layer: graph.activation(layer),
             "Rescaling": _rescaling, "Normalization": _normalization, "Flatten": _flatten,
             "Dropout": _dropout, "Conv2D": _conv2d,
             "MaxPool2D": _pool("MaxPool"), "AvgPool2D": _pool("AveragePool", count_include_pad=1),
             "BatchNorm": _batch_norm, "Reshape": _reshape}


def _check_model(model):
    """The model's dtype; ValueError unless ``model`` is a built Sequential whose every layer
    has an exporter, and its parameters share one float dtype."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, list) or not hasattr(model, "get_config"):
        raise TypeError(f"engine.onnx.export takes an nn.Sequential model, got "
                        f"{type(model).__name__}")
    if not layers or model.input_shape is None or not all(layer.built for layer in layers):
        raise ValueError("engine.onnx.export: the model is not built; give its first layer "
                         "input_shape=... or call it on a batch first")
    for index, layer in enumerate(layers):
        if type(layer).__name__ not in EXPORTERS:
            raise ValueError(f"engine.onnx.export: layer {index} '{layer.name}' "
                             f"({type(layer).__name__}) has no ONNX export yet; exported "
                             f"layers: {', '.join(EXPORTERS)}")
    dtypes = {np.dtype(p.dtype) for p in model.parameters()} or {np.dtype(np.float32)}
    if len(dtypes) > 1:
        raise ValueError(f"engine.onnx.export: the parameters mix dtypes "
                         f"{sorted(map(str, dtypes))}; convert the model with model.to(dtype)")
    return dtypes.pop()


def _standardise(graph, normalize, dtype, input_shape):
    """Start the graph with ``(input - mean) / std``."""
    try:
        mean, std = (np.asarray(value, dtype) for value in normalize)
        shape = np.broadcast_shapes(mean.shape, std.shape, input_shape)
    except (TypeError, ValueError) as error:
        raise ValueError(f"engine.onnx.export: normalize must be (mean, std), numbers or "
                         f"arrays broadcasting against one sample {input_shape} ({error})") \
            from None
    if shape != tuple(input_shape) or not (np.isfinite(mean).all() and np.isfinite(std).all()
                                           and (std > 0).all()):
        raise ValueError(f"engine.onnx.export: normalize needs a finite mean and a positive "
                         f"finite std broadcasting against one sample {input_shape}")
    graph.node("Sub", "normalize", (graph.weight("normalize.mean", mean),))
    graph.node("Div", "normalize", (graph.weight("normalize.std", std),))


def to_onnx(model, opset=None, normalize=None):
    """The ``onnx.ModelProto`` of ``model``, checked by ``onnx.checker`` (module docstring)."""
    onnx = _onnx()
    opset = DEFAULT_OPSET if opset is None else opset
    newest = onnx.defs.onnx_opset_version()
    if not isinstance(opset, int) or isinstance(opset, bool) or not MIN_OPSET <= opset <= newest:
        raise ValueError(f"engine.onnx.export: opset must be an integer from {MIN_OPSET} to "
                         f"{newest} (this onnx package's newest), got {opset!r}")
    dtype = _check_model(model)
    # a model that starts with Rescaling takes raw images: uint8 in, as nn.load's model does
    raw = type(model.layers[0]).__name__ == "Rescaling" and normalize is None
    graph = _Graph(onnx, np.uint8 if raw else dtype)
    if normalize is not None:
        _standardise(graph, normalize, dtype, model.input_shape)
    for layer in model.layers:
        EXPORTERS[type(layer).__name__](graph, layer)
    if graph.value == INPUT:   # a model of identities still computes its output by a node
        graph.node("Identity", "output")
    graph.nodes[-1].output[0] = OUTPUT
    element = onnx.helper.np_dtype_to_tensor_dtype(dtype)
    inputs = [onnx.helper.make_tensor_value_info(INPUT, onnx.helper.np_dtype_to_tensor_dtype(
                                                     graph.input_dtype),
                                                 ["batch", *model.input_shape])]
    outputs = [onnx.helper.make_tensor_value_info(OUTPUT, element,
                                                  ["batch", *model.output_shape])]
    opsets = [onnx.helper.make_opsetid("", opset)]
    proto = onnx.helper.make_model(
        onnx.helper.make_graph(graph.nodes, model.name, inputs, outputs, graph.initializers),
        opset_imports=opsets, producer_name="numba-engine", producer_version=engine.__version__,
        ir_version=onnx.helper.find_min_ir_version_for(opsets))
    onnx.checker.check_model(proto, full_check=True)
    return proto


def export(model, path, opset=None, normalize=None):
    """Write ``model`` (a built ``nn.Sequential``) to ``path`` as ONNX with operator set
    ``opset`` (default ``DEFAULT_OPSET``), standardising its input first with ``normalize``
    (``(mean, std)``, or None); returns the ``onnx.ModelProto``. The file is written whole
    or not at all (``engine.archive.atomic_write``)."""
    proto = to_onnx(model, opset, normalize)
    with archive.atomic_write(os.fspath(path)) as file:
        file.write(proto.SerializeToString())
    return proto
