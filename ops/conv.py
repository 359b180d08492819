"""Conv2D, fused: ``act(conv(x, w) + b)`` forward in one kernel, backward in one (CPU) or two
to three (CUDA: dx, and dw with db, split-K in two) kernels, with PyTorch's layouts and
semantics.

x is (N, C, H, W), w is (O, C / groups, KH, KW), b is (O,) or absent; the output is
(N, O, OH, OW) with ``OH = (H + pad_top + pad_bottom - DH * (KH - 1) - 1) // SH + 1`` (OW
alike) and

    y[n, o, oh, ow] = act(b[o] + Σ_{c, i, j} w[o, c, i, j] · x[n, g·Cg + c, ih, iw]),
    ih = oh·SH - pad_top + i·DH,  iw = ow·SW - pad_left + j·DW,  g = o // (O / groups),

where ``Cg = C / groups`` and x reads 0 outside the input (zero padding). ``padding`` is an
int, a pair (rows, columns), "valid" (no padding) or "same" (stride 1 only, as torch: the
total ``D·(K - 1)`` per dimension, the odd one on the bottom/right).

Backward, with ``G = grad_out · act'(y)`` (the activation's derivative read from y, as
``ops.dense`` does, so leaky_relu needs ``alpha >= 0``):
- ``dx[n, c, ih, iw] = Σ_{o in c's group, i, j} G[n, o, oh, ow] · w[o, c % Cg, i, j]`` over
  the taps with ``oh = (ih + pad_top - i·DH) / SH`` (and ow alike) whole and in range;
- ``dw[o, c, i, j] = Σ_{n, oh, ow} G[n, o, oh, ow] · x[n, g·Cg + c, ih, iw]``;
- ``db[o] = Σ_{n, oh, ow} G[n, o, oh, ow]``.
Every sum runs in a fixed order (no float atomics): results are reproducible bit for bit.

CPU: im2col and one BLAS GEMM per sample and group, in ``ops.conv_cpu`` (its measurements
there).

CUDA: three implicit GEMMs of ``ops.gemm``'s template (``ops.gemm.conv_operands``), whose
tiles are gathered from the NCHW arrays as they are loaded, never materialised as im2col:
the forward ``y[o, p] = act(b[o] + Σ_k w[o, k] · X[k, p])`` over the output positions p and
taps k = (c, i, j), stores NCHW; ``dx`` on the flipped filter, the positions p those of the
input; ``dw`` as the fixed-order split-K product over the N·OH·OW positions, with db as one
more output column (B's column of ones). ``G = grad_out · act'(y)`` is the template's
prologue, applied as a tile is stashed. No float atomics: the backward is reproducible bit for
bit. The geometry (all but the batch) is a compile-time constant of the kernels; a first
layer's ``dx`` is never launched. The direct kernels they replace (one thread per output, dx
gathered per input element, dw per weight element) ran the 32->64 conv at 28.8x (forward) and
30.6x (backward) cuDNN's time on the H200.
"""
import numpy as np

from ops.conv_cpu import conv2d_backward_cpu, conv2d_forward_cpu
from ops.dispatch import Out, run
from ops.gemm.conv_operands import ConvGeometry
from ops.gemm.plans import conv_gemm_plan
from ops.gemm.tilings import CONV_FORWARD, CONV_GRAD_INPUT, CONV_GRAD_WEIGHT
from ops.launch import Kernel
from ops.layout import flat
from ops.memory import empty
from ops.pointwise import ACTIVATIONS
from ops.registry import Op, register


# ------------------------------------------------------------------ geometry


def sizes(value, rank, what, op_name, minimum):
    """``value`` (an int, or ``rank`` ints: one per spatial dimension) as a tuple of ``rank``
    ints ``>= minimum``."""
    values = (value,) * rank if isinstance(value, (int, np.integer)) else value
    if not isinstance(values, (tuple, list)) or len(values) != rank or not all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        several = "a pair of ints" if rank == 2 else f"a tuple of {rank}"
        raise ValueError(f"{op_name}: {what} must be an int or {several}, got {value!r}")
    if min(values) < minimum:
        raise ValueError(f"{op_name}: {what} must be >= {minimum}, got {value!r}")
    return tuple(int(v) for v in values)


def pair(value, what, op_name, minimum):
    """``value`` (an int or a pair of ints) as a pair of ints ``>= minimum``."""
    return sizes(value, 2, what, op_name, minimum)


def window_output_size(size, kernel, stride, dilation, pad_before, pad_after):
    """Positions of a dilated window sliding over a padded dimension (0 when it never fits)."""
    span = dilation * (kernel - 1) + 1
    padded = size + pad_before + pad_after
    return (padded - span) // stride + 1 if padded >= span else 0


