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

CPU: per sample and group, im2col into a (Cg·KH·KW, OH·OW) buffer and one BLAS GEMM
(``np.dot`` inside ``@njit``) straight into the output, then one pass adds the bias and
activates in place. The backward computes G once per sample, then ``dx`` as
``col2im(w_gᵀ @ G_g)`` and ``dw`` as ``Σ_n G_g @ colsᵀ``. Samples run in parallel
(``prange``); the backward splits the batch into ``BACKWARD_TASKS`` fixed slices, each
summing its own partial dw and db, added in slice order: the same sums on any thread count.
Measured on the 2-core CPU, the kernels alone, float32, batch 128, best of 25 rounds (thread
CPU time for the serial figures), 32->64 3x3 "same" on 14x14 unless said:
- forward 8.7 ms serial: the GEMM 6.7 ms (137 GFLOP/s, OpenBLAS), im2col 1.5, bias and
  relu 0.2; torch on one thread (oneDNN) 3.5 ms, backward 18.1 ms against torch's 7.2;
- several samples per GEMM do not pay: 1568 and 6272 columns ran at 128 and 112 GFLOP/s;
  nor in the backward (2-core AMD machine, 2 threads): a slice's G and columns side by
  side, 2, 4 or 16 samples per dw and dx GEMM, took 15.5-17.1 ms against 14.3-16.5
  per sample (32->64), 3.0-3.8 against 2.4-3.1 (1->32), the columns out of L2;
- direct loops lose even with one input channel: 6.0 ms against 0.93 (1->32 on 28x28);
- im2col copies a row as one shifted run when stride is 1 and OW = W ("same"): 6.4 -> 1.5
  ms; the bias/activation and act' loops are compiled per activation code (relu over 3.2M
  float32: 2.5 ms with the code a runtime value, 0.43 ms);
- ``prange`` on two idle cores: forward 8.7 -> 4.4 ms, backward 18.1 -> 9.0 (1->32: 1.34
  -> 0.73 and 3.34 -> 1.77); 1-5 us more at tiny shapes. Beside other busy processes the
  two threads wait on each other (1->32 forward + backward, mean: 5.3 ms serial, 18.6 ms
  on two threads); ``numba.set_num_threads(1)`` gives back the serial time (5.4 ms).

CUDA: three implicit GEMMs of ``ops.gemm``'s template (``conv_gemm_shape`` of ``ops.gemm.conv_operands``), whose
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
from numba import njit, prange

from ops.cpu_threads import engine_threads
from ops.dispatch import Out, run
from ops.launch import CPU_KERNEL, Kernel
from ops.layout import flat
from ops.gemm.conv_operands import ConvGeometry
from ops.gemm.plans import conv_gemm_plan
from ops.gemm.tilings import CONV_FORWARD, CONV_GRAD_INPUT, CONV_GRAD_WEIGHT
from ops.memory import empty
from ops.pointwise import (ACTIVATIONS, IDENTITY, LEAKY_RELU, RELU, SIGMOID, TANH,
                           derivative_cpu, value_cpu)
from ops.registry import Op, register

BACKWARD_TASKS = 8   # batch slices of the CPU backward: a few per thread, few partial sums

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


# meta: (N, C, H, W, O, OH, OW, KH, KW, SH, SW, PT, PL, DH, DW, GROUPS, HAS_BIAS), a tuple of
# ints that both kernels take: the CPU kernels read it, the CUDA plans make all but N
# compile-time constants of their GEMMs (nothing travels to the device). PT/PL are the
# top/left padding (the bottom/right one only shapes OH/OW).
@njit(inline="always")
def _geometry_cpu(meta):
    return (meta[0], meta[1], meta[2], meta[3], meta[4], meta[5], meta[6], meta[7], meta[8],
            meta[9], meta[10], meta[11], meta[12], meta[13], meta[14], meta[15])


HAS_BIAS_AT = 16


# ------------------------------------------------------------------ CPU kernels


@njit(inline="always")
def valid_range(count, stride, offset, size):
    """``[lo, hi)``: the positions p in [0, count) whose ``p·stride + offset`` lies in
    [0, size)."""
    lo = 0 if offset >= 0 else (-offset + stride - 1) // stride
    hi = 0 if size - offset <= 0 else (size - offset + stride - 1) // stride
    hi = min(hi, count)
    return lo, max(lo, hi)


@njit(inline="always")
def _is_shift(geometry):
    """True when every im2col row is the input plane shifted by one offset (stride 1 and the
    output as wide as the input: 'same' padding), so rows copy in one contiguous run."""
    return geometry[9] == 1 and geometry[10] == 1 and geometry[6] == geometry[3]


@njit(inline="always")
def _zero_padding_columns(row, at, ow_lo, ow_hi, ow_n, zero):
    """The columns of output row ``at`` (of ``row``) whose tap reads the left or right
    padding."""
    for ow in range(ow_lo):
        row[at + ow] = zero
    for ow in range(ow_hi, ow_n):
        row[at + ow] = zero


