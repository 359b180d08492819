"""Per-step state on the device: what a captured step reads instead of kernel arguments.

A replayed CUDA graph runs the kernels it recorded with the arguments it recorded, so a
value that changes every step (an optimizer's step count, the loader's batch position, a
dropout seed's step) cannot be a kernel argument: it lives in a small int64 array on the
step's device, the kernels that need it read it there, and one single-thread kernel
(``advance``, ``advance_steps``) moves it on, in the same stream order as the kernels around
it. A value the host decides between steps (a learning rate written into ``param_groups``)
lives in a ``HostMirror``, which the eager step and every replay sync before the step. The
eager step runs the same kernels on the same arrays, so eager and replayed steps compute the
same values, and a recording's kernel arguments never change.
"""
import numpy as np
from numba import njit

from ops.cuda import cuda
from ops.element_kernel import element_kernel
from ops.fill import fill
from ops.launch import CPU_KERNEL, Kernel, unrecorded
from ops.memory import empty


def _advance_element(i, counter, amount):
    counter[i] += amount   # a counter has one element: one thread


ADVANCE = element_kernel("advance_counter", _advance_element)


def new_counter(device, value=0):
    """A one-element int64 counter on ``device`` holding ``value``."""
    return fill(empty(1, np.int64, device), value)


def advance(counter, amount=1):
    """Add ``amount`` to ``counter`` on its device (one launch, no host sync)."""
    ADVANCE(counter, int(amount))


def set_counter(counter, value):
    """Write ``value`` into ``counter`` on its device, after the kernels launched before."""
    fill(counter, value)


# ------------------------------------------------------------------ an optimizer's step counts

T, BUFFER_UPDATES, SKIPPED = 0, 1, 2   # the words of ``new_step_counts``


@njit(**CPU_KERNEL)
def advance_steps_cpu(counts, faults):
    for k in range(0, faults.size, 4):
        if faults[k] != 0:   # a bad input this step: the update that follows leaves all as it was
            counts[SKIPPED] = 1
            return
    counts[T] += 1
    counts[BUFFER_UPDATES] += 1
    counts[SKIPPED] = 0


@cuda.jit(cache=True)
def advance_steps_cuda(counts, faults):
    # the fault words are mapped host memory: one thread per kind reads its flag, so the
    # step waits for one read across the bus, not one per kind in turn
    k = cuda.threadIdx.x * 4
    flagged = 0   # an integer: the barrier's predicate is an int32
    if k < faults.size and faults[k] != 0:
        flagged = 1
    faulted = cuda.syncthreads_or(flagged)
    if cuda.threadIdx.x == 0:
        if faulted:
            counts[SKIPPED] = 1
        else:
            counts[T] += 1
            counts[BUFFER_UPDATES] += 1
            counts[SKIPPED] = 0


ADVANCE_STEPS = Kernel("advance_steps", advance_steps_cpu, advance_steps_cuda,
                       lambda counts, faults: (1, max(1, faults.size // 4)))


def new_step_counts(device, step=0, buffer_updates=0):
    """The step counts of an optimizer's update unit on ``device``: ``[t, updates its state
    buffers have had, skipped]``. ``advance_steps`` moves the first two on before each update,
    unless an input fault is pending (``ops.flag_buffer``): then it sets ``skipped`` and the
    update kernel, reading it, changes nothing."""
    with unrecorded():   # set-up, not step work: a replay must not reset the counts
        counts = empty(3, np.int64, device)
        store_values(counts, (step, buffer_updates, 0))
    return counts


def advance_steps(counts, faults):
    ADVANCE_STEPS(counts, faults)


# ------------------------------------------------------------------ values written by the host

def _store_element(i, out, count, v0, v1, v2, v3, v4, v5, v6, v7):
    if i < count:
        out[i] = (v0, v1, v2, v3, v4, v5, v6, v7)[i]


STORE_VALUES = element_kernel("store_values", _store_element)
MAX_VALUES = 8


def store_values(out, values):
    """Write up to ``MAX_VALUES`` host numbers into the 1-D ``out``, in one launch."""
    if not 0 < len(values) <= min(MAX_VALUES, out.size):
        raise ValueError(f"store_values: {len(values)} values for an array of {out.size} "
                         f"(at most {MAX_VALUES})")
    cast = out.dtype.type
    padded = [cast(v) for v in values] + [cast(0)] * (MAX_VALUES - len(values))
    STORE_VALUES(out, len(values), *padded)


class HostMirror:
    """A float64 device array of values the host decides (an optimizer group's learning rate
    and other hyper-parameters) that kernels read instead of taking them as arguments, so a
    recorded kernel never needs new arguments. ``sync(values)`` compares and writes only
    when something changed: one launch then, none otherwise."""

    def __init__(self, device, values):
        with unrecorded():
            self.array = empty(len(values), np.float64, device)
        self.values = None
        self.sync(values)

    def sync(self, values):
        values = tuple(map(float, values))
        if values != self.values:
            with unrecorded():   # the replay runs this sync itself, before its kernels
                store_values(self.array, values)
            self.values = values
        return self.array
