"""Cross-entropy with torch's options: ``label_smoothing``, ``reduction`` and class
probabilities as the target. The plain case (integer labels, no smoothing, the mean) stays
``ops.loss.CrossEntropy``, whose kernels the captured MLP step runs; this op is taken only
when an option asks for it, so the plain step is unchanged.

With ``C`` classes, ``lse = log Σ_j exp(x_j)`` and smoothing ``ε`` (torch's definitions):

- integer labels: ``loss_i = (1 - ε) (lse - x_label) + ε (lse - mean_j x_j)``, the gradient
  ``p_j - (1 - ε) [j = label] - ε / C``;
- probabilities ``t`` (rows of the target, any non-negative values): ``t' = (1 - ε) t + ε / C``,
  ``loss_i = Σ_j t'_j (lse - x_j)``, the gradient ``p_j Σ_k t'_k - t'_j``;
- ``reduction``: "mean" (over the rows), "sum", or "none" (the (N,) row losses).

The target gets no gradient. The forward writes the softmax, the row losses and their
reduction in one kernel (on CUDA one block, ``ops.block_reduce``: a fixed order, no atomics);
the backward is one elementwise pass reading ``grad_out`` on the device. Labels outside
[0, C) are reported as ``ops.loss`` reports them.
"""
import math

from numba import njit

from ops.block_reduce import REDUCE_THREADS, SUM, block_reduce_cuda
from ops.cuda import cuda
from ops.device import device_of
from ops.dispatch import Out, run
from ops.element_kernel import element_kernel
from ops.launch import CPU_KERNEL, Kernel, blocks_of
from ops.layout import flat
from ops.loss import _bad_labels, _row_loss_cpu, _row_loss_cuda, labels_on_device
from ops.registry import Op, register
from ops.twin import twin

REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}
NONE, MEAN = REDUCTIONS["none"], REDUCTIONS["mean"]
ONE_BLOCK = blocks_of(lambda *args: 1, REDUCE_THREADS)


def _row_math(row_loss):
    """The row losses of both target kinds, given the device's compiled plain row loss
    (``ops.loss``: writes the row's softmax, returns ``lse - x_label``)."""

    def label_row(logits, labels, probs, bad_label, i, classes, smoothing):
        nll = row_loss(logits, labels, probs, bad_label, i, classes)
        if smoothing == 0.0:
            return nll
        mean = 0.0
        for j in range(classes):
            mean += logits[i * classes + j]
        lse = nll + logits[i * classes + labels[i]] if nll == nll else nll   # NaN: a bad label
        return (1.0 - smoothing) * nll + smoothing * (lse - mean / classes)

    def probability_row(logits, target, probs, i, classes, smoothing):
        base = i * classes
        top = logits[base]
        for j in range(1, classes):
            top = max(top, logits[base + j])
        total = 0.0
        for j in range(classes):
            total += math.exp(logits[base + j] - top)
        lse = top + math.log(total)
        loss = 0.0
        for j in range(classes):
            probs[base + j] = math.exp(logits[base + j] - top) / total
            weight = (1.0 - smoothing) * target[base + j] + smoothing / classes
            loss += weight * (lse - logits[base + j])
        return loss

    return label_row, probability_row


_label_row_cpu, _probability_row_cpu = (njit(inline="always")(f) for f in _row_math(_row_loss_cpu))
_label_row_cuda, _probability_row_cuda = (cuda.jit(device=True)(f)
                                          for f in _row_math(_row_loss_cuda))


@njit(inline="always")
def _reduced(total, rows, reduction):
    return total / rows if reduction == MEAN else total


@njit(**CPU_KERNEL)
def label_cross_entropy_cpu(logits, labels, probs, row_losses, loss, bad_label, smoothing,
                            reduction):
    rows = labels.size
    total = 0.0
    for i in range(rows):
        row_losses[i] = _label_row_cpu(logits, labels, probs, bad_label, i, probs.size // rows,
                                       smoothing)
        total += row_losses[i]
    loss[0] = _reduced(total, rows, reduction)


@cuda.jit(cache=True)
def label_cross_entropy_cuda(logits, labels, probs, row_losses, loss, bad_label, smoothing,
                             reduction):
    t = cuda.threadIdx.x
    rows = labels.size
    total = 0.0
    for i in range(t, rows, REDUCE_THREADS):
        row_losses[i] = _label_row_cuda(logits, labels, probs, bad_label, i, probs.size // rows,
                                        smoothing)
        total += row_losses[i]
    total = block_reduce_cuda(SUM, total)
    if t == 0:
        loss[0] = total / rows if reduction == MEAN else total


@njit(**CPU_KERNEL)
def probability_cross_entropy_cpu(logits, target, probs, row_losses, loss, smoothing,
                                  reduction):
    rows = row_losses.size
    total = 0.0
    for i in range(rows):
        row_losses[i] = _probability_row_cpu(logits, target, probs, i, probs.size // rows,
                                             smoothing)
        total += row_losses[i]
    loss[0] = _reduced(total, rows, reduction)


@cuda.jit(cache=True)
def probability_cross_entropy_cuda(logits, target, probs, row_losses, loss, smoothing,
                                   reduction):
    t = cuda.threadIdx.x
    rows = row_losses.size
    total = 0.0
    for i in range(t, rows, REDUCE_THREADS):
        row_losses[i] = _probability_row_cuda(logits, target, probs, i, probs.size // rows,
                                              smoothing)
        total += row_losses[i]
    total = block_reduce_cuda(SUM, total)
    if t == 0:
        loss[0] = total / rows if reduction == MEAN else total


