"""Import: an ONNX chain read back into an ``nn.Sequential`` (``engine.onnx``'s docstring)."""
import math
import os

import numpy as np

from engine import nn
from engine.file_safety import SizeBudget
from engine.interop import sequential
from engine.onnx.import_graph_reader import needs_graph, read_graph
from engine.onnx.common import MIN_OPSET, PROBE_BATCHES, _onnx
from engine.onnx.importers import IMPORTERS

# ------------------------------------------------------------------ import

# operators a shape computation beside the chain may use (torch writes one for Unflatten and
# view(x.size(0), ...)); the importer evaluates them with NumPy for two batch sizes
SHAPE_OPERATORS = ("Constant", "Identity", "Shape", "Gather", "Unsqueeze", "Squeeze", "Concat",
                   "Slice", "Cast", "Add", "Sub", "Mul", "Div", "Mod", "Reshape")
FLOAT_TYPES = (np.dtype(np.float32), np.dtype(np.float64))


class OnnxImportError(ValueError):
    """A file ``load`` does not read, and why (a ValueError naming the file and the node)."""


class _Reader:
    """One ONNX graph being read: its constants, which node makes each value, and the feature
    shape (without the batch) of each value on the chain read so far."""

    def __init__(self, onnx, proto, path):
        self.onnx, self.path, self.graph = onnx, path, proto.graph
        self.initializers = {tensor.name: tensor for tensor in self.graph.initializer}
        self.producer = {output: node for node in self.graph.node for output in node.output}
        self.shapes = {}
        self._values = {}
        self._constants = {}   # the initializers read so far, as arrays
        self._evaluating = set()   # the values being computed: one met again is a cycle
        # what the shape computations may allocate: about the file's size
        self.budget = SizeBudget("the model file", proto.ByteSize())

    def fail(self, node, message):
        where = f"node {node.name!r} ({node.op_type})" if node is not None else "the graph"
        return OnnxImportError(f"engine.onnx.load: {self.path!r}: {where}: {message}")

    def attributes(self, node):
        return {a.name: self.onnx.helper.get_attribute_value(a) for a in node.attribute}

    def _tensor(self, tensor, node):
        if tensor.data_location == self.onnx.TensorProto.EXTERNAL:
            stored = self.onnx.TensorProto()
            stored.CopyFrom(tensor)
            stored.raw_data = self._external_bytes(tensor, node)
            stored.data_location = self.onnx.TensorProto.DEFAULT
            del stored.external_data[:]
            tensor = stored
        try:
            return self.onnx.numpy_helper.to_array(tensor)
        except Exception as error:   # a size that does not match the shape, an unknown type
            raise self.fail(node, f"tensor {tensor.name!r} cannot be read ({error})") from None

    def _external_bytes(self, tensor, node):
        """The bytes of a tensor kept in an external file (as torch's exporter writes weights
        by default: ``model.onnx.data`` beside ``model.onnx``), read only from a file in the
        model's own folder and only within that file."""
        entries = {entry.key: entry.value for entry in tensor.external_data}
        location = entries.get("location", "")
        folder = os.path.dirname(os.path.realpath(self.path))
        target = os.path.realpath(os.path.join(folder, location))
        if (not location or os.path.isabs(location)
                or os.path.dirname(target) != folder or not os.path.isfile(target)):
            raise self.fail(node, f"tensor {tensor.name!r} keeps its data in {location!r}, "
                                  "which is not a file in the model's folder")
        try:
            offset, length = int(entries.get("offset", 0)), entries.get("length")
            size = os.path.getsize(target)
            length = size - offset if length is None else int(length)
        except ValueError:
            raise self.fail(node, f"tensor {tensor.name!r}: offset and length must be "
                                  f"integers, got {entries}") from None
        if offset < 0 or length < 0 or offset + length > size:
            raise self.fail(node, f"tensor {tensor.name!r}: bytes {offset} to {offset + length}"
                                  f" of {location!r}, which holds {size}")
        with open(target, "rb") as file:
            file.seek(offset)
            return file.read(length)

    def value(self, name, node, batch=PROBE_BATCHES[0]):
        """The array ``name`` holds: an initializer, a Constant, or a shape computation
        (``SHAPE_OPERATORS``) evaluated for inputs of ``batch`` samples."""
        if name in self.initializers:   # read once: a node may name one many times
            if name not in self._constants:
                self._constants[name] = self._tensor(self.initializers[name], node)
            return self._constants[name]
        key = (name, batch)
        if key not in self._values:
            producer = self.producer.get(name)
            if producer is None or producer.op_type not in SHAPE_OPERATORS:
                made = "the graph input" if producer is None else f"a {producer.op_type} node"
                raise self.fail(node, f"input {name!r} must be stored in the file (an "
                                      f"initializer or a Constant), but {made} computes it")
            if key in self._evaluating:
                raise self.fail(producer, f"value {name!r} is computed from itself: the graph "
                                          "has a cycle")
            self._evaluating.add(key)
            try:
                self._values[key] = self.guarded(producer, self._evaluate, producer, batch)
            finally:
                self._evaluating.discard(key)
        return self._values[key]

    def guarded(self, node, function, *args):
        """``function(*args)``, any failure but the importer's own refusals (NumPy's, on
        values a crafted file holds) a ValueError naming ``node``."""
        try:
            return function(*args)
        except OnnxImportError:
            raise
        except Exception as error:
            raise self.fail(node, f"cannot be read ({type(error).__name__}: {error})") from None

    def _evaluate(self, node, batch):
        a = self.attributes(node)
        if node.op_type == "Constant":
            if "value" in a:
                return self._tensor(a["value"], node)
            for key in ("value_int", "value_ints", "value_float", "value_floats"):
                if key in a:
                    return np.array(a[key], np.int64 if "int" in key else np.float32)
            raise self.fail(node, f"a Constant with {sorted(a)} is not read")
        if node.op_type == "Shape":
            if node.input[0] not in self.shapes:
                raise self.fail(node, f"the shape of {node.input[0]!r} is not known here")
            shape = np.array((batch,) + self.shapes[node.input[0]], np.int64)
            return shape[a.get("start", 0):a.get("end", len(shape))]
        inputs = [self.value(name, node, batch) if name else None for name in node.input]
        x = inputs[0]
        try:
            self.budget.charge(8 * _result_size(node.op_type, inputs, a), "its result")
        except ValueError as error:
            raise self.fail(node, str(error)) from None
        if node.op_type in ("Add", "Sub", "Mul", "Mod"):
            operation = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply,
                         "Mod": np.fmod if a.get("fmod") else np.mod}[node.op_type]
            return operation(x, inputs[1])
        if node.op_type == "Div":
            return (np.trunc(x / inputs[1]).astype(x.dtype) if x.dtype.kind in "iu"
                    else x / inputs[1])
        if node.op_type == "Identity":
            return x
        if node.op_type == "Cast":
            return x.astype(self.onnx.helper.tensor_dtype_to_np_dtype(a["to"]))
        if node.op_type == "Gather":
            return np.take(x, inputs[1], axis=a.get("axis", 0))
        if node.op_type == "Concat":
            return np.concatenate(inputs, axis=a["axis"])
        if node.op_type == "Reshape":
            return x.reshape([d if d else x.shape[i] for i, d in enumerate(inputs[1])])
        axes = a.get("axes", None if len(inputs) < 2 or inputs[1] is None else inputs[1])
        if node.op_type == "Unsqueeze":
            return np.expand_dims(x, tuple(int(v) for v in axes))
        if node.op_type == "Squeeze":
            return np.squeeze(x, None if axes is None else tuple(int(v) for v in axes))
        starts, ends = inputs[1], inputs[2]   # Slice
        axes = range(len(starts)) if len(inputs) < 4 or inputs[3] is None else inputs[3]
        steps = [1] * len(starts) if len(inputs) < 5 or inputs[4] is None else inputs[4]
        index = [slice(None)] * x.ndim
        for start, end, axis, step in zip(starts, ends, axes, steps):
            index[int(axis)] = slice(int(start), int(end), int(step))
        return x[tuple(index)]


