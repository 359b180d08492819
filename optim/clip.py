"""Gradient clipping: by the global norm of all gradients, or element by element.

``clip_grad_norm_`` on the parameters of one FlatBuffer is two kernels on the GPU:

1. ``norm_partials``: a grid of at most ``MAX_NORM_BLOCKS`` blocks; each thread folds
   ``|g|**p`` over a fixed stride, each block reduces its threads with the fixed-order
   ``ops.block_reduce`` into one partial;
2. ``scale_by_norm``: every block reduces all partials with the same fixed-order tree (so
   every block sees the same total, bit for bit), then scales its elements by
   ``min(1, max_norm / (total + 1e-6))``; block 0 writes the total.

No float atomics: the norm is the same run to run. The scale cannot join the reduction
without a grid-wide barrier, and cannot wait for the optimizer's kernel because
``clip_grad_norm_`` must leave the gradients clipped when it returns (as torch does).
Gradients spread over several tensors take two launches per tensor (partials of every
tensor go into one array). Accumulation is float64 on both devices. The partials array has
the same layout on both: the CPU kernel folds a tensor's elements in order into its first
partial and zeroes the others (adding 0 is exact; 0 is the neutral element of the max of
absolute values too).
"""
import math

import numpy as np
from numba import njit

from engine.tensor import Tensor
from ops.block_reduce import (MAX, REDUCE_THREADS, SUM, block_reduce_cuda, combine_cpu,
                               combine_cuda)
from ops.cuda import SIMULATOR, cuda
from ops.device import device_of, to_host
from ops.element_kernel import element_kernel
from ops.launch import Kernel, blocks_of
from ops.layout import flat
from ops.memory import empty
from ops.twin import twin
from optim.optimizer import whole_flat_buffer

MAX_NORM_BLOCKS = 4 if SIMULATOR else 512   # partials per gradient array, at most
TORCH_CLIP_EPS = 1e-6                       # torch: max_norm / (total_norm + 1e-6)


def _accumulate(acc, value, norm_type):
    """Fold ``|value|`` into a running sum of ``|g|**p`` (a running max for p = inf)."""
    a = abs(value)
    if norm_type == math.inf:
        if a > acc or a != a:   # NaN wins, as in torch
            return a
        return acc
    if norm_type == 2.0:
        return acc + a * a
    if norm_type == 1.0:
        return acc + a
    return acc + a ** norm_type


def _combine_code(norm_type):
    """The block reduction that folds partial results: a max for p = inf, else a sum."""
    return MAX if norm_type == math.inf else SUM


def _finish(acc, norm_type):
    """The norm from the accumulated ``sum |g|**p`` (or max)."""
    if norm_type == math.inf or norm_type == 1.0:
        return acc
    if norm_type == 2.0:
        return math.sqrt(acc)
    return acc ** (1.0 / norm_type)


def _clip_coefficient(total, max_norm):
    coefficient = max_norm / (total + TORCH_CLIP_EPS)
    if coefficient > 1.0:   # NaN stays NaN (torch's clamp propagates it)
        coefficient = 1.0
    return coefficient


_accumulate_cpu, _accumulate_cuda = twin(_accumulate)
_combine_code_cpu, _combine_code_cuda = twin(_combine_code)
_finish_cpu, _finish_cuda = twin(_finish)
_coefficient_cpu, _coefficient_cuda = twin(_clip_coefficient)


@njit(cache=True, fastmath={"reassoc"}, error_model="numpy")
def _sum_of_squares_cpu(grad):
    """Σ g² in float64 vector lanes ("reassoc": a fixed order of this code, the same bits
    every run): 0.8M float32 gradients 0.67 -> 0.06 ms, where one running sum waits on
    each add."""
    acc = 0.0
    for i in range(grad.size):
        acc += float(grad[i]) * float(grad[i])
    return acc


@njit(cache=True, fastmath=False, error_model="numpy")
def norm_partials_cpu(grad, norm_type, partials, first, count):
    if norm_type == 2.0:
        acc = _sum_of_squares_cpu(grad)
    else:
        acc = 0.0
        for i in range(grad.size):
            acc = _accumulate_cpu(acc, float(grad[i]), norm_type)
    partials[first] = acc
    for k in range(first + 1, first + count):
        partials[k] = 0.0


@cuda.jit(cache=True, fastmath=False)
def norm_partials_cuda(grad, norm_type, partials, first, count):
    acc = 0.0
    for i in range(cuda.grid(1), grad.size, cuda.gridsize(1)):
        acc = _accumulate_cuda(acc, float(grad[i]), norm_type)
    acc = block_reduce_cuda(_combine_code_cuda(norm_type), acc)
    if cuda.threadIdx.x == 0:
        partials[first + cuda.blockIdx.x] = acc


@njit(cache=True, fastmath=False, error_model="numpy")
def scale_by_norm_cpu(grad, partials, norm_type, max_norm, total_out):
    code = _combine_code_cpu(norm_type)
    acc = partials[0]
    for k in range(1, partials.size):
        acc = combine_cpu(code, acc, partials[k])
    total = _finish_cpu(acc, norm_type)
    coefficient = _coefficient_cpu(total, max_norm)
    for i in range(grad.size):
        grad[i] = float(grad[i]) * coefficient
    total_out[0] = total