def _row_scale(grad_out, row, rows, reduction):
    if reduction == NONE:
        return grad_out[row]
    return grad_out[0] / rows if reduction == MEAN else grad_out[0]


def _label_grad(row_scale):
    def element(i, probs, labels, grad_out, grad_logits, smoothing, reduction):
        rows = labels.size
        classes = probs.size // rows
        row = i // classes
        hit = (1.0 - smoothing) if labels[row] == i % classes else 0.0
        grad_logits[i] = ((probs[i] - hit - smoothing / classes)
                          * row_scale(grad_out, row, rows, reduction))
    return element


def _probability_grad(row_scale):
    def element(i, probs, target, grad_out, grad_logits, rows, smoothing, reduction):
        classes = probs.size // rows
        row = i // classes
        weights = 0.0   # Σ_j t'_j of the row (1 for rows of probabilities, not assumed)
        for j in range(row * classes, (row + 1) * classes):
            weights += (1.0 - smoothing) * target[j] + smoothing / classes
        weight = (1.0 - smoothing) * target[i] + smoothing / classes
        grad_logits[i] = (probs[i] * weights - weight) * row_scale(grad_out, row, rows,
                                                                   reduction)
    return element


_row_scales = twin(_row_scale)   # (cpu, cuda)


LABEL_CROSS_ENTROPY = Kernel("label_cross_entropy", label_cross_entropy_cpu,
                             label_cross_entropy_cuda, ONE_BLOCK)
LABEL_CROSS_ENTROPY_GRAD = element_kernel("label_cross_entropy_grad", _label_grad,
                                          positional=True, pairs=[_row_scales])
PROBABILITY_CROSS_ENTROPY = Kernel("probability_cross_entropy", probability_cross_entropy_cpu,
                                   probability_cross_entropy_cuda, ONE_BLOCK)
PROBABILITY_CROSS_ENTROPY_GRAD = element_kernel("probability_cross_entropy_grad",
                                                _probability_grad, positional=True,
                                                pairs=[_row_scales])


def checked_options(label_smoothing, reduction):
    if not (isinstance(label_smoothing, (int, float)) and 0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"cross_entropy: label_smoothing must be a number in [0, 1], got "
                         f"{label_smoothing!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction must be one of {sorted(REDUCTIONS)}, got "
                         f"{reduction!r}")
    return float(label_smoothing), REDUCTIONS[reduction]


def _check_logits(logits):
    if logits.ndim != 2 or logits.shape[0] == 0 or logits.shape[1] == 0:
        raise ValueError(f"cross_entropy: expects logits (N, C) with N, C > 0, got "
                         f"{tuple(logits.shape)}")


def _outputs(logits):
    """The softmax, the row losses and their reduction."""
    return (Out(logits.shape, logits.dtype), Out((logits.shape[0],), logits.dtype),
            Out((), logits.dtype))


@register
class LabelCrossEntropy(Op):
    """Cross-entropy of ``logits`` (N, C) against integer ``labels`` (N,) with torch's
    ``label_smoothing`` and ``reduction``."""
    name = "label_cross_entropy"
    kernels = (LABEL_CROSS_ENTROPY, LABEL_CROSS_ENTROPY_GRAD)
    integer_inputs = (1,)
    host_inputs = (1,)   # host labels are checked on the host, then copied

    def check(self, logits, labels):
        _check_logits(logits)
        if labels.ndim != 1 or labels.shape[0] != logits.shape[0]:
            raise ValueError(f"cross_entropy: expects labels (N,) for logits "
                             f"{tuple(logits.shape)}, got {tuple(labels.shape)}")
        self.smoothing, self.reduction = checked_options(**self.params)

    def forward(self, logits, labels):
        labels, bad = labels_on_device(logits, labels)
        self.probs, row_losses, loss = run(
            LABEL_CROSS_ENTROPY, flat(logits), labels,
            *_outputs(logits), bad.device,
            self.smoothing, self.reduction)
        if not bad.deferred:
            bad.raise_if_flagged()
        self.labels = labels
        return row_losses if self.reduction == NONE else loss

    def backward(self, grad_out, grad_dst):
        bad = _bad_labels(device_of(self.probs))
        if bad.deferred:
            bad.raise_if_flagged()
        return run(LABEL_CROSS_ENTROPY_GRAD, flat(self.probs), self.labels, flat(grad_out),
                   Out(self.probs.shape, self.probs.dtype), self.smoothing,
                   self.reduction), None


@register
class ProbabilityCrossEntropy(Op):
    """Cross-entropy of ``logits`` (N, C) against class probabilities ``target`` (N, C)
    with torch's ``label_smoothing`` and ``reduction``."""
    name = "probability_cross_entropy"
    kernels = (PROBABILITY_CROSS_ENTROPY, PROBABILITY_CROSS_ENTROPY_GRAD)

    def check(self, logits, target):
        _check_logits(logits)
        if tuple(target.shape) != tuple(logits.shape):
            raise ValueError(f"cross_entropy: class-probability targets must have the logits' "
                             f"shape {tuple(logits.shape)}, got {tuple(target.shape)}")
        self.smoothing, self.reduction = checked_options(**self.params)

    def forward(self, logits, target):
        self.probs, row_losses, loss = run(
            PROBABILITY_CROSS_ENTROPY, flat(logits), flat(target),
            *_outputs(logits), self.smoothing, self.reduction)
        self.target = target
        return row_losses if self.reduction == NONE else loss

    def backward(self, grad_out, grad_dst):
        return run(PROBABILITY_CROSS_ENTROPY_GRAD, flat(self.probs), flat(self.target),
                   flat(grad_out), Out(self.probs.shape, self.probs.dtype),
                   self.target.shape[0], self.smoothing, self.reduction), None
