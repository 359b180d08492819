"""The CPU loops of Conv2D (``ops.conv``): the direct loops of ``ops.conv_direct_cpu`` where
the measured rule below picks them (stride 1, one group, >= 32 taps: each gradient 0.85-0.96x
im2col's time on the CNN's 32->64 layer), else im2col and one BLAS GEMM per sample and group.
Both paths share G, the bias sums, the fixed batch slices of the backward and the activation
loops. The im2col path:

CPU: per sample and group, im2col into a (Cg·KH·KW, OH·OW) buffer and one BLAS GEMM
(``np.dot`` inside ``@njit``) straight into the output, then one pass adds the bias and
activates in place. The backward computes G once per sample, then ``dx`` as
``col2im(w_gᵀ @ G_g)`` and ``dw`` as ``Σ_n G_g @ colsᵀ``. The forward runs in blocks of
samples on the engine's threads (``ops.cpu_threads.run_over``); the backward splits the
batch into ``BACKWARD_TASKS`` fixed slices, each summing its own partial dw and db, runs
blocks of slices, and adds the partials in slice order: the same sums on any thread count.
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
- two threads on two idle cores (Numba's ``prange`` then, the same blocks): forward 8.7 ->
  4.4 ms, backward 18.1 -> 9.0 (1->32: 1.34 -> 0.73 and 3.34 -> 1.77). The engine's own
  threads instead of ``prange``: the same step time (the CNN's replayed step on the 2-core
  Xeon, 2 threads: 45.0 and 44.1 ms against 49.7 and 41.7, alternating) and half the
  compile time: the CNN's first step from an empty cache compiled the two conv kernels in
  32.1-33.3 s, now 13.2-16.1 (each further activation 19 -> 7.4-7.7 s, float64 33 -> 18).
"""
import numpy as np
from numba import njit

from ops.conv_direct_cpu import (TILE_COLUMNS, aligned_empty, blocked_weights, copy_rows,
                                 flipped_weights, forward_sums, grad_input_sums, grad_weight_sample,
                                 gradient_extents, input_extents, padded_size, position_offsets,
                                 round_up, sums_size, sums_stride, tap_offsets,
                                 weight_partial_size)
from ops.cpu_threads import run_over, slice_blocks
from ops.im2col_cpu import col2im_add, im2col
from ops.launch import CPU_KERNEL
from ops.constant_code import kernels_of_code
from ops.pointwise import ACTIVATIONS, IDENTITY, derivative_cpu, value_cpu

BACKWARD_TASKS = 8   # batch slices of the CPU backward: a few per thread, few partial sums


# meta: (N, C, H, W, O, OH, OW, KH, KW, SH, SW, PT, PL, DH, DW, GROUPS, HAS_BIAS), a tuple of
# ints that both kernels take: the CPU kernels read it, the CUDA plans make all but N
# compile-time constants of their GEMMs (nothing travels to the device). PT/PL are the
# top/left padding (the bottom/right one only shapes OH/OW).
@njit(inline="always")
def _geometry_cpu(meta):
    return (meta[0], meta[1], meta[2], meta[3], meta[4], meta[5], meta[6], meta[7], meta[8],
            meta[9], meta[10], meta[11], meta[12], meta[13], meta[14], meta[15])


HAS_BIAS_AT = 16


@njit(inline="always")
def _activate(destination, source, shift, code, alpha):
    """destination = act(source + shift), ``code`` a constant of the calling kernel: the loop
    vectorises (relu over 3.2M float32: 2.5 ms with a runtime code, 0.43 ms)."""
    for p in range(destination.size):
        destination[p] = value_cpu(code, source[p] + shift, alpha)


@njit(inline="always")
def _gradient(destination, grad_out, y, code, alpha):
    """destination = grad_out · act'(y), ``code`` a constant (see ``_activate``)."""
    for p in range(destination.size):
        destination[p] = grad_out[p] * derivative_cpu(code, y[p], y[p], alpha)


# The measured rule (``bench.conv_ops --cpu-path both``; the serial table in
# ops/conv_direct_cpu.py): the direct loops where the shape has them (stride 1, one group; the
# input gradient also needs padding <= (K-1)·D, as its G is padded before) and enough taps
# per output to fill their tiles: the 1->32 layer's 9 taps ran 1.4x im2col's time forward,
# 1.5x in dw; from 32->64 on 14x14 up (288 taps) every gradient ran 0.79-0.98x.
DIRECT_MIN_TAPS = 32


@njit(inline="always")
def direct_forward_pays(geometry):
    nb, c_in, h, w_in, o_out, oh_n, ow_n, kh, kw, sh, sw, pt, pl, dh, dw, groups = geometry
    return sh == 1 and sw == 1 and groups == 1 and c_in * kh * kw >= DIRECT_MIN_TAPS