def _result_size(operator, inputs, attributes):
    """How many elements a shape computation's ``operator`` makes of ``inputs``, known
    before it runs (0 for a view of its input: Reshape, Squeeze, Slice, ...), so the file's
    budget is charged before NumPy allocates: a broadcast, a Concat or a Gather of a small
    file's constants can otherwise ask for gigabytes."""
    if operator in ("Add", "Sub", "Mul", "Mod", "Div"):
        return math.prod(np.broadcast_shapes(inputs[0].shape, inputs[1].shape))
    if operator == "Concat":
        return sum(value.size for value in inputs if value is not None)
    if operator == "Gather":
        x, indices = inputs[0], inputs[1]
        axis = attributes.get("axis", 0) % max(x.ndim, 1)
        return math.prod(x.shape[:axis]) * indices.size * math.prod(x.shape[axis + 1:])
    if operator == "Cast":
        return inputs[0].size
    return 0


def _chain(reader):
    """The graph's nodes from its one input to its one output, each feeding the next; a
    ValueError for a graph that branches, joins or has several inputs or outputs. Nodes off
    the chain compute constants or shapes for it."""
    graph = reader.graph
    inputs = [value for value in graph.input if value.name not in reader.initializers]
    if len(inputs) != 1 or len(graph.output) != 1:
        raise reader.fail(None, f"{len(inputs)} inputs ({[v.name for v in inputs]}) and "
                                f"{len(graph.output)} outputs; a Sequential has one of each")
    computed = {inputs[0].name}   # the values that depend on the input's data
    feeds = {}
    for node in _gelu_compositions_as_nodes(reader):
        data = [name for name in node.input if name in computed]
        if not data or node.op_type == "Shape":   # Shape reads the size, not the data
            continue
        if len(data) > 1:
            raise reader.fail(node, f"combines {len(data)} computed values {data}: the graph "
                                    "is not a chain of layers")
        feeds.setdefault(data[0], []).append(node)
        computed.update(name for name in node.output if name)
    chain, value, visited = [], inputs[0].name, set()
    while value in feeds:
        if value in visited:   # a node that feeds a value the chain computed before
            raise reader.fail(feeds[value][0], f"value {value!r} is computed again further "
                                               "down the chain: the graph has a cycle")
        visited.add(value)
        if len(feeds[value]) > 1 or value == graph.output[0].name:
            users = [node.name for node in feeds[value]]
            raise reader.fail(None, f"value {value!r} feeds {users}"
                                    + (" and the output" if value == graph.output[0].name
                                       else "") + ": the graph branches")
        node = feeds[value][0]
        if not node.output or not node.output[0]:
            raise reader.fail(node, "has no output")
        chain.append(node)
        extra = [name for name in node.output[1:] if name in feeds
                 or name == graph.output[0].name]
        if extra:
            raise reader.fail(node, f"its outputs {extra} are used too: not a chain")
        value = node.output[0]
    if value != graph.output[0].name:
        raise reader.fail(None, f"the output {graph.output[0].name!r} is not computed from "
                                f"the input {inputs[0].name!r} by a chain of nodes")
    return inputs[0], chain


