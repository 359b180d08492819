"""Export traced from the ops a forward runs (``engine.onnx.export(model, path, example=...)``).

The model runs its forward once on ``example`` in eval mode, under ``no_grad``, while
``engine.autograd.trace_ops`` hands every op it applies to this module with the op's inputs
and output, and the layer running it (each layer's ``forward`` is wrapped for that one call
to keep the stack of dotted layer names). The ops that the outputs depend on then become ONNX
nodes through their own declaration, ``Op.onnx(graph, inputs)`` (``ops.registry``): the op
writes its node(s) through ``OnnxGraph`` below, so no table here knows any layer. A value an
op reads that no recorded op computed is the graph's input (an example tensor), a parameter
or buffer (an initializer under its dotted name, ``blocks.0.fc.weight``; a weight shared by
two layers is stored once), or a constant the forward made (``arange``'s positions). The
shapes are those the trace saw; a second trace on one more sample opens the batch
dimension where nothing but Reshape targets follow it (``to_onnx``).
"""
import itertools

import numpy as np

import engine
from engine.autograd import Value, no_grad, trace_ops
from engine.onnx.common import ACTIVATIONS, GELU_OPSET, INPUT, OUTPUT, _onnx, checked_opset
from ops.device import to_host
from ops.pointwise import GELU_CUBIC, SQRT_TWO_OVER_PI
from ops.registry import REGISTRY

# the pointwise functions without a layer (ops.pointwise.TABLE's onnx names activations only)
FUNCTIONS = {"neg": "Neg", "exp": "Exp", "log": "Log", "sqrt": "Sqrt", "abs": "Abs"}


class OnnxGraph:
    """The nodes and initializers being written; what an op's ``onnx`` declaration calls.

    While a declaration runs, ``input_shapes`` and ``output_shape`` are the shapes its op saw,
    ``dtype`` is the model's float dtype and ``opset`` the operator set written."""

    def __init__(self, onnx, dtype, opset):
        self.onnx, self.dtype, self.opset = onnx, np.dtype(dtype), opset
        self.nodes, self.initializers, self.value_dtypes = [], {}, {}
        self.input_shapes = self.output_shape = self.where = None
        self.prefix = "graph"
        self._counter = itertools.count()

    def _fresh(self, hint):
        return f"{hint}_{next(self._counter)}"

    def node(self, operator, inputs, **attributes):
        """One node of ``operator`` on the values named ``inputs``; the name of its output."""
        output = self._fresh(f"{self.prefix}/{operator}")
        self.nodes.append(self.onnx.helper.make_node(operator, list(inputs), [output],
                                                     name=output, **attributes))
        return output

    def initializer(self, name, array):
        """``array`` stored under ``name`` (once); its name."""
        if name not in self.initializers:
            array = np.asarray(array)
            self.initializers[name] = self.onnx.numpy_helper.from_array(array, name)
            self.value_dtypes[name] = array.dtype
        return name

    def constant(self, value, hint):
        """A constant input (a number or an array; floats in the model's dtype); its name."""
        array = np.asarray(value)
        if array.dtype.kind == "f":
            array = array.astype(self.dtype)
        return self.initializer(self._fresh(f"{self.prefix}/{hint}"), array)

    def int64(self, value):
        """``value`` as int64 (Gather's indices): a Cast unless it is already."""
        if self.value_dtypes.get(value) == np.dtype(np.int64):
            return value
        return self.node("Cast", [value], to=self.onnx.TensorProto.INT64)

    def refuse(self, reason):
        raise ValueError(f"engine.onnx.export: {self.where}: {reason}")

    def pointwise(self, entry, x, p):
        """The node(s) of an ``ops.pointwise`` function of ``x`` (parameter ``p``)."""
        if entry.name in FUNCTIONS:
            return self.node(FUNCTIONS[entry.name], [x])
        if entry.name == "silu":   # ONNX has no SiLU operator: x * sigmoid(x)
            return self.node("Mul", [x, self.node("Sigmoid", [x])])
        return self.activation(entry.name, x, p)

    def activation(self, name, x, alpha):
        """``x`` through the activation ``name`` (None: ``x`` itself); ``alpha``: leaky_relu's."""
        if name is None:
            return x
        if name in ("gelu", "gelu_tanh"):
            return self._gelu(x, name == "gelu_tanh")
        operator = ACTIVATIONS.get(name)
        if operator is None:
            exportable = sorted(key for key, value in ACTIVATIONS.items() if value)
            self.refuse(f"ONNX has no operator for the activation {name!r} (its "
                        f"ops/pointwise.py entry names none); exported activations: "
                        f"{', '.join(exportable)}")
        attributes = ({"alpha": float(alpha)} if name == "leaky_relu"
                      else {"axis": -1} if name == "softmax" else {})
        return self.node(operator, [x], **attributes)

    def _gelu(self, x, tanh_form):
        """ONNX's Gelu from opset 20; before, its composition: x * 0.5 * (1 + erf(x / sqrt 2))
        or torch's tanh form x * 0.5 * (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))."""
        if self.opset >= GELU_OPSET:
            return self.node("Gelu", [x], approximate="tanh" if tanh_form else "none")
        if tanh_form:
            cube = self.node("Mul", [self.node("Mul", [x, x]), x])
            inner = self.node("Add", [x, self.node("Mul", [cube, self.constant(
                GELU_CUBIC, "gelu.cubic")])])
            curve = self.node("Tanh", [self.node("Mul", [inner, self.constant(
                SQRT_TWO_OVER_PI, "gelu.sqrt_2_over_pi")])])
        else:
            curve = self.node("Erf", [self.node("Div", [x, self.constant(np.sqrt(2.0),
                                                                          "gelu.sqrt2")])])
        one_plus = self.node("Add", [curve, self.constant(1.0, "gelu.one")])
        return self.node("Mul", [self.node("Mul", [x, one_plus]),
                                 self.constant(0.5, "gelu.half")])


