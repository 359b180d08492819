"""Losses, each one kernel forward (the batch mean included) and one kernel backward.

- ``cross_entropy(logits (N, C), labels (N,))``: mean of ``logsumexp(x_i) - x_i[label_i]``.
  The forward also saves the softmax probabilities, so the backward is one elementwise pass
  ``(p - onehot) * grad_out / N`` that reads ``grad_out`` on the device.
- ``binary_cross_entropy(p, t)``: mean of ``-(t log p + (1 - t) log(1 - p))``, each log
  clamped at -100 as in PyTorch, so p = 0 or 1 gives a finite loss.
- ``mse(pred, target)``: mean of ``(pred - target)²``.

The means are fixed-order reductions (float64 accumulators): on CUDA one block of threads
takes strided rows, then a shared-memory tree. No float atomics.

Bad labels. On the CPU the kernel returns the first bad row and the op raises at once. On
CUDA a kernel cannot raise and a device->host copy per step would stall the pipeline, so the
kernel writes the bad label, its row and the class count into a small buffer in mapped
(host-visible) memory, and makes the loss NaN. The host reads that buffer, without a
synchronisation, at the start of every later CUDA cross-entropy call and in the backward:
the ValueError comes at the latest one step after the bad batch. Labels given as a host
NumPy array are checked on the host before they are copied.
"""
import math

import numpy as np
from numba import cuda, float64, njit

from ops.block_sum import block_sum_cuda
from ops.device import SIMULATOR, device_of, to_device
from ops.launch import launch, launch_blocks, run_kernel
from ops.layout import flat, same_device, same_dtype
from ops.memory import empty
from ops.registry import Op, register

REDUCE_THREADS = 8 if SIMULATOR else 256   # a power of two (the tree halves it)
LOG_FLOOR = -100.0   # PyTorch's clamp of BCE's logs
BCE_GRAD_EPS = 1e-12


@cuda.jit(device=True)
def _block_mean(partial, t, total, count, out):
    """out[0] = the block's ``total``s summed in a fixed order, divided by ``count``."""
    total = block_sum_cuda(partial, t, total)
    if t == 0:
        out[0] = total / count


# ------------------------------------------------------------------ cross-entropy

def _row_loss(logits, labels, probs, i, classes):
    """Row i's loss and softmax probabilities (the label already validated)."""
    base = i * classes
    top = logits[base]
    for j in range(1, classes):
        if logits[base + j] > top:
            top = logits[base + j]
    total = 0.0
    for j in range(classes):
        total += math.exp(logits[base + j] - top)
    lse = top + math.log(total)
    for j in range(classes):
        probs[base + j] = math.exp(logits[base + j] - lse)
    return lse - logits[base + labels[i]]


_row_loss_cpu = njit(inline="always")(_row_loss)
_row_loss_cuda = cuda.jit(device=True)(_row_loss)


@njit(cache=True)
def cross_entropy_cpu(logits, labels, probs, loss, classes):
    """Writes loss[0] and probs; returns the first row with a bad label, or -1."""
    rows = labels.size
    for i in range(rows):
        if labels[i] < 0 or labels[i] >= classes:
            return i
    total = 0.0
    for i in range(rows):
        total += _row_loss_cpu(logits, labels, probs, i, classes)
    loss[0] = total / rows
    return -1


@cuda.jit(cache=True)
def cross_entropy_cuda(logits, labels, probs, loss, bad_label):
    partial = cuda.shared.array(REDUCE_THREADS, float64)
    t = cuda.threadIdx.x
    rows = labels.size
    classes = probs.size // rows
    total = 0.0
    for i in range(t, rows, REDUCE_THREADS):
        label = labels[i]
        if label < 0 or label >= classes:
            bad_label[0] = 1
            bad_label[1] = label
            bad_label[2] = i
            bad_label[3] = classes
            total += math.nan
            for j in range(classes):
                probs[i * classes + j] = math.nan
        else:
            total += _row_loss_cuda(logits, labels, probs, i, classes)
    _block_mean(partial, t, total, rows, loss)


