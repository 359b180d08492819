"""How many threads the engine's CPU kernels run on, and the pool that splits a large GEMM.

One count (``threads()``) drives the CPU side, set by ``engine.set_num_threads`` or, by
default, the CPUs the process may use less those that other processes kept busy:

- a large GEMM (``SPLIT_MIN_MACS`` multiply-adds or more) is cut into row blocks of its
  output (``row_blocks``, at most one per ``MIN_BLOCK_MACS`` of work), each one
  single-threaded BLAS call (with the ``@njit(nogil=True)`` loops around it), run by
  ``run_blocks`` on the calling thread and ``ops.cpu_pool``'s worker threads (started at the
  first split, spinning between splits without the GIL). No ``prange``: a parallel kernel
  costs 1.1-2.2 s of compile on a cold cache, the split costs none (the blocks run the code
  the unsplit call runs, on row slices).
  BLAS's own pool stays at one thread (``engine.blas_threads``), since its idle threads
  spin;
- an element kernel (an optimizer's update, ``ops.element_kernel``) over
  ``SPLIT_MIN_ELEMENTS`` elements or more runs in blocks of its elements the same way
  (``element_blocks``);
- the convolutions, pooling and BatchNorm run their samples, planes or channels in blocks
  the same way (``in_blocks``; ``prange`` loops doubled their compile time: the CNN's first
  step from an empty cache compiled its conv kernels in 32.1-33.3 s, 13.2-16.1 without).

Following the load reads no clock in a thread of its own: at most once every
``LOAD_INTERVAL_S`` (about an epoch of the reference MLP), the first kernel that asks reads
``/proc/stat`` and this process's own CPU time and takes the CPUs that the other processes
used on average since the last reading (``others_busy``); the first kernel, and the first
after ``IDLE_S`` without one, guesses from the threads runnable now (``others_now``). Two threads beside one busy
process wait on each other (a parallel step waits for its slower half, which waits a
scheduler slice for its core): conv 1->32 forward and backward took 18.6 ms on two threads
against 5.3 serial, and 2 BLAS threads ran 128x784x256 about 15x slower than 1. A split
sees that wait itself before the next reading does: when its workers end more than its own
block's time after it (``split_stalled``) in 2 of the last 3 splits, the count drops to one
thread for ``FALL_BACK_S``, then the load is read again.
"""
import collections
import functools
import os
import threading
import time

import numpy as np

from ops.cpu_pool import run_calls

