"""BatchNorm over the channels of (N, C) or (N, C, H, W) inputs, as torch's BatchNorm1d/2d.

x is seen as (N, C, S) with S the product of the dims after C (1 for 2-D inputs); channel c
has the ``n = N·S`` values ``x[:, c, :]``. With ``w`` and ``b`` the optional weight and bias
(1 and 0 when absent):

- training: ``mean_c = Σ x / n``, ``var_c = Σ (x - mean_c)² / n`` (biased, two passes, in
  float64), then in place ``running_mean = (1 - momentum)·running_mean + momentum·mean_c``
  and ``running_var = (1 - momentum)·running_var + momentum·var_c·n / (n - 1)`` (unbiased);
- eval: ``mean_c, var_c = running_mean[c], running_var[c]``, nothing updated;
- ``y = (x - mean_c) · invstd_c · w[c] + b[c]`` with ``invstd_c = 1 / sqrt(var_c + eps)``.

Backward from ``dy = grad_out``, with ``x̂ = (x - mean_c)·invstd_c`` and sums over channel c:
``db = Σ dy``, ``dw = Σ dy·x̂``, and ``dx = w·invstd·(dy - Σ dy / n - x̂·Σ dy·x̂ / n)`` in
training (the statistics depend on x), ``dx = dy·w·invstd`` in eval. The running statistics
are buffers: they get no gradient.

On the CPU one kernel forward (statistics, running-statistics update and normalisation) and
one backward (both sums and dx), each a parallel loop over channels; on CUDA two launches each
way over blocks of a channel's batch chunk (see "CUDA kernels": fixed-order sums,
reproducible bit for bit). The update happens on the device, from device scalars only:
capture-ready. Measured on the 2-core CPU (128x64x14x14 float32): the two-pass statistics
take 1.58 ms against 1.24 for one pass of sums and sums of squares, kept for the
cancellation the latter suffers at large means (the CUDA kernels' one pass is shifted by a
value of the channel instead); ``prange`` over channels takes the forward from 1.9 to 1.0 ms
and the backward from 1.8 to 0.94 (torch: 2.0 and 1.0 on one thread). A (N, C) input walks
its rows, channels inner, instead of one strided channel at a time: 128x128 forward 83 -> 15
us, backward 88 -> 17 us (torch on one thread: 14 and 27 us).
"""
import functools
import math

import numpy as np
from numba import njit, prange

from ops.block_reduce import REDUCE_THREADS, SUM, block_reduce_cuda
from ops.cpu_threads import engine_threads
from ops.cuda_backend import SIMULATOR, cuda
from ops.dispatch import Out, run
from ops.elementwise import BINARY, MUL, SUB, binary
from ops.launch import CPU_KERNEL, Kernel, elements
from ops.layout import flat
from ops.memory import empty
from ops.reduce import REDUCE, reduce
from ops.registry import Op, register

# meta: a tuple of ints (N, C, S, training, has_weight, has_bias); the backward's adds
# (needs_x, needs_w, needs_b): the buffer of a gradient not asked for is a placeholder never
# written (a CUDA
# kernel cannot take an empty array on the fast launch path: its data pointer is NULL)


# ------------------------------------------------------------------ CPU kernels


@njit(**CPU_KERNEL)
def _batch_norm_rows(x, running_mean, running_var, weight, bias, y, saved_mean, saved_invstd,
                     meta, momentum, eps):
    """The (N, C) forward: rows outer and channels inner (contiguous), each channel's sums
    still in row order."""
    nb, channels, training, has_weight, has_bias = meta[0], meta[1], meta[3], meta[4], meta[5]
    mean, var = np.zeros(channels), np.zeros(channels)
    if training:
        for n in range(nb):
            row = x[n * channels:(n + 1) * channels]
            for c in range(channels):
                mean[c] += row[c]
        for c in range(channels):
            mean[c] /= nb
        for n in range(nb):
            row = x[n * channels:(n + 1) * channels]
            for c in range(channels):
                var[c] += (row[c] - mean[c]) ** 2
        for c in range(channels):
            var[c] /= nb
            running_mean[c] = (1 - momentum) * running_mean[c] + momentum * mean[c]
            running_var[c] = (1 - momentum) * running_var[c] + momentum * var[c] * nb / (nb - 1)
    else:
        for c in range(channels):
            mean[c], var[c] = running_mean[c], running_var[c]
    typed_mean, scale, shift = (np.empty(channels, y.dtype), np.empty(channels, y.dtype),
                                np.empty(channels, y.dtype))
    for c in range(channels):
        invstd = 1 / math.sqrt(var[c] + eps)
        saved_mean[c], saved_invstd[c] = mean[c], invstd
        typed_mean[c] = mean[c]
        scale[c] = invstd * weight[c] if has_weight else invstd
        shift[c] = bias[c] if has_bias else 0.0
    for n in range(nb):
        first = n * channels
        source, destination = x[first:first + channels], y[first:first + channels]
        for c in range(channels):
            destination[c] = (source[c] - typed_mean[c]) * scale[c] + shift[c]


