"""The ONNX operators an imported graph model (``engine.onnx.import_graph.GraphModel``) runs
in its forward as engine functional ops: ``OPERATIONS[op_type](inputs, attributes)`` -> the
node's outputs (a list).

An input is an engine Tensor (a value computed from the model's input, a parameter or a
buffer), a NumPy array (a constant of the file, or a shape computation: ``Shape`` of a
Tensor reads its shape on the host) or None (an optional input left out). A node of host
arrays only computes on the host with NumPy, as ONNX does (shape arithmetic, the constants a
torch export computes from shapes); a node that reads a Tensor runs engine ops on its device,
so it is differentiated and runs on CUDA as on the CPU. A host operand of one element
becomes a Python number (``x * 0.25`` is one scalar op), a larger one a Tensor of the other
operand's dtype on its device."""
import math

import numpy as np

from engine import functional as F
from engine import sequence
from engine.onnx.importers import OPERATOR_ACTIVATIONS

# ONNX's elementwise functions without an activation layer, by their engine name
FUNCTIONS = {"Neg": "neg", "Exp": "exp", "Log": "log", "Sqrt": "sqrt", "Abs": "abs"}
HOST_FUNCTIONS = {"Neg": np.negative, "Exp": np.exp, "Log": np.log, "Sqrt": np.sqrt,
                  "Abs": np.abs}


def _host(value):
    return isinstance(value, np.ndarray)


def _as_tensor(value, like):
    """``value`` (a host array) as a Tensor of ``like``'s float dtype (integers and booleans
    keep theirs) on its device."""
    array = np.asarray(value)
    floats = array.dtype.kind == "f" and like.data.dtype.kind == "f"
    dtype = like.data.dtype if floats else array.dtype
    return like._operand(array, dtype=dtype)


def _operand(value, like):
    """A host operand of a binary op beside the Tensor ``like``: a Python number where it is
    one element that broadcasts to nothing new, else a Tensor."""
    if value.size == 1 and value.ndim <= like.ndim and value.dtype.kind in "fiu":
        return float(value.reshape(()))
    return _as_tensor(value, like)


def _binary(host_op, engine_op):
    def run(inputs, attributes):
        a, b = inputs[0], inputs[1]
        if _host(a) and _host(b):
            return [host_op(a, b)]
        a = _operand(a, b) if _host(a) else a
        b = _operand(b, a) if _host(b) else b
        return [engine_op(a, b)]
    return run


def _host_div(a, b):
    """ONNX's Div: integer division truncates (shape arithmetic), floats divide."""
    return np.trunc(a / b).astype(a.dtype) if a.dtype.kind in "iu" else a / b


def _matmul(inputs, attributes):
    a, b = inputs
    if _host(a) and _host(b):
        return [np.matmul(a, b)]
    a = _as_tensor(a, b) if _host(a) else a
    b = _as_tensor(b, a) if _host(b) else b
    return [F.matmul(a, b)]


def _gemm(inputs, attributes):
    """``alpha * A' @ B' + beta * C`` (A', B' transposed where transA, transB say)."""
    a, b = inputs[0], inputs[1]
    c = inputs[2] if len(inputs) > 2 else None
    if attributes.get("transA", 0):
        a = F.transpose(a) if not _host(a) else a.T
    if attributes.get("transB", 0):
        b = F.transpose(b) if not _host(b) else b.T
    (y,) = _matmul([a, b], {})
    alpha, beta = attributes.get("alpha", 1.0), attributes.get("beta", 1.0)
    if alpha != 1.0:
        y = y * alpha
    if c is not None:
        (y,) = _binary(np.add, F.add)([y, c * beta if beta != 1.0 else c], {})
    return [y]


def _transpose(inputs, attributes):
    x = inputs[0]
    perm = attributes.get("perm") or list(reversed(range(x.ndim)))
    return [np.transpose(x, perm) if _host(x) else F.permute(x, *perm)]


def _reshape_target(x_shape, target, allowzero):
    """ONNX's target: a 0 copies the input's size there (unless ``allowzero``), -1 is
    inferred."""
    return tuple(int(size) if size or allowzero else int(x_shape[axis])
                 for axis, size in enumerate(target))