# A block is worth a thread when its BLAS call takes a few times the pool's hand-off. The
# pool's workers run a GEMM block as its CBLAS call from compiled code (ops.cpu_pool), 2-3 us
# after the hand-over; one BLAS thread takes 94 us for 3.2M multiply-adds (16x784x256). So a
# GEMM runs in at most macs // MIN_BLOCK_MACS blocks (about 50 us of BLAS each): on 2 threads
# the MLP's 4.2M second layer forward (128x256 @ 256x128) in two blocks took 61-68 us against
# 94-103 whole (bench.cpu_step, alternating), its 25.7M first layer at most 12 blocks (on 16
# threads, where the uncapped split made 16 of 1.6M; with the executor's 20-50 us hand-offs
# the 16-core host ran the MLP slower on 16 threads than on 2, 1.269 against 1.045 s/epoch,
# and the cap was 6 blocks of 4M).
MIN_BLOCK_MACS = 2 << 20
SPLIT_MIN_MACS = 2 * MIN_BLOCK_MACS   # the smallest GEMM that splits (in two)
MIN_BLOCK_ROWS = 32   # a block of fewer output rows runs BLAS's edge kernels most of the time
ROW_ALIGN = 16   # OpenBLAS's Haswell sgemm works on 16 output rows at a time
# An element kernel splits later than a GEMM: Adam ran 0.93 ns an element on one thread of the
# 2-core Xeon and the hand-off costs 40-50 us (nogil kernels, load 0): over 235k elements
# (the MLP's parameters) 219 us whole against 165 in two blocks, 128k 119-124 against 104,
# 64k 59 against 73-89. The batch gather (NumPy's take of 128 MNIST rows) does not split:
# 47 us whole, 74-83 in two.
MIN_BLOCK_ELEMENTS = 64 << 10
SPLIT_MIN_ELEMENTS = 2 * MIN_BLOCK_ELEMENTS
# ... and a block must also take this long by the kernel's own measured pace (``split_over_
# threads`` times its whole calls). A worker starts a kernel's block 2-3 us after the hand-over
# (``ops.compiled_call``: a Python call took 20-22 us to get the GIL), so shorter blocks pay
# than before (100 us). Measured on the 2-core EPYC (load 0.5, 2 threads, ``opt.step()``
# medians, alternating the floor 100 / 30 / 10 us): Adam over 235k 107 / 81 / 80 us (one
# thread 106), SGD over 669k 74 / 62 / 62 (one thread 74); plain SGD over 235k, blocks of
# about 10 us, lost when split: 35 / 35 / 40. But blocks under 50 us lost in a model's step,
# whose arrays the caller's core had just written (LayerNorm's 768x128 forward in two blocks
# of 22 us: 46 -> 37 us alone, but the GPT's step's 9 forwards 553 us split against 437-479
# whole), and SGD's over 669k (blocks of about 35 us) ran 62-134 us on 2 threads from run to
# run against 77 on one.
MIN_BLOCK_SECONDS = 50e-6
# ... or this long where the blocks are the last call's, on the same arrays (an optimizer's
# update: ``ops.compiled_call.KeptBlocks``), handed over without making their records anew.
MIN_KEPT_BLOCK_SECONDS = 10e-6
ELEMENT_ALIGN = 64   # block edges on whole 256-byte lines of float32
LOAD_INTERVAL_S = 1.0
# A process none of whose kernels asked for the count this long was idle: the CPUs others
# used meanwhile are no guide to now. In bench.cnn and bench.mlp, whose rows run in processes
# of their own, the engine's process waiting while PyTorch's ran its epoch read PyTorch's two
# busy cores as neighbours and began its next epoch on one thread (the MLP's 0.8 s epochs
# all of it). So after such a gap the count is guessed afresh; a step asks every few ms.
IDLE_S = 0.5
# The fresh guess: the fewest runnable threads of other processes in a few looks a few ms
# apart; one look can catch the threads of a process that has just ended its work still
# spinning (libgomp's spin before they sleep), a busy neighbour is in every look.
GUESS_LOOKS, GUESS_LOOK_GAP_S = 3, 0.002
STALL_MIN_S = 200e-6   # a wait for the workers shorter than this is never a stall
# One stalled split is not yet a busy neighbour: on the quiet 2-core machine 8% of the CNN's
# splits (its Dense 3136->128) stalled, one at a time, and falling back on each left 34-46 of
# 50 steps on one thread (82-97 ms a step against 53 on two); beside a busy process 31%
# stalled, 14 times 2 of 3 in a row, quiet never.
STALLS_TO_FALL_BACK, STALL_WINDOW = 2, 3
# How long a fall back to one thread lasts before the load is read again. Until the next
# regular reading (a second) was too long on the 2-core Xeon VM, where stalls come in bursts
# of a few ms on a quiet machine: PyTorch's Quickstart port fell back once or twice an epoch
# and ran 40-85% of its calls on one thread (epochs 2.07 s against 1.61-1.85 on two). A
# stall costs about its block (the caller takes back a block its worker has not started),
# so trying two threads again soon costs little beside a busy neighbour.
FALL_BACK_S = 0.1
# a BLAS thread count chosen in the environment (BLAS reads these itself) is left to BLAS,
# which then threads the GEMMs: the engine's own count is 1 until set_threads
USER_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                  "BLIS_NUM_THREADS")