@njit(**CPU_KERNEL)
def _batch_norm_backward_rows(x, weight, saved_mean, saved_invstd, grad_out, grad_x, grad_w,
                              grad_b, meta):
    """The (N, C) backward, rows outer and channels inner (see ``_batch_norm_rows``)."""
    nb, channels, training, has_weight = meta[0], meta[1], meta[3], meta[4]
    needs_x, needs_w, needs_b = meta[6], meta[7], meta[8]
    sum_dy, sum_dy_xhat = np.zeros(channels), np.zeros(channels)
    for n in range(nb):
        first = n * channels
        source, gradient = x[first:first + channels], grad_out[first:first + channels]
        for c in range(channels):
            sum_dy[c] += gradient[c]
            sum_dy_xhat[c] += gradient[c] * (source[c] - saved_mean[c])
    for c in range(channels):
        sum_dy_xhat[c] *= saved_invstd[c]
        if needs_b:
            grad_b[c] = sum_dy[c]
        if needs_w:
            grad_w[c] = sum_dy_xhat[c]
    if not needs_x:
        return
    scale, mean_dy, mean_dy_xhat = np.empty(channels), np.zeros(channels), np.zeros(channels)
    for c in range(channels):
        scale[c] = saved_invstd[c] * weight[c] if has_weight else saved_invstd[c]
        if training:
            mean_dy[c], mean_dy_xhat[c] = sum_dy[c] / nb, sum_dy_xhat[c] / nb
    for n in range(nb):
        first = n * channels
        for c in range(channels):
            xhat = (x[first + c] - saved_mean[c]) * saved_invstd[c]
            grad_x[first + c] = scale[c] * (grad_out[first + c] - mean_dy[c]
                                            - xhat * mean_dy_xhat[c])


@njit(**CPU_KERNEL, parallel=True)
def batch_norm_cpu(x, running_mean, running_var, weight, bias, y, saved_mean, saved_invstd,
                   meta, momentum, eps):
    nb, channels, inner, training, has_weight, has_bias = (meta[0], meta[1], meta[2],
                                                           meta[3], meta[4], meta[5])
    if inner == 1:   # (N, C): a channel's values are strided, so walk the rows instead
        _batch_norm_rows(x, running_mean, running_var, weight, bias, y, saved_mean,
                         saved_invstd, meta, momentum, eps)
        return
    count = nb * inner
    for c in prange(channels):
        if training:
            total = 0.0
            for n in range(nb):
                segment = x[(n * channels + c) * inner:(n * channels + c + 1) * inner]
                for s in range(inner):
                    total += segment[s]
            mean = total / count
            total = 0.0
            for n in range(nb):
                segment = x[(n * channels + c) * inner:(n * channels + c + 1) * inner]
                for s in range(inner):
                    total += (segment[s] - mean) ** 2
            var = total / count
            running_mean[c] = (1 - momentum) * running_mean[c] + momentum * mean
            running_var[c] = (1 - momentum) * running_var[c] + momentum * var * count / (count - 1)
        else:
            mean, var = running_mean[c], running_var[c]
        invstd = 1 / math.sqrt(var + eps)
        saved_mean[c], saved_invstd[c] = mean, invstd
        scale = invstd * weight[c] if has_weight else invstd
        shift = bias[c] if has_bias else 0.0
        typed_mean, typed_scale, typed_shift = (y.dtype.type(mean), y.dtype.type(scale),
                                                y.dtype.type(shift))
        for n in range(nb):
            first = (n * channels + c) * inner
            source, destination = x[first:first + inner], y[first:first + inner]
            for s in range(inner):
                destination[s] = (source[s] - typed_mean) * typed_scale + typed_shift


