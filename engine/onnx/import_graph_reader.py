"""Reading a graph that is not a chain into a ``GraphModel`` (``engine.onnx.import_graph``).

The nodes that hold weights become engine layers, read by the chain importer's
``IMPORTERS`` (``engine.onnx.importers``): ``Gemm`` with a stored weight and bias and
``MatMul`` followed by the ``Add`` of a stored bias a ``Dense``, ``LayerNormalization``
over the last axis a ``LayerNorm``, ``Gather`` of a stored float table an ``Embedding``,
``Conv``, ``BatchNormalization``, the pools and ``Dropout`` their layers. Two nodes of the
same weights and attributes share one layer (a layer the traced export wrote twice). Every
other node runs as engine functional ops (``engine.onnx.import_ops``; attention's composition
as one fused op, ``engine.onnx.import_fusion``). A stored tensor that
such a node reads is a trainable ``nn.Parameter`` where it is a weight (an operand of
``MatMul`` or ``Gemm``, a table, a scale, the bias added to a product), the layer's own
parameter where a layer holds it unchanged (an embedding table the output head reads
transposed: tied weights stay tied), a buffer where it is another float tensor (a causal
mask), and a host constant otherwise (shapes, indices, single numbers)."""
import numpy as np

from engine.interop import sequential
from engine.onnx.import_ops import LAYER_NORM, SPLIT, SUPPORTED
from engine.onnx.import_fusion import fuse_attention, fuse_dense_activations
from engine.onnx.import_graph import GraphModel, attribute_name
from engine.onnx.importers import IMPORTERS

# the operators whose stored float operands are weights, by input position
WEIGHT_SLOTS = {"Gemm": (0, 1, 2), "MatMul": (0, 1), "LayerNormalization": (1, 2),
                "Gather": (0,), "Conv": (1, 2), "BatchNormalization": (1, 2)}
# operators a weight may pass through before it is used (a transposed embedding table)
MOVES = ("Transpose", "Reshape", "Identity", "Squeeze", "Unsqueeze", "Cast")
# what an engine Tensor holds: the float dtypes, ids, masks
INPUT_DTYPES = tuple(np.dtype(name) for name in ("float32", "float64", "int64", "int32",
                                                 "uint8", "bool"))
# layers that need the feature shape of their input (from ONNX's shape inference)
IMAGE_LAYERS = ("Conv", "BatchNormalization", "MaxPool", "AveragePool")


def needs_graph(reader, nodes, inputs, chain_operators):
    """Whether the graph's ``nodes`` (GELU compositions folded) are read as a
    ``GraphModel``: several inputs or outputs, a node that combines two computed values, or
    a computed node whose operator only the graph importer reads (``Transpose``, ``Where``,
    ``Split``, ...; a chain of ``chain_operators`` stays a Sequential)."""
    if len(inputs) != 1 or len(reader.graph.output) != 1:
        return bool(inputs) and bool(reader.graph.output)
    computed = {inputs[0].name}
    for node in nodes:
        data = [name for name in node.input if name in computed]
        if not data or node.op_type == "Shape":
            continue
        if len(data) > 1 or (node.op_type not in chain_operators
                             and node.op_type in SUPPORTED):
            return True
        computed.update(name for name in node.output if name)
    return False


