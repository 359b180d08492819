"""Layer normalisation over the trailing ``n`` elements of each row (torch's ``layer_norm``):
``y = (x - mean) / sqrt(var + eps) * weight + bias``, the variance biased.

The input is ``rows`` rows of ``n`` contiguous elements. Forward: one pass over a row gives
its statistics as shifted moments, ``s1 = Σ (x - x0)`` and ``s2 = Σ (x - x0)²`` with ``x0``
the row's first element (CUDA's sums in float64; the CPU's in x's dtype over blocks of
``SUM_BLOCK`` elements, the blocks' sums in float64): ``mean = x0 + s1 / n``, ``var = s2 / n
- (s1 / n)²``. The shift keeps the moments' cancellation to the row's spread, not its offset
(a row at 1e4 with spread 1 keeps 1e-8 of relative precision where unshifted float64 moments
keep 1e-4). The row's mean and ``rstd = 1 / sqrt(var + eps)`` are saved (float64) for the
backward; a second pass writes y. On CUDA a row gets a group of a block's threads as
softmax's rows do (``ops.softmax.row_group``, up to ``LANE_ELEMENTS`` elements a lane), the
two sums going through ``ops.block_reduce``'s fixed tree.

Backward, from ``g = grad_out`` and ``x̂ = (x - mean) · rstd``:
- ``dx = rstd · (g·w - mean(g·w) - x̂ · mean(g·w · x̂))``: one kernel, a row per group;
- ``dweight = Σ_rows g · x̂`` and ``dbias = Σ_rows g``: partial sums over chunks of
  ``PARAM_CHUNK`` rows (a thread per chunk and column, in x's dtype), then a fold of each
  column's chunks in ``FOLD_LANES`` lanes and a pairwise sum of the lanes (float64): no
  atomics, and the same order on both devices.

The CPU kernels are ``ops.layer_norm_cpu``'s.
"""
import math

import numpy as np
from numba import float64

from ops.block_reduce import REDUCE_THREADS, SUM, group_reduce_cuda
from ops.cuda import SIMULATOR, cuda
from ops.dispatch import Out, run
from ops.launch import Kernel
from ops.layer_norm_cpu import (FOLD_LANES, HAS_BIAS, HAS_WEIGHT, PARAM_CHUNK,
                                layer_norm_backward_cpu, layer_norm_split_cpu)
from ops.layout import flat
from ops.registry import Op, register
from ops.softmax import row_group
from ops.twin import twin

STATS_DTYPE = np.float64
# A row's threads leave each at most this many of its elements: a warp for the GPT's rows of
# 384. H100, 16384 x 384 float32, each kernel replayed alone (GPU us, forward / dx): 32 lanes
# a row 41.0 / 47.6, 64 (softmax's 8 elements a lane) 56.9 / 62.6, 128 87.1 / 93.5
LANE_ELEMENTS = 16