@cuda.jit(cache=True, fastmath=False)
def scale_by_norm_cuda(grad, partials, norm_type, max_norm, total_out):
    code = _combine_code_cuda(norm_type)
    acc = 0.0
    for k in range(cuda.threadIdx.x, partials.size, REDUCE_THREADS):   # same order in every block
        acc = combine_cuda(code, acc, partials[k])
    total = _finish_cuda(block_reduce_cuda(code, acc), norm_type)
    coefficient = _coefficient_cuda(total, max_norm)
    i = cuda.grid(1)
    if i < grad.size:
        grad[i] = float(grad[i]) * coefficient
    if i == 0:
        total_out[0] = total


def partial_count(grad):
    """How many partials ``norm_partials`` writes for ``grad``: its CUDA grid's blocks."""
    return min(MAX_NORM_BLOCKS, -(-grad.size // REDUCE_THREADS))


NORM_PARTIALS = Kernel("norm_partials", norm_partials_cpu, norm_partials_cuda,
                       blocks_of(lambda grad, norm_type, partials, first, count: count,
                                 REDUCE_THREADS))
SCALE_BY_NORM = Kernel("scale_by_norm", scale_by_norm_cpu, scale_by_norm_cuda,
                       blocks_of(lambda grad, *rest: -(-grad.size // REDUCE_THREADS),
                                 REDUCE_THREADS))


def _clip_value_element(i, grad, clip_value):
    # clamped into [-clip_value, clip_value]; NaN stays NaN (min/max might drop it)
    value = grad[i]
    if value > clip_value:
        value = clip_value
    elif value < -clip_value:
        value = -clip_value
    grad[i] = value


CLIP_VALUE = element_kernel("clip_value", _clip_value_element)


# ------------------------------------------------------------------ public functions

def _gradient_buffers(params, where):
    """The 1-D gradient arrays to clip: the FlatBuffer's whole gradient when ``params`` are
    exactly its parameters and every slot is valid, else each existing ``p.grad``."""
    if isinstance(params, Tensor):
        params = [params]
    params = list(params)
    for position, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"{where}: parameter {position} is a {type(p).__name__}, not an engine Tensor")
    buffer = whole_flat_buffer(params)
    if buffer is not None and buffer.grads_valid():
        return [buffer.grad]
    grads = [flat(p.grad.data) for p in params if p.grad is not None and p.size]
    devices = {device_of(g) for g in grads}
    dtypes = {np.dtype(g.dtype) for g in grads}
    if len(devices) > 1 or len(dtypes) > 1:
        raise ValueError(f"{where}: gradients live on {sorted(devices)} with dtypes "
                         f"{sorted(str(d) for d in dtypes)}; clip each device/dtype separately")
    return grads


def clip_grad_norm_(params, max_norm, norm_type=2.0, error_if_nonfinite=False):
    """Scale the gradients of ``params`` in place so that their global ``norm_type``-norm is at
    most ``max_norm``; returns that norm before clipping.

    As ``torch.nn.utils.clip_grad_norm_``: every gradient is multiplied by
    ``min(1, max_norm / (total_norm + 1e-6))``; gradients that are None are ignored. The
    result is a 0-d engine Tensor on the gradients' device and dtype (no device sync; call
    ``.item()`` for a float). ``error_if_nonfinite=True`` raises (after a sync) when the
    norm is NaN or Inf, before scaling anything. ``norm_type`` is any p > 0 or ``math.inf``.
    """
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not max_norm >= 0:
        raise ValueError(f"clip_grad_norm_: invalid max_norm: {max_norm} (must be >= 0)")
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: invalid norm_type: {norm_type} (must be > 0 or inf)")
    grads = _gradient_buffers(params, "clip_grad_norm_")
    if not grads:
        return Tensor(np.zeros((), np.float32))
    device, dtype = device_of(grads[0]), grads[0].dtype
    if error_if_nonfinite:
        _raise_if_nonfinite_norm(grads, norm_type)
    counts = [partial_count(g) for g in grads]
    partials = empty(sum(counts), np.float64, device)
    total = empty(1, dtype, device)
    first = 0
    for grad, count in zip(grads, counts):
        NORM_PARTIALS(grad, norm_type, partials, first, count)
        first += count
    for grad in grads:
        SCALE_BY_NORM(grad, partials, norm_type, max_norm, total)
    return Tensor(total.reshape(()))


def _raise_if_nonfinite_norm(grads, norm_type):
    partials = np.empty(len(grads), np.float64)
    for first, grad in enumerate(grads):
        NORM_PARTIALS(np.ascontiguousarray(to_host(grad)), norm_type, partials, first, 1)
    if not np.all(np.isfinite(partials)):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} of the "
                           "gradients is non-finite, so it cannot be clipped")


def clip_grad_value_(params, clip_value):
    """Clamp every gradient element of ``params`` into ``[-clip_value, clip_value]`` in place
    (one kernel for a whole FlatBuffer, else one per gradient). NaN gradients stay NaN."""
    clip_value = float(clip_value)
    if not clip_value >= 0:
        raise ValueError(f"clip_grad_value_: invalid clip_value: {clip_value} (must be >= 0)")
    for grad in _gradient_buffers(params, "clip_grad_value_"):
        value = grad.dtype.type(clip_value)
        CLIP_VALUE(grad, value)
