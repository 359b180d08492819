"""The CUDA kernels of BatchNorm (``ops.batch_norm``) and their launch plans: two launches
each way over blocks of a channel's batch chunk, fixed-order sums (below)."""
import functools
import math

import numpy as np

from ops.block_reduce import REDUCE_THREADS, SUM, block_reduce_cuda
from ops.cuda import SIMULATOR, cuda
from ops.memory import empty

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


def batch_norm_plan(args):
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


def batch_norm_backward_plan(args):
    x, weight, saved_mean, saved_invstd, grad_out, grad_x, grad_w, grad_b, meta = args
    nb, channels, inner, training, has_weight, _, needs_x, needs_w, needs_b = meta
    gradient_sums, gradients = _cuda_kernels(inner)[2:]
    blocks, rows, partials = _chunk_partials(nb, channels, inner)
    return [(gradient_sums, blocks, REDUCE_THREADS, (x, saved_mean, grad_out, partials, rows)),
            (gradients, blocks, REDUCE_THREADS,
             (x, weight, saved_mean, saved_invstd, grad_out, grad_x, grad_w, grad_b, partials,
              rows, training, has_weight, needs_x, needs_w, needs_b))]

