"""Losses, each one kernel forward (the batch mean included) and one kernel backward.

- ``cross_entropy(logits (N, C), labels (N,))``: mean of ``logsumexp(x_i) - x_i[label_i]``.
  The forward also saves the softmax probabilities, so the backward is one elementwise pass
  ``(p - onehot) * grad_out / N`` that reads ``grad_out`` on the device.
- ``binary_cross_entropy(p, t)``: mean of ``-(t log p + (1 - t) log(1 - p))``, each log
  clamped at -100 as in PyTorch, so p = 0 or 1 gives a finite loss.
- ``mse(pred, target)``: mean of ``(pred - target)²``.

The means are fixed-order reductions (float64 accumulators): on CUDA one block of threads
takes strided rows (cross-entropy's over many logits computed beforehand by a thread each),
then ``ops.block_reduce``. No float atomics. The softmax of a row is
``exp(x - max) / Σ exp(x - max)``, so huge tied logits (1e17) still share probability 1.

Bad labels. A kernel cannot raise, so both kernels write the bad label, its row and the
class count into a small buffer and make the loss NaN. On the CPU the op reads the buffer
right after the call and raises at once. On CUDA a device->host copy per step would stall
the pipeline, so the buffer is mapped (host-visible) memory that the host reads, without a
synchronisation, at the start of every later CUDA cross-entropy call and in the backward:
the ValueError comes at the latest one step after the bad batch. Labels given as a host
NumPy array are checked on the host before they are copied.
"""
import math

import numpy as np
from numba import njit

from ops.block_reduce import REDUCE_THREADS, SUM, block_reduce_cuda
from ops.cuda import cuda
from ops.device import device_of, to_device
from ops.dispatch import Out, run
from ops.flag_buffer import flag_buffer
from ops.input_fault import fault_message
from ops.launch import CPU_KERNEL, Kernel, blocks_of, elements, threads_for
from ops.layout import flat
from ops.memory import empty
from ops.registry import Op, register

LOG_FLOOR = -100.0   # PyTorch's clamp of BCE's logs
BCE_GRAD_EPS = 1e-12
ONE_BLOCK = blocks_of(lambda *args: 1, REDUCE_THREADS)


# ------------------------------------------------------------------ cross-entropy

def _row_loss(logits, labels, probs, bad_label, i, classes):
    """Row i's loss, with its softmax probabilities written to ``probs``; a label outside
    [0, classes) is recorded in ``bad_label`` and makes the row NaN."""
    base = i * classes
    label = labels[i]
    if label < 0 or label >= classes:
        if bad_label[0] == 0:   # the first bad row (on CUDA: one of them)
            bad_label[0] = 1
            bad_label[1] = label
            bad_label[2] = i
            bad_label[3] = classes
        for j in range(classes):
            probs[base + j] = math.nan
        return math.nan
    top = logits[base]
    for j in range(1, classes):
        if logits[base + j] > top:
            top = logits[base + j]
    total = 0.0
    for j in range(classes):   # each exp once, kept in probs (computing it again: 2x the time)
        probs[base + j] = math.exp(logits[base + j] - top)
        total += probs[base + j]
    for j in range(classes):
        probs[base + j] = probs[base + j] / total
    return (top - logits[base + label]) + math.log(total)


_row_loss_cpu = njit(inline="always")(_row_loss)
_row_loss_cuda = cuda.jit(device=True)(_row_loss)


@njit(**CPU_KERNEL)
def cross_entropy_cpu(logits, labels, probs, loss, bad_label):
    rows = labels.size
    classes = probs.size // rows
    total = 0.0
    for i in range(rows):
        total += _row_loss_cpu(logits, labels, probs, bad_label, i, classes)
    loss[0] = total / rows


@cuda.jit(cache=True)
def cross_entropy_cuda(logits, labels, probs, loss, bad_label):
    t = cuda.threadIdx.x
    rows = labels.size
    classes = probs.size // rows
    total = 0.0
    for i in range(t, rows, REDUCE_THREADS):
        total += _row_loss_cuda(logits, labels, probs, bad_label, i, classes)
    total = block_reduce_cuda(SUM, total)
    if t == 0:
        loss[0] = total / rows


