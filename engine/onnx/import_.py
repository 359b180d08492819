"""Import: an ONNX chain read back into an ``nn.Sequential`` (``engine.onnx``'s docstring)."""
import math
import os

import numpy as np

from engine import nn
from engine.file_safety import SizeBudget
from engine.interop import sequential
from engine.onnx.import_graph import joins, read_graph
from engine.onnx.common import ACTIVATIONS, MIN_OPSET, _onnx

# ------------------------------------------------------------------ import

# the operators of the export table above, read back
OPERATOR_ACTIVATIONS = {operator: name for name, operator in ACTIVATIONS.items() if operator}
# operators a shape computation beside the chain may use (torch writes one for Unflatten and
# view(x.size(0), ...)); the importer evaluates them with NumPy for two batch sizes
SHAPE_OPERATORS = ("Constant", "Identity", "Shape", "Gather", "Unsqueeze", "Squeeze", "Concat",
                   "Slice", "Cast", "Add", "Sub", "Mul", "Div", "Mod", "Reshape")
PROBE_BATCHES = (2, 3)   # a Reshape target must follow the batch and fix everything else
FLOAT_TYPES = (np.dtype(np.float32), np.dtype(np.float64))


class OnnxImportError(ValueError):
    """A file ``load`` does not read, and why (a ValueError naming the file and the node)."""


def _short(value):
    """A float attribute as the engine wrote it: ONNX stores float32, so 1e-5 comes back as
    9.99999974738e-06; the shortest decimal that rounds to the same float32 is 1e-05."""
    return float(str(np.float32(value)))


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


def _image_input(reader, node, shape):
    if len(shape) != 3:
        raise reader.fail(node, f"takes 4-D inputs (batch, channels, height, width), got "
                                f"features of shape {shape}")


def _symmetric_pads(reader, node, pads, what):
    """The (rows, columns) padding of ONNX ``pads`` ``[top, left, bottom, right]``."""
    top, left, bottom, right = pads
    if (top, left) != (bottom, right):
        raise reader.fail(node, f"pads {list(pads)} are not symmetric; the engine's {what} "
                                "pads each side alike")
    return top, left


def _import_gemm(reader, node, layers, shape, dtype):
    a = reader.attributes(node)
    if a.get("transA", 0):
        raise reader.fail(node, "transA=1 (a transposed input) has no Dense equivalent")
    weight = reader.value(node.input[1], node)
    if a.get("transB", 0):
        weight = weight.T
    units = weight.shape[1]
    bias = np.zeros(units, dtype)
    if len(node.input) > 2 and node.input[2]:
        constant = reader.value(node.input[2], node)
        rows = constant.reshape(-1, constant.shape[-1]) if constant.ndim > 1 else None
        if constant.ndim > 2 or (rows is not None and rows.shape[0] != 1) or (
                constant.size not in (1, units)):
            raise reader.fail(node, f"adds a C of shape {constant.shape} to the product's "
                                    f"{units} columns; a Dense layer's bias is one value per "
                                    "column, the same for every row")
        bias = np.broadcast_to(constant.reshape(-1), (units,))
    return _dense(reader, node, shape, a.get("alpha", 1.0) * weight, a.get("beta", 1.0) * bias)


def _dense(reader, node, shape, weight, bias):
    if len(shape) != 1 or weight.ndim != 2 or weight.shape[0] != shape[0]:
        raise reader.fail(node, f"multiplies features of shape {shape} by a weight of shape "
                                f"{weight.shape}; a Dense layer takes (batch, features) "
                                "inputs and an (in, out) weight")
    return sequential.layer("Dense", {"units": int(weight.shape[1])}, weight=weight, bias=bias)


def _import_matmul(reader, node, layers, shape, dtype):
    weight = reader.value(node.input[1], node)
    return _dense(reader, node, shape, weight, np.zeros(weight.shape[-1], dtype))


def _statistic(reader, node):
    """A constant operand in float64, float32 ones as the shortest decimals (``_short``)."""
    constant = reader.value(node.input[1], node)
    if constant.dtype == np.float32:
        return np.vectorize(_short, otypes=[np.float64])(constant)
    return constant.astype(np.float64)