def conv_output_sizes(spatial, kernel, stride, dilation, paddings, op_name):
    """The output size along each spatial dimension of a convolution (``paddings``: (before,
    after) per dimension); a ValueError naming ``op_name`` where the dilated kernel does not
    fit in the padded input. The layers' shape inference and the op's check both ask here."""
    out = tuple(window_output_size(size, k, s, d, before, after)
                for size, k, s, d, (before, after) in zip(spatial, kernel, stride, dilation,
                                                          paddings))
    if min(out) < 1:
        padded = "x".join(str(size + before + after)
                          for size, (before, after) in zip(spatial, paddings))
        span = "x".join(str(d * (k - 1) + 1) for k, d in zip(kernel, dilation))
        raise ValueError(f"{op_name}: the padded input ({padded}) is smaller than the dilated "
                         f"kernel ({span})")
    return out


def _shown(values):
    """Per-dimension values in a message: one int when all are equal, else the tuple."""
    return values[0] if len(set(values)) == 1 else tuple(values)


def check_pool_padding(kernel, padding, op_name, kernel_name="kernel_size"):
    """A ValueError naming ``op_name`` where a pooling window's ``padding`` (each side) is
    over half the window, which torch refuses too (a window of padding alone)."""
    if any(2 * p > k for p, k in zip(padding, kernel)):
        raise ValueError(f"{op_name}: padding {_shown(padding)} must be at most half of "
                         f"{kernel_name} {_shown(kernel)}")


def pool_output_sizes(spatial, kernel, stride, padding, op_name, kernel_name="kernel_size"):
    """The output size along each spatial dimension of a pooling window (``padding`` on each
    side); a ValueError naming ``op_name`` where the padding is over half the window or the
    window does not fit in the padded input. The pooling layers' shape inference and the
    pooling ops' check both ask here (``kernel_name``: the layers' "pool_size")."""
    check_pool_padding(kernel, padding, op_name, kernel_name)
    out = tuple(window_output_size(size, k, s, 1, p, p)
                for size, k, s, p in zip(spatial, kernel, stride, padding))
    if min(out) < 1:
        padded = "x".join(str(size + 2 * p) for size, p in zip(spatial, padding))
        raise ValueError(f"{op_name}: {kernel_name} {_shown(kernel)} does not fit in the "
                         f"padded input ({padded})")
    return out