def blas_threads_chosen_in_environment():
    """Whether one of ``USER_VARIABLES`` is set: BLAS then keeps the count it read."""
    return any(os.environ.get(name) for name in USER_VARIABLES)


def usable_cpus():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # no affinity call on this platform
        return os.cpu_count() or 1


def threads_for_load(cpus, others):
    """The thread count on ``cpus`` usable CPUs while other processes keep ``others`` of
    them busy on average (half a CPU or more counts as one)."""
    return max(1, min(cpus, cpus - int(others + 0.5)))


class _LoadReader:
    """The CPUs that other processes used between two readings (Linux; None elsewhere)."""

    def __init__(self):
        self.cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.last = self._reading()

    def _reading(self):
        """(wall time, busy ticks of the usable CPUs, this process's ticks), or None."""
        try:
            wanted = {f"cpu{cpu}" for cpu in self.cpus}
            busy = 0
            with open("/proc/stat") as stat:
                for line in stat:
                    fields = line.split()
                    if fields and fields[0] in wanted:   # user nice system idle iowait irq ...
                        values = [int(value) for value in fields[1:9]]
                        busy += sum(values) - values[3] - values[4]
            with open("/proc/self/stat") as own:
                fields = own.read().rsplit(")", 1)[1].split()
            return time.monotonic(), busy, int(fields[11]) + int(fields[12])   # utime stime
        except (OSError, ValueError, IndexError):
            return None

    @staticmethod
    def _runnable_others():
        try:
            with open("/proc/stat") as stat:
                for line in stat:
                    if line.startswith("procs_running"):
                        return max(0, int(line.split()[1]) - 1)   # less the caller
        except (OSError, ValueError, IndexError):
            pass
        return None

    def others_now(self):
        """Threads of other processes runnable now (the first guess): the fewest of
        ``GUESS_LOOKS`` looks ``GUESS_LOOK_GAP_S`` apart, None where none could be read."""
        looks = []
        for look in range(GUESS_LOOKS):
            if look:
                time.sleep(GUESS_LOOK_GAP_S)
            looks.append(self._runnable_others())
            if looks[-1] is None:
                return None
        return min(looks)


    def others_busy(self):
        """The CPUs other processes kept busy on average since the last call."""
        now = self._reading()
        if now is None or self.last is None or now[0] <= self.last[0]:
            return None
        (then, busy_then, own_then), (wall, busy, own) = self.last, now
        self.last = now
        return max(0.0, ((busy - busy_then) - (own - own_then)) / self.tick / (wall - then))


_lock = threading.Lock()
_recent_splits = collections.deque(maxlen=STALL_WINDOW)   # whether each stalled
_chosen = None   # the count set_threads fixed; None: follow the load
_count = None   # the count in force while following the load
_next_reading = 0.0
_last_asked = 0.0
_reader = None


def threads():
    """The engine's CPU thread count now (re-reading the load at most every
    ``LOAD_INTERVAL_S`` while no count is fixed, guessing it afresh after ``IDLE_S``
    without a call)."""
    global _count, _next_reading, _reader, _last_asked
    if _chosen is not None:
        return _chosen
    now, asked = time.monotonic(), _last_asked
    _last_asked = now
    idle = now - asked > IDLE_S
    if _count is not None and now < _next_reading and not idle:
        return _count
    with _lock:
        cpus = usable_cpus()
        if blas_threads_chosen_in_environment():
            _count, _next_reading = 1, float("inf")
            return _count
        if _reader is None or idle:   # a first or fresh guess, and a new baseline
            _reader = _LoadReader()
            others = _reader.others_now()
        else:
            others = _reader.others_busy()
        if others is not None:
            _count = threads_for_load(cpus, others)
        elif _count is None:
            _count = cpus
        _next_reading = time.monotonic() + LOAD_INTERVAL_S
        return _count