@njit(inline="always")
def direct_grad_weight_pays(geometry):
    return direct_forward_pays(geometry)


@njit(inline="always")
def direct_backward_fits(geometry):
    """The direct input gradient's shapes: the forward's, padding at most (K-1)·D."""
    nb, c_in, h, w_in, o_out, oh_n, ow_n, kh, kw, sh, sw, pt, pl, dh, dw, groups = geometry
    return (sh == 1 and sw == 1 and groups == 1 and pt <= (kh - 1) * dh
            and pl <= (kw - 1) * dw)


@njit(inline="always")
def direct_grad_input_pays(geometry):
    return direct_forward_pays(geometry) and direct_backward_fits(geometry)


# a kernel's path: the rule's per shape, or one forced (the benchmarks and tests build those);
# an int, as the closure's constant: Numba's cache keys a closure by its variables' pickle,
# which for a compiled function differs in every process (a recompile each time)
RULE, DIRECT, IM2COL = 0, 1, 2


def _forward_kernel(path, act, name):
    """The forward of samples ``first`` to ``last`` (a block of the batch) with the fused
    activation ``act`` (a constant of the kernel; its argument ``code`` is the op's, unread),
    its path per shape chosen by ``path`` (``RULE``: ``direct_forward_pays``, or ``DIRECT``
    or ``IM2COL`` forced)."""
    def conv2d_forward(x, w, bias, out, meta, code, alpha, first, last):
        geometry = _geometry_cpu(meta)
        nb, c_in, h, w_in, o_out, oh_n, ow_n, kh, kw, sh, sw, pt, pl, dh, dw, groups = geometry
        has_bias = meta[HAS_BIAS_AT]
        positions = oh_n * ow_n
        cg, og = c_in // groups, o_out // groups
        k = cg * kh * kw
        if direct_forward_pays(geometry) if path == RULE else path == DIRECT:
            rows, columns = input_extents(geometry)
            offsets = tap_offsets(c_in, kh, kw, dh, dw, rows, columns)
            weights = blocked_weights(w, o_out, k)
            stride = sums_stride(oh_n, columns)
            padded = aligned_empty(padded_size(c_in, rows, columns), x.dtype)
            sums = aligned_empty(sums_size(o_out, oh_n, columns), x.dtype)
            for n in range(first, last):
                forward_sums(x, n, geometry, weights, offsets, padded, sums)
                copy_rows(sums, stride, columns, out, n * o_out * positions, o_out, oh_n, ow_n)
                for o in range(o_out):
                    at = (n * o_out + o) * positions
                    plane = out[at:at + positions]
                    _activate(plane, plane, bias[o] if has_bias else alpha - alpha, act, alpha)
        else:
            cols = np.empty((k, positions), x.dtype)
            for n in range(first, last):
                for g in range(groups):
                    im2col(x, n, g, geometry, cols)
                    at = (n * o_out + g * og) * positions
                    product = out[at:at + og * positions].reshape((og, positions))
                    np.dot(w[g * og * k:(g + 1) * og * k].reshape((og, k)), cols, product)
                    for o_local in range(og):
                        o = g * og + o_local
                        _activate(product[o_local], product[o_local],
                                  bias[o] if has_bias else alpha - alpha, act, alpha)

    conv2d_forward.__name__ = conv2d_forward.__qualname__ = name
    return njit(**CPU_KERNEL, nogil=True)(conv2d_forward)


# A row's sum in vector lanes ("reassoc": the order fixed by this compiled loop, the same bits
# every run and on any thread count, a row being one thread's). One running sum waited on each
# add: the 1->32 layer's G and db over 128x32x28x28 took 3.56 ms on one thread of the 2-core
# Xeon, its backward 4.2 ms of which the dw GEMMs 0.5.
@njit(**CPU_KERNEL, fastmath={"reassoc"})
def _row_total(row):
    total = row.dtype.type(0)
    for p in range(row.size):
        total += row[p]
    return total


@njit(inline="always")
def _sample_gradient(grad_out, y, n, o_out, positions, gradient, b_partial, needs_b, act,
                     alpha):
    """Sample n's G = grad_out · act'(y) into ``gradient`` (O, OH·OW); its row sums added
    to ``b_partial`` when asked."""
    at = n * o_out * positions
    for o in range(o_out):
        row = gradient[o]
        _gradient(row, grad_out[at + o * positions:at + (o + 1) * positions],
                  y[at + o * positions:at + (o + 1) * positions], act, alpha)
        if needs_b:
            b_partial[o] += _row_total(row)