def _trace(model, examples):
    """``[(op, inputs, output, layer name)]`` of one eval-mode forward, and its outputs."""
    records, stack = [], []
    layers = [(model.name, model)] + list(model.named_layers())
    wrapped = []

    def running(name, forward):
        def traced(*args, **kwargs):
            stack.append(name)
            try:
                return forward(*args, **kwargs)
            finally:
                stack.pop()
        return traced

    was_training = model.training
    try:
        for name, layer in layers:
            if "forward" not in vars(layer):   # a layer shared twice is wrapped once
                vars(layer)["forward"] = running(name, layer.forward)
                wrapped.append(layer)
        model.eval()
        with no_grad(), trace_ops(lambda op, inputs, output: records.append(
                (op, inputs, output, stack[-1] if stack else model.name))):
            outputs = model(*examples)
    finally:
        for layer in wrapped:
            del vars(layer)["forward"]
        model.train(was_training)
    return records, outputs


def _needed(records, outputs):
    """The records the outputs depend on, in the order they ran."""
    made = {key: index for index, (_, _, output, _) in enumerate(records)
            for key in (id(output), id(output.data))}
    needed, stack = set(), [made[id(x)] for x in outputs if id(x) in made]
    while stack:
        index = stack.pop()
        if index not in needed:
            needed.add(index)
            stack.extend(made[id(x)] for x in records[index][1] if id(x) in made)
    return [records[index] for index in sorted(needed)]


def _refuse_undeclared(op, layer):
    exportable = sorted(name for name, cls in REGISTRY.items() if cls.onnx is not None)
    raise ValueError(f"engine.onnx.export: op '{op.name}' (run by layer '{layer}') declares "
                     f"no ONNX node(s) (ops.registry.Op.onnx), so the model cannot be "
                     f"exported; ops that export: {', '.join(exportable)}")


def to_onnx(model, example, opset):
    """The checked ``onnx.ModelProto`` of ``model``'s forward on ``example`` (a tensor or
    array, or a tuple of them for a forward of several inputs). The forward is traced again
    on one more sample: where the two graphs differ only in the batch dimension of the
    inputs and outputs and in one entry of a Reshape's target, that entry becomes -1 and the
    batch dimension is left open (``batch``); otherwise the example's shapes are fixed."""
    onnx = _onnx()
    opset = checked_opset(onnx, opset)
    examples = tuple(example) if isinstance(example, (tuple, list)) else (example,)
    examples = tuple(x if isinstance(x, Value) else engine.tensor(np.asarray(x))
                     for x in examples)
    proto = _graph_proto(onnx, model, examples, opset)
    if all(x.ndim for x in examples):
        grown = tuple(engine.tensor(np.concatenate([x.numpy(), x.numpy()[:1]]),
                                    device=x.device) for x in examples)
        proto = _open_batch(onnx, proto, _graph_proto(onnx, model, grown, opset)) or proto
    onnx.checker.check_model(proto, full_check=True)
    return proto


