"""Elementwise ops: binary with NumPy broadcasting, the unary functions of ``ops.pointwise``,
and clip.

Every op code gets its own pair of kernels, generated below from one template with the code
as a constant: the compiler folds the dispatch away and vectorises the cheap ops, and a new
elementwise function is one entry in ``ops.pointwise``, not new kernels. Broadcasting reads
the inputs through the strides of ``ops.layout.broadcast_layout``, so no input is ever
materialised at the output's shape.

Clip has two parameters, so it is a kernel pair of its own rather than a table entry: the
table's one parameter is also the signature of the fused Dense epilogues, which have no use
for a second one.
"""
import math
import numbers

from numba import njit

from ops.constant_code import kernels_of_code
from ops.cuda import cuda
from ops.dispatch import Meta, Out, run
from ops.element_kernel import split_over_threads
from ops.gelu_cpu import gelu_cpu, gelu_grad_cpu
from ops.gelu_cuda import gelu_cuda, gelu_grad_cuda
from ops.device import device_of
from ops.launch import Kernel, elements
from ops.layout import (SAME_SHAPE, broadcast_layout, broadcast_offsets_cpu,
                        broadcast_offsets_cuda, broadcast_shape, flat, meta_on)
from ops.pointwise import (GELU, NEG, TABLE, derivative_cpu, derivative_cuda, value_cpu,
                           value_cuda)
from ops.reduce import REDUCE, SUM, sum_to_shape
from ops.registry import Op, register
from ops.twin import twin

# ------------------------------------------------------------------ binary kernels

ADD, SUB, MUL, DIV = 0, 1, 2, 3
BINARY_NAMES = {ADD: "add", SUB: "sub", MUL: "mul", DIV: "div"}


def _binary_value(code, x, y):
    if code == ADD:
        return x + y
    if code == SUB:
        return x - y
    if code == MUL:
        return x * y
    return x / y   # DIV: IEEE (inf, nan), never an exception


_binary_value_cpu, _binary_value_cuda = twin(_binary_value)


@kernels_of_code("code")
def _binary_kernel(code):
    """The twin kernels of ``a <code> b`` into ``out`` (flat arrays, broadcast by ``meta``)."""

    @njit(cache=True, error_model="numpy")
    def binary_cpu(a, b, out, meta):
        if meta[0] == 0:   # same shape: no index arithmetic
            if out.ctypes.data == a.ctypes.data:
                # in place (a gradient accumulated into its slot): out read through its
                # own name, or LLVM's overlap test of out against a fails at run time and
                # the loop takes its scalar version (98k float32 on one core of the Xeon:
                # 72-75 us against 25 for the vector loop)
                for i in range(out.size):
                    out[i] = _binary_value_cpu(code, out[i], b[i])
                return
            for i in range(out.size):
                out[i] = _binary_value_cpu(code, a[i], b[i])
            return
        # a row of the last (coalesced) dim at a time: its offsets once, then row slices
        # indexed from 0 (loops LLVM vectorises) or one operand's value along the row; the
        # GPT's position embedding added to the batch, (12, 64, 128) + (64, 128), took 864 us
        # with the offsets of every element, 145 with a stride added per element, 27 so (the
        # same-shape add: 23)
        ndim = meta[0]
        row, stride_a, stride_b = meta[ndim], meta[2 * ndim], meta[3 * ndim]
        for start in range(0, out.size, row):
            offset_a, offset_b = broadcast_offsets_cpu(start, meta)
            target = out[start:start + row]
            if stride_a == 1 and stride_b == 1:
                x, y = a[offset_a:offset_a + row], b[offset_b:offset_b + row]
                for j in range(row):
                    target[j] = _binary_value_cpu(code, x[j], y[j])
            elif stride_a == 1 and stride_b == 0:
                x, y0 = a[offset_a:offset_a + row], b[offset_b]
                for j in range(row):
                    target[j] = _binary_value_cpu(code, x[j], y0)
            elif stride_a == 0 and stride_b == 1:
                x0, y = a[offset_a], b[offset_b:offset_b + row]
                for j in range(row):
                    target[j] = _binary_value_cpu(code, x0, y[j])
            else:   # both operands broadcast along the row
                for j in range(row):
                    target[j] = _binary_value_cpu(code, a[offset_a + j * stride_a],
                                                  b[offset_b + j * stride_b])

    @cuda.jit(cache=True)
    def binary_cuda(a, b, out, meta):
        i = cuda.grid(1)
        if i < out.size:
            if meta[0] == 0:
                out[i] = _binary_value_cuda(code, a[i], b[i])
            else:
                offset_a, offset_b = broadcast_offsets_cuda(i, meta)
                out[i] = _binary_value_cuda(code, a[offset_a], b[offset_b])

    return Kernel(BINARY_NAMES[code], binary_cpu, binary_cuda, elements(2))