@njit(**CPU_KERNEL, parallel=True)
def batch_norm_backward_cpu(x, weight, saved_mean, saved_invstd, grad_out, grad_x, grad_w,
                            grad_b, meta):
    nb, channels, inner, training, has_weight = meta[0], meta[1], meta[2], meta[3], meta[4]
    needs_x, needs_w, needs_b = meta[6], meta[7], meta[8]
    if inner == 1:
        _batch_norm_backward_rows(x, weight, saved_mean, saved_invstd, grad_out, grad_x,
                                  grad_w, grad_b, meta)
        return
    count = nb * inner
    for c in prange(channels):
        mean, invstd = saved_mean[c], saved_invstd[c]
        mean64 = 1.0 * mean   # sums in float64 throughout: backward 2.2 -> 1.8 ms, one thread
        sum_dy = 0.0
        sum_dy_xhat = 0.0
        for n in range(nb):
            first = (n * channels + c) * inner
            source, gradient = x[first:first + inner], grad_out[first:first + inner]
            for s in range(inner):
                sum_dy += gradient[s]
                sum_dy_xhat += gradient[s] * (source[s] - mean64)
        sum_dy_xhat *= invstd
        if needs_b:
            grad_b[c] = sum_dy
        if needs_w:
            grad_w[c] = sum_dy_xhat
        if not needs_x:
            continue
        # the coefficients in x's dtype: the loop below then vectorises
        dtype = grad_x.dtype.type
        scale = dtype(invstd * weight[c] if has_weight else invstd)
        mean_dy = dtype(sum_dy / count if training else 0.0)
        mean_dy_xhat = dtype(sum_dy_xhat / count if training else 0.0)
        for n in range(nb):
            first = (n * channels + c) * inner
            source, gradient = x[first:first + inner], grad_out[first:first + inner]
            destination = grad_x[first:first + inner]
            for s in range(inner):
                xhat = (source[s] - mean) * invstd
                destination[s] = scale * (gradient[s] - mean_dy - xhat * mean_dy_xhat)


# ------------------------------------------------------------------ CUDA kernels
#
# Each channel's n = N·S values are split along the batch into ``chunks`` runs of ``rows``
# samples, one block per (channel, chunk). Two launches each way:
#
# - forward: every block's sums Σ d and Σ d² of its chunk, d = x - K with K the channel's
#   first value (float64; shifted by a value of the channel, the one-pass variance keeps its
#   digits where the plain Σ x² form cancels at large means), into ``partials``; then every
#   block sums its channel's partials in a fixed tree, block 0 of the channel updates the
#   running statistics, and each block normalises its chunk;
# - backward: every block's Σ dy and Σ dy·(x - mean) of its chunk; then the channel's sums,
#   dw and db from block 0, dx for each chunk.
#
# The same order every run, no float atomics: reproducible bit for bit. S (the product of
# the dims after C) is a compile-time constant, and a thread steps from one of its values to
# the next by additions (no 64-bit division per value). Each thread issues its loads
# ``UNROLL`` at a time: the loops are latency-bound. On the H200 (CNN's 128x64x14x14) the
# one-block-per-channel kernel (64 blocks, runtime 64-bit divisions) took 76 us forward, one
# load in flight per thread 31-44 us at every chunking tried, this one 19.4 us (torch 11.2).

# values per thread and pass: more chunks mean more blocks, each paying its tree reductions.
# H200, 128x64x14x14 forward / backward us: 8 values 24.8 / 26.3, 16 21.0 / 23.2, 32 19.4 /
# 22.2 (4 chunks of 41 samples; torch 11.2 / 20.3); 64 was slower in the loop before this one
# the simulator's 9: its (3, 2, 5, 7) case gets chunks of 2 and 1 samples
VALUES_PER_THREAD = 9 if SIMULATOR else 32
UNROLL = 4