def _gelu_compositions_as_nodes(reader):
    """The graph's nodes, each GELU written as ``x * (1 + erf(x / sqrt 2)) * 0.5`` (what the
    export writes below opset 20, as torch's exporter does: ``Div``, ``Erf``, ``Add``, then
    ``x`` joins again in a ``Mul``, then a ``Mul`` by 0.5) replaced by one ``Gelu`` node."""
    nodes = list(reader.graph.node)
    users = {}
    for node in nodes:
        for name in node.input:
            users.setdefault(name, []).append(node)

    def only_user(value, op_type):
        found = users.get(value, [])
        return found[0] if len(found) == 1 and found[0].op_type == op_type else None

    def constant_of(node, value, expected):
        """True when ``node``'s other operand than ``value`` is the constant ``expected``."""
        others = [name for name in node.input if name != value]
        if len(others) != 1 or len(node.input) != 2:
            return False
        try:
            constant = reader.value(others[0], node)
        except OnnxImportError:
            return False
        return constant.size == 1 and abs(float(constant.reshape(())) - expected) <= 1e-6 * expected

    replaced = {}
    for div in nodes:
        if div.op_type != "Div" or not div.input or not constant_of(div, div.input[0],
                                                                      math.sqrt(2)):
            continue
        x = div.input[0]
        erf = only_user(div.output[0], "Erf")
        add = erf and only_user(erf.output[0], "Add")
        mul = add and only_user(add.output[0], "Mul")
        if not (add and constant_of(add, erf.output[0], 1.0) and mul
                and sorted(mul.input) == sorted([add.output[0], x])):
            continue
        half = only_user(mul.output[0], "Mul")
        if not (half and constant_of(half, mul.output[0], 0.5)):
            continue
        gelu = reader.onnx.helper.make_node("Gelu", [x], [half.output[0]],
                                            name=half.name or "gelu")
        replaced.update({id(div): gelu, id(erf): None, id(add): None, id(mul): None,
                         id(half): None})
    return [replaced.get(id(node), node) for node in nodes if replaced.get(id(node), 0) is not None]


def _feature_shape(reader, value):
    dims = value.type.tensor_type.shape.dim
    shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in dims)
    if len(shape) < 2 or None in shape[1:] or min(shape[1:]) < 1:
        named = [d.dim_param or d.dim_value for d in dims]
        raise reader.fail(None, f"input {value.name!r} has shape {named}; the importer needs "
                                "(batch, fixed features...)")
    return shape[1:]


def _read_proto(onnx, path):
    with open(path, "rb") as file:   # FileNotFoundError, PermissionError name the path
        content = file.read()
    try:
        proto = onnx.load_model_from_string(content)
    except Exception as error:   # protobuf's DecodeError and friends: damaged bytes
        raise ValueError(f"engine.onnx.load: {path!r} is not an ONNX model "
                         f"({type(error).__name__}: {error})") from None
    if not proto.graph.node and not proto.graph.output:
        raise ValueError(f"engine.onnx.load: {path!r} is not an ONNX model (no graph)")
    return proto


