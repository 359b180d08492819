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
one backward (both sums and dx), each a parallel loop over channels (``ops.batch_norm_cpu``,
its measurements there); on CUDA two launches each way over blocks of a channel's batch chunk
(``ops.batch_norm_cuda``: fixed-order sums, reproducible bit for bit). The update happens on
the device, from device scalars only: capture-ready.
"""
import math

import numpy as np
from numba import njit

from ops.batch_norm_cpu import batch_norm_backward_blocks_cpu, batch_norm_blocks_cpu
from ops.batch_norm_cuda import batch_norm_backward_plan, batch_norm_plan
from ops.block_reduce import SUM
from ops.cuda import cuda
from ops.dispatch import Out, run
from ops.elementwise import BINARY, MUL, SUB, binary
from ops.launch import CPU_KERNEL, Kernel, elements
from ops.layout import flat
from ops.reduce import REDUCE, reduce
from ops.registry import Op, register

BATCH_NORM = Kernel("batch_norm", batch_norm_blocks_cpu, cuda_plan=batch_norm_plan)
BATCH_NORM_BACKWARD = Kernel("batch_norm_backward", batch_norm_backward_blocks_cpu,
                             cuda_plan=batch_norm_backward_plan)


# ------------------------------------------------------------------ the op


@register
class BatchNormOp(Op):
    """Inputs ``(x, running_mean, running_var)``, then optionally ``weight``, then ``bias``
    (a bias without a weight: pass ones as the weight); params training (default False),
    momentum (default 0.1, in [0, 1]) and eps (default 1e-5, > 0)."""
    name = "batch_norm"
    kernels = (BATCH_NORM, BATCH_NORM_BACKWARD)

    def onnx(self, graph, inputs):   # eval mode: the running statistics
        if self.params.get("training", False):
            graph.refuse("batch_norm in training mode (batch statistics); export runs the "
                         "model in eval mode: call model.eval() in a custom forward's place")
        x, mean, var, *affine = inputs
        channels = graph.input_shapes[0][1]
        weight = affine[0] if affine else graph.constant(np.ones(channels, graph.dtype),
                                                         "batch_norm.ones")
        bias = affine[1] if len(affine) > 1 else graph.constant(
            np.zeros(channels, graph.dtype), "batch_norm.zeros")
        return graph.node("BatchNormalization", [x, weight, bias, mean, var],
                          epsilon=float(self.params.get("eps", 1e-5)))

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
# result (tests/engine/test_distributed.py compares them).


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
