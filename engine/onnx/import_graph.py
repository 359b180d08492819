"""``GraphModel``: the ``nn.Model`` that ``engine.onnx.load`` reads a graph that is not a
chain into (residual joins, attention: nodes that combine two computed values, several
inputs or outputs; ``engine.onnx.import_graph_reader`` reads it). Its forward runs the
graph's nodes in order: those that hold weights through engine layers, the others as engine
functional ops (``engine.onnx.import_ops``), so it trains, runs on CUDA as on the CPU, and
saves and loads as any registered model (its config is the graph)."""
import re

import numpy as np

from engine import nn
from engine.onnx.import_ops import run as run_node
from engine.tensor import Tensor, tensor


@nn.register
class GraphModel(nn.Model):
    """The model ``engine.onnx.load`` reads from a graph that is not a chain: ``nodes``, each
    ``[name, operator, inputs, outputs, attributes, layer]`` (``layer``: None for a node run
    as functional ops, else the index of the layer that runs it on its one input), run in
    order from the graph's ``inputs`` (``[name, shape, dtype]``, None for an open dimension)
    to its ``outputs`` (value names; several give a tuple). ``layers`` are layer
    descriptions (``class_name``, ``config``); ``parameters`` and ``buffers``
    ``[value, attribute, shape, dtype]`` (held by the ``weights`` and ``constants``
    sub-layers); ``aliases`` ``{value: [layer index, attribute]}`` (a stored value a layer
    holds); ``constants`` ``{value: {"dtype", "shape", "values"}}`` the host constants."""

    def __init__(self, nodes, inputs, outputs, layers=(), parameters=(), buffers=(),
                 aliases=None, constants=None, name="onnx_graph"):
        super().__init__(name=name)
        self.nodes = [list(node) for node in nodes]
        self.inputs, self.outputs = [list(entry) for entry in inputs], list(outputs)
        self.layer_configs = [dict(entry) for entry in layers]
        self.layers = nn.LayerList([nn.LAYERS[entry["class_name"]](**entry["config"])
                                    for entry in self.layer_configs])
        self.weights, self.constants = nn.Layer(name="weights"), nn.Layer(name="constants")
        self.parameter_entries = [list(entry) for entry in parameters]
        self.buffer_entries = [list(entry) for entry in buffers]
        for _, attribute, shape, dtype in self.parameter_entries:
            setattr(self.weights, attribute, nn.Parameter(np.zeros(shape, dtype)))
        for _, attribute, shape, dtype in self.buffer_entries:
            self.constants.register_buffer(attribute, tensor(np.zeros(shape, dtype)))
        self.aliases, self.constant_entries = dict(aliases or {}), dict(constants or {})
        self._host = {value: np.array(entry["values"], entry["dtype"]).reshape(entry["shape"])
                      for value, entry in self.constant_entries.items()}
        self._held = {value: (self.weights, attribute)
                      for value, attribute, _, _ in self.parameter_entries}
        self._held.update({value: (self.constants, attribute)
                           for value, attribute, _, _ in self.buffer_entries})

    def build(self, input_shape=None, device=None, initialize=True, dtype=None):
        """Build each layer for the input shape its config declares (the importer read it
        from the layer's weights or ONNX's shape inference), then pack the parameters:
        nothing runs, so a graph whose inputs' values matter (a shape fed to a Reshape) or
        whose shapes are fixed builds too. ``input_shape`` and ``dtype`` (``nn.Model``'s
        signature, ``nn.load``'s call) are the graph's own."""
        if device is not None:
            self.to(device)
        if self.built:
            return self.output_shape
        for layer in self.layers:
            if not layer.built:
                layer.build(layer.input_shape, self.device)
                layer._apply_trainable()
        self.built = True
        _, shape, dtype = self.inputs[0] if self.inputs else (None, [None], "float32")
        self.input_shape, self.input_dtype = tuple(shape[1:]), np.dtype(dtype)
        self._pack()
        return self.output_shape

    def _value(self, values, name):
        if name in values:
            return values[name]
        if name in self._host:
            return self._host[name]
        if name in self.aliases:
            index, attribute = self.aliases[name]
            return getattr(self.layers[index], attribute)
        holder, attribute = self._held[name]
        return getattr(holder, attribute)

    def forward(self, *inputs):
        if len(inputs) != len(self.inputs):
            raise TypeError(f"{self.name}: the graph takes {len(self.inputs)} inputs "
                            f"{[entry[0] for entry in self.inputs]}, got {len(inputs)}")
        values = {entry[0]: x if isinstance(x, Tensor) else self._as_input(x)
                  for entry, x in zip(self.inputs, inputs)}
        for name, operator, node_inputs, outputs, attributes, layer in self.nodes:
            arguments = [self._value(values, value) if value else None for value in node_inputs]
            try:
                if layer is None:
                    results = run_node(operator, arguments, attributes, len(outputs))
                else:
                    data = arguments[0]
                    if isinstance(data, np.ndarray):   # an embedding of stored ids
                        data = tensor(data, device=self.device)
                    results = [self.layers[layer](data)]
            except (ValueError, TypeError, IndexError) as error:   # named by its node
                kind = next(base for base in (ValueError, TypeError, IndexError)
                            if isinstance(error, base))
                raise kind(f"{self.name}: node {name!r} ({operator}): {error}") from None
            values.update((output, result) for output, result in zip(outputs, results)
                          if output)
        results = tuple(self._value(values, name) for name in self.outputs)
        return results[0] if len(results) == 1 else results

    def get_config(self):
        return {"nodes": self.nodes, "inputs": self.inputs, "outputs": self.outputs,
                "layers": self.layer_configs, "parameters": self.parameter_entries,
                "buffers": self.buffer_entries, "aliases": self.aliases,
                "constants": self.constant_entries, "name": self.name}


def attribute_name(value, taken):
    """A Python attribute name for the stored value ``value``: its characters other than
    letters, digits and ``_`` replaced (``blocks.0.fc.weight`` -> ``blocks_0_fc_weight``),
    numbered where that is taken."""
    base = re.sub(r"\W", "_", value).strip("_") or "value"
    base = base if base[0].isalpha() else f"v_{base}"
    name, number = base, 1
    while name in taken or hasattr(nn.Layer, name):
        name, number = f"{base}_{number}", number + 1
    taken.add(name)
    return name