def _opset(reader, proto):
    versions = {entry.domain or "ai.onnx": entry.version for entry in proto.opset_import}
    opset = versions.get("ai.onnx")
    newest = reader.onnx.defs.onnx_opset_version()
    if opset is None or not MIN_OPSET <= opset <= newest:
        raise reader.fail(None, f"operator set {opset}; the importer reads opsets "
                                f"{MIN_OPSET} to {newest}")
    return opset


def from_onnx(proto, path="<model>"):
    """The ``nn.Sequential`` that computes what the ONNX ``proto`` computes (``load``)."""
    reader = _Reader(_onnx(), proto, path)
    # every step reads values of the file: a failure the checks do not name (an unknown
    # element type, a missing field of a crafted file) is a damaged file too
    layers, input_shape, dtype = reader.guarded(None, _layers, reader, proto)
    if isinstance(layers, nn.Model):   # a graph (engine.onnx.import_graph)
        return layers
    return sequential.build(sequential.fuse_activations(layers), input_shape, dtype,
                            proto.graph.name or "sequential", f"engine.onnx.load: {path!r}")


def _layers(reader, proto):
    """The layer descriptions of the chain (``engine.interop.sequential``), the input's
    feature shape and dtype."""
    onnx = reader.onnx
    _opset(reader, proto)
    graph = reader.graph
    inputs = [value for value in graph.input if value.name not in reader.initializers]
    nodes = _gelu_compositions_as_nodes(reader)
    if needs_graph(reader, nodes, inputs, IMPORTERS):
        return read_graph(reader, proto, nodes, inputs), None, None
    graph_input, chain = _chain(reader)
    if not graph_input.type.HasField("tensor_type"):
        raise reader.fail(None, f"input {graph_input.name!r} is a "
                                f"{graph_input.type.WhichOneof('value')}, not a tensor")
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(graph_input.type.tensor_type.elem_type))
    if dtype.kind in "iu" and chain and chain[0].op_type == "Cast":   # raw images, cast first
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(
            reader.attributes(chain[0])["to"]))
    if dtype.kind in "iu" and chain and chain[0].op_type == "Gather":   # token ids in
        dtype = np.dtype(reader.value(chain[0].input[0], chain[0]).dtype)
    if dtype not in FLOAT_TYPES:
        raise reader.fail(None, f"input {graph_input.name!r} is {dtype}; the engine's models "
                                "take float32 or float64")
    shape = reader.shapes[graph_input.name] = _feature_shape(reader, graph_input)
    layers, _ = _import_chain(reader, chain, shape, dtype)
    if not layers:
        raise reader.fail(None, "the graph computes nothing but its input: no layers")
    return layers, reader.shapes[graph_input.name], dtype


def _import_chain(reader, chain, shape, dtype):
    """The layer descriptions of ``chain``'s nodes read from a value of feature ``shape``,
    and the shape they compute."""
    layers = []
    for node in chain:
        if node.domain not in ("", "ai.onnx") or node.op_type not in IMPORTERS:
            operator = f"{node.domain}.{node.op_type}" if node.domain else node.op_type
            raise reader.fail(node, f"operator {operator!r} has no engine layer; the importer "
                                    f"reads {', '.join(sorted(IMPORTERS))}")
        layer = reader.guarded(node, IMPORTERS[node.op_type], reader, node, layers, shape,
                               dtype)
        if layer is not None:
            try:
                shape = nn.LAYERS[layer["class_name"]](**layer["config"]).compute_output_shape(
                    shape)
            except (TypeError, ValueError) as error:
                raise reader.fail(node, str(error)) from None
            layers.append(layer)
        reader.shapes[node.output[0]] = shape
    return layers, shape


def load(path):
    """The ``nn.Sequential`` that computes what the ONNX file at ``path`` computes, built from
    a chain of the operators of ``IMPORTERS`` (what ``export`` writes, and what
    ``torch.onnx.export`` writes for the equivalent torch network), with its weights; in
    train mode, on the CPU, as a new model is.

    The file is parsed as protobuf and its tensors read as arrays: nothing in it runs. A
    tensor kept in an external file (torch's exporter writes its weights to ``<path>.data``)
    is read only from a file in the model's folder, within that file's size. A graph that
    is not a chain (branches, several inputs), an operator or attribute without an engine
    equivalent, or damaged bytes are a ``ValueError`` naming the file and the node."""
    path = os.fspath(path)
    return from_onnx(_read_proto(_onnx(), path), path)