class _GraphReader:
    """One graph being read into a ``GraphModel``'s constructor arguments and weights."""

    def __init__(self, reader, proto, nodes, dtype):
        self.reader, self.proto, self.nodes, self.dtype = reader, proto, nodes, dtype
        self.producer = {output: node for node in nodes for output in node.output}
        self.users = {}
        for node in nodes:
            for position, name in enumerate(node.input):
                self.users.setdefault(name, []).append((node, position))
        self.layers = []
        self.owned, self.aliases = {}, {}    # stored value -> layer index; -> [index, attribute]
        self.consumed = set()                # Add nodes a Dense took as its bias
        self.used = {name for node in nodes for name in node.input} | {
            value.name for value in reader.graph.output}
        self.outputs_of = {}                 # a Dense's node -> its Add's output
        self._shapes = None

    # ------------------------------------------------------------- stored values
    def stored(self, name):
        return name in self.reader.initializers

    def float_stored(self, name):
        return self.stored(name) and self.reader.value(name, None).dtype.kind == "f"

    def behind_moves(self, name):
        """The stored value ``name`` is (through Transpose, Reshape, ... nodes), or None."""
        while not self.stored(name):
            producer = self.producer.get(name)
            if producer is None or producer.op_type not in MOVES:
                return None
            name = producer.input[0]
        return name

    def weights(self):
        """The stored float values the graph uses as weights (``WEIGHT_SLOTS``, the bias
        added to a product)."""
        found = set()
        for node in self.nodes:
            for position in WEIGHT_SLOTS.get(node.op_type, ()):
                if position < len(node.input) and node.input[position]:
                    source = self.behind_moves(node.input[position])
                    if source is not None and self.float_stored(source):
                        found.add(source)
            if node.op_type == "Add" and len(node.input) == 2:
                producers = [self.producer.get(name) for name in node.input]
                for name, other in zip(node.input, reversed(producers)):
                    if self.is_bias(name, other):
                        found.add(name)
        return found

    def is_bias(self, name, product):
        """Whether the stored ``name`` added to the output of the node ``product`` is a
        linear layer's bias: one value per column (1-D) after a product by a stored weight
        (not the causal mask added to attention's scores)."""
        if product is None or product.op_type not in ("MatMul", "Gemm") or len(
                product.input) < 2 or not self.float_stored(name):
            return False
        weight = self.behind_moves(product.input[1])
        return (weight is not None and self.float_stored(weight)
                and self.reader.value(name, None).ndim <= 1)

    # ------------------------------------------------------------- layers
    def feature_shape(self, node):
        """The feature shape (without the batch) of ``node``'s data input, from ONNX's shape
        inference."""
        if self._shapes is None:
            onnx = self.reader.onnx
            inferred = onnx.shape_inference.infer_shapes(self.proto).graph
            self._shapes = {}
            for value in [*inferred.value_info, *inferred.input, *inferred.output]:
                dims = value.type.tensor_type.shape.dim
                if dims and all(d.HasField("dim_value") for d in dims[1:]):
                    self._shapes[value.name] = tuple(d.dim_value for d in dims[1:])
        shape = self._shapes.get(node.input[0])
        if shape is None:
            raise self.reader.fail(node, f"the shape of its input {node.input[0]!r} is not "
                                         "known (ONNX's shape inference gives no fixed "
                                         "feature shape); a layer is built for one")
        return shape

    def layer_of(self, node):
        """``(layer description, the stored values it holds, {value: attribute} of those it
        holds unchanged, the bias Add it takes or None)`` for a node that becomes a layer,
        else None (a node run as functional ops)."""
        operator, inputs = node.op_type, list(node.input)
        attributes = self.reader.attributes(node)
        if operator == "Gemm" and len(inputs) > 2 and inputs[2] and all(
                self.float_stored(name) for name in inputs[1:3]) and not attributes.get(
                "transA", 0):
            weight = self.reader.value(inputs[1], node)
            rows = weight.shape[1] if attributes.get("transB", 0) else weight.shape[0]
            layer = IMPORTERS["Gemm"](self.reader, node, [], (rows,), self.dtype)
            unchanged = {}   # what the Dense holds as the file stores it
            if not attributes.get("transB", 0) and attributes.get("alpha", 1.0) == 1.0:
                unchanged[inputs[1]] = "weight"
            if attributes.get("beta", 1.0) == 1.0 and self.reader.value(
                    inputs[2], node).shape == layer["weights"]["bias"].shape:
                unchanged[inputs[2]] = "bias"
            return layer, inputs[1:3], unchanged, None, (rows,)
        if operator == "MatMul" and self.float_stored(inputs[1]) and not self.stored(inputs[0]):
            weight = self.reader.value(inputs[1], node)
            bias = self.bias_after(node, weight) if weight.ndim == 2 else None
            if bias is None:
                return None   # no bias: a Dense would add parameters the graph has not
            add, bias_name = bias
            layer = IMPORTERS["MatMul"](self.reader, node, [], (weight.shape[0],), self.dtype)
            layer["weights"]["bias"] = self.reader.value(bias_name, add)
            return (layer, [inputs[1], bias_name], {inputs[1]: "weight", bias_name: "bias"},
                    add, weight.shape[:1])
        if operator == "LayerNormalization" and attributes.get("axis", -1) == -1 and len(
                inputs) > 2 and all(self.float_stored(name) for name in inputs[1:3]) \
                and not any(name in self.used for name in node.output[1:]):
            scale = self.reader.value(inputs[1], node)
            layer = IMPORTERS[operator](self.reader, node, [], scale.shape[-1:], self.dtype)
            return (layer, inputs[1:3], {inputs[1]: "weight", inputs[2]: "bias"}, None,
                    scale.shape[-1:])
        if operator == "Gather" and attributes.get("axis", 0) == 0 and self.float_stored(
                inputs[0]) and self.reader.value(inputs[0], node).ndim == 2:
            layer = IMPORTERS["Gather"](self.reader, node, [], (), self.dtype)
            return layer, inputs[:1], {inputs[0]: "weight"}, None, (1,)
        if operator == "Dropout":
            return IMPORTERS[operator](self.reader, node, [], (), self.dtype), [], {}, None, (1,)
        if operator in IMAGE_LAYERS:
            shape = self.feature_shape(node)
            layer = IMPORTERS[operator](self.reader, node, [], shape, self.dtype)
            return layer, [name for name in inputs[1:] if name], {}, None, shape
        return None

    def bias_after(self, node, weight):
        """The Add (and its stored bias's name) that adds one value per column to
        ``node``'s product, where it is the product's only user."""
        users = self.users.get(node.output[0], [])
        if len(users) != 1 or users[0][0].op_type != "Add" or len(users[0][0].input) != 2:
            return None
        add = users[0][0]
        other = add.input[1 - users[0][1]]
        if not self.float_stored(other):
            return None
        bias = self.reader.value(other, add)
        return (add, other) if bias.shape == weight.shape[-1:] else None

    def _key(self, node, found):
        """What makes two nodes one layer: the operator, the stored values, the attributes
        and the input's feature shape."""
        return (node.op_type, tuple(found[1]), tuple(found[4]),
                repr(sorted(self.reader.attributes(node).items())))

    def read_layers(self):
        """Pass one: ``{id(node): layer index}``. Each node that holds weights becomes a
        layer, or shares the layer of a node of the same weights and attributes, where
        every other node that reads its stored values reads them unchanged from the layer
        (else it runs as functional ops)."""
        plan, keys = {}, {}
        for node in self.nodes:
            found = self.layer_of(node)
            if found is None:
                continue
            layer, held, unchanged, add, shape = found
            key = self._key(node, found)
            if key not in keys:
                if not self._may_hold(node, key, held, unchanged, add):
                    continue
                keys[key] = len(self.layers)
                layer["config"]["input_shape"] = [int(size) for size in shape]
                self.layers.append(layer)
                for name in held:
                    self.owned[name] = keys[key]
                    if name in unchanged:
                        self.aliases[name] = [keys[key], unchanged[name]]
            plan[id(node)] = keys[key]
            if add is not None:
                self.consumed.add(id(add))
                self.outputs_of[id(node)] = add.output[0]
        return plan

    def _copies_for(self, user, node):
        """Whether ``user`` only copies a stored value for ``node`` (torch's exporter stores
        equal initialisers once: a BatchNorm's ones as its running variance too)."""
        return user.op_type in MOVES and all(
            reader is node for output in user.output for reader, _ in self.users.get(output, []))

    def _may_hold(self, node, key, held, unchanged, add):
        for name in held:
            if name in self.owned:
                return False
            for user, _ in self.users.get(name, []):
                if user is node or user is add or name in unchanged or self._copies_for(
                        user, node):
                    continue
                other = self.layer_of(user)
                if other is None or self._key(user, other) != key:
                    return False
        return True