def set_threads(n):
    """Fix the count at ``n`` (a positive int), or follow the load again (``None``)."""
    global _chosen, _count, _reader
    with _lock:
        _chosen = n
        _count = _reader = None


def following_load():
    return _chosen is None


_numpy_blas_set = False


def numpy_blas_on_one_thread():
    """Before the first GEMM through NumPy's BLAS (``ops.gemm.cpu.blas_product``): every BLAS
    library loaded on one thread, unless one of ``USER_VARIABLES`` chose a count.
    ``engine.blas_threads`` does the same when Numba's first compile loads SciPy's BLAS;
    this covers a GEMM before any compile (a linear Dense forward compiles nothing). Once
    per process: 7 ms (threadpoolctl's import and its scan)."""
    global _numpy_blas_set
    if _numpy_blas_set:
        return
    with _lock:
        if not _numpy_blas_set and not blas_threads_chosen_in_environment():
            from threadpoolctl import ThreadpoolController
            for library in ThreadpoolController().select(user_api="blas").lib_controllers:
                library.set_num_threads(1)
        _numpy_blas_set = True


# ------------------------------------------------------------------ the GEMM split

def row_blocks(rows, macs, threads_at_most=None):
    """The ``(start, stop)`` row blocks a GEMM of ``macs`` multiply-adds with ``rows``
    output rows (or columns) runs in: one per thread (at most ``threads_at_most``), as many
    as give each block ``MIN_BLOCK_MACS`` and ``MIN_BLOCK_ROWS``; None for one plain call
    (small, or one thread)."""
    if macs < SPLIT_MIN_MACS:
        return None
    count = threads() if threads_at_most is None else min(threads(), threads_at_most)
    return _even_blocks(rows, min(count, rows // MIN_BLOCK_ROWS, macs // MIN_BLOCK_MACS),
                        ROW_ALIGN)


def thread_shares(gemm_macs):
    """The threads each of several independent GEMMs (of ``gemm_macs`` multiply-adds) may
    split into when they run at once, in one hand-off: the engine's threads dealt out in
    turn; None: run them one after another, whole, on this thread (one thread, or together
    less than ``SPLIT_MIN_MACS``). Dense's backward on 2 threads, dX beside dW (the GPT's
    768x128x384 layer): each GEMM whole on one core beats each cut in two, one hand-off
    instead of two and BLAS on full-size blocks."""
    count = threads()
    if count < 2 or sum(gemm_macs) < SPLIT_MIN_MACS:
        return None
    return [count // len(gemm_macs) + (index < count % len(gemm_macs))
            for index in range(len(gemm_macs))]


def slice_blocks(slices, macs):
    """The ``(first, last)`` blocks of ``slices`` independent slices of ``macs`` multiply-adds
    in all (attention's batch x heads) run in: one per thread, as many as give each
    ``MIN_BLOCK_MACS``; None for one plain call."""
    if macs < SPLIT_MIN_MACS:
        return None
    return _even_blocks(slices, min(threads(), slices, macs // MIN_BLOCK_MACS), 1)


def element_blocks(size, seconds_per_element=None, kept=False):
    """The ``(start, stop)`` blocks an element kernel (``ops.element_kernel``) over ``size``
    elements runs in: one per thread, as many as give each ``MIN_BLOCK_ELEMENTS`` and, where
    the kernel's pace is known (``seconds_per_element``), ``MIN_BLOCK_SECONDS`` of work
    (``MIN_KEPT_BLOCK_SECONDS`` where the blocks' hand-off is ``kept``); None for one plain
    call."""
    if size < SPLIT_MIN_ELEMENTS:
        return None
    count = min(threads(), size // MIN_BLOCK_ELEMENTS)
    if seconds_per_element is not None:
        floor = MIN_KEPT_BLOCK_SECONDS if kept else MIN_BLOCK_SECONDS
        count = min(count, int(size * seconds_per_element / floor))
    return _even_blocks(size, count, ELEMENT_ALIGN)


def work_blocks(size, seconds, align=1):
    """The ``(start, stop)`` blocks of ``range(size)`` a kernel of about ``seconds`` on one
    thread runs in: one per thread, as many as give each ``MIN_BLOCK_SECONDS`` of work, inner
    edges on multiples of ``align``; None for one plain call."""
    return _even_blocks(size, min(threads(), int(seconds / MIN_BLOCK_SECONDS),
                                  -(-size // align)), align)


def _even_blocks(size, count, align):
    """``count`` blocks of ``range(size)`` of about equal length, inner edges on multiples
    of ``align``; None for fewer than two."""
    if count < 2:
        return None
    edges = [0] + [min(size, round(size * block / count / align) * align)
                   for block in range(1, count)] + [size]
    return [(start, stop) for start, stop in zip(edges, edges[1:]) if stop > start]


def run_blocks(calls):
    """Run ``calls`` (``(function, args)`` pairs, the functions ``@njit(nogil=True)`` or
    Python code around one that releases the GIL) at once: the first on this thread, the
    rest on ``ops.cpu_pool``'s spinning workers; returns when all are done and raises what
    one of them raised."""
    if len(calls) == 1:   # a split into one block (Dense's dW over few features): no pool
        function, args = calls[0]
        function(*args)
        return
    start = time.perf_counter()
    own = run_calls(calls)
    if stalls_persist(split_stalled(own, time.perf_counter() - start - own)):
        _fall_back_to_one_thread()


def split_stalled(own_s, waited_s):
    """A split whose workers finished ``waited_s`` after this thread's own block (which took
    ``own_s``) waited on a worker that was not running: equal blocks on free cores end
    together (the wake-up of a worker is tens of us), one waiting for a core ends a scheduler
    slice (milliseconds) later."""
    return waited_s > max(own_s, STALL_MIN_S)


def stalls_persist(stalled):
    """Note whether a split ``stalled``: True when STALLS_TO_FALL_BACK of the last
    STALL_WINDOW splits did (the window then starts again)."""
    with _lock:
        _recent_splits.append(stalled)
        if sum(_recent_splits) < STALLS_TO_FALL_BACK:
            return False
        _recent_splits.clear()
        return True


def _fall_back_to_one_thread():
    """While following the load: one thread for ``FALL_BACK_S``, then a reading of the load;
    a stalled split shows a neighbour before ``/proc/stat`` does (one started since the last
    reading, or one the reading's average hid)."""
    global _count, _next_reading
    if _chosen is None:
        with _lock:
            _count, _next_reading = 1, time.monotonic() + FALL_BACK_S


# ------------------------------------------------------------------ kernels over blocks

def run_over(kernel, count, blocks, *args):
    """``kernel(*args, first, last)`` (a ``nogil`` ``@njit`` kernel over ``range(count)``:
    samples, planes, channels) once per block of ``blocks`` on the engine's threads, or once
    over the whole range for None."""
    if blocks is None:
        kernel(*args, 0, count)
    else:
        run_blocks([(kernel, (*args, first, last)) for first, last in blocks])


def in_blocks(kernel, count_of, seconds_of):
    """The CPU function that runs ``kernel`` (see ``run_over``) over ``range(count_of(args))``
    in blocks each worth ``MIN_BLOCK_SECONDS`` by ``seconds_of(args)`` (one thread's time
    for the whole range). A tuple argument (an op's meta) goes to the kernel as an int64
    array, so a worker's block is a compiled call (``ops.compiled_call``)."""
    @functools.wraps(kernel)
    def on_engine_threads(*args):
        args = tuple(np.asarray(a, np.int64) if type(a) is tuple else a for a in args)
        count = count_of(args)
        run_over(kernel, count, work_blocks(count, seconds_of(args)), *args)
    return on_engine_threads