# Above this many logits the rows' losses come from a thread each, across the GPU, into a
# float64 buffer that one block then sums in the same order (the same bits): one block
# computing every row as well took 1.50 ms of the GPT's H200 step (16,384 rows of 65
# classes), 37 us so on an H100. Below it one launch does all (an MNIST batch, 128 x 10).
ONE_BLOCK_LOGITS = 4096   # 16 rows of 16 classes a thread of a 256-thread block (any device)


@cuda.jit(cache=True)
def cross_entropy_rows_cuda(logits, labels, probs, row_losses, bad_label):
    i = cuda.grid(1)
    if i < labels.size:
        row_losses[i] = _row_loss_cuda(logits, labels, probs, bad_label, i,
                                       probs.size // labels.size)


@cuda.jit(cache=True)
def mean_of_rows_cuda(row_losses, loss):
    t = cuda.threadIdx.x
    rows = row_losses.size
    total = 0.0
    for i in range(t, rows, REDUCE_THREADS):
        total += row_losses[i]
    total = block_reduce_cuda(SUM, total)
    if t == 0:
        loss[0] = total / rows


def _cross_entropy_plan(args):
    logits, labels, probs, loss, bad_label = args
    if logits.size <= ONE_BLOCK_LOGITS:
        return [(cross_entropy_cuda, 1, REDUCE_THREADS, args)]
    rows = labels.size
    row_losses = empty((rows,), np.float64, "cuda")
    threads = threads_for(rows)
    return [(cross_entropy_rows_cuda, -(-rows // threads), threads,
             (logits, labels, probs, row_losses, bad_label)),
            (mean_of_rows_cuda, 1, REDUCE_THREADS, (row_losses, loss))]


def _cross_entropy_grad(i, j, classes, probs, labels, scale, grad_logits):
    """Row i, class j of the gradient: ``(p - 1 if j is the label else p) * grad / rows``."""
    k = i * classes + j
    grad_logits[k] = (probs[k] - 1 if labels[i] == j else probs[k]) * scale


_cross_entropy_grad_cpu = njit(inline="always")(_cross_entropy_grad)
_cross_entropy_grad_cuda = cuda.jit(device=True)(_cross_entropy_grad)


@njit(**CPU_KERNEL)
def cross_entropy_grad_cpu(probs, labels, grad_out, grad_logits):
    """Rows, then classes: no division an element (a flat loop's ``k // classes`` took 209 us
    of the CPU GPT's 768 x 65)."""
    rows = labels.size
    classes = probs.size // rows
    scale = grad_out[0] / rows
    for i in range(rows):
        for j in range(classes):
            _cross_entropy_grad_cpu(i, j, classes, probs, labels, scale, grad_logits)


@cuda.jit(cache=True)
def cross_entropy_grad_cuda(probs, labels, grad_out, grad_logits):
    k = cuda.grid(1)
    if k < probs.size:
        rows = labels.size
        classes = probs.size // rows
        i = k // classes
        _cross_entropy_grad_cuda(i, k - i * classes, classes, probs, labels,
                                 grad_out[0] / rows, grad_logits)


CROSS_ENTROPY = Kernel("cross_entropy", cross_entropy_cpu, cuda_plan=_cross_entropy_plan)
CROSS_ENTROPY_GRAD = Kernel("cross_entropy_grad", cross_entropy_grad_cpu,
                            cross_entropy_grad_cuda, elements(0))


_bad_label_message = fault_message("cross_entropy: label {0} at row {1} is outside [0, {2})",
                                   "a recent CUDA batch")


def _bad_labels(device):
    return flag_buffer("cross_entropy", device, _bad_label_message, ValueError)


def labels_on_device(logits, labels):
    """``(labels on the logits' device, the bad-label flags)``: host labels checked on the
    host, then copied; a bad label of an earlier CUDA batch raised, read without a sync."""
    device = device_of(logits)
    if device_of(labels) != device:
        _check_labels_on_host(np.asarray(labels), logits.shape[1])
        labels = to_device(labels, device)
    bad = _bad_labels(device)
    if bad.deferred:
        bad.raise_if_flagged()
    return labels, bad


def _check_labels_on_host(labels, classes):
    bad = np.flatnonzero((labels < 0) | (labels >= classes))
    if bad.size:
        raise ValueError(f"cross_entropy: label {labels[bad[0]]} at row {bad[0]} is outside "
                         f"[0, {classes})")


@register
class CrossEntropy(Op):
    """Mean cross-entropy of ``logits`` (N, C) against integer ``labels`` (N,)."""
    name = "cross_entropy"
    kernels = (CROSS_ENTROPY, CROSS_ENTROPY_GRAD)
    integer_inputs = (1,)
    host_inputs = (1,)   # host labels are checked on the host, then copied

    def check(self, logits, labels):
        if logits.ndim != 2 or labels.ndim != 1 or labels.shape[0] != logits.shape[0]:
            raise ValueError(f"cross_entropy: expects logits (N, C) and labels (N,), got "
                             f"{tuple(logits.shape)} and {tuple(labels.shape)}")
        if logits.shape[0] == 0 or logits.shape[1] == 0:
            raise ValueError(f"cross_entropy: empty batch, logits of shape {tuple(logits.shape)}")

    def forward(self, logits, labels):
        labels, bad = labels_on_device(logits, labels)
        self.probs, loss = run(CROSS_ENTROPY, flat(logits), labels,
                               Out(logits.shape, logits.dtype), Out((), logits.dtype),
                               bad.device)
        if not bad.deferred:
            bad.raise_if_flagged()
        self.labels = labels
        return loss

    def backward(self, grad_out, grad_dst):
        bad = _bad_labels(device_of(self.probs))
        if bad.deferred:
            bad.raise_if_flagged()
        return run(CROSS_ENTROPY_GRAD, flat(self.probs), self.labels, flat(grad_out),
                   Out(self.probs.shape, self.probs.dtype)), None


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


@njit(**CPU_KERNEL)
def pair_loss_cpu(code, p, t, loss):
    total = 0.0
    for k in range(p.size):
        total += _pair_term_cpu(code, p[k], t[k])
    loss[0] = total / p.size


@cuda.jit(cache=True)
def pair_loss_cuda(code, p, t, loss):
    t_index = cuda.threadIdx.x
    total = 0.0
    for k in range(t_index, p.size, REDUCE_THREADS):
        total += _pair_term_cuda(code, p[k], t[k])
    total = block_reduce_cuda(SUM, total)
    if t_index == 0:
        loss[0] = total / p.size


@njit(**CPU_KERNEL)
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


PAIR_LOSS = Kernel("pair_loss", pair_loss_cpu, pair_loss_cuda, ONE_BLOCK)
PAIR_GRAD = Kernel("pair_loss_grad", pair_grad_cpu, pair_grad_cuda, elements(1))


class _PairLoss(Op):
    """A mean over elements of a loss of (prediction, target) pairs of the same shape."""
    kernels = (PAIR_LOSS, PAIR_GRAD)
    code = None

    def check(self, p, t):
        if tuple(p.shape) != tuple(t.shape):
            raise ValueError(f"{self.name}: prediction {tuple(p.shape)} and target "
                             f"{tuple(t.shape)} must have the same shape")
        if p.size == 0:
            raise ValueError(f"{self.name}: empty input of shape {tuple(p.shape)}")
        if self.code == BCE_CODE and isinstance(p, np.ndarray) and not np.all((p >= 0) & (p <= 1)):
            bad = p[~((p >= 0) & (p <= 1))]   # host data is checked here; device data gives NaN
            raise ValueError(f"binary_cross_entropy: probabilities must lie in [0, 1], got "
                             f"{bad[0]} (and {bad.size - 1} more)")

    def forward(self, p, t):
        self.p, self.t = p, t
        return run(PAIR_LOSS, self.code, flat(p), flat(t), Out((), p.dtype))

    def backward(self, grad_out, grad_dst):
        needs_p, needs_t = self.needs_input_grad
        shape, dtype = self.p.shape, self.p.dtype
        grad_p = Out(shape, dtype) if needs_p else None
        grad_t = Out(shape, dtype) if needs_t else None
        which = (1 if needs_p else 0) | (2 if needs_t else 0)
        first = grad_p or grad_t   # an unused slot gets the used one: never written
        run(PAIR_GRAD, self.code, flat(self.p), flat(self.t), flat(grad_out), first,
            grad_t or first, which)
        return (grad_p.array if needs_p else None), (grad_t.array if needs_t else None)


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