def _entries(reader, graph, plan, nodes):
    """``[(node, GraphModel node entry)]`` in the graph's order: a layer's node reads its
    data input only (its weights are the layer's) and gives its bias Add's output; Constant
    nodes and the Adds a Dense took are not run."""
    found = []
    for number, node in enumerate(nodes):
        if node.op_type == "Constant" or id(node) in graph.consumed:
            continue
        name = node.name or f"{node.op_type}_{number}"
        if id(node) in plan:
            data = node.input[1 if node.op_type == "Gather" else 0]
            found.append((node, [name, node.op_type, [data],
                                 [graph.outputs_of.get(id(node), node.output[0])], {},
                                 plan[id(node)]]))
        else:
            found.append((node, [name, node.op_type, list(node.input), list(node.output),
                                 _attribute_values(reader, node), None]))
    return found


def _live(entries, outputs):
    """The ``entries`` the ``outputs`` depend on, in order: a node nothing reads is not run
    (torch's exporter writes Identity copies of a weight that only a layer reads)."""
    needed, kept = set(outputs), []
    for node, entry in reversed(entries):
        if any(value in needed for value in entry[3]):
            kept.append((node, entry))
            needed.update(value for value in entry[2] if value)
    return kept[::-1]


def _attribute_values(reader, node):
    """``node``'s attributes as JSON values (Cast's ``to`` as a NumPy dtype's name)."""
    found = {}
    for key, value in reader.attributes(node).items():
        if isinstance(value, bytes):
            value = value.decode()
        elif isinstance(value, list):
            value = [v.decode() if isinstance(v, bytes) else v for v in value]
        if not isinstance(value, (int, float, str, list)):
            raise reader.fail(node, f"attribute {key!r} ({type(value).__name__}) is not read")
        found[key] = value
    if node.op_type == "Cast":
        found["to"] = np.dtype(reader.onnx.helper.tensor_dtype_to_np_dtype(found["to"])).name
    return found
