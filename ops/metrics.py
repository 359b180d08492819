"""Running training metrics kept on the batch's device: one launch per step, no host sync.

``totals`` is a float64 array ``[sum of batch loss * rows, correct predictions, rows]``; the
training loop reads it once per epoch. Not an op: nothing here is differentiated.
"""
import numpy as np
from numba import njit

from ops.block_reduce import REDUCE_THREADS, SUM, block_reduce_cuda
from ops.cuda import cuda
from ops.device import to_host
from ops.launch import Kernel, blocks_of
from ops.fill import fill
from ops.memory import empty

LOSS_SUM, CORRECT, ROWS = range(3)


def _is_correct(logits, labels, row):
    """1.0 when the row's first largest logit is at its label, else 0.0."""
    best = 0
    for c in range(1, logits.shape[1]):
        if logits[row, c] > logits[row, best]:
            best = c
    return 1.0 if best == labels[row] else 0.0


def _add_totals(totals, loss, rows, correct, has_loss):
    totals[LOSS_SUM] += loss[0] * rows if has_loss else 0.0
    totals[CORRECT] += correct
    totals[ROWS] += rows


_is_correct_cpu = njit(inline="always", error_model="numpy")(_is_correct)
_is_correct_cuda = cuda.jit(device=True)(_is_correct)
_add_totals_cpu = njit(inline="always", error_model="numpy")(_add_totals)
_add_totals_cuda = cuda.jit(device=True)(_add_totals)


@njit(cache=True, error_model="numpy")
def accumulate_cpu(loss, logits, labels, totals, classify, has_loss):
    rows = logits.shape[0]
    correct = 0.0
    if classify:
        for row in range(rows):
            correct += _is_correct_cpu(logits, labels, row)
    _add_totals_cpu(totals, loss, rows, correct, has_loss)


@cuda.jit(cache=True)
def accumulate_cuda(loss, logits, labels, totals, classify, has_loss):
    """One block: per-thread counts over rows, then the fixed-order block reduction."""
    t = cuda.threadIdx.x
    rows = logits.shape[0]
    count = 0.0
    if classify:
        for row in range(t, rows, REDUCE_THREADS):
            count += _is_correct_cuda(logits, labels, row)
    correct = block_reduce_cuda(SUM, count)
    if t == 0:
        _add_totals_cuda(totals, loss, rows, correct, has_loss)


ACCUMULATE = Kernel("accumulate_metrics", accumulate_cpu, accumulate_cuda,
                    blocks_of(lambda *args: 1, REDUCE_THREADS))


class RunningMetrics:
    """Mean loss and accuracy of one pass, accumulated on ``device``."""

    def __init__(self, device):
        # zeroed here, not by the first add: every add is then the same launch, which a
        # captured step can replay
        self.totals = fill(empty(3, np.float64, device), 0)
        self.classify = None
        self._no_labels = empty(0, np.int64, device)

    def reset(self):
        """Start a new pass: the totals zeroed by a kernel (the same arrays: a captured step
        that adds to them stays valid)."""
        fill(self.totals, 0)

    def add(self, loss, logits, labels):
        """``loss``: the batch-mean loss array (one element, or None); ``logits`` (rows,
        classes) or any prediction array; ``labels``: class indices (else no accuracy)."""
        classify = bool(logits.ndim == 2 and labels.ndim == 1
                        and np.dtype(labels.dtype).kind in "iu")
        first = self.classify is None
        self.classify = classify if first else self.classify and classify
        if logits.ndim != 2:
            logits = logits.reshape(logits.shape[0], -1)
        has_loss = loss is not None
        self.has_loss = has_loss if first else self.has_loss and has_loss
        ACCUMULATE(loss.reshape(1) if has_loss else self.totals, logits,
                   labels if classify else self._no_labels, self.totals, classify, has_loss)

    def read(self):
        """``(mean loss per sample, accuracy or None, rows)``; one device-to-host copy."""
        if self.classify is None:
            return None, None, 0
        loss_sum, correct, rows = to_host(self.totals)
        if rows == 0:
            return None, None, 0
        return ((loss_sum / rows if self.has_loss else None),
                (correct / rows if self.classify else None), int(rows))