def _open_batch(onnx, proto, grown):
    """``proto`` with its batch dimension open, where ``grown`` (the trace on one more
    sample) differs from it only there (``to_onnx``); None where it differs elsewhere."""
    graph, other = proto.graph, grown.graph
    if [(n.op_type, list(n.input)) for n in graph.node] != [
            (n.op_type, list(n.input)) for n in other.node]:
        return None
    reshape_targets = {n.input[1] for n in graph.node if n.op_type == "Reshape"}
    theirs = {tensor.name: onnx.numpy_helper.to_array(tensor) for tensor in other.initializer}
    opened = []
    for tensor in graph.initializer:
        mine, their = onnx.numpy_helper.to_array(tensor), theirs.get(tensor.name)
        if their is None or mine.shape != their.shape:
            return None
        if np.array_equal(mine, their):
            continue
        differs = np.flatnonzero(mine != their)
        if tensor.name not in reshape_targets or mine.ndim != 1 or len(differs) != 1:
            return None
        target = mine.copy()
        target[differs[0]] = -1
        opened.append((tensor, target))
    for values, their_values in ((graph.input, other.input), (graph.output, other.output)):
        for value, their_value in zip(values, their_values):
            dims, their_dims = value.type.tensor_type.shape.dim, \
                their_value.type.tensor_type.shape.dim
            if any(a.dim_value != b.dim_value for a, b in list(zip(dims, their_dims))[1:]):
                return None
    opened_proto = type(proto)()
    opened_proto.CopyFrom(proto)
    names = {tensor.name: target for tensor, target in opened}
    for tensor in opened_proto.graph.initializer:
        if tensor.name in names:
            tensor.CopyFrom(onnx.numpy_helper.from_array(names[tensor.name], tensor.name))
    for value in [*opened_proto.graph.input, *opened_proto.graph.output]:
        first = value.type.tensor_type.shape.dim[0]
        first.Clear()
        first.dim_param = "batch"
    return opened_proto


def _graph_proto(onnx, model, examples, opset):
    """The (unchecked) proto of ``model``'s forward traced on ``examples``."""
    records, outputs = _trace(model, examples)
    outputs = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
    if not all(isinstance(x, Value) for x in outputs):
        raise TypeError(f"engine.onnx.export: {model.name}'s forward returned "
                        f"{[type(x).__name__ for x in outputs]}; export takes Tensors")
    dtypes = {np.dtype(p.dtype) for p in model.parameters()} or {
        np.dtype(x.dtype) for x in examples if np.dtype(x.dtype).kind == "f"} or {
        np.dtype(np.float32)}
    if len(dtypes) > 1:
        raise ValueError(f"engine.onnx.export: the parameters mix dtypes "
                         f"{sorted(map(str, dtypes))}; convert the model with model.to(dtype)")
    graph = OnnxGraph(onnx, dtypes.pop(), opset)
    helper = onnx.helper
    input_names = [INPUT] if len(examples) == 1 else [f"{INPUT}_{i}" for i in range(
        len(examples))]
    # a value is known by its tensor and by its array: an op may be handed either (the
    # embedding takes its ids' array)
    names = {key: name for x, name in zip(examples, input_names) for key in (id(x), id(x.data))}
    for x, name in zip(examples, input_names):
        graph.value_dtypes[name] = np.dtype(x.dtype)
    stored = {id(value): name for name, value in [*model.named_parameters(),
                                                   *model.named_buffers()]}

    def name_of(value, layer):
        if id(value) in names:
            return names[id(value)]
        array = to_host(value.data if isinstance(value, Value) else value)
        if id(value) in stored:
            return graph.initializer(stored[id(value)], array)
        return graph.initializer(graph._fresh(f"{layer}.constant"), array)

    for op, inputs, output, layer in _needed(records, outputs):
        if op.onnx is None:
            _refuse_undeclared(op, layer)
        graph.prefix, graph.where = layer, f"op '{op.name}' in layer '{layer}'"
        graph.input_shapes = [tuple(x.shape) for x in inputs]
        graph.output_shape = tuple(output.shape)
        value = op.onnx(graph, [name_of(x, layer) for x in inputs])
        graph.value_dtypes.setdefault(value, np.dtype(output.dtype))
        names[id(output)] = names[id(output.data)] = value
    output_names = _name_outputs(graph, [name_of(x, model.name) for x in outputs], input_names)
    used = {name for node in graph.nodes for name in node.input}
    proto = helper.make_model(
        helper.make_graph(
            graph.nodes, model.name,
            [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(
                np.dtype(x.dtype)), list(x.shape)) for x, name in zip(examples, input_names)],
            [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(
                np.dtype(x.dtype)), list(x.shape)) for x, name in zip(outputs, output_names)],
            [tensor for name, tensor in graph.initializers.items() if name in used]),
        opset_imports=[helper.make_opsetid("", opset)], producer_name="numba-engine",
        producer_version=engine.__version__,
        ir_version=helper.find_min_ir_version_for([helper.make_opsetid("", opset)]))
    return proto


def _name_outputs(graph, values, input_names):
    """Rename the nodes' outputs to ``output`` (``output_0``, ... for several); a value that
    no node computes here (an input, a constant, one output twice) gets an Identity."""
    wanted = [OUTPUT] if len(values) == 1 else [f"{OUTPUT}_{i}" for i in range(len(values))]
    computed = {node.output[0]: node for node in graph.nodes}
    renamed = {}
    for value, name in zip(values, wanted):
        if value in computed and value not in renamed:
            renamed[value] = name
        else:
            graph.nodes.append(graph.onnx.helper.make_node(
                "Identity", [renamed.get(value, value)], [name], name=name))
    for node in graph.nodes:
        node.output[:] = [renamed.get(name, name) for name in node.output]
        node.input[:] = [renamed.get(name, name) for name in node.input]
    return wanted
