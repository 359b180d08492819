"""The operators ``engine.onnx.load`` reads, each into engine layer descriptions
(``IMPORTERS``: what the export writes, and what ``torch.onnx.export`` writes for the
equivalent torch network; ``engine.onnx``'s docstring says what each computes)."""
import math

import numpy as np

from engine import nn
from engine.interop import sequential
from engine.onnx.common import ACTIVATIONS, PROBE_BATCHES

# the operators of the export table, read back
OPERATOR_ACTIVATIONS = {operator: name for name, operator in ACTIVATIONS.items() if operator}


def _short(value):
    """A float attribute as the engine wrote it: ONNX stores float32, so 1e-5 comes back as
    9.99999974738e-06; the shortest decimal that rounds to the same float32 is 1e-05."""
    return float(str(np.float32(value)))


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