def _graph_inputs(reader, inputs):
    """``[name, shape (None for an open dimension), dtype]`` of each graph input, and the
    model's float dtype: its float inputs', else its stored floats', else float32."""
    entries, floats = [], set()
    for value in inputs:
        if not value.type.HasField("tensor_type"):
            raise reader.fail(None, f"input {value.name!r} is a "
                                    f"{value.type.WhichOneof('value')}, not a tensor")
        dtype = np.dtype(reader.onnx.helper.tensor_dtype_to_np_dtype(
            value.type.tensor_type.elem_type))
        if dtype not in INPUT_DTYPES:
            raise reader.fail(None, f"input {value.name!r} is {dtype}; the engine's models "
                                    f"take {', '.join(d.name for d in INPUT_DTYPES)}")
        if dtype.kind == "f":
            floats.add(dtype)
        shape = [d.dim_value if d.HasField("dim_value") else None
                 for d in value.type.tensor_type.shape.dim]
        entries.append([value.name, shape, dtype.name])
    if not floats:
        floats = {np.dtype(reader.onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
                  for tensor in reader.graph.initializer} & {np.dtype(np.float32),
                                                            np.dtype(np.float64)}
    if len(floats) > 1:
        raise reader.fail(None, f"the graph mixes float dtypes {sorted(map(str, floats))}; "
                                "an engine model has one")
    return entries, floats.pop() if floats else np.dtype(np.float32)


def read_graph(reader, proto, nodes, inputs):
    """The built ``GraphModel`` of ``nodes`` (GELU compositions folded) from the graph's
    ``inputs`` to its outputs, with the file's weights."""
    input_entries, dtype = _graph_inputs(reader, inputs)
    graph = _GraphReader(reader, proto, nodes, dtype)
    plan = graph.read_layers()
    weights = graph.weights()
    fed = {entry[0] for entry in input_entries}
    computed = fed | {name for node in nodes if node.op_type != "Constant"
                      for name in node.output}
    parameters, buffers, constants, state, taken = [], [], {}, {}, set()

    def resolve(name, node):
        """Where the forward finds ``name``, a value no node of the forward computes."""
        if (not name or name in computed or name in graph.aliases or name in constants
                or any(name == entry[0] for entry in parameters + buffers)):
            return
        array = reader.value(name, node)
        if name in weights or (array.dtype.kind == "f" and array.size > 1):
            entries = parameters if name in weights else buffers
            attribute = attribute_name(name, taken)
            entries.append([name, attribute, list(array.shape), dtype.name])
            holder = "weights" if entries is parameters else "constants"
            state[f"{holder}.{attribute}"] = np.asarray(array, dtype)
        else:
            constants[name] = {"dtype": array.dtype.name, "shape": list(array.shape),
                               "values": array.reshape(-1).tolist()}

    outputs = [value.name for value in reader.graph.output]
    entries = []
    for node, entry in _live(_entries(reader, graph, plan, nodes), outputs):
        if entry[5] is None and (node.domain not in ("", "ai.onnx")
                                 or node.op_type not in SUPPORTED):
            operator = f"{node.domain}.{node.op_type}" if node.domain else node.op_type
            raise reader.fail(node, f"operator {operator!r} is not supported; the graph "
                                    f"importer reads {', '.join(SUPPORTED)} (and "
                                    f"{', '.join(sorted(IMAGE_LAYERS))} as layers)")
        extra = [value for value in node.output[1:] if value in graph.used]
        if extra and (entry[5] is not None or node.op_type not in (SPLIT, LAYER_NORM)):
            raise reader.fail(node, f"its outputs {extra} are used; the importer computes "
                                    f"a {node.op_type}'s first output only")
        entries.append(entry)
    entries = fuse_attention(entries, outputs, lambda name: None if name in computed or
                             not name else reader.value(name, None))
    entries = fuse_dense_activations(entries, graph.layers, outputs)
    for entry in entries:
        for value in entry[2]:
            resolve(value, None)
    made = fed | {value for entry in entries for value in entry[3]}
    for output in outputs:
        if output not in made:
            resolve(output, None)   # a constant output: the forward returns it as stored
    layers = []
    for entry in graph.layers:
        config = dict(entry["config"])
        if entry["class_name"] in sequential.WEIGHTED and dtype != np.float32:
            config["dtype"] = dtype.name
        layers.append({"class_name": entry["class_name"], "config": config})
    model = GraphModel(entries, input_entries, outputs, layers, parameters, buffers,
                       graph.aliases, constants, name=reader.graph.name or "onnx_graph")
    model.build()
    full = model.state_dict()
    for index, entry in enumerate(graph.layers):
        for key, array in entry["weights"].items():
            full[f"layers.{index}.{key}"] = np.asarray(array, dtype)
    full.update(state)
    model.load_state_dict(full)
    return model