def _patch_loop(adjoint):
    """The im2col loop (``adjoint=False``) or its adjoint (``True``), written once; the
    direction is a constant of the closure, so each compiled kernel holds only its own
    branches (Numba prunes ``if`` on a frozen closure value).

    im2col, ``_im2col(x, n, g, geometry, cols)``: ``cols[(c·KH + i)·KW + j, oh·OW + ow] =
    x[n, g·Cg + c, ih, iw]``, 0 in the padding.
    Its adjoint, ``_col2im_add(grad_x, n, g, geometry, cols)``: ``grad_x[n, g·Cg + c, ih,
    iw] += cols[...]`` over the taps inside the input, in a fixed order (c, i, j, oh, ow).
    It zeroes the padding taps of ``cols`` (scratch) on the shift path, which then adds
    whole rows."""
    def patch_loop(image, n, g, geometry, cols):
        nb, c_in, h, w_in, o_out, oh_n, ow_n, kh, kw, sh, sw, pt, pl, dh, dw, groups = geometry
        cg = c_in // groups
        positions = oh_n * ow_n
        zero = cols.dtype.type(0)
        shifted = _is_shift(geometry)
        for c in range(cg):
            first = (n * c_in + g * cg + c) * h * w_in
            plane = image[first:first + h * w_in]
            for i in range(kh):
                oh_lo, oh_hi = valid_range(oh_n, sh, i * dh - pt, h)
                for j in range(kw):
                    row = cols[(c * kh + i) * kw + j, :positions]
                    ow_lo, ow_hi = valid_range(ow_n, sw, j * dw - pl, w_in)
                    if not adjoint:   # the output rows whose taps all read the padding
                        row[:oh_lo * ow_n] = zero
                        row[oh_hi * ow_n:] = zero
                    if shifted:
                        if adjoint:   # before the whole run is added
                            for oh in range(oh_lo, oh_hi):
                                _zero_padding_columns(row, oh * ow_n, ow_lo, ow_hi, ow_n, zero)
                        shift = (i * dh - pt) * w_in + j * dw - pl
                        lo = max(oh_lo * ow_n, -shift)
                        hi = min(oh_hi * ow_n, plane.size - shift)
                        run, window = row[lo:hi], plane[lo + shift:hi + shift]
                        for p in range(run.size):
                            if adjoint:
                                window[p] += run[p]
                            else:
                                run[p] = window[p]
                        if not adjoint:   # after the run copied over them
                            for oh in range(oh_lo, oh_hi):
                                _zero_padding_columns(row, oh * ow_n, ow_lo, ow_hi, ow_n, zero)
                        continue
                    for oh in range(oh_lo, oh_hi):
                        start = (oh * sh - pt + i * dh) * w_in - pl + j * dw
                        if not adjoint:
                            _zero_padding_columns(row, oh * ow_n, ow_lo, ow_hi, ow_n, zero)
                        for ow in range(ow_lo, ow_hi):
                            if adjoint:
                                plane[start + ow * sw] += row[oh * ow_n + ow]
                            else:
                                row[oh * ow_n + ow] = plane[start + ow * sw]

    patch_loop.__name__ = patch_loop.__qualname__ = "_col2im_add" if adjoint else "_im2col"
    return njit(**CPU_KERNEL)(patch_loop)


_im2col = _patch_loop(adjoint=False)
_col2im_add = _patch_loop(adjoint=True)


@njit(inline="always")
def _activate_run(destination, source, shift, code, alpha):
    for p in range(destination.size):
        destination[p] = value_cpu(code, source[p] + shift, alpha)


@njit(inline="always")
def _activate(destination, source, shift, act, alpha):
    """destination = act(source + shift), one loop per activation with its code a constant:
    the loop vectorises (relu over 3.2M float32: 2.5 ms with a runtime code, 0.43 ms)."""
    if act == RELU:
        _activate_run(destination, source, shift, RELU, alpha)
    elif act == LEAKY_RELU:
        _activate_run(destination, source, shift, LEAKY_RELU, alpha)
    elif act == SIGMOID:
        _activate_run(destination, source, shift, SIGMOID, alpha)
    elif act == TANH:
        _activate_run(destination, source, shift, TANH, alpha)
    elif act == IDENTITY:
        _activate_run(destination, source, shift, IDENTITY, alpha)


@njit(inline="always")
def _gradient_run(destination, grad_out, y, code, alpha):
    for p in range(destination.size):
        destination[p] = grad_out[p] * derivative_cpu(code, y[p], y[p], alpha)


@njit(inline="always")
def _gradient(destination, grad_out, y, act, alpha):
    """destination = grad_out · act'(y), one loop per activation (see ``_activate``)."""
    if act == RELU:
        _gradient_run(destination, grad_out, y, RELU, alpha)
    elif act == LEAKY_RELU:
        _gradient_run(destination, grad_out, y, LEAKY_RELU, alpha)
    elif act == SIGMOID:
        _gradient_run(destination, grad_out, y, SIGMOID, alpha)
    elif act == TANH:
        _gradient_run(destination, grad_out, y, TANH, alpha)
    elif act == IDENTITY:
        _gradient_run(destination, grad_out, y, IDENTITY, alpha)