def _reshape(inputs, attributes):
    x, target = inputs
    if not _host(target):   # a target fed to the graph: read on the host
        target = target.numpy()
    shape = _reshape_target(x.shape, target.reshape(-1), attributes.get("allowzero", 0))
    return [x.reshape(shape) if _host(x) else F.reshape(x, shape)]


def _flatten(inputs, attributes):
    x = inputs[0]
    axis = attributes.get("axis", 1) % max(x.ndim, 1) if x.ndim else 0
    shape = (math.prod(x.shape[:axis]), -1)
    return [x.reshape(shape) if _host(x) else F.reshape(x, shape)]


def _axes(inputs, attributes):
    """A node's ``axes``: its second input (opset 13 on) or its attribute."""
    if len(inputs) > 1 and inputs[1] is not None:
        return tuple(int(axis) for axis in np.asarray(inputs[1]).reshape(-1))
    axes = attributes.get("axes")
    return None if axes is None else tuple(int(axis) for axis in axes)


def _unsqueeze(inputs, attributes):
    x, axes = inputs[0], _axes(inputs, attributes)
    return [np.expand_dims(x, axes) if _host(x) else F.unsqueeze(x, axes)]


def _squeeze(inputs, attributes):
    x, axes = inputs[0], _axes(inputs, attributes)
    return [np.squeeze(x, axes) if _host(x) else F.squeeze(x, axes)]


def _softmax(function, host_log):
    def run(inputs, attributes):
        x, axis = inputs[0], attributes.get("axis", -1)
        if _host(x):
            shifted = x - x.max(axis=axis, keepdims=True)
            total = np.exp(shifted).sum(axis=axis, keepdims=True)
            return [shifted - np.log(total) if host_log else np.exp(shifted) / total]
        return [function(x, axis=axis)]
    return run


def _where(inputs, attributes):
    condition, a, b = inputs
    if all(_host(value) for value in inputs):
        return [np.where(condition, a, b)]
    like = next(value for value in (a, b, condition) if not _host(value))
    a, b = (_operand(v, like) if _host(v) else v for v in (a, b))
    if _host(condition):
        condition = condition.astype(bool)
    return [F.where(condition, a, b)]


def _slice_bound(value, size, step, end):
    """ONNX's clamping of a Slice bound on an axis of ``size`` as a Python slice bound."""
    value = int(value)
    if value < 0:
        value += size
    if step > 0:
        return min(max(value, 0), size)
    value = min(max(value, -1), size - 1)
    return None if end and value == -1 else value   # -1: past the front


def _index(x, key):
    return x[key] if _host(x) else F.index(x, key)


def _slice(inputs, attributes):
    x, starts, ends = inputs[0], inputs[1], inputs[2]
    axes = inputs[3] if len(inputs) > 3 and inputs[3] is not None else range(len(starts))
    steps = inputs[4] if len(inputs) > 4 and inputs[4] is not None else [1] * len(starts)
    key = [slice(None)] * x.ndim
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis, step = int(axis) % x.ndim, int(step)
        size = x.shape[axis]
        key[axis] = slice(_slice_bound(start, size, step, False),
                          _slice_bound(end, size, step, True), step)
    return [_index(x, tuple(key))]