def batch_chunks(nb, inner):
    """(chunks, rows): each channel's batch in ``chunks`` runs of ``rows`` samples (the last
    run shorter), about ``VALUES_PER_THREAD`` values per thread of a block."""
    rows = min(nb, max(1, VALUES_PER_THREAD * REDUCE_THREADS // inner))
    return -(-nb // rows), rows


@functools.cache
def _cuda_kernels(inner):
    """The four CUDA kernels for S = ``inner`` values per sample and channel."""

    @cuda.jit(device=True)
    def chunk_of(b, channels, nb, rows):
        """Block ``b``'s channel, first sample and number of values."""
        chunks = -(-nb // rows)
        c = b // chunks
        first = (b - c * chunks) * rows
        return c, first, min(rows, nb - first) * inner

    step_samples, step_values = REDUCE_THREADS // inner, REDUCE_THREADS % inner

    @cuda.jit(device=True)
    def start_of(t, c, first, channels):
        """Thread t's first value of the chunk: its sample's offset in x and its position."""
        return ((first + t // inner) * channels + c) * inner, t % inner

    @cuda.jit(device=True)
    def advance(sample_at, position, sample_stride):
        """The value REDUCE_THREADS further on, by additions only (no division per value)."""
        position += step_values
        sample_at += step_samples * sample_stride
        if position >= inner:
            position -= inner
            sample_at += sample_stride
        return sample_at, position

    @cuda.jit(device=True)
    def positions(j, count, sample_at, position, sample_stride):
        """The chunk's values j, j + T, j + 2T, j + 3T (T threads) from j's (sample offset,
        position): their places in x, past the end repeating the first (safe to read), how
        many are real, and where j + 4T starts."""
        a0 = sample_at + position
        sample_at, position = advance(sample_at, position, sample_stride)
        a1 = sample_at + position
        sample_at, position = advance(sample_at, position, sample_stride)
        a2 = sample_at + position
        sample_at, position = advance(sample_at, position, sample_stride)
        a3 = sample_at + position
        sample_at, position = advance(sample_at, position, sample_stride)
        real = min(UNROLL, (count - j + REDUCE_THREADS - 1) // REDUCE_THREADS)
        return (a0, a1 if real > 1 else a0, a2 if real > 2 else a0, a3 if real > 3 else a0,
                real, sample_at, position)

    @cuda.jit(device=True)
    def chunk_sums(u, u_shift, x, x_shift, t, count, sample_at, position, sample_stride):
        """Σ (u - u_shift) and Σ (u - u_shift)·(x - x_shift) over the thread's values of the
        chunk, in float64, four loads at a time."""
        first = 0.0
        second = 0.0
        for j in range(t, count, UNROLL * REDUCE_THREADS):
            a0, a1, a2, a3, real, sample_at, position = positions(
                j, count, sample_at, position, sample_stride)
            u0, u1, u2, u3 = u[a0] - u_shift, u[a1] - u_shift, u[a2] - u_shift, u[a3] - u_shift
            x0, x1, x2, x3 = x[a0] - x_shift, x[a1] - x_shift, x[a2] - x_shift, x[a3] - x_shift
            first += u0
            second += u0 * x0
            if real > 1:
                first += u1
                second += u1 * x1
            if real > 2:
                first += u2
                second += u2 * x2
            if real > 3:
                first += u3
                second += u3 * x3
        return first, second

    @cuda.jit(device=True)
    def store_partials(partials, t, first, second):
        first = block_reduce_cuda(SUM, first)
        second = block_reduce_cuda(SUM, second)
        if t == 0:
            partials[2 * cuda.blockIdx.x] = first
            partials[2 * cuda.blockIdx.x + 1] = second

    @cuda.jit(cache=True)
    def statistics_cuda(x, partials, channels, rows):
        """The chunk's Σ d and Σ d², d = x - the channel's first value."""
        t = cuda.threadIdx.x
        nb = x.size // (channels * inner)
        c, first, count = chunk_of(cuda.blockIdx.x, channels, nb, rows)
        shift = 1.0 * x[c * inner]
        sample_at, position = start_of(t, c, first, channels)
        total, squares = chunk_sums(x, shift, x, shift, t, count, sample_at, position,
                                    channels * inner)
        store_partials(partials, t, total, squares)

    @cuda.jit(cache=True)
    def normalise_cuda(x, running_mean, running_var, weight, bias, y, saved_mean,
                       saved_invstd, partials, rows, training, has_weight, has_bias, momentum,
                       eps):
        t = cuda.threadIdx.x
        channels = saved_mean.size
        nb = x.size // (channels * inner)
        c, first, count = chunk_of(cuda.blockIdx.x, channels, nb, rows)
        if training:
            # the block's threads share the channel's partials, then the fixed-order tree:
            # one thread walking them all was latency-bound (128 chunks: 1042 us)
            chunks = -(-nb // rows)
            total = 0.0
            squares = 0.0
            for q in range(t, chunks, REDUCE_THREADS):
                total += partials[2 * (c * chunks + q)]
                squares += partials[2 * (c * chunks + q) + 1]
            values = nb * inner
            shifted_mean = block_reduce_cuda(SUM, total) / values
            var = max(block_reduce_cuda(SUM, squares) / values - shifted_mean ** 2, 0.0)
            mean = x[c * inner] + shifted_mean
            if t == 0 and first == 0:
                running_mean[c] = (1 - momentum) * running_mean[c] + momentum * mean
                running_var[c] = ((1 - momentum) * running_var[c]
                                  + momentum * var * values / (values - 1))
        else:
            mean, var = 1.0 * running_mean[c], 1.0 * running_var[c]
        invstd = 1 / math.sqrt(var + eps)
        if t == 0 and first == 0:
            saved_mean[c], saved_invstd[c] = mean, invstd
        scale = invstd * weight[c] if has_weight else invstd
        shift = (bias[c] if has_bias else 0.0) - mean * scale
        sample_at, position = start_of(t, c, first, channels)
        for j in range(t, count, UNROLL * REDUCE_THREADS):
            a0, a1, a2, a3, real, sample_at, position = positions(
                j, count, sample_at, position, channels * inner)
            v0, v1, v2, v3 = x[a0], x[a1], x[a2], x[a3]
            y[a0] = v0 * scale + shift
            if real > 1:
                y[a1] = v1 * scale + shift
            if real > 2:
                y[a2] = v2 * scale + shift
            if real > 3:
                y[a3] = v3 * scale + shift

    @cuda.jit(cache=True)
    def gradient_sums_cuda(x, saved_mean, grad_out, partials, rows):
        """The chunk's Σ dy and Σ dy·(x - mean)."""
        t = cuda.threadIdx.x
        channels = saved_mean.size
        nb = x.size // (channels * inner)
        c, first, count = chunk_of(cuda.blockIdx.x, channels, nb, rows)
        sample_at, position = start_of(t, c, first, channels)
        sum_dy, sum_dy_centered = chunk_sums(grad_out, 0.0, x, 1.0 * saved_mean[c], t, count,
                                             sample_at, position, channels * inner)
        store_partials(partials, t, sum_dy, sum_dy_centered)

    @cuda.jit(cache=True)
    def gradients_cuda(x, weight, saved_mean, saved_invstd, grad_out, grad_x, grad_w, grad_b,
                       partials, rows, training, has_weight, needs_x, needs_w, needs_b):
        t = cuda.threadIdx.x
        channels = saved_mean.size
        nb = x.size // (channels * inner)
        c, first, count = chunk_of(cuda.blockIdx.x, channels, nb, rows)
        chunks = -(-nb // rows)
        mean, invstd = saved_mean[c], saved_invstd[c]
        sum_dy = 0.0
        sum_dy_xhat = 0.0
        for q in range(t, chunks, REDUCE_THREADS):
            sum_dy += partials[2 * (c * chunks + q)]
            sum_dy_xhat += partials[2 * (c * chunks + q) + 1]
        sum_dy = block_reduce_cuda(SUM, sum_dy)
        sum_dy_xhat = block_reduce_cuda(SUM, sum_dy_xhat) * invstd
        if t == 0 and first == 0:
            if needs_b:
                grad_b[c] = sum_dy
            if needs_w:
                grad_w[c] = sum_dy_xhat
        if not needs_x:
            return
        values = nb * inner
        scale = invstd * weight[c] if has_weight else invstd
        mean_dy = sum_dy / values if training else 0.0
        mean_dy_xhat = sum_dy_xhat / values if training else 0.0
        # dx = scale·(dy - mean_dy - (x - mean)·invstd·mean_dy_xhat)
        #    = scale·dy - slope·x + offset
        slope = scale * invstd * mean_dy_xhat
        offset = scale * (mean * invstd * mean_dy_xhat - mean_dy)
        sample_at, position = start_of(t, c, first, channels)
        for j in range(t, count, UNROLL * REDUCE_THREADS):
            a0, a1, a2, a3, real, sample_at, position = positions(
                j, count, sample_at, position, channels * inner)
            g0, g1, g2, g3 = grad_out[a0], grad_out[a1], grad_out[a2], grad_out[a3]
            v0, v1, v2, v3 = x[a0], x[a1], x[a2], x[a3]
            grad_x[a0] = scale * g0 - slope * v0 + offset
            if real > 1:
                grad_x[a1] = scale * g1 - slope * v1 + offset
            if real > 2:
                grad_x[a2] = scale * g2 - slope * v2 + offset
            if real > 3:
                grad_x[a3] = scale * g3 - slope * v3 + offset

    return statistics_cuda, normalise_cuda, gradient_sums_cuda, gradients_cuda


def _chunk_partials(nb, channels, inner, used=True):
    """The launches' block count, the chunks' rows, and the two float64 partials of each
    block (one placeholder element where nothing writes them: eval's forward)."""
    chunks, rows = batch_chunks(nb, inner)
    blocks = channels * chunks
    return blocks, rows, empty(2 * blocks if used else 1, np.float64, "cuda")


def _forward_plan(args):
    x, running_mean, running_var, weight, bias, y, saved_mean, saved_invstd, meta = args[:9]
    momentum, eps = args[9:]
    nb, channels, inner, training, has_weight, has_bias = meta
    statistics, normalise = _cuda_kernels(inner)[:2]
    blocks, rows, partials = _chunk_partials(nb, channels, inner, used=training)
    launches = [(statistics, blocks, REDUCE_THREADS, (x, partials, channels, rows))] \
        if training else []
    return launches + [(normalise, blocks, REDUCE_THREADS,
                        (x, running_mean, running_var, weight, bias, y, saved_mean,
                         saved_invstd, partials, rows, training, has_weight, has_bias,
                         momentum, eps))]


def _backward_plan(args):
    x, weight, saved_mean, saved_invstd, grad_out, grad_x, grad_w, grad_b, meta = args
    nb, channels, inner, training, has_weight, _, needs_x, needs_w, needs_b = meta
    gradient_sums, gradients = _cuda_kernels(inner)[2:]
    blocks, rows, partials = _chunk_partials(nb, channels, inner)
    return [(gradient_sums, blocks, REDUCE_THREADS, (x, saved_mean, grad_out, partials, rows)),
            (gradients, blocks, REDUCE_THREADS,
             (x, weight, saved_mean, saved_invstd, grad_out, grad_x, grad_w, grad_b, partials,
              rows, training, has_weight, needs_x, needs_w, needs_b))]


BATCH_NORM = Kernel("batch_norm", engine_threads(batch_norm_cpu), cuda_plan=_forward_plan)
BATCH_NORM_BACKWARD = Kernel("batch_norm_backward", engine_threads(batch_norm_backward_cpu),
                             cuda_plan=_backward_plan)


# ------------------------------------------------------------------ the op


@register
class BatchNormOp(Op):
    """Inputs ``(x, running_mean, running_var)``, then optionally ``weight``, then ``bias``
    (a bias without a weight: pass ones as the weight); params training (default False),
    momentum (default 0.1, in [0, 1]) and eps (default 1e-5, > 0)."""
    name = "batch_norm"
    kernels = (BATCH_NORM, BATCH_NORM_BACKWARD)

    def check(self, x, running_mean, running_var, weight=None, bias=None):
        training = bool(self.params.get("training", False))
        momentum = self.params.get("momentum", 0.1)
        eps = self.params.get("eps", 1e-5)
        if not 2 <= x.ndim <= 4:
            raise ValueError(f"batch_norm: expects x (N, C) or (N, C, H, W), got shape "
                             f"{tuple(x.shape)}")
        channels = x.shape[1]
        for what, array in (("running_mean", running_mean), ("running_var", running_var),
                            ("weight", weight), ("bias", bias)):
            if array is not None and tuple(array.shape) != (channels,):
                raise ValueError(f"batch_norm: {what} must have shape ({channels},) for x "
                                 f"{tuple(x.shape)}, got {tuple(array.shape)}")
        if momentum is None or not 0 <= momentum <= 1:
            raise ValueError(f"batch_norm: momentum must be a number in [0, 1] (the "
                             f"cumulative average of momentum=None is not supported), got "
                             f"{momentum!r}")
        if not eps > 0:
            raise ValueError(f"batch_norm: eps must be > 0, got {eps!r}")
        inner = math.prod(x.shape[2:])
        if training and x.shape[0] * inner <= 1:
            raise ValueError(f"batch_norm: training needs more than one value per channel, "
                             f"got x {tuple(x.shape)}")
        dtype = np.dtype(x.dtype).type
        self.momentum, self.eps = dtype(momentum), dtype(eps)
        self.meta = tuple(int(v) for v in (x.shape[0], channels, inner, training,
                                           weight is not None, bias is not None))

    def forward(self, x, running_mean, running_var, weight=None, bias=None):
        channels = x.shape[1]
        # an absent weight or bias is never read: running_mean fills its slot
        y, self.mean, self.invstd = run(
            BATCH_NORM, flat(x), running_mean, running_var,
            running_mean if weight is None else weight, running_mean if bias is None else bias,
            Out(x.shape, x.dtype), Out((channels,), x.dtype), Out((channels,), x.dtype),
            self.meta, self.momentum, self.eps)
        self.x, self.weight = x, weight
        return y

    def backward(self, grad_out, grad_dst):
        asked = tuple(self.needs_input_grad) + (False,) * (5 - len(self.needs_input_grad))
        needs = (asked[0], asked[3], asked[4])   # the running statistics get no gradient
        destinations = tuple(grad_dst) + (None,) * (5 - len(grad_dst))
        destinations = (destinations[0], destinations[3], destinations[4])
        x, dtype, channels = self.x, np.dtype(self.x.dtype), self.x.shape[1]
        placeholders = (flat(x), self.mean, self.mean)   # never written: see the meta
        slots = [(Out(shape, dtype) if destination is None else flat(destination)) if needed
                 else placeholder
                 for needed, destination, shape, placeholder in zip(
                     needs, destinations, (x.shape, (channels,), (channels,)), placeholders)]
        weight = self.mean if self.weight is None else self.weight   # read only if given
        run(BATCH_NORM_BACKWARD, flat(x), weight, self.mean, self.invstd, flat(grad_out),
            *slots, self.meta + tuple(int(need) for need in needs))
        grad_x, grad_w, grad_b = (
            None if not needed else slot.array if isinstance(slot, Out) else destination
            for needed, slot, destination in zip(needs, slots, destinations))
        return (grad_x, None, None, grad_w, grad_b)[:len(self.needs_input_grad)]


# ------------------------------------------------------------------ synchronised across ranks
#
# torch's SyncBatchNorm: in training, the batch statistics are those of the global batch of
# every rank together. The op gets ``average``, a function replacing a host or device array
# by its mean over the ranks in place (``engine.distributed``: MPI on the host, NCCL on the
# GPU), and the number of ``ranks``; every rank's batch has the same size (the data-parallel
# loaders' shards do), so the mean of the ranks' per-channel means is the global one.
#
# forward: mean = average(Σ x / n), var = average(Σ (x - mean)² / n) (two passes, as the
#   one-process kernel), then the BATCH_NORM kernel in its eval form normalises with them,
#   and the running statistics take them with the global count R·n for the unbiased variance;
# backward: the BATCH_NORM_BACKWARD kernel gives the local Σ dy and Σ dy·x̂ (the weight's and
#   bias's gradients, which the gradient all-reduce then averages), their means are averaged
#   over the ranks, and dx = w·invstd·(dy - mean(dy) - x̂·mean(dy·x̂)) with those global
#   means.
# A rank's dx is then the gradient of the sum of all ranks' losses, which the gradient
# all-reduce's mean turns into the gradient of the global batch's loss: the one-process
# result (tests/test_distributed.py compares them).


@njit(**CPU_KERNEL)
def sync_running_update_cpu(running_mean, running_var, mean, var, momentum, unbias):
    for c in range(mean.size):
        running_mean[c] = (1 - momentum) * running_mean[c] + momentum * mean[c]
        running_var[c] = (1 - momentum) * running_var[c] + momentum * var[c] * unbias


@cuda.jit(cache=True)
def sync_running_update_cuda(running_mean, running_var, mean, var, momentum, unbias):
    c = cuda.grid(1)
    if c < mean.size:
        running_mean[c] = (1 - momentum) * running_mean[c] + momentum * mean[c]
        running_var[c] = (1 - momentum) * running_var[c] + momentum * var[c] * unbias


def _sync_grad_x(x, grad_out, weight, mean, invstd, means, grad_x, inner, has_weight, i):
    channels = mean.size
    c = (i // inner) % channels
    scale = invstd[c] * weight[c] if has_weight else invstd[c]
    xhat = (x[i] - mean[c]) * invstd[c]
    grad_x[i] = scale * (grad_out[i] - means[c] - xhat * means[channels + c])


_sync_grad_x_cpu = njit(inline="always")(_sync_grad_x)
_sync_grad_x_cuda = cuda.jit(device=True)(_sync_grad_x)


@njit(**CPU_KERNEL)
def sync_grad_x_cpu(x, grad_out, weight, mean, invstd, means, grad_x, inner, has_weight):
    for i in range(grad_x.size):
        _sync_grad_x_cpu(x, grad_out, weight, mean, invstd, means, grad_x, inner, has_weight, i)


@cuda.jit(cache=True)
def sync_grad_x_cuda(x, grad_out, weight, mean, invstd, means, grad_x, inner, has_weight):
    i = cuda.grid(1)
    if i < grad_x.size:
        _sync_grad_x_cuda(x, grad_out, weight, mean, invstd, means, grad_x, inner, has_weight,
                          i)


@njit(**CPU_KERNEL)
def sync_means_cpu(sum_dy, sum_dy_xhat, means, inverse_count):
    for c in range(sum_dy.size):
        means[c] = sum_dy[c] * inverse_count
        means[sum_dy.size + c] = sum_dy_xhat[c] * inverse_count


@cuda.jit(cache=True)
def sync_means_cuda(sum_dy, sum_dy_xhat, means, inverse_count):
    c = cuda.grid(1)
    if c < sum_dy.size:
        means[c] = sum_dy[c] * inverse_count
        means[sum_dy.size + c] = sum_dy_xhat[c] * inverse_count


SYNC_RUNNING_UPDATE = Kernel("sync_batch_norm_running", sync_running_update_cpu,
                             sync_running_update_cuda, elements(2))
SYNC_MEANS = Kernel("sync_batch_norm_means", sync_means_cpu, sync_means_cuda, elements(0))
SYNC_GRAD_X = Kernel("sync_batch_norm_grad_x", sync_grad_x_cpu, sync_grad_x_cuda, elements(6))


@register
class SyncBatchNormOp(BatchNormOp):
    """``BatchNorm`` whose training statistics are the global batch's over the ranks of a
    data-parallel run (see above); params as BatchNorm's, plus ``average`` (in-place mean of
    an array over the ranks) and ``ranks`` (their number). In eval it is BatchNorm."""
    name = "sync_batch_norm"
    kernels = (REDUCE[SUM], BINARY[SUB], BINARY[MUL], BATCH_NORM, SYNC_RUNNING_UPDATE,
               BATCH_NORM_BACKWARD, SYNC_MEANS, SYNC_GRAD_X)

    def check(self, x, running_mean, running_var, weight=None, bias=None):
        super().check(x, running_mean, running_var, weight, bias)
        self.training = bool(self.params.get("training", False))
        self.average, self.ranks = self.params["average"], int(self.params["ranks"])
        self.axes = (0,) + tuple(range(2, x.ndim))
        self.count = x.shape[0] * math.prod(x.shape[2:])   # this rank's values per channel
        self.channel_shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
        nb, channels, inner, _, has_weight, has_bias = self.meta
        self.meta = (nb, channels, inner, 0, has_weight, has_bias)   # the eval form

    def forward(self, x, running_mean, running_var, weight=None, bias=None):
        if not self.training:
            return super().forward(x, running_mean, running_var, weight, bias)
        mean = reduce(SUM, x, self.axes, scale=1.0 / self.count)
        self.average(mean)
        centered = binary(SUB, x, mean.reshape(self.channel_shape))
        var = reduce(SUM, binary(MUL, centered, centered), self.axes, scale=1.0 / self.count)
        self.average(var)
        total = self.ranks * self.count
        run(SYNC_RUNNING_UPDATE, running_mean, running_var, mean, var, self.momentum,
            self.momentum.dtype.type(total / (total - 1)))
        return super().forward(x, mean, var, weight, bias)   # normalised with the global ones

    def backward(self, grad_out, grad_dst):
        if not self.training:
            return super().backward(grad_out, grad_dst)
        asked = tuple(self.needs_input_grad) + (False,) * (5 - len(self.needs_input_grad))
        destinations = tuple(grad_dst) + (None,) * (5 - len(grad_dst))
        x, dtype, channels = self.x, np.dtype(self.x.dtype), self.x.shape[1]
        # this rank's sums, wanted or not: Σ dy·x̂ in dw's slot, Σ dy in db's
        slots = [flat(destinations[k]) if asked[k] and destinations[k] is not None else
                 Out((channels,), dtype) for k in (3, 4)]
        weight = self.mean if self.weight is None else self.weight   # read only if given
        run(BATCH_NORM_BACKWARD, flat(x), weight, self.mean, self.invstd, flat(grad_out),
            flat(x), *slots, self.meta + (0, 1, 1))
        sum_dy_xhat, sum_dy = (slot.array if isinstance(slot, Out) else destination
                               for slot, destination in zip(slots, destinations[3:]))
        grad_x = None
        if asked[0]:
            means = run(SYNC_MEANS, sum_dy, sum_dy_xhat, Out((2 * channels,), dtype),
                        dtype.type(1.0 / self.count))
            self.average(means)   # the global batch's mean dy and mean dy·x̂, one collective
            destination = destinations[0]
            made = run(SYNC_GRAD_X, flat(x), flat(grad_out), weight, self.mean, self.invstd,
                       means, Out(x.shape, dtype) if destination is None else flat(destination),
                       math.prod(x.shape[2:]), self.weight is not None)
            grad_x = made if destination is None else destination
        return (grad_x, None, None, sum_dy_xhat if asked[3] else None,
                sum_dy if asked[4] else None)[:len(self.needs_input_grad)]