BINARY = {code: _binary_kernel(code) for code in BINARY_NAMES}


def binary(code, a, b, out=None):
    """``a <op> b`` with NumPy broadcasting, into ``out`` when given (it may alias ``a``).
    Into an ``out`` of the operands' one shape (a gradient accumulated into its slot) the
    kernel runs without ``run``'s placeholders or the broadcast layout (128 floats 5.5 -> 3.7
    us on the 2-core Xeon; a LayerNorm fwd+bwd accumulates three)."""
    if out is not None and a.shape == b.shape == out.shape:
        device = device_of(a)
        BINARY[code].run_on(device, (flat(a), flat(b), flat(out), meta_on(device, SAME_SHAPE)))
        return out
    shape = broadcast_shape(a.shape, b.shape, BINARY_NAMES[code])
    meta = Meta(broadcast_layout(shape, tuple(a.shape), tuple(b.shape)))
    if out is None:
        return run(BINARY[code], flat(a), flat(b), Out(shape, a.dtype), meta)
    run(BINARY[code], flat(a), flat(b), flat(out), meta)
    return out


def add_arrays(a, b, out=None):
    """``a + b`` of two arrays (no tape): gradient accumulation."""
    return binary(ADD, a, b, out)


# ------------------------------------------------------------------ unary kernels

@kernels_of_code("code")
def _unary_kernels(code, name):
    """The twin kernels of f = ``ops.pointwise`` function ``code``, a constant of each
    (``ops.constant_code``): the value, and the input gradient ``grad_out * f'(x)``."""

    @njit(cache=True, error_model="numpy", nogil=True)
    def unary_cpu(x, out, p):
        for i in range(out.size):
            out[i] = value_cpu(code, x[i], p)

    @cuda.jit(cache=True)
    def unary_cuda(x, out, p):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = value_cuda(code, x[i], p)

    @njit(cache=True, error_model="numpy", nogil=True)
    def unary_grad_cpu(x, y, grad_out, grad_in, p):
        for i in range(grad_in.size):
            grad_in[i] = grad_out[i] * derivative_cpu(code, x[i], y[i], p)

    @cuda.jit(cache=True)
    def unary_grad_cuda(x, y, grad_out, grad_in, p):
        i = cuda.grid(1)
        if i < grad_in.size:
            grad_in[i] = grad_out[i] * derivative_cuda(code, x[i], y[i], p)

    if code == GELU:   # float32 in float32: vectorisable code (ops.gelu_cpu), libdevice's
        unary_cpu, unary_grad_cpu = gelu_cpu, gelu_grad_cpu   # erff and expf (ops.gelu_cuda)
        unary_cuda, unary_grad_cuda = gelu_cuda, gelu_grad_cuda
    # large inputs in blocks on the engine's threads (the GPT's GELU: 393k elements)
    return (Kernel(name, split_over_threads(unary_cpu, 2), unary_cuda, elements(1)),
            Kernel(f"{name}_grad", split_over_threads(unary_grad_cpu, 4), unary_grad_cuda,
                   elements(3)))


UNARY = {entry.code: _unary_kernels(entry.code, entry.name) for entry in TABLE}


def unary(code, x, p=0.0):
    """f(x) elementwise for the ``ops.pointwise`` function ``code`` with parameter ``p``."""
    kernel, _ = UNARY[code]
    return run(kernel, flat(x), Out(x.shape, x.dtype), x.dtype.type(p))   # float32 stays float32