def _split(inputs, attributes, outputs):
    """ONNX's Split into ``outputs`` parts along ``axis``: the sizes its second input or
    attribute gives, else equal parts (the last smaller, as opset 18's ``num_outputs``)."""
    x, axis = inputs[0], attributes.get("axis", 0) % inputs[0].ndim
    sizes = inputs[1] if len(inputs) > 1 and inputs[1] is not None else attributes.get("split")
    length = x.shape[axis]
    if sizes is None:
        part = -(-length // outputs)
        sizes = [min(part, length - k * part) for k in range(outputs)]
    parts, start = [], 0
    for size in (int(size) for size in np.asarray(sizes).reshape(-1)):
        key = (slice(None),) * axis + (slice(start, start + size),)
        parts.append(_index(x, key))
        start += size
    return parts


def _gather(inputs, attributes):
    """``Gather``: an embedding's rows of a 2-D table Tensor picked by integer ids along
    axis 0 (its deterministic backward), else ``data`` indexed along ``axis`` by the
    indices (a number, a host array or a Tensor of ids)."""
    data, indices = inputs
    axis = attributes.get("axis", 0)
    if _host(data) and _host(indices):
        return [np.take(data, indices, axis=axis)]
    if _host(data):
        raise ValueError("gathers from a constant by computed indices; the importer gathers "
                         "from computed values and weights")
    if _host(indices):   # ONNX counts a negative index from the end
        size = data.shape[axis]
        indices = np.where(indices < 0, indices + size, indices).astype(np.int64)
    if axis == 0 and data.ndim == 2 and (not _host(indices) or indices.ndim >= 1):
        return [sequence.embedding(indices, data)]
    if _host(indices) and indices.ndim == 0:
        indices = int(indices)
    return [_index(data, (slice(None),) * (axis % data.ndim) + (indices,))]


def _concat(inputs, attributes):
    axis = attributes["axis"]
    if all(_host(value) for value in inputs):
        return [np.concatenate(inputs, axis=axis)]
    like = next(value for value in inputs if not _host(value))
    return [F.cat([_as_tensor(v, like) if _host(v) else v for v in inputs], axis=axis)]


def _cast(inputs, to):
    x = inputs[0]
    if _host(x):
        return [x.astype(to)]
    return [x if x.data.dtype == to else F.astype(x, to)]


def _shape(inputs, attributes):
    shape = np.array(inputs[0].shape, np.int64)
    return [shape[attributes.get("start", 0):attributes.get("end", len(shape))]]


def _layer_norm(inputs, attributes, outputs):
    """``LayerNormalization`` from ``axis`` on; its Mean and InvStdDev outputs too where the
    graph uses them."""
    x, scale = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    axis, eps = attributes.get("axis", -1) % x.ndim, attributes.get("epsilon", 1e-5)
    results = [sequence.layer_norm(x, x.shape[axis:], scale, bias, eps=eps)]
    if outputs > 1:
        axes = tuple(range(axis, x.ndim))
        mean = F.mean(x, axis=axes, keepdims=True)
        variance = F.mean((x - mean) * (x - mean), axis=axes, keepdims=True)
        results += [mean, 1.0 / F.sqrt(variance + eps)]
    return results


def _activation(inputs, attributes, operator):
    x, name = inputs[0], OPERATOR_ACTIVATIONS[operator]
    if _host(x):
        raise ValueError(f"{operator} of a constant: the importer runs activations on "
                         "computed values")
    if name == "leaky_relu":
        return [F.leaky_relu(x, attributes.get("alpha", 0.01))]
    if name == "gelu":
        return [F.gelu(x, attributes.get("approximate", "none"))]
    if name == "softmax":
        return [F.softmax(x, axis=attributes.get("axis", -1))]
    return [F.POINTWISE[name](x)]


def _function(operator):
    def run(inputs, attributes):
        x = inputs[0]
        return [HOST_FUNCTIONS[operator](x) if _host(x) else F.POINTWISE[FUNCTIONS[operator]](x)]
    return run


def _reduce(function, host_function):
    def run(inputs, attributes):
        x, axes = inputs[0], _axes(inputs, attributes)
        keep = bool(attributes.get("keepdims", 1))
        if axes == () and attributes.get("noop_with_empty_axes", 0):
            return [x]
        if _host(x):
            return [host_function(x, axis=axes, keepdims=keep)]
        return [function(x, axis=axes, keepdims=keep)]
    return run


def _comparison(host_op, engine_op, reflected_op):
    """A comparison (a bool result, never differentiated); a host left operand swaps sides
    (``2 < x`` is ``x > 2``)."""
    def run(inputs, attributes):
        a, b = inputs
        if _host(a) and _host(b):
            return [host_op(a, b)]
        if _host(a):
            return [reflected_op(b, _operand(a, b))]
        return [engine_op(a, _operand(b, a) if _host(b) else b)]
    return run


def _pow(inputs, attributes):
    x, exponent = inputs
    if _host(x) and _host(exponent):
        return [np.power(x, exponent)]
    if not _host(exponent) or exponent.size != 1:
        raise ValueError("Pow by a computed or non-scalar exponent; the engine raises to one "
                         "number")
    return [F.pow(x, float(exponent.reshape(())))]


def _clip(inputs, attributes):
    """``Clip``: bounds as inputs (opset 11 on), "" (None here) for an open side."""
    x = inputs[0]
    low, high = (None if len(inputs) <= k or inputs[k] is None else inputs[k]
                 for k in (1, 2))
    if _host(x):
        return [np.clip(x, low, high)]
    if any(bound is not None and not _host(bound) for bound in (low, high)):
        raise ValueError("Clip with computed bounds; the engine clips to numbers")
    low, high = (None if bound is None else float(bound.reshape(())) for bound in (low, high))
    return [F.clip(x, low, high)]


def _identity(inputs, attributes):
    return [inputs[0]]


def _host_only(function, operator):
    def run(inputs, attributes):
        if not all(_host(value) for value in inputs):
            raise ValueError(f"{operator} of computed values: the importer reads {operator} in "
                             "shape arithmetic (constants and shapes) only")
        return [function(*inputs)]
    return run


OPERATIONS = {
    **{operator: (lambda operator: lambda inputs, attributes: _activation(
        inputs, attributes, operator))(operator) for operator in OPERATOR_ACTIVATIONS},
    **{operator: _function(operator) for operator in FUNCTIONS},
    "Add": _binary(np.add, F.add), "Sub": _binary(np.subtract, F.sub),
    "Mul": _binary(np.multiply, F.mul), "Div": _binary(_host_div, F.div),
    "Max": _binary(np.maximum, F.maximum), "Min": _binary(np.minimum, F.minimum),
    "Mod": _host_only(np.mod, "Mod"), "Pow": _pow, "Clip": _clip,
    "Greater": _comparison(np.greater, F.gt, F.lt), "Less": _comparison(np.less, F.lt, F.gt),
    "GreaterOrEqual": _comparison(np.greater_equal, F.ge, F.le),
    "LessOrEqual": _comparison(np.less_equal, F.le, F.ge),
    "Equal": _comparison(np.equal, F.eq, F.eq),
    "MatMul": _matmul, "Gemm": _gemm, "Transpose": _transpose, "Reshape": _reshape,
    "Flatten": _flatten, "Unsqueeze": _unsqueeze, "Squeeze": _squeeze,
    "Softmax": _softmax(F.softmax, False), "LogSoftmax": _softmax(F.log_softmax, True),
    "Where": _where, "Slice": _slice, "Gather": _gather, "Concat": _concat,
    "Shape": _shape, "Identity": _identity, "Dropout": _identity,
    "ReduceSum": _reduce(F.sum, np.sum), "ReduceMean": _reduce(F.mean, np.mean),
    "ReduceMax": _reduce(F.max, np.max), "ReduceMin": _reduce(F.min, np.min),
    "Size": lambda inputs, attributes: [np.array(math.prod(inputs[0].shape), np.int64)],
}
# Split's and LayerNormalization's outputs are as many as the node names; Cast's "to" is
# a NumPy dtype's name
SPLIT, CAST, LAYER_NORM = "Split", "Cast", "LayerNormalization"
# attention's composition fused at import (engine.onnx.import_fusion): not an ONNX operator
ATTENTION = "engine.attention"
SUPPORTED = sorted([*OPERATIONS, SPLIT, CAST, LAYER_NORM, "Constant"])


def run(operator, inputs, attributes, outputs):
    """The ``outputs`` outputs of the node ``operator`` on ``inputs`` (Tensors, host arrays,
    None for an optional input left out), as a list."""
    if operator == SPLIT:
        results = _split(inputs, attributes, outputs)
    elif operator == LAYER_NORM:
        results = _layer_norm(inputs, attributes, outputs)
    elif operator == ATTENTION:
        q, k, v, mask = inputs
        results = [sequence.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=attributes["causal"], scale=attributes["scale"])]
    elif operator == CAST:
        results = _cast(inputs, np.dtype(attributes["to"]))
    else:
        results = OPERATIONS[operator](inputs, attributes)
    # NumPy gives a scalar for a 0-d result (np.sqrt of a 0-d array): an array here
    return [np.asarray(value) if isinstance(value, np.generic) else value for value in results]