def _typed(config, dtype):
    """``config`` with the model's float dtype (a float64 graph's layers are float64)."""
    return config if dtype == np.float32 else {**config, "dtype": dtype.name}


def _scalar(reader, node, what):
    constant = _statistic(reader, node)
    if constant.size != 1:
        raise reader.fail(node, f"{what} by a constant of shape {constant.shape}; the engine's "
                                "Rescaling takes one number")
    return float(constant.reshape(()))


def _import_mul(reader, node, layers, shape, dtype):
    """A multiplication by one number: ``Rescaling`` (what its export writes)."""
    return sequential.layer("Rescaling", _typed({"scale": _scalar(reader, node, "multiplies")},
                                                dtype))


def _import_sub(reader, node, layers, shape, dtype):
    """A constant subtracted: the mean of a ``Normalization`` (its export writes a Sub and a
    Div by the standard deviation; a Div that follows gives the variance)."""
    mean = _statistic(reader, node)
    entry = sequential.layer("Normalization", _typed({"mean": _config_value(mean),
                                                      "variance": 1.0}, dtype),
                             mean=mean, variance=np.ones(()))
    entry["subtracted"] = True   # a Div next divides this layer, not one of its own
    return entry


def _import_div(reader, node, layers, shape, dtype):
    """A division by a constant ``c``: the standard deviation of a ``Normalization``, the one
    the Sub before it started, else one of mean 0. The layer divides by
    ``max(sqrt(variance), 1e-7)`` in the model's dtype, so ``c`` is read only where that is
    ``|c|`` to the bit; a negative ``c`` (one sign throughout) is that division followed by a
    ``Rescaling`` by -1, exact too. Any other divisor (zero, below Keras's floor, mixed signs,
    one whose square does not give it back) is refused: no engine layer divides by it
    exactly."""
    divisor = reader.value(node.input[1], node)
    constant = _statistic(reader, node)   # as the file wrote it, float32 ones short
    negative = bool((divisor < 0).all()) and divisor.size > 0
    # squared in the model's dtype, whose sqrt gives |c| back (in binary floating point,
    # barring overflow and underflow): squared in float64 and rounded to float32, it may not
    magnitude = np.abs(divisor).astype(dtype)
    variance = (magnitude * magnitude).astype(np.float64)
    divides_exactly = np.array_equal(
        np.maximum(np.sqrt(variance.astype(dtype)), dtype.type(nn.Normalization.STD_FLOOR)),
        magnitude)
    if not (negative or (divisor > 0).all()) or not divides_exactly:
        raise reader.fail(node, f"divides by the constant {_short_array(constant)}: the "
                                "importer reads a Div only as a Normalization's division by "
                                "a standard deviation (every divisor of one sign, its "
                                f"magnitude at least {nn.Normalization.STD_FLOOR}, exact as "
                                f"sqrt(divisor ** 2) in {dtype})")
    previous = layers[-1] if layers else None
    mean = np.zeros(())
    if previous is not None and previous.get("subtracted"):
        mean = layers.pop()["weights"]["mean"]
    normalization = sequential.layer("Normalization",
                                     _typed({"mean": _config_value(mean),
                                             "variance": _config_value(variance)}, dtype),
                                     mean=mean, variance=variance)
    if not negative:
        return normalization
    layers.append(normalization)   # it keeps the shape: the Rescaling's is the same
    return sequential.layer("Rescaling", _typed({"scale": -1.0}, dtype))


def _short_array(array):
    return f"{array.reshape(-1)[:4].tolist()}{'...' if array.size > 4 else ''}" + (
        f" of shape {array.shape}" if array.ndim else "")


def _config_value(array):
    return float(array) if array.ndim == 0 else array.tolist()