def unary_grad(code, x, y, grad_out, p=0.0):
    _, kernel = UNARY[code]
    return run(kernel, flat(x), flat(y), flat(grad_out), Out(x.shape, x.dtype), x.dtype.type(p))


# ------------------------------------------------------------------ binary ops

class _Binary(Op):
    code = None

    def check(self, a, b):
        broadcast_shape(a.shape, b.shape, self.name)

    def forward(self, a, b):
        self.a_shape, self.b_shape = tuple(a.shape), tuple(b.shape)
        return binary(self.code, a, b)

    def onnx(self, graph, inputs):   # ONNX's Add, Sub, Mul, Div broadcast as NumPy does
        return graph.node(self.name.capitalize(), inputs)


@register
class Add(_Binary):
    name, code = "add", ADD
    kernels = (BINARY[ADD], REDUCE[SUM])   # the sum undoes broadcasting

    def backward(self, grad_out, grad_dst):
        return sum_to_shape(grad_out, self.a_shape), sum_to_shape(grad_out, self.b_shape)


@register
class Sub(_Binary):
    name, code = "sub", SUB
    kernels = (BINARY[SUB], UNARY[NEG][0], REDUCE[SUM])

    def backward(self, grad_out, grad_dst):
        needs_a, needs_b = self.needs_input_grad
        grad_a = sum_to_shape(grad_out, self.a_shape) if needs_a else None
        grad_b = sum_to_shape(unary(NEG, grad_out), self.b_shape) if needs_b else None
        return grad_a, grad_b


@register
class Mul(_Binary):
    name, code = "mul", MUL
    kernels = (BINARY[MUL], REDUCE[SUM])

    def forward(self, a, b):
        self.a, self.b = a, b
        return super().forward(a, b)

    def backward(self, grad_out, grad_dst):
        needs_a, needs_b = self.needs_input_grad
        grad_a = sum_to_shape(binary(MUL, grad_out, self.b), self.a_shape) if needs_a else None
        grad_b = sum_to_shape(binary(MUL, grad_out, self.a), self.b_shape) if needs_b else None
        return grad_a, grad_b


@register
class Div(_Binary):
    name, code = "div", DIV
    kernels = (BINARY[DIV], BINARY[MUL], UNARY[NEG][0], REDUCE[SUM])

    def forward(self, a, b):
        self.b = b
        self.out = super().forward(a, b)
        return self.out

    def backward(self, grad_out, grad_dst):
        needs_a, needs_b = self.needs_input_grad
        grad_a = binary(DIV, grad_out, self.b)   # d(a/b)/da = 1/b; also reused for b
        grad_b = None
        if needs_b:   # d(a/b)/db = -(a/b)/b
            grad_b = sum_to_shape(unary(NEG, binary(MUL, grad_a, self.out)), self.b_shape)
        return (sum_to_shape(grad_a, self.a_shape) if needs_a else None), grad_b


# ------------------------------------------------------------------ unary ops

class _Unary(Op):
    entry = None   # the ops.pointwise.Pointwise this op computes

    def forward(self, x):
        self.p = self.params.get("p", 0.0)
        out = unary(self.entry.code, x, self.p)
        self.x = x if self.entry.reads_input else out   # y stands for x otherwise
        self.y = out
        return out

    def backward(self, grad_out, grad_dst):
        return (unary_grad(self.entry.code, self.x, self.y, grad_out, self.p),)

    # the scalar forms: ONNX's binary operator, and whether the scalar is its first operand
    ONNX_SCALAR = {"add_scalar": ("Add", False), "mul_scalar": ("Mul", False),
                   "div_scalar": ("Div", False), "pow_scalar": ("Pow", False),
                   "rsub_scalar": ("Sub", True), "rdiv_scalar": ("Div", True)}

    def onnx(self, graph, inputs):
        p = self.params.get("p", 0.0)
        if self.entry.name not in self.ONNX_SCALAR:   # the functions: graph knows their nodes
            return graph.pointwise(self.entry, inputs[0], p)
        operator, scalar_first = self.ONNX_SCALAR[self.entry.name]
        scalar = graph.constant(p, f"{self.entry.name}.p")
        return graph.node(operator, [scalar, inputs[0]] if scalar_first else [inputs[0], scalar])