@cuda.jit(cache=True)
def layer_norm_cuda(x, weight, bias, out, mean, rstd, rows, n, eps, affine, group):
    t = cuda.threadIdx.x
    lane = t % group
    r = cuda.blockIdx.x * (REDUCE_THREADS // group) + t // group
    count = n if r < rows else 0   # a group past the last row still joins the reductions
    base = r * n
    shift = x[base] if count else 0.0
    s1 = 0.0
    s2 = 0.0
    for k in range(lane, count, group):
        d = float(x[base + k] - shift)
        s1 += d
        s2 += d * d
    s1 = group_reduce_cuda(SUM, s1, group)
    s2 = group_reduce_cuda(SUM, s2, group)
    if count:
        m1 = s1 / n
        row_mean = shift + m1
        row_rstd = 1.0 / math.sqrt(max(s2 / n - m1 * m1, 0.0) + eps)
        if lane == 0:
            mean[r] = row_mean
            rstd[r] = row_rstd
        for k in range(lane, count, group):
            value = (x[base + k] - row_mean) * row_rstd
            if affine & HAS_WEIGHT:
                value = value * weight[k]
            if affine & HAS_BIAS:
                value = value + bias[k]
            out[base + k] = value


@cuda.jit(cache=True)
def layer_norm_grad_cuda(x, weight, mean, rstd, grad_out, grad_x, rows, n, affine, group):
    t = cuda.threadIdx.x
    lane = t % group
    r = cuda.blockIdx.x * (REDUCE_THREADS // group) + t // group
    count = n if r < rows else 0
    base = r * n
    row_mean = mean[r] if count else 0.0
    row_rstd = rstd[r] if count else 0.0
    total = 0.0
    total_xhat = 0.0
    for k in range(lane, count, group):
        gw = float(grad_out[base + k])
        if affine & HAS_WEIGHT:
            gw *= weight[k]
        total += gw
        total_xhat += gw * (x[base + k] - row_mean) * row_rstd
    total = group_reduce_cuda(SUM, total, group) / n
    total_xhat = group_reduce_cuda(SUM, total_xhat, group) / n
    for k in range(lane, count, group):
        gw = float(grad_out[base + k])
        if affine & HAS_WEIGHT:
            gw *= weight[k]
        xhat = (x[base + k] - row_mean) * row_rstd
        grad_x[base + k] = row_rstd * (gw - total - xhat * total_xhat)


def _partial_sums(c, j, x, mean, rstd, grad_out, partials, rows, n):
    """Chunk ``c``'s rows of column ``j``, in order, into ``partials[0|1, c, j]`` (Σ g·x̂ and
    Σ g, added in x's dtype as the CPU's chunk loop adds them: Σ g is the same bits)."""
    total_xhat = total = x.dtype.type(0)
    for r in range(c * PARAM_CHUNK, min(rows, (c + 1) * PARAM_CHUNK)):
        g = grad_out[r * n + j]
        total += g
        total_xhat += g * x.dtype.type((x[r * n + j] - mean[r]) * rstd[r])
    partials[0, c, j] = total_xhat
    partials[1, c, j] = total


FOLD_COLUMNS = 2 if SIMULATOR else 32   # columns of a CUDA block (the simulator: few threads)


_partial_sums_cuda = twin(_partial_sums)[1]   # the CPU walks rows, not columns


@cuda.jit(cache=True)
def layer_norm_partial_sums_cuda(x, mean, rstd, grad_out, partials, grad_weight, grad_bias,
                                 rows, n, which):
    t = cuda.grid(1)   # a thread per (chunk, column): neighbours read neighbouring columns
    if t < partials.shape[1] * n:
        _partial_sums_cuda(t // n, t % n, x, mean, rstd, grad_out, partials, rows, n)


@cuda.jit(cache=True)
def layer_norm_fold_cuda(x, mean, rstd, grad_out, partials, grad_weight, grad_bias, rows, n,
                         which):
    column, lane = cuda.threadIdx.x, cuda.threadIdx.y
    j = cuda.blockIdx.x * FOLD_COLUMNS + column
    lanes = cuda.shared.array((2, FOLD_LANES, FOLD_COLUMNS), float64)
    total_xhat = 0.0
    total = 0.0
    if j < n:
        for c in range(lane, partials.shape[1], FOLD_LANES):
            total_xhat += partials[0, c, j]
            total += partials[1, c, j]
    lanes[0, lane, column] = total_xhat
    lanes[1, lane, column] = total
    cuda.syncthreads()
    width = FOLD_LANES // 2
    while width > 0:
        if lane < width:
            lanes[0, lane, column] += lanes[0, lane + width, column]
            lanes[1, lane, column] += lanes[1, lane + width, column]
        cuda.syncthreads()
        width //= 2
    if lane == 0 and j < n:
        if which & HAS_WEIGHT:
            grad_weight[j] = lanes[0, 0, column]
        if which & HAS_BIAS:
            grad_bias[j] = lanes[1, 0, column]


def _row_launch(kernel, args, rows, n):
    """``kernel`` over ``rows`` rows of ``n``, a group of a block's threads a row."""
    group = row_group(n, 1, LANE_ELEMENTS)
    return (kernel, -(-rows // (REDUCE_THREADS // group)), REDUCE_THREADS, (*args, group))


def _forward_plan(args):
    return (_row_launch(layer_norm_cuda, args, args[6], args[7]),)


def _backward_plan(args):
    """dx where asked (a group of threads a row); dweight/dbias where asked, in two
    launches: the chunks' partials (chunks x n threads: 512 x 384 for 16384 rows of 384,
    where a thread per column walking every row kept 384 threads busy), then FOLD_LANES
    threads a column folding them (``fold_cpu``'s order)."""
    (x, weight, mean, rstd, grad_out, grad_x, partials, grad_weight, grad_bias, rows, n,
     affine, which) = args
    launches = []
    if grad_x.size:
        launches.append(_row_launch(layer_norm_grad_cuda, (x, weight, mean, rstd, grad_out,
                                                           grad_x, rows, n, affine), rows, n))
    if which:
        params = (x, mean, rstd, grad_out, partials, grad_weight, grad_bias, rows, n, which)
        threads = 256
        launches += [(layer_norm_partial_sums_cuda, -(-partials.shape[1] * n // threads),
                      threads, params),
                     (layer_norm_fold_cuda, -(-n // FOLD_COLUMNS), (FOLD_COLUMNS, FOLD_LANES),
                      params)]
    return launches


LAYER_NORM = Kernel("layer_norm", layer_norm_split_cpu, cuda_plan=_forward_plan)
LAYER_NORM_BACKWARD = Kernel("layer_norm_backward", layer_norm_backward_cpu,
                             cuda_plan=_backward_plan)


@register
class LayerNormOp(Op):
    """Inputs ``(x, weight, bias)`` with weight and bias of the normalised shape, or x in
    the place of one that is absent; params ``normalized_shape`` (a tuple: x's trailing
    dims), ``eps`` and ``affine`` (``HAS_WEIGHT | HAS_BIAS`` of those given)."""
    name = "layer_norm"
    kernels = (LAYER_NORM, LAYER_NORM_BACKWARD)

    def check(self, x, weight, bias):
        shape = tuple(self.params["normalized_shape"])
        trailing = tuple(x.shape[x.ndim - len(shape):]) if len(shape) <= x.ndim else None
        if not shape or trailing != shape:
            raise ValueError(f"layer_norm: normalized_shape {shape} must be the trailing "
                             f"dims of the input, got input of shape {tuple(x.shape)}")
        affine = self.params["affine"]
        for flag, name, array in ((HAS_WEIGHT, "weight", weight), (HAS_BIAS, "bias", bias)):
            if affine & flag and tuple(array.shape) != shape:
                raise ValueError(f"layer_norm: {name} of shape {tuple(array.shape)} must have "
                                 f"the normalized_shape {shape}")
        eps = self.params["eps"]
        if not eps >= 0:
            raise ValueError(f"layer_norm: eps must be >= 0, got {eps}")
        self.n = math.prod(shape)
        self.rows = x.size // self.n if self.n else 0

    def forward(self, x, weight, bias):
        out, self.mean, self.rstd = run(
            LAYER_NORM, flat(x), flat(weight), flat(bias), Out(x.shape, x.dtype),
            Out((self.rows,), STATS_DTYPE), Out((self.rows,), STATS_DTYPE),
            self.rows if self.n else 0, self.n, float(self.params["eps"]),
            self.params["affine"])
        self.x, self.weight = x, weight
        return out

    def onnx(self, graph, inputs):   # ONNX's LayerNormalization: opset 17 on
        if graph.opset < 17:
            graph.refuse(f"layer_norm needs opset 17 or later (LayerNormalization), got "
                         f"{graph.opset}")
        shape, affine = tuple(self.params["normalized_shape"]), self.params["affine"]
        weight = inputs[1] if affine & HAS_WEIGHT else graph.constant(
            np.ones(shape, graph.dtype), "layer_norm.ones")
        bias = inputs[2] if affine & HAS_BIAS else graph.constant(
            np.zeros(shape, graph.dtype), "layer_norm.zeros")
        return graph.node("LayerNormalization", [inputs[0], weight, bias], axis=-len(shape),
                          epsilon=float(self.params["eps"]))

    def backward(self, grad_out, grad_dst):
        needs_x, needs_w, needs_b = self.needs_input_grad
        affine = self.params["affine"]
        x, rows, n = self.x, self.rows if self.n else 0, self.n
        which = (HAS_WEIGHT if needs_w and affine & HAS_WEIGHT else 0) | \
            (HAS_BIAS if needs_b and affine & HAS_BIAS else 0)
        shape = tuple(self.params["normalized_shape"])
        grad_x, partials, grad_w, grad_b = run(
            LAYER_NORM_BACKWARD, flat(x), flat(self.weight), self.mean, self.rstd,
            flat(grad_out), Out(x.shape if needs_x else (0,), x.dtype),
            Out((2, -(-rows // PARAM_CHUNK) if which else 0, n), STATS_DTYPE, flat=False),
            *[Out(shape if which & flag else (0,), x.dtype) for flag in (HAS_WEIGHT, HAS_BIAS)],
            rows, n, affine, which)
        return (grad_x if needs_x else None, grad_w if which & HAS_WEIGHT else None,
                grad_b if which & HAS_BIAS else None)