@njit(inline="always")
def _direct_gradients(geometry, path, needs_x, needs_w):
    """Whether dw and dx take the direct loops: by the rule (``RULE``), or forced."""
    direct_w = needs_w and (direct_grad_weight_pays(geometry) if path == RULE
                            else path == DIRECT and direct_forward_pays(geometry))
    direct_x = needs_x and (direct_grad_input_pays(geometry) if path == RULE
                            else path == DIRECT and direct_backward_fits(geometry))
    return direct_w, direct_x


@njit(**CPU_KERNEL)
def backward_partials(x, w, meta, path, needs_x, needs_w, needs_b):
    """The zeroed partial dw and db of each of the backward's tasks (a fixed split of the
    batch, added in task order by ``summed_partials``: the same sums on any thread count);
    the direct partials are (K rounded up, O rounded up), the GEMM's (O, K)."""
    geometry = _geometry_cpu(meta)
    nb, c_in, o_out, kh, kw, groups = (geometry[0], geometry[1], geometry[4], geometry[7],
                                       geometry[8], geometry[15])
    k = c_in // groups * kh * kw
    direct_w, _ = _direct_gradients(geometry, path, needs_x, needs_w)
    tasks = min(nb, BACKWARD_TASKS)
    w_size = (weight_partial_size(k, o_out) if direct_w else w.size) if needs_w else 0
    w_partials = aligned_empty(tasks * w_size, x.dtype)
    w_partials[:] = 0
    return (w_partials.reshape((tasks, w_size)),
            np.zeros((tasks, o_out if needs_b else 0), x.dtype))


@njit(**CPU_KERNEL)
def summed_partials(w_partials, b_partials, grad_w, grad_b, meta, path, needs_x, needs_w):
    """dw and db: the tasks' partials added in task order."""
    geometry = _geometry_cpu(meta)
    c_in, o_out, kh, kw, groups = geometry[1], geometry[4], geometry[7], geometry[8], geometry[15]
    k = c_in // groups * kh * kw
    direct_w, _ = _direct_gradients(geometry, path, needs_x, needs_w)
    tasks = w_partials.shape[0]
    o_columns = round_up(o_out, TILE_COLUMNS)
    zero = w_partials.dtype.type(0)
    for index in range(grad_w.size if needs_w else 0):
        at = (index % k) * o_columns + index // k if direct_w else index
        total = zero
        for task in range(tasks):
            total += w_partials[task, at]
        grad_w[index] = total
    for o in range(b_partials.shape[1]):
        total = zero
        for task in range(tasks):
            total += b_partials[task, o]
        grad_b[o] = total