def _unary_op(entry):
    # "Op" as DenseOp's: a layer may have the function's name (torch's nn.Sigmoid)
    class_name = "".join(part.capitalize() for part in entry.name.split("_")) + "Op"
    cls = type(class_name, (_Unary,), {"name": entry.name, "entry": entry,
                                       "kernels": UNARY[entry.code],
                                       "__doc__": f"Elementwise {entry.name}."})
    return register(cls)


UNARY_OPS = {entry.name: _unary_op(entry) for entry in TABLE if entry.name != "identity"}
AddScalarOp, MulScalarOp, DivScalarOp = (UNARY_OPS[n] for n in ("add_scalar", "mul_scalar",
                                                                  "div_scalar"))
RSubScalarOp, RDivScalarOp, PowScalarOp = (UNARY_OPS[n] for n in ("rsub_scalar", "rdiv_scalar",
                                                                  "pow_scalar"))
LeakyReluOp, GeluOp, GeluTanhOp = (UNARY_OPS[n] for n in ("leaky_relu", "gelu", "gelu_tanh"))


# ------------------------------------------------------------------ clip

def _clipped(x, low, high):
    """min(max(x, low), high), as torch.clamp: nan stays nan, low > high gives high."""
    y = low if x < low else x
    return high if y > high else y


def _inside(x, low, high):
    """Where clip passes its gradient: low <= x <= high, both ends included (torch's rule)."""
    return low <= x <= high


_clipped_cpu, _clipped_cuda = twin(_clipped)
_inside_cpu, _inside_cuda = twin(_inside)


@njit(cache=True, error_model="numpy")
def clip_cpu(x, out, low, high):
    for i in range(out.size):
        out[i] = _clipped_cpu(x[i], low, high)


@cuda.jit(cache=True)
def clip_cuda(x, out, low, high):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = _clipped_cuda(x[i], low, high)


@njit(cache=True, error_model="numpy")
def clip_grad_cpu(x, grad_out, grad_in, low, high):
    for i in range(grad_in.size):
        grad_in[i] = grad_out[i] if _inside_cpu(x[i], low, high) else 0.0


@cuda.jit(cache=True)
def clip_grad_cuda(x, grad_out, grad_in, low, high):
    i = cuda.grid(1)
    if i < grad_in.size:
        grad_in[i] = grad_out[i] if _inside_cuda(x[i], low, high) else 0.0


CLIP = Kernel("clip", clip_cpu, clip_cuda, elements(1))
CLIP_GRAD = Kernel("clip_grad", clip_grad_cpu, clip_grad_cuda, elements(2))


@register
class Clip(Op):
    """``x`` limited to [low, high]; ``low`` or ``high`` None leaves that side open."""
    name = "clip"
    kernels = (CLIP, CLIP_GRAD)

    def check(self, x):
        for side in ("low", "high"):
            bound = self.params.get(side)
            if bound is not None and not isinstance(bound, numbers.Real):
                raise TypeError(f"clip: {side} must be a Python number or None, got "
                                f"{type(bound).__name__}")
            if bound is not None and bound != bound:
                raise ValueError(f"clip: {side} is nan; give a number or None")
        if self.params.get("low") is None and self.params.get("high") is None:
            raise ValueError("clip: give low, high or both (x.clip(0, 1), x.clip(min=0))")

    def forward(self, x):
        low, high = self.params.get("low"), self.params.get("high")
        self.x = x
        self.low = x.dtype.type(-math.inf if low is None else low)   # float32 stays float32
        self.high = x.dtype.type(math.inf if high is None else high)
        return run(CLIP, flat(x), Out(x.shape, x.dtype), self.low, self.high)

    def backward(self, grad_out, grad_dst):
        return (run(CLIP_GRAD, flat(self.x), flat(grad_out), Out(self.x.shape, self.x.dtype),
                    self.low, self.high),)

    def onnx(self, graph, inputs):   # ONNX's Clip: bounds as inputs, "" for an open side
        bounds = [graph.constant(bound, f"clip.{side}") if bound is not None else ""
                  for side, bound in (("low", self.params.get("low")),
                                      ("high", self.params.get("high")))]
        return graph.node("Clip", [inputs[0], *bounds])
