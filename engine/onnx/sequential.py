"""Export of an ``nn.Sequential`` layer by layer (``engine.onnx``'s docstring)."""
import math

import numpy as np

import engine
from engine.onnx.common import ACTIVATIONS, GELU_OPSET, INPUT, OUTPUT, _onnx, checked_opset
from ops import pointwise


class _OnnxGraphBuilder:
    """The nodes and initializers of the graph being built; ``value`` names what the last
    node computed, ``input_dtype`` is the graph input's."""

    def __init__(self, onnx, input_dtype, dtype, opset):
        self.onnx, self.nodes, self.initializers = onnx, [], []
        self.value, self.input_dtype = INPUT, np.dtype(input_dtype)
        self.dtype, self.opset = np.dtype(dtype), opset   # the model's float dtype

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
        if layer.activation == "gelu" and self.opset < GELU_OPSET:
            self.gelu_composition(layer.name)
            return
        entry = pointwise.BY_NAME.get(layer.activation)
        if entry is not None and self.opset < entry.onnx_opset:
            raise ValueError(f"engine.onnx.export: layer '{layer.name}': ONNX's {entry.onnx} "
                             f"(its activation {layer.activation!r}) is an operator from opset "
                             f"{entry.onnx_opset} on; export with opset={entry.onnx_opset} or "
                             f"later, got {self.opset}")
        attributes = ({"alpha": layer.alpha} if layer.activation == "leaky_relu"
                      else {"axis": -1} if layer.activation == "softmax" else {})
        self.node(ACTIVATIONS[layer.activation], layer.name, **attributes)

    def gelu_composition(self, name):
        """x * 0.5 * (1 + erf(x / sqrt 2)): GELU in the operators of any opset."""
        x = self.value
        constant = {key: self.weight(f"{name}.gelu_{key}", np.asarray(value, self.dtype))
                    for key, value in (("sqrt2", math.sqrt(2)), ("one", 1), ("half", 0.5))}
        self.node("Div", f"{name}/gelu", (constant["sqrt2"],))
        self.node("Erf", f"{name}/gelu")
        self.node("Add", f"{name}/gelu", (constant["one"],))
        self.node("Mul", f"{name}/gelu", (x,))
        self.node("Mul", f"{name}/gelu_half", (constant["half"],))


def _dense(graph, layer):
    weight = graph.weight(f"{layer.name}.weight", layer.weight.numpy())
    bias = graph.weight(f"{layer.name}.bias", layer.bias.numpy())
    graph.node("Gemm", layer.name, (weight, bias))
    graph.activation(layer)


def _flatten(graph, layer):
    graph.node("Flatten", layer.name, axis=1)


def _dropout(graph, layer):   # the identity in eval mode, which is what an export runs
    graph.node("Identity", layer.name)


def _conv(graph, layer):   # Conv1D and Conv2D: ONNX's Conv takes any rank
    weights = [graph.weight(f"{layer.name}.weight", layer.weight.numpy())]
    if layer.use_bias:
        weights.append(graph.weight(f"{layer.name}.bias", layer.bias.numpy()))
    graph.node("Conv", layer.name, weights, kernel_shape=list(layer.kernel_size),
               strides=list(layer.stride), dilations=list(layer.dilation), group=layer.groups,
               pads=[before for before, _ in layer.paddings]
               + [after for _, after in layer.paddings])
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
    # ONNX's momentum weighs the running value, torch's and the engine's the batch's; it
    # changes nothing at inference, and an import reads the layer's back from it
    graph.node("BatchNormalization", layer.name,
               [graph.weight(f"{layer.name}.{entry}", array) for entry, array in arrays],
               epsilon=layer.eps, momentum=1 - layer.momentum)


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


def _embedding(graph, layer):   # Gather's data is the table, its indices the chain's value
    table = graph.weight(f"{layer.name}.weight", layer.weight.numpy())
    output = f"{layer.name}/Gather"
    graph.nodes.append(graph.onnx.helper.make_node("Gather", [table, graph.value], [output],
                                                   name=output, axis=0))
    graph.value = output


def _layer_norm(graph, layer):   # ONNX's LayerNormalization: opset 17 on
    if graph.opset < 17:
        raise ValueError(f"engine.onnx.export: layer '{layer.name}' (LayerNorm) needs opset 17 "
                         f"or later (LayerNormalization), got {graph.opset}")
    graph.node("LayerNormalization", layer.name,
               [graph.weight(f"{layer.name}.{entry}", getattr(layer, entry).numpy())
                for entry in ("weight", "bias")], axis=-1, epsilon=layer.eps)


EXPORTERS = {"Dense": _dense, "Activation": lambda graph, layer: graph.activation(layer),
             "Rescaling": _rescaling, "Normalization": _normalization, "Flatten": _flatten,
             "Dropout": _dropout, "Conv1D": _conv, "Conv2D": _conv,
             "MaxPool2D": _pool("MaxPool"), "AvgPool2D": _pool("AveragePool", count_include_pad=1),
             "BatchNorm": _batch_norm, "Reshape": _reshape, "Embedding": _embedding,
             "LayerNorm": _layer_norm}


def _exporter(layer):
    """The exporter of ``layer``'s class or of the engine layer it derives from (torch's
    ``nn.Linear`` is a Dense), None if neither has one."""
    for kind in type(layer).__mro__:
        if kind.__name__ in EXPORTERS:
            return EXPORTERS[kind.__name__]
    return None


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
        if _exporter(layer) is None:
            raise ValueError(f"engine.onnx.export: layer {index} '{layer.name}' "
                             f"({type(layer).__name__}) has no ONNX export yet; exported "
                             f"layers: {', '.join(EXPORTERS)}")
        if getattr(layer, "data_format", "channels_first") != "channels_first":
            raise ValueError(f"engine.onnx.export: layer {index} '{layer.name}' "
                             f"({type(layer).__name__}) takes channels-last images, which this "
                             "export does not write; rebuild it with "
                             "data_format='channels_first'")
        activation = getattr(layer, "activation", None)
        if activation is not None and ACTIVATIONS.get(activation) is None:
            exportable = sorted(name for name, operator in ACTIVATIONS.items() if operator)
            raise ValueError(f"engine.onnx.export: layer {index} '{layer.name}' "
                             f"({type(layer).__name__}): ONNX has no operator for its activation "
                             f"{activation!r} (its ops/pointwise.py entry names none); "
                             f"exported activations: {', '.join(exportable)}")
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
    opset = checked_opset(onnx, opset)
    dtype = _check_model(model)
    # a model that starts with Rescaling takes raw images: uint8 in, as nn.load's model does
    raw = type(model.layers[0]).__name__ == "Rescaling" and normalize is None
    ids = type(model.layers[0]).__name__ == "Embedding"   # token ids in: int64
    graph = _OnnxGraphBuilder(onnx, np.uint8 if raw else np.int64 if ids else dtype, dtype,
                              opset)
    if normalize is not None:
        _standardise(graph, normalize, dtype, model.input_shape)
    for layer in model.layers:
        _exporter(layer)(graph, layer)
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