def _backward_kernel(path, act, name):
    """The backward tasks ``first_task`` to ``last_task`` (``backward_partials``' fixed
    slices of the batch), the path of each gradient per shape chosen by ``path`` (see
    ``_forward_kernel``): dx where asked, each task's partial dw and db into its row of
    ``w_partials`` and ``b_partials``."""
    def conv2d_backward(x, w, y, grad_out, grad_x, w_partials, b_partials, meta, code, alpha,
                        needs_x, needs_w, needs_b, first_task, last_task):
        geometry = _geometry_cpu(meta)
        nb, c_in, h, w_in, o_out, oh_n, ow_n, kh, kw, sh, sw, pt, pl, dh, dw, groups = geometry
        positions = oh_n * ow_n
        cg, og = c_in // groups, o_out // groups
        k = cg * kh * kw
        tasks = w_partials.shape[0]
        direct_w, direct_x = _direct_gradients(geometry, path, needs_x, needs_w)
        rows, columns = input_extents(geometry)
        offsets = tap_offsets(c_in, kh, kw, dh, dw, rows, columns)
        positions_at = position_offsets(geometry, columns)
        g_rows, g_columns = gradient_extents(geometry)
        g_offsets = tap_offsets(o_out, kh, kw, dh, dw, g_rows, g_columns)
        flipped = flipped_weights(w, o_out, c_in, kh, kw) if direct_x else w[:0]
        stride = sums_stride(h, g_columns)
        im2col_k = k if (needs_w and not direct_w) or (needs_x and not direct_x) else 0
        gradient = np.empty((o_out, positions), x.dtype)   # G: BLAS needs it in memory
        cols = np.empty((im2col_k, positions), x.dtype)
        product = np.empty((og, k if needs_w and not direct_w else 0), x.dtype)
        padded = aligned_empty(padded_size(c_in, rows, columns) if direct_w else 0, x.dtype)
        blocked_g = aligned_empty(positions * round_up(o_out, TILE_COLUMNS) if direct_w
                                  else 0, x.dtype)
        blocked_g[:] = 0   # its columns past O stay 0
        g_padded = aligned_empty(padded_size(o_out, g_rows, g_columns) if direct_x else 0,
                                 x.dtype)
        sums = aligned_empty(sums_size(c_in, h, g_columns) if direct_x else 0, x.dtype)
        for task in range(first_task, last_task):
            for n in range(task * nb // tasks, (task + 1) * nb // tasks):
                _sample_gradient(grad_out, y, n, o_out, positions, gradient, b_partials[task],
                                 needs_b, act, alpha)
                if direct_w:
                    grad_weight_sample(x, n, geometry, gradient, offsets, positions_at, padded,
                                       blocked_g, w_partials[task])
                elif needs_w:
                    for g in range(groups):
                        im2col(x, n, g, geometry, cols)
                        np.dot(gradient[g * og:(g + 1) * og], cols.T, product)
                        partial = w_partials[task, g * og * k:(g + 1) * og * k]
                        flat_product = product.reshape(og * k)
                        for index in range(og * k):
                            partial[index] += flat_product[index]
                if direct_x:
                    grad_input_sums(gradient, geometry, flipped, g_offsets, g_padded, sums)
                    copy_rows(sums, stride, g_columns, grad_x, n * c_in * h * w_in, c_in, h,
                              w_in)
                elif needs_x:
                    grad_x[n * c_in * h * w_in:(n + 1) * c_in * h * w_in] = 0
                    for g in range(groups):
                        np.dot(w[g * og * k:(g + 1) * og * k].reshape((og, k)).T,
                               gradient[g * og:(g + 1) * og], cols)
                        col2im_add(grad_x, n, g, geometry, cols)

    conv2d_backward.__name__ = conv2d_backward.__qualname__ = name
    return njit(**CPU_KERNEL, nogil=True)(conv2d_backward)


PATH_NAMES = {RULE: "", DIRECT: "_direct", IM2COL: "_im2col"}


@kernels_of_code("act")
def conv2d_cpu_kernels(act, path=RULE):
    """The CPU forward and backward of a Conv2D whose fused activation is ``act``, the code a
    constant of the kernels (ops.constant_code.kernels_of_code), on ``path``. Each also takes
    the code as its argument ``code``, the op's runs being the CPU kernel's and the CUDA
    plan's alike; only a fused code has kernels (act' is read from y)."""
    if act not in ACTIVATIONS.values():
        raise ValueError(f"conv2d: activation code {act} has no fused CPU loop (the fused "
                         f"ones: ops.pointwise.ACTIVATIONS {ACTIVATIONS}); run the activation "
                         "after the conv")
    suffix = PATH_NAMES[path]
    return (_forward_kernel(path, act, "conv2d_forward_cpu" + suffix),
            _backward_kernel(path, act, "conv2d_backward_cpu" + suffix))


def _macs(meta):
    """A convolution's multiply-adds (one gradient's as many)."""
    nb, c_in, _, _, o_out, oh_n, ow_n, kh, kw = meta[:9]
    return nb * o_out * oh_n * ow_n * (c_in // meta[15]) * kh * kw


def conv2d_cpu_functions(path=RULE):
    """``(forward, backward)``: the CPU functions the op runs, each picking the kernels of its
    activation code on ``path`` (the benchmarks and tests force ``DIRECT`` or ``IM2COL``) and
    running them in blocks on the engine's threads (Numba's ``prange`` did that before, and
    doubled the kernels' compile time: see the module's notes)."""
    def conv2d_forward(x, w, bias, out, meta, act, alpha):
        meta = np.asarray(meta, np.int64)
        samples = int(meta[0])
        run_over(conv2d_cpu_kernels(act, path)[0], samples, slice_blocks(samples, _macs(meta)),
                 x, w, bias, out, meta, act, alpha)

    def conv2d_backward(x, w, y, grad_out, grad_x, grad_w, grad_b, meta, act, alpha, needs_x,
                        needs_w, needs_b):
        meta = np.asarray(meta, np.int64)
        w_partials, b_partials = backward_partials(x, w, meta, path, needs_x, needs_w, needs_b)
        tasks = w_partials.shape[0]   # a task's partials: the same bits in any block
        run_over(conv2d_cpu_kernels(act, path)[1], tasks,
                 slice_blocks(tasks, _macs(meta) * (int(needs_x) + int(needs_w))), x, w, y,
                 grad_out, grad_x, w_partials, b_partials, meta, act, alpha, needs_x, needs_w,
                 needs_b)
        summed_partials(w_partials, b_partials, grad_w, grad_b, meta, path, needs_x, needs_w)
    conv2d_forward.__name__ = "conv2d_forward_cpu" + PATH_NAMES[path]
    conv2d_backward.__name__ = "conv2d_backward_cpu" + PATH_NAMES[path]
    return conv2d_forward, conv2d_backward


conv2d_forward_cpu, conv2d_backward_cpu = conv2d_cpu_functions()
# the compiled side, for whoever inspects it: the linear layer's kernels
conv2d_forward_cpu.__wrapped__, conv2d_backward_cpu.__wrapped__ = conv2d_cpu_kernels(IDENTITY)