# the codes ``_activate`` and ``_gradient`` have a loop for; each CPU kernel refuses any
# other before its parallel loop (a raise inside a prange loop serialises it)
CPU_FUSED = (IDENTITY, RELU, LEAKY_RELU, SIGMOID, TANH)
if set(CPU_FUSED) != set(ACTIVATIONS.values()):
    raise ImportError("ops/conv.py: the CPU conv's activation loops (_activate, _gradient, "
                      f"CPU_FUSED {CPU_FUSED}) do not cover ops.pointwise.ACTIVATIONS "
                      f"{ACTIVATIONS}: add a branch for each fused code")


@njit(inline="always")
def _check_fused(act):
    if act not in CPU_FUSED:
        raise ValueError("conv2d: this activation code has no fused CPU loop "
                         "(ops/conv.py CPU_FUSED); run the activation after the conv")


@njit(**CPU_KERNEL, parallel=True)
def conv2d_forward_cpu(x, w, bias, out, meta, act, alpha):
    _check_fused(act)
    geometry = _geometry_cpu(meta)
    nb, c_in, h, w_in, o_out, oh_n, ow_n, kh, kw, sh, sw, pt, pl, dh, dw, groups = geometry
    has_bias = meta[HAS_BIAS_AT]
    positions = oh_n * ow_n
    cg, og = c_in // groups, o_out // groups
    k = cg * kh * kw
    for n in prange(nb):
        cols = np.empty((k, positions), x.dtype)
        for g in range(groups):
            _im2col(x, n, g, geometry, cols)
            at = (n * o_out + g * og) * positions
            product = out[at:at + og * positions].reshape((og, positions))
            np.dot(w[g * og * k:(g + 1) * og * k].reshape((og, k)), cols, product)
            for o_local in range(og):
                o = g * og + o_local
                _activate(product[o_local], product[o_local],
                          bias[o] if has_bias else alpha - alpha, act, alpha)


@njit(**CPU_KERNEL, parallel=True)
def conv2d_backward_cpu(x, w, y, grad_out, grad_x, grad_w, grad_b, meta, act, alpha,
                        needs_x, needs_w, needs_b):
    """The gradients the flags ask for; the buffer of one not asked for is a placeholder
    that is never written."""
    _check_fused(act)
    geometry = _geometry_cpu(meta)
    nb, c_in, h, w_in, o_out, oh_n, ow_n, kh, kw, sh, sw, pt, pl, dh, dw, groups = geometry
    positions = oh_n * ow_n
    cg, og = c_in // groups, o_out // groups
    k = cg * kh * kw
    tasks = min(nb, BACKWARD_TASKS)
    # one partial dw and db per task (a fixed split of the batch), added in task order
    # below: the same sums on any number of threads
    w_partials = np.zeros((tasks, w.size if needs_w else 0), x.dtype)
    b_partials = np.zeros((tasks, o_out if needs_b else 0), x.dtype)
    for task in prange(tasks):
        gradient = np.empty((o_out, positions), x.dtype)   # G: BLAS needs it in memory
        cols = np.empty((k, positions), x.dtype)
        product = np.empty((og, k), x.dtype)
        for n in range(task * nb // tasks, (task + 1) * nb // tasks):
            at = n * o_out * positions
            for o in range(o_out):
                row = gradient[o]
                _gradient(row, grad_out[at + o * positions:at + (o + 1) * positions],
                          y[at + o * positions:at + (o + 1) * positions], act, alpha)
                if needs_b:
                    total = b_partials[task, o]
                    for p in range(positions):
                        total += row[p]
                    b_partials[task, o] = total
            if needs_x:
                grad_x[n * c_in * h * w_in:(n + 1) * c_in * h * w_in] = 0
            for g in range(groups):
                g_group = gradient[g * og:(g + 1) * og]
                if needs_w:
                    _im2col(x, n, g, geometry, cols)
                    np.dot(g_group, cols.T, product)
                    partial = w_partials[task, g * og * k:(g + 1) * og * k]
                    flat_product = product.reshape(og * k)
                    for index in range(og * k):
                        partial[index] += flat_product[index]
                if needs_x:
                    np.dot(w[g * og * k:(g + 1) * og * k].reshape((og, k)).T, g_group, cols)
                    _col2im_add(grad_x, n, g, geometry, cols)
    for index in range(w_partials.shape[1]):
        total = alpha - alpha
        for task in range(tasks):
            total += w_partials[task, index]
        grad_w[index] = total
    for o in range(b_partials.shape[1]):
        total = alpha - alpha
        for task in range(tasks):
            total += b_partials[task, o]
        grad_b[o] = total


# ------------------------------------------------------------------ CUDA kernels


def _kernel_geometry(geometry):
    """The ``ops.gemm.conv_operands.ConvGeometry`` of the op's geometry tuple: everything but the batch."""
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


CONV2D_FORWARD = Kernel("conv2d_forward", engine_threads(conv2d_forward_cpu),
                        cuda_plan=_forward_plan)
CONV2D_BACKWARD = Kernel("conv2d_backward", engine_threads(conv2d_backward_cpu),
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