def conv_padding(padding, kernel, dilation, stride, op_name):
    """``((top, bottom), (left, right))`` of ``padding``: an int, a pair, "valid" or "same"."""
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0), (0, 0)
        if padding != "same":
            raise ValueError(f"{op_name}: padding must be an int, a pair, 'valid' or 'same', "
                             f"got {padding!r}")
        if stride != (1, 1):
            raise ValueError(f"{op_name}: padding='same' needs stride 1, got stride {stride}")
        totals = [d * (k - 1) for d, k in zip(dilation, kernel)]
        return tuple((t // 2, t - t // 2) for t in totals)
    rows, columns = pair(padding, "padding", op_name, 0)
    return (rows, rows), (columns, columns)


# ------------------------------------------------------------------ CUDA kernels


def _kernel_geometry(geometry):
    """The ``ConvGeometry`` (ops.gemm.conv_operands) of the op's geometry tuple: everything
    but the batch."""
    return ConvGeometry(*geometry[1:])


def _forward_plan(args):
    x, w, bias, out, geometry, act, alpha = args
    return conv_gemm_plan(CONV_FORWARD, _kernel_geometry(geometry), geometry[0], x.dtype, act,
                          (x, w, bias, out, alpha))


def _backward_plan(args):
    x, w, y, grad_out, grad_x, grad_w, grad_b, geometry, act, alpha, needs_x, needs_w, needs_b = \
        args
    kernel_geometry, batch = _kernel_geometry(geometry), geometry[0]
    launches = []
    if needs_x:   # a first layer's image needs none: the launch is skipped
        launches += conv_gemm_plan(CONV_GRAD_INPUT, kernel_geometry, batch, x.dtype, act,
                                   (w, grad_out, y, grad_x, alpha))
    if needs_w or needs_b:
        if not needs_w:   # db alone: dw goes to scratch, not to w's placeholder
            grad_w = empty((w.size,), w.dtype, "cuda")
        launches += conv_gemm_plan(CONV_GRAD_WEIGHT, kernel_geometry._replace(BIAS=needs_b),
                                   batch, x.dtype, act, (grad_out, y, x, grad_w, grad_b, alpha))
    return launches


CONV2D_FORWARD = Kernel("conv2d_forward", conv2d_forward_cpu,
                        cuda_plan=_forward_plan)
CONV2D_BACKWARD = Kernel("conv2d_backward", conv2d_backward_cpu,
                         cuda_plan=_backward_plan)


# ------------------------------------------------------------------ the op


@register
class Conv2DOp(Op):
    """``act(conv2d(x, w) + b)``; params stride, padding, dilation, groups (torch's meaning),
    activation (a name of ``ops.pointwise.ACTIVATIONS``) and alpha (leaky_relu, >= 0).
    Inputs ``(x, w)`` or ``(x, w, b)``."""
    name = "conv2d"
    kernels = (CONV2D_FORWARD, CONV2D_BACKWARD)

    def check(self, x, w, b=None):
        params = self.params
        activation = params.get("activation")
        if activation not in ACTIVATIONS:
            raise ValueError(f"conv2d: unknown activation {activation!r}; expected one of "
                             f"{sorted(ACTIVATIONS, key=str)}")
        alpha = float(params.get("alpha", 0.01))
        if alpha < 0:
            raise ValueError(f"conv2d: leaky_relu alpha must be >= 0, got {alpha}")
        shapes = f"x {tuple(x.shape)}, w {tuple(w.shape)}" + (
            "" if b is None else f", b {tuple(b.shape)}")
        if x.ndim != 4 or w.ndim != 4:
            raise ValueError(f"conv2d: expects x (N, C, H, W) and w (O, C/groups, KH, KW), got "
                             f"{shapes}")
        groups = params.get("groups", 1)
        if not isinstance(groups, (int, np.integer)) or isinstance(groups, bool) or groups < 1:
            raise ValueError(f"conv2d: groups must be a positive int, got {groups!r}")
        nb, c_in, h, w_in = x.shape
        o_out, cg, kh, kw = w.shape
        if c_in % groups or o_out % groups or cg * groups != c_in:
            raise ValueError(f"conv2d: with groups={groups}, x's channels and w's outputs must "
                             f"divide by groups and w must have C/groups = "
                             f"{c_in / groups:g} input channels; got {shapes}")
        if b is not None and (b.ndim != 1 or b.shape[0] != o_out):
            raise ValueError(f"conv2d: bias must have shape ({o_out},); got {shapes}")
        if kh < 1 or kw < 1:
            raise ValueError(f"conv2d: empty kernel; got {shapes}")
        stride = pair(params.get("stride", 1), "stride", "conv2d", 1)
        dilation = pair(params.get("dilation", 1), "dilation", "conv2d", 1)
        paddings = conv_padding(params.get("padding", 0), (kh, kw), dilation, stride, "conv2d")
        (pt, _), (pl, _) = paddings
        try:
            oh, ow = conv_output_sizes((h, w_in), (kh, kw), stride, dilation, paddings, "conv2d")
        except ValueError as error:
            raise ValueError(f"{error}; got {shapes}") from None
        self.out_shape = (nb, o_out, oh, ow)
        self.meta = tuple(int(v) for v in (nb, c_in, h, w_in, o_out, oh, ow, kh, kw) + stride
                          + (pt, pl) + dilation + (groups, b is not None))
        self.act = ACTIVATIONS[activation]
        self.alpha = np.dtype(x.dtype).type(alpha)

    def forward(self, x, w, b=None):
        # an absent bias is never read: w fills its slot, so every call has one signature
        bias = flat(w) if b is None else b
        out = run(CONV2D_FORWARD, flat(x), flat(w), bias, Out(self.out_shape, x.dtype),
                  self.meta, self.act, self.alpha)
        self.x, self.w, self.y, self.has_bias = x, w, out, b is not None
        return out

    def onnx(self, graph, inputs):   # Conv with the weight in the layout both share
        _, _, kh, kw = graph.input_shapes[1]
        stride = pair(self.params.get("stride", 1), "stride", "conv2d", 1)
        dilation = pair(self.params.get("dilation", 1), "dilation", "conv2d", 1)
        (top, bottom), (left, right) = conv_padding(self.params.get("padding", 0), (kh, kw),
                                                    dilation, stride, "conv2d")
        out = graph.node("Conv", inputs, kernel_shape=[kh, kw], strides=list(stride),
                         dilations=list(dilation), group=int(self.params.get("groups", 1)),
                         pads=[top, left, bottom, right])
        return graph.activation(self.params.get("activation"), out, float(self.alpha))

    def backward(self, grad_out, grad_dst):
        asked = tuple(self.needs_input_grad)
        needs = (asked[0], asked[1], len(asked) > 2 and asked[2] and self.has_bias)
        destinations = tuple(grad_dst) + (None,) * (3 - len(grad_dst))
        x, w, dtype = self.x, self.w, np.dtype(self.x.dtype)
        placeholders = (flat(x), flat(w), flat(w))   # never written: see the CPU kernel
        slots = [(Out(shape, dtype) if destination is None else flat(destination)) if needed
                 else placeholder
                 for needed, destination, shape, placeholder in zip(
                     needs, destinations, (x.shape, w.shape, (w.shape[0],)), placeholders)]
        run(CONV2D_BACKWARD, flat(x), flat(w), flat(self.y), flat(grad_out), *slots,
            self.meta, self.act, self.alpha, *needs)
        grads = [None if not needed else slot.array if isinstance(slot, Out) else destination
                 for needed, slot, destination in zip(needs, slots, destinations)]
        return tuple(grads[:len(asked)])