@njit(cache=True)
def cross_entropy_grad_cpu(probs, labels, grad_out, grad_logits):
    rows = labels.size
    classes = probs.size // rows
    scale = grad_out[0] / rows
    for k in range(probs.size):
        hit = labels[k // classes] == k % classes
        grad_logits[k] = (probs[k] - 1 if hit else probs[k]) * scale


@cuda.jit(cache=True)
def cross_entropy_grad_cuda(probs, labels, grad_out, grad_logits):
    k = cuda.grid(1)
    if k < probs.size:
        rows = labels.size
        classes = probs.size // rows
        hit = labels[k // classes] == k % classes
        grad_logits[k] = (probs[k] - 1 if hit else probs[k]) * (grad_out[0] / rows)


class _BadLabelBuffer:
    """[flag, label, row, classes] in mapped memory: the kernel writes, the host reads it
    whenever it likes without stopping the device."""

    def __init__(self):
        if SIMULATOR:   # kernels run synchronously: a plain device array reads the same
            self.device = cuda.to_device(np.zeros(4, np.int64))
            self.host = None
        else:
            from numba.cuda.cudadrv.devicearray import DeviceNDArray
            self.host = cuda.mapped_array(4, np.int64)
            self.host[:] = 0
            # a device-array view of the same memory: the launch path refuses host arrays
            self.device = DeviceNDArray(self.host.shape, self.host.strides, self.host.dtype,
                                        gpu_data=self.host.gpu_data)

    def raise_if_flagged(self):
        values = self.device.copy_to_host() if SIMULATOR else self.host.copy()
        if values[0]:
            if SIMULATOR:
                self.device.copy_to_device(np.zeros(4, np.int64))
            else:
                self.host[:] = 0
            raise ValueError(f"cross_entropy: label {values[1]} at row {values[2]} is outside "
                             f"[0, {values[3]}) (a recent CUDA batch)")


_bad_label_buffer = None


def _bad_labels():
    global _bad_label_buffer
    if _bad_label_buffer is None:
        _bad_label_buffer = _BadLabelBuffer()
    return _bad_label_buffer


def _check_labels_on_host(labels, classes):
    bad = np.flatnonzero((labels < 0) | (labels >= classes))
    if bad.size:
        raise ValueError(f"cross_entropy: label {labels[bad[0]]} at row {bad[0]} is outside "
                         f"[0, {classes})")


@register
class CrossEntropy(Op):
    """Mean cross-entropy of ``logits`` (N, C) against integer ``labels`` (N,)."""
    name = "cross_entropy"
    integer_inputs = (1,)
    cpu_kernels = (cross_entropy_cpu, cross_entropy_grad_cpu)
    cuda_kernels = (cross_entropy_cuda, cross_entropy_grad_cuda)

    def forward(self, logits, labels):
        if np.dtype(labels.dtype).kind not in "iu":
            raise TypeError(f"cross_entropy: labels must be integers, got {np.dtype(labels.dtype)}")
        if logits.ndim != 2 or labels.ndim != 1 or labels.shape[0] != logits.shape[0]:
            raise ValueError(f"cross_entropy: expects logits (N, C) and labels (N,), got "
                             f"{tuple(logits.shape)} and {tuple(labels.shape)}")
        rows, classes = logits.shape
        if rows == 0 or classes == 0:
            raise ValueError(f"cross_entropy: empty batch, logits of shape {tuple(logits.shape)}")
        device = device_of(logits)
        if device_of(labels) != device:
            if device_of(labels) == "cpu":
                _check_labels_on_host(np.asarray(labels), classes)
            labels = to_device(labels, device)
        self.probs = empty(logits.shape, logits.dtype, device)
        loss = empty((), logits.dtype, device)
        if device == "cuda":
            bad = _bad_labels()
            bad.raise_if_flagged()   # a previous batch's bad label, read without a sync
            launch_blocks(cross_entropy_cuda, 1, REDUCE_THREADS, flat(logits), labels,
                          flat(self.probs), flat(loss), bad.device)
            if SIMULATOR:
                bad.raise_if_flagged()
        else:
            bad_row = cross_entropy_cpu(flat(logits), labels, flat(self.probs), flat(loss),
                                        classes)
            if bad_row >= 0:
                _check_labels_on_host(labels, classes)
        self.labels = labels
        return loss

    def backward(self, grad_out, grad_dst):
        grad = empty(self.probs.shape, self.probs.dtype, device_of(self.probs))
        args = (flat(self.probs), self.labels, flat(grad_out), flat(grad))
        if device_of(grad) == "cuda":
            _bad_labels().raise_if_flagged()
            launch(cross_entropy_grad_cuda, grad.size, *args)
        else:
            cross_entropy_grad_cpu(*args)
        return grad, None


# ------------------------------------------------------------------ BCE and MSE

BCE_CODE, MSE_CODE = 0, 1


def _pair_math(jit):
    """The element math of BCE and MSE compiled by ``jit``: one copy per device."""

    @jit
    def bce_logs(p):
        log_p = math.log(p) if p > 0 else -math.inf
        log_q = math.log(1 - p) if p < 1 else -math.inf
        return max(log_p, LOG_FLOOR), max(log_q, LOG_FLOOR)

    @jit
    def term(code, p, t):
        if code == MSE_CODE:
            return (p - t) * (p - t)
        if not (0 <= p <= 1):   # NaN too: a probability out of range poisons the loss
            return math.nan
        log_p, log_q = bce_logs(p)
        return -(t * log_p + (1 - t) * log_q)

    @jit
    def grads(code, p, t, scale):
        """(d loss/d p, d loss/d t) of one element, times ``scale`` = grad_out / N."""
        if code == MSE_CODE:
            d = 2 * (p - t) * scale
            return d, -d
        log_p, log_q = bce_logs(p)
        return (p - t) / max(p * (1 - p), BCE_GRAD_EPS) * scale, (log_q - log_p) * scale

    return term, grads


_pair_term_cpu, _pair_grads_cpu = _pair_math(njit(inline="always"))
_pair_term_cuda, _pair_grads_cuda = _pair_math(cuda.jit(device=True))


@njit(cache=True)
def pair_loss_cpu(code, p, t, loss):
    total = 0.0
    for k in range(p.size):
        total += _pair_term_cpu(code, p[k], t[k])
    loss[0] = total / p.size


@cuda.jit(cache=True)
def pair_loss_cuda(code, p, t, loss):
    partial = cuda.shared.array(REDUCE_THREADS, float64)
    t_index = cuda.threadIdx.x
    total = 0.0
    for k in range(t_index, p.size, REDUCE_THREADS):
        total += _pair_term_cuda(code, p[k], t[k])
    _block_mean(partial, t_index, total, p.size, loss)


@njit(cache=True)
def pair_grad_cpu(code, p, t, grad_out, grad_p, grad_t, which):
    scale = grad_out[0] / p.size
    for k in range(p.size):
        dp, dt = _pair_grads_cpu(code, p[k], t[k], scale)
        if which & 1:
            grad_p[k] = dp
        if which & 2:
            grad_t[k] = dt


@cuda.jit(cache=True)
def pair_grad_cuda(code, p, t, grad_out, grad_p, grad_t, which):
    k = cuda.grid(1)
    if k < p.size:
        dp, dt = _pair_grads_cuda(code, p[k], t[k], grad_out[0] / p.size)
        if which & 1:
            grad_p[k] = dp
        if which & 2:
            grad_t[k] = dt


class _PairLoss(Op):
    """A mean over elements of a loss of (prediction, target) pairs of the same shape."""
    cpu_kernels = (pair_loss_cpu, pair_grad_cpu)
    cuda_kernels = (pair_loss_cuda, pair_grad_cuda)
    code = None

    def forward(self, p, t):
        device = same_device(self.name, p, t)
        same_dtype(self.name, p, t)
        if tuple(p.shape) != tuple(t.shape):
            raise ValueError(f"{self.name}: prediction {tuple(p.shape)} and target "
                             f"{tuple(t.shape)} must have the same shape")
        if p.size == 0:
            raise ValueError(f"{self.name}: empty input of shape {tuple(p.shape)}")
        if self.code == BCE_CODE and device == "cpu" and not np.all((p >= 0) & (p <= 1)):
            bad = np.asarray(p)[~((p >= 0) & (p <= 1))]
            raise ValueError(f"binary_cross_entropy: probabilities must lie in [0, 1], got "
                             f"{bad[0]} (and {bad.size - 1} more)")
        loss = empty((), p.dtype, device)
        if device == "cuda":
            launch_blocks(pair_loss_cuda, 1, REDUCE_THREADS, self.code, flat(p), flat(t),
                          flat(loss))
        else:
            pair_loss_cpu(self.code, flat(p), flat(t), flat(loss))
        self.p, self.t = p, t
        return loss

    def backward(self, grad_out, grad_dst):
        needs_p, needs_t = self.needs_input_grad
        device, dtype = device_of(self.p), self.p.dtype
        grad_p = empty(self.p.shape, dtype, device) if needs_p else None
        grad_t = empty(self.t.shape, dtype, device) if needs_t else None
        which = (1 if needs_p else 0) | (2 if needs_t else 0)
        first = grad_p if needs_p else grad_t   # an unused slot gets the used one: never written
        args = (self.code, flat(self.p), flat(self.t), flat(grad_out), flat(first),
                flat(grad_t if needs_t else first), which)
        run_kernel(device, pair_grad_cpu, pair_grad_cuda, self.p.size, *args)
        return grad_p, grad_t


@register
class BinaryCrossEntropy(_PairLoss):
    """Mean binary cross-entropy of probabilities ``p`` against targets ``t`` in [0, 1]."""
    name = "binary_cross_entropy"
    code = BCE_CODE


@register
class MSE(_PairLoss):
    """Mean squared error."""
    name = "mse"
    code = MSE_CODE


