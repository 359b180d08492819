"""Gradient clipping: by the global norm of all gradients, or element by element.

``clip_grad_norm_`` on the parameters of one FlatBuffer is ONE kernel on the GPU: a single
block sums ``|g|**p`` over the flat gradient buffer in a fixed order (strided per-thread
sums, then a shared-memory tree; no float atomics, so the norm is the same run to run),
then every thread scales its own elements by ``min(1, max_norm / (norm + 1e-6))``. One block
keeps the reduction and the scale in one launch; at MNIST-MLP sizes (~2e5 gradients) its
memory traffic costs about what a second launch would. Gradients spread over several
tensors take two launches per tensor: a partial sum each, then a scale that re-reads all
partials in order. Accumulation is float64 on both devices.
"""
import math

import numpy as np
from numba import cuda, float64, njit

from engine.tensor import Tensor
from ops.device import SIMULATOR, device_of
from ops.launch import launch, launch_blocks
from ops.layout import flat
from ops.memory import empty
from optim.optimizer import whole_flat_buffer

CLIP_THREADS = 8 if SIMULATOR else 512    # one block; a power of two (the tree halves it)
TORCH_CLIP_EPS = 1e-6                     # torch: max_norm / (total_norm + 1e-6)


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


def _combine(left, right, norm_type):
    if norm_type == math.inf:
        return right if (right > left or right != right) else left
    return left + right


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


_accumulate_cpu = njit(inline="always")(_accumulate)
_combine_cpu = njit(inline="always")(_combine)
_finish_cpu = njit(inline="always")(_finish)
_coefficient_cpu = njit(inline="always")(_clip_coefficient)
_accumulate_cuda = cuda.jit(device=True)(_accumulate)
_combine_cuda = cuda.jit(device=True)(_combine)
_finish_cuda = cuda.jit(device=True)(_finish)
_coefficient_cuda = cuda.jit(device=True)(_clip_coefficient)


@njit(cache=True, fastmath=False)
def norm_partial_cpu(grad, norm_type, partials, index):
    acc = 0.0
    for i in range(grad.size):
        acc = _accumulate_cpu(acc, float(grad[i]), norm_type)
    partials[index] = acc


@njit(cache=True, fastmath=False)
def scale_by_norm_cpu(grad, partials, norm_type, max_norm, total_out):
    acc = partials[0]
    for k in range(1, partials.size):
        acc = _combine_cpu(acc, partials[k], norm_type)
    total = _finish_cpu(acc, norm_type)
    coefficient = _coefficient_cpu(total, max_norm)
    for i in range(grad.size):
        grad[i] = float(grad[i]) * coefficient
    total_out[0] = total


@njit(cache=True, fastmath=False)
def clip_norm_fused_cpu(grad, norm_type, max_norm, total_out):
    acc = 0.0
    for i in range(grad.size):
        acc = _accumulate_cpu(acc, float(grad[i]), norm_type)
    total = _finish_cpu(acc, norm_type)
    coefficient = _coefficient_cpu(total, max_norm)
    for i in range(grad.size):
        grad[i] = float(grad[i]) * coefficient
    total_out[0] = total


@cuda.jit(device=True)
def _block_reduce_cuda(grad, norm_type, partial):
    """Every thread of the one block gets the block's fixed-order ``sum |g|**p`` (or max)."""
    t = cuda.threadIdx.x
    acc = 0.0
    for i in range(t, grad.size, CLIP_THREADS):
        acc = _accumulate_cuda(acc, float(grad[i]), norm_type)
    partial[t] = acc
    cuda.syncthreads()
    step = CLIP_THREADS // 2
    while step > 0:
        if t < step:
            partial[t] = _combine_cuda(partial[t], partial[t + step], norm_type)
        cuda.syncthreads()
        step //= 2
    return partial[0]


@cuda.jit(fastmath=False)
def norm_partial_cuda(grad, norm_type, partials, index):
    partial = cuda.shared.array(CLIP_THREADS, float64)
    acc = _block_reduce_cuda(grad, norm_type, partial)
    if cuda.threadIdx.x == 0:
        partials[index] = acc


@cuda.jit(fastmath=False)
def scale_by_norm_cuda(grad, partials, norm_type, max_norm, total_out):
    acc = partials[0]
    for k in range(1, partials.size):   # every thread, the same fixed order
        acc = _combine_cuda(acc, partials[k], norm_type)
    total = _finish_cuda(acc, norm_type)
    coefficient = _coefficient_cuda(total, max_norm)
    i = cuda.grid(1)
    if i < grad.size:
        grad[i] = float(grad[i]) * coefficient
    if i == 0:
        total_out[0] = total


@cuda.jit(fastmath=False)
def clip_norm_fused_cuda(grad, norm_type, max_norm, total_out):
    partial = cuda.shared.array(CLIP_THREADS, float64)
    total = _finish_cuda(_block_reduce_cuda(grad, norm_type, partial), norm_type)
    coefficient = _coefficient_cuda(total, max_norm)
    for i in range(cuda.threadIdx.x, grad.size, CLIP_THREADS):
        grad[i] = float(grad[i]) * coefficient
    if cuda.threadIdx.x == 0:
        total_out[0] = total


def _clamp(value, bound):
    """``value`` clamped into [-bound, bound]; NaN stays NaN (min/max might drop it)."""
    if value > bound:
        return bound
    if value < -bound:
        return -bound
    return value


_clamp_cpu = njit(inline="always")(_clamp)
_clamp_cuda = cuda.jit(device=True)(_clamp)


@njit(cache=True)
def clip_value_cpu(grad, clip_value):
    for i in range(grad.size):
        grad[i] = _clamp_cpu(grad[i], clip_value)


@cuda.jit
def clip_value_cuda(grad, clip_value):
    i = cuda.grid(1)
    if i < grad.size:
        grad[i] = _clamp_cuda(grad[i], clip_value)


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
    grads = [flat(p.grad.data) for p in params if p.grad is not None]
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
    total = empty(1, dtype, device)
    if error_if_nonfinite:
        _raise_if_nonfinite_norm(grads, norm_type)
    if len(grads) == 1:
        if device == "cuda":
            launch_blocks(clip_norm_fused_cuda, 1, CLIP_THREADS, grads[0], norm_type, max_norm, total)
        else:
            clip_norm_fused_cpu(grads[0], norm_type, max_norm, total)
    else:
        partials = empty(len(grads), np.float64, device)
        for index, grad in enumerate(grads):
            if device == "cuda":
                launch_blocks(norm_partial_cuda, 1, CLIP_THREADS, grad, norm_type, partials, index)
            else:
                norm_partial_cpu(grad, norm_type, partials, index)
        for grad in grads:
            if device == "cuda":
                launch(scale_by_norm_cuda, grad.size, grad, partials, norm_type, max_norm, total)
            else:
                scale_by_norm_cpu(grad, partials, norm_type, max_norm, total)
    return Tensor(total.reshape(()))


def _raise_if_nonfinite_norm(grads, norm_type):
    partials = empty(len(grads), np.float64, "cpu")
    for index, grad in enumerate(grads):
        host = np.ascontiguousarray(grad.copy_to_host() if device_of(grad) == "cuda" else grad)
        norm_partial_cpu(host, norm_type, partials, index)
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
        if device_of(grad) == "cuda":
            launch(clip_value_cuda, grad.size, grad, value)
        else:
            clip_value_cpu(grad, value)