def _import_cast(reader, node, layers, shape, dtype):
    """The cast of integer input (raw images) to the model's float type, written before a
    ``Rescaling``, which casts integer input itself; a cast to the type a value already has."""
    onnx = reader.onnx
    to = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(reader.attributes(node)["to"]))
    graph_input = reader.graph.input[0]
    given = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(
        graph_input.type.tensor_type.elem_type))
    if not layers and node.input[0] == graph_input.name and given.kind in "iu":
        return None
    if to != dtype:
        raise reader.fail(node, f"a Cast to {to} of {dtype} values: the engine's models keep "
                                "one float dtype (a Cast is read as the first node, of "
                                "integer input)")
    return None


def _import_add(reader, node, layers, shape, dtype):
    """A constant added after a Dense layer without activation: its bias (MatMul + Add);
    one number added after a Rescaling: its offset."""
    previous = layers[-1] if layers else None
    if (previous is not None and previous["class_name"] == "Rescaling"
            and "offset" not in previous["config"]):
        previous["config"]["offset"] = _scalar(reader, node, "adds")
        return None
    if (previous is None or previous["class_name"] != "Dense"
            or previous["config"].get("activation") is not None):
        raise reader.fail(node, "adds a constant to a value that is not a Dense layer's "
                                "output; the importer reads Add only as the bias of MatMul")
    units = previous["config"]["units"]
    constant = reader.value(node.input[1], node)
    try:
        previous["weights"]["bias"] = previous["weights"]["bias"] + np.broadcast_to(
            np.reshape(constant, constant.shape[-1:] if constant.ndim else ()), (units,))
    except ValueError:
        raise reader.fail(node, f"adds a constant of shape {constant.shape} to {units} "
                                "features; a bias has one value per feature") from None
    return None


