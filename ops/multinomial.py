"""``multinomial``: draw category positions from the rows of non-negative weights (torch's
``multinomial``: with or without replacement), from a seed in device memory.

A thread owns a row. Draw s of row r takes a uniform number from a hash of (seed, r, s)
(``ops.dropout``'s seed hash: the same integers on both devices, so the CPU and CUDA draw the
same samples from one seed), scales it by the row's total weight (float64) and walks the
row to the category whose cumulative weight passes it, skipping the categories drawn already
when drawing without replacement.

Bad rows. A negative, infinite or NaN weight, a row without positive weight, or fewer
positive weights than draws without replacement: host rows are checked on the host before
the kernel runs (a ValueError naming the op, the row and the fix); on the device the kernel
records the row in the op's fault words (``ops.flag_buffer``) and writes -1.
"""
import math

import numpy as np
from numba import njit

from ops.cuda_backend import cuda
from ops.device import device_of
from ops.dispatch import Out, run
from ops.dropout import _call_seed_cpu, _call_seed_cuda
from ops.flag_buffer import flag_buffer
from ops.launch import CPU_KERNEL, Kernel
from ops.layout import flat
from ops.registry import Op, register

UNIFORM_SCALE = 2.0 ** -63   # a 63-bit hash to [0, 1)


def _draw_with(call_seed):
    def draw(r, probs, seed, out, n, samples, replacement, bad):
        base = r * n
        total = 0.0
        positive = 0
        for j in range(n):
            p = probs[base + j]
            if not (p >= 0) or p == math.inf:
                total = -1.0
                break
            total += p
            if p > 0:
                positive += 1
        if total <= 0 or (not replacement and positive < samples):
            if bad[0] == 0:
                bad[1] = positive if total > 0 else -1
                bad[2] = r
                bad[3] = samples
                bad[0] = 1
            for s in range(samples):
                out[r * samples + s] = -1
            return
        for s in range(samples):
            u = call_seed(seed[0], r * samples + s) * UNIFORM_SCALE
            left = total
            if not replacement:   # the weight the earlier draws of this row took away
                for earlier in range(s):
                    left -= probs[base + out[r * samples + earlier]]
            target = u * left
            chosen = -1
            running = 0.0
            for j in range(n):
                p = probs[base + j]
                if p <= 0:
                    continue
                if not replacement:
                    taken = False
                    for earlier in range(s):
                        taken = taken or out[r * samples + earlier] == j
                    if taken:
                        continue
                chosen = j   # the last eligible category catches rounding at the end
                running += p
                if running > target:
                    break
            out[r * samples + s] = chosen
    return draw


_draw_cpu = njit(inline="always", error_model="numpy")(_draw_with(_call_seed_cpu))
_draw_cuda = cuda.jit(device=True)(_draw_with(_call_seed_cuda))


@njit(**CPU_KERNEL)
def multinomial_cpu(probs, seed, out, n, samples, replacement, bad):
    for r in range(out.size // samples if samples else 0):
        _draw_cpu(r, probs, seed, out, n, samples, replacement, bad)


@cuda.jit(cache=True)
def multinomial_cuda(probs, seed, out, n, samples, replacement, bad):
    r = cuda.grid(1)
    if samples and r < out.size // samples:
        _draw_cuda(r, probs, seed, out, n, samples, replacement, bad)


MULTINOMIAL = Kernel("multinomial", multinomial_cpu, multinomial_cuda,
                     lambda probs, seed, out, n, samples, *rest:
                     out.size // samples if samples else 0)


def _bad_row_message(values, deferred):
    when = " (a recent CUDA call)" if deferred else ""
    if values[1] < 0:
        problem = "has a negative, infinite or NaN weight, or no positive one"
    else:
        problem = (f"has {values[1]} positive weights for {values[3]} draws without "
                   "replacement (pass replacement=True, or draw fewer)")
    return f"multinomial: row {values[2]} of the probabilities {problem}{when}"


def _bad_rows(device):
    return flag_buffer("multinomial", device, _bad_row_message, ValueError)


def check_rows_on_host(probs, samples, replacement):
    """Raise the op's ValueError for the first bad row of the host array ``probs``."""
    rows = np.asarray(probs, np.float64).reshape(-1, tuple(probs.shape)[-1])
    with np.errstate(invalid="ignore"):
        broken = ~np.all(np.isfinite(rows) & (rows >= 0), axis=1) | ~(rows.sum(axis=1) > 0)
    positive = np.count_nonzero(rows > 0, axis=1)
    short = (positive < samples) & (not replacement)
    for r in np.flatnonzero(broken | short)[:1]:
        raise ValueError(_bad_row_message((1, -1 if broken[r] else positive[r], r, samples),
                                          False))


@register
class Multinomial(Op):
    """Inputs ``(probs, seed)``: probs (n,) or (rows, n) weights, seed a one-element int64
    array; params ``samples`` and ``replacement``. Never differentiated."""
    name = "multinomial"
    kernels = (MULTINOMIAL,)
    integer_inputs = (1,)

    def check(self, probs, seed):
        samples, shape = self.params["samples"], tuple(probs.shape)
        if probs.ndim not in (1, 2) or shape[-1] == 0:
            raise ValueError(f"multinomial: probs must be (n,) or (rows, n) with n > 0, got "
                             f"shape {shape}")
        if samples <= 0:
            raise ValueError(f"multinomial: num_samples must be positive, got {samples}")
        if not self.params["replacement"] and samples > shape[-1]:
            raise ValueError(f"multinomial: cannot draw {samples} samples from {shape[-1]} "
                             "categories without replacement (pass replacement=True)")

    def forward(self, probs, seed):
        samples, replacement = self.params["samples"], self.params["replacement"]
        if device_of(probs) == "cpu":
            check_rows_on_host(probs, samples, replacement)
        bad = _bad_rows(device_of(probs))
        if bad.deferred:
            bad.raise_if_flagged()
        out = run(MULTINOMIAL, flat(probs), seed,
                  Out(tuple(probs.shape)[:-1] + (samples,), np.int64), tuple(probs.shape)[-1],
                  samples, bool(replacement), bad.device)
        if not bad.deferred:
            bad.raise_if_flagged()
        return out
