"""The CPU kernels of BatchNorm (``ops.batch_norm``): one kernel forward (statistics,
running-statistics update and normalisation) and one backward (both sums and dx), each a
loop over a block of channels run on the engine's threads (``ops.cpu_threads.in_blocks``),
or over the rows of a (N, C) input in one call.

Measured on the 2-core CPU (128x64x14x14 float32): the two-pass statistics take 1.58 ms
against 1.24 for one pass of sums and sums of squares, kept for the cancellation the latter
suffers at large means (the CUDA kernels' one pass is shifted by a value of the channel
instead); two threads over the channels (``prange`` then) took the forward from 1.9 to 1.0
ms and the backward from 1.8 to 0.94 (torch: 2.0 and 1.0 on one thread), and the sums in
vector lanes (``_SUMS``) take them to 0.53 and 0.47. A (N, C) input walks its rows,
channels inner, instead of one strided channel at a time: 128x128 forward 83 -> 15 us,
backward 88 -> 17 us (torch on one thread: 14 and 27 us).
"""
import math

import numpy as np
from numba import njit

from ops.cpu_threads import in_blocks
from ops.launch import CPU_KERNEL

_CHANNEL_LOOPS = dict(CPU_KERNEL, nogil=True)   # a block of channels a call

# meta: a tuple of ints (N, C, S, training, has_weight, has_bias); the backward's adds
# (needs_x, needs_w, needs_b): the buffer of a gradient not asked for is a placeholder never
# written (a CUDA kernel cannot take an empty array on the fast launch path: its data pointer
# is NULL)


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


# A channel's sums in float64 vector lanes ("reassoc": a fixed order of this code, the same
# bits every run and on any thread count, a channel being one thread's): 128x64x14x14 on
# 2 threads, forward 1.51 -> 0.53 ms, backward 1.09 -> 0.47 (one thread: 0.38 and 0.43; a
# single running sum had waited on each add), the dx loop in x's dtype
_SUMS = dict(CPU_KERNEL, nogil=True, fastmath={"reassoc"})


@njit(**_SUMS)
def _channel_sum(x, c, nb, channels, inner, centre, squared):
    """Σ x of channel ``c``, or with ``squared`` Σ (x - centre)², in float64."""
    total = 0.0
    for n in range(nb):
        segment = x[(n * channels + c) * inner:(n * channels + c + 1) * inner]
        if squared:
            for s in range(inner):
                total += (segment[s] - centre) ** 2
        else:
            for s in range(inner):
                total += segment[s]
    return total


@njit(**_SUMS)
def _channel_gradient_sums(x, grad_out, c, nb, channels, inner, mean):
    """``(Σ dy, Σ dy · (x - mean))`` of channel ``c``, in float64."""
    sum_dy = 0.0
    sum_dy_centred = 0.0
    for n in range(nb):
        first = (n * channels + c) * inner
        source, gradient = x[first:first + inner], grad_out[first:first + inner]
        for s in range(inner):
            sum_dy += gradient[s]
            sum_dy_centred += gradient[s] * (source[s] - mean)
    return sum_dy, sum_dy_centred


@njit(**_CHANNEL_LOOPS)
def batch_norm_cpu(x, running_mean, running_var, weight, bias, y, saved_mean, saved_invstd,
                   meta, momentum, eps, first_channel, last_channel):
    nb, channels, inner, training, has_weight, has_bias = (meta[0], meta[1], meta[2],
                                                           meta[3], meta[4], meta[5])
    if inner == 1:   # (N, C): a channel's values are strided, so walk the rows instead
        _batch_norm_rows(x, running_mean, running_var, weight, bias, y, saved_mean,
                         saved_invstd, meta, momentum, eps)
        return
    count = nb * inner
    for c in range(first_channel, last_channel):
        if training:
            mean = _channel_sum(x, c, nb, channels, inner, 0.0, False) / count
            var = _channel_sum(x, c, nb, channels, inner, mean, True) / count
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


@njit(**_CHANNEL_LOOPS)
def batch_norm_backward_cpu(x, weight, saved_mean, saved_invstd, grad_out, grad_x, grad_w,
                            grad_b, meta, first_channel, last_channel):
    nb, channels, inner, training, has_weight = meta[0], meta[1], meta[2], meta[3], meta[4]
    needs_x, needs_w, needs_b = meta[6], meta[7], meta[8]
    if inner == 1:
        _batch_norm_backward_rows(x, weight, saved_mean, saved_invstd, grad_out, grad_x,
                                  grad_w, grad_b, meta)
        return
    count = nb * inner
    for c in range(first_channel, last_channel):
        mean, invstd = saved_mean[c], saved_invstd[c]
        sum_dy, sum_dy_xhat = _channel_gradient_sums(x, grad_out, c, nb, channels, inner,
                                                     mean)
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
        typed_mean, typed_invstd = dtype(mean), dtype(invstd)
        for n in range(nb):
            first = (n * channels + c) * inner
            source, gradient = x[first:first + inner], grad_out[first:first + inner]
            destination = grad_x[first:first + inner]
            for s in range(inner):
                xhat = (source[s] - typed_mean) * typed_invstd
                destination[s] = scale * (gradient[s] - mean_dy - xhat * mean_dy_xhat)


def _channels(seconds_per_element):
    """``in_blocks``' rule: blocks of the channels (meta, argument 8: (N, C, S, ...)), by one
    thread's time an element; a (N, C) input (S = 1) walks its rows in one call."""
    return (lambda args: int(args[8][1]) if args[8][2] > 1 else 1,
            lambda args: args[0].size * seconds_per_element)


# one thread's time an element (128x64x14x14 float32, the 2-core EPYC: the notes above)
batch_norm_blocks_cpu = in_blocks(batch_norm_cpu, *_channels(0.66e-9))
batch_norm_backward_blocks_cpu = in_blocks(batch_norm_backward_cpu, *_channels(0.6e-9))