def _import_conv(reader, node, layers, shape, dtype):
    """``Conv`` of a 3-D weight as ``Conv1D``, of a 4-D one as ``Conv2D``."""
    a = reader.attributes(node)
    weight = reader.value(node.input[1], node)
    if weight.ndim not in (3, 4):
        raise reader.fail(node, f"a weight of {weight.ndim} dimensions; the engine imports "
                                "1-D and 2-D convolutions (a 3-D or 4-D weight)")
    rank = weight.ndim - 2
    layer = "Conv1D" if rank == 1 else "Conv2D"
    if len(shape) != rank + 1:
        raise reader.fail(node, f"a {layer} takes inputs of {rank + 2} dimensions, got "
                                f"features of shape {shape}")
    kernel = tuple(a.get("kernel_shape", weight.shape[2:]))
    stride = tuple(a.get("strides", (1,) * rank))
    dilation = tuple(a.get("dilations", (1,) * rank))
    auto_pad = a.get("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad not in ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"):
        raise reader.fail(node, f"auto_pad {auto_pad!r} is not an ONNX value")
    extents = [d * (k - 1) + 1 for d, k in zip(dilation, kernel)]
    if auto_pad.startswith("SAME"):
        pads = _same_pads(shape[1:], extents, stride, upper=auto_pad == "SAME_UPPER")
    else:
        pads = list(a.get("pads", [0] * (2 * rank))) if auto_pad == "NOTSET" else [0] * (2 * rank)
    same = [(e - 1) // 2 for e in extents] + [e - 1 - (e - 1) // 2 for e in extents]
    if stride == (1,) * rank and list(pads) == same and pads[:rank] != pads[rank:]:
        padding = "same"
    else:
        padding = _symmetric_equivalent(reader, node, layer, shape[1:], extents, stride, pads)
    config = {"filters": int(weight.shape[0]), "kernel_size": list(kernel),
              "stride": list(stride), "padding": padding, "dilation": list(dilation),
              "groups": int(a.get("group", 1))}
    weights = {"weight": weight}
    if len(node.input) > 2 and node.input[2]:
        weights["bias"] = reader.value(node.input[2], node)
    else:
        config["use_bias"] = False
    return sequential.layer(layer, config, **weights)


def _same_pads(sizes, extents, stride, upper):
    """ONNX's ``pads`` (begins, then ends) for ``auto_pad`` SAME_UPPER (``upper``: an odd
    total's extra row at the end) or SAME_LOWER (at the beginning): the output
    ``ceil(size / stride)`` long, from the input's size."""
    totals = [max((-(-n // s) - 1) * s + e - n, 0) for n, e, s in zip(sizes, extents, stride)]
    begins = [t // 2 if upper else t - t // 2 for t in totals]
    return begins + [t - b for t, b in zip(totals, begins)]


def _symmetric_equivalent(reader, node, layer, sizes, extents, stride, pads):
    """The engine's symmetric padding (one per axis) computing what ONNX's ``pads`` compute:
    each axis padded by its ``begin`` on both sides, where that gives ONNX's output size (the
    rows past it at the end are then read by no window); else a refusal."""
    rank = len(sizes)
    begins, ends = list(pads[:rank]), list(pads[rank:])
    for n, e, s, begin, end in zip(sizes, extents, stride, begins, ends):
        if (n + 2 * begin - e) // s != (n + begin + end - e) // s:
            raise reader.fail(node, f"pads {list(pads)} (begins, then ends) on an input of "
                                    f"{list(sizes)} with stride {list(stride)}: the engine's "
                                    f"{layer} pads each side alike, and no symmetric padding "
                                    "computes this")
    return begins


def _import_pool(class_name):
    def read(reader, node, layers, shape, dtype):
        _image_input(reader, node, shape)
        a = reader.attributes(node)
        if a.get("ceil_mode", 0) or any(d != 1 for d in a.get("dilations", (1, 1))):
            raise reader.fail(node, "ceil_mode=1 or dilations other than 1 have no "
                                    f"{class_name} equivalent")
        auto_pad = a.get("auto_pad", b"NOTSET")
        if auto_pad not in (b"NOTSET", b"VALID", "NOTSET", "VALID"):
            raise reader.fail(node, f"auto_pad {auto_pad!r}: give explicit pads")
        padding = _symmetric_pads(reader, node, a.get("pads", [0] * 4), class_name)
        if class_name == "AvgPool2D" and any(padding) and not a.get("count_include_pad", 0):
            raise reader.fail(node, "count_include_pad=0: the engine's average counts the "
                                    "padded zeros, as torch's default does")
        kernel = list(a["kernel_shape"])
        return sequential.layer(class_name, {"pool_size": kernel,
                                             "stride": list(a.get("strides", (1, 1))),
                                             "padding": list(padding)})
    return read


def _import_batch_norm(reader, node, layers, shape, dtype):
    a = reader.attributes(node)
    if a.get("training_mode", 0):
        raise reader.fail(node, "training_mode=1: the importer reads inference graphs")
    weight, bias, mean, var = (reader.value(name, node) for name in node.input[1:5])
    momentum = _short(1 - _short(a.get("momentum", 0.9)))   # as _batch_norm writes it
    config = {"momentum": momentum, "eps": _short(a.get("epsilon", 1e-5))}
    return sequential.layer("BatchNorm", config, weight=weight, bias=bias, running_mean=mean,
                            running_var=var)


def _import_activation(reader, node, layers, shape, dtype):
    a = reader.attributes(node)
    name = OPERATOR_ACTIVATIONS[node.op_type]
    config = {"activation": name}
    if name == "leaky_relu":
        config["alpha"] = _short(a.get("alpha", 0.01))
    if name == "gelu" and a.get("approximate", b"none") not in (b"none", "none"):
        raise reader.fail(node, f"Gelu approximate={a['approximate']!r}; the layers compute "
                                "the exact (\"none\") form")
    if name == "softmax" and a.get("axis", -1) not in (-1, len(shape)):
        raise reader.fail(node, f"softmax over axis {a['axis']} of a {len(shape) + 1}-D "
                                "value; the engine's is over the last axis")
    return sequential.layer("Activation", config)


def _import_flatten(reader, node, layers, shape, dtype):
    if reader.attributes(node).get("axis", 1) != 1:
        raise reader.fail(node, "Flatten must keep the batch axis (axis=1)")
    return sequential.layer("Flatten", {})


def _import_reshape(reader, node, layers, shape, dtype):
    """A Reshape whose target keeps the batch dimension and fixes the rest, whether stored
    or computed from the input's shape (torch's Unflatten)."""
    literal_zeros = reader.attributes(node).get("allowzero", 0)   # else 0 copies the input's
    targets = []
    for batch in PROBE_BATCHES:
        source = (batch,) + shape
        target = [int(d) if d or literal_zeros else source[i]
                  for i, d in enumerate(reader.value(node.input[1], node, batch))]
        if target.count(-1) == 1:
            known = math.prod(d for d in target if d != -1)
            target[target.index(-1)] = math.prod(source) // max(known, 1)
        if math.prod(target) != math.prod(source) or target[0] != batch:
            raise reader.fail(node, f"reshapes a batch of {batch} (features {shape}) to "
                                    f"{target}; an engine Reshape keeps the batch dimension")
        targets.append(target[1:])
    if targets[0] != targets[1]:
        raise reader.fail(node, f"the target's feature shape follows the batch size "
                                f"({targets}); an engine Reshape fixes it")
    return sequential.layer("Reshape", {"shape": targets[0]})


def _import_dropout(reader, node, layers, shape, dtype):
    inputs = list(node.input) + [""] * 3
    if inputs[2] and bool(reader.value(inputs[2], node)):
        raise reader.fail(node, "training_mode=True: the importer reads inference graphs")
    ratio = (float(reader.value(inputs[1], node)) if inputs[1]
             else reader.attributes(node).get("ratio", 0.5))
    return sequential.layer("Dropout", {"p": _short(ratio)})


def _import_gather(reader, node, layers, shape, dtype):
    if layers or reader.attributes(node).get("axis", 0) != 0 or node.input[0] not in \
            reader.initializers:
        raise reader.fail(node, "only a first Gather of rows (axis 0) of a stored table, "
                                "indexed by the input's ids, is an Embedding")
    table = reader.value(node.input[0], node)
    return sequential.layer("Embedding", {"num_embeddings": int(table.shape[0]),
                                          "embedding_dim": int(table.shape[1])}, weight=table)


def _import_layer_norm(reader, node, layers, shape, dtype):
    a = reader.attributes(node)
    if a.get("axis", -1) not in (-1, len(shape)) or len(node.input) < 2:
        raise reader.fail(node, f"normalises from axis {a.get('axis')} of a "
                                f"{len(shape) + 1}-D value; the engine's LayerNorm takes the "
                                "last axis, with a scale")
    scale = reader.value(node.input[1], node)
    bias = (reader.value(node.input[2], node) if len(node.input) > 2 and node.input[2]
            else np.zeros_like(scale))
    return sequential.layer("LayerNorm", {"eps": _short(a.get("epsilon", 1e-5))},
                            weight=scale, bias=bias)


IMPORTERS = {"Gemm": _import_gemm, "MatMul": _import_matmul, "Add": _import_add,
             "Conv": _import_conv, "MaxPool": _import_pool("MaxPool2D"),
             "AveragePool": _import_pool("AvgPool2D"), "BatchNormalization": _import_batch_norm,
             "Flatten": _import_flatten, "Reshape": _import_reshape, "Dropout": _import_dropout,
             "Identity": lambda *args: None, "Cast": _import_cast, "Mul": _import_mul,
             "Sub": _import_sub, "Div": _import_div, "Gather": _import_gather,
             "LayerNormalization": _import_layer_norm,
             **{operator: _import_activation for operator in OPERATOR_ACTIVATIONS}}
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
    if isinstance(layers, nn.Model):   # a graph with residual joins
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
    if len(inputs) == 1 and len(graph.output) == 1 and joins(
            reader, nodes, inputs[0].name):
        graph_input = inputs[0]
        chain = [node for node in nodes if graph_input.name in node.input]   # what reads it
    else:
        graph_input, chain = _chain(reader)
        nodes = None
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
    if nodes is not None:
        model = read_graph(reader, nodes, graph_input, graph.output[0].name, dtype,
                           lambda chain, shape, dtype: _import_chain(reader, chain, shape,
                                                                     dtype))
        model.build(shape, dtype=np.dtype(onnx.helper.tensor_dtype_to_np_dtype(
            graph_input.type.tensor_type.elem_type)))
        return model, shape, dtype
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
