"""The worker threads that run a split's blocks (``run_blocks``): they wait for work spinning on
a flag, with the GIL released, instead of sleeping on a lock.

A block is handed over by writing its call into the worker's slot and a new number into the
worker's flag (``publish``); the worker, looping in compiled code that reads the flag
(``wait_for_change``, an atomic load and the CPU's spin-wait hint), sees it within a
microsecond, runs the call and writes the number into its done flag, which the calling thread
waits on the same way. A ``ThreadPoolExecutor`` hands over through a lock and a condition:
the worker sleeps in the kernel and is woken by a system call, and the caller sleeps on the
future the same way. Measured on the 2-core EPYC (load 0): two no-op blocks 20 us through the
executor against 4-6 spinning; the MLP's first Dense forward (128x784 @ 784x256) in two column
blocks 544 us through the executor, 321 spinning, 502 whole on one thread.

A worker spins for at most ``SPIN_S`` without work, then sleeps on its condition (so an idle
process holds no core), and the next block wakes it through the condition (the executor's
cost, once).

A block of NumPy's ``matmul`` (``ops.gemm.cpu.blas_product``) is handed over as its CBLAS
call (``ops.gemm.cblas``), and a block of an ``@njit`` kernel as a record of its native call
(``ops.compiled_call``: the element kernels, Adam's, GELU's, ...), which the worker runs without
leaving compiled code: a Python call must take the GIL from the calling thread first, which
started the worker's block 20-22 us after the hand-over on this VM, a compiled call 2-3 us.

Nothing here reads the load: ``ops.cpu_threads`` decides how many blocks a call splits into.
"""
import atexit
import os
import platform
import threading
import time

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ops import compiled_call
from ops.gemm import cblas

# How long a worker without work keeps spinning before it sleeps: longer than the Python
# between two splits of an eager step. At 2 ms the PyTorch Quickstart's eager step (about 2
# ms, its splits' gaps sometimes longer) found its worker asleep, the wake-up missed the
# block, the splits stalled and the count fell to one thread: the port took 1.09-1.28x
# torch's epoch; at 20 ms 0.72-0.89x (`bench.ports.quickstart_on_mnist --beside-torch`, 7
# runs alternating). An idle process's worker then holds a core for 20 ms before it sleeps.
SPIN_S = 20e-3
# Spins of the caller's wait for a worker between two yields of its core (about 100 us)
SPINS_PER_CHECK = 1 << 12
FLAG_STRIDE = 8   # int64s apart: the job and done flags on cache lines of their own
_JOB, _KIND, _CLAIM, _DONE = 0, 1, 2, FLAG_STRIDE   # a worker's flags
_PYTHON, _GEMM, _COMPILED = 0, 1, 2   # the kinds of job: a Python call, a CBLAS call, a
# compiled call (the record's address in the description's first field)
STOP = -1   # the job number that ends a worker


@intrinsic
def _load_acquire(typingctx, array, index):
    """``array[index]`` read as an atomic acquire load: the compiler re-reads it every time."""
    def codegen(context, builder, signature, args):
        pointer = cgutils.get_item_pointer(
            context, builder, signature.args[0],
            context.make_array(signature.args[0])(context, builder, args[0]), [args[1]])
        return builder.load_atomic(pointer, "acquire", 8)
    return array.dtype(array, index), codegen


@intrinsic
def _store_release(typingctx, array, index, value):
    """``array[index] = value`` as an atomic release store: every write before it is seen
    first."""
    def codegen(context, builder, signature, args):
        pointer = cgutils.get_item_pointer(
            context, builder, signature.args[0],
            context.make_array(signature.args[0])(context, builder, args[0]), [args[1]])
        builder.store_atomic(args[2], pointer, "release", 8)
        return context.get_dummy_value()
    return types.void(array, index, value), codegen


@intrinsic
def _compare_and_swap(typingctx, array, index, expected, value):
    """``array[index] = value`` if it holds ``expected``, atomically: whether it did."""
    def codegen(context, builder, signature, args):
        pointer = cgutils.get_item_pointer(
            context, builder, signature.args[0],
            context.make_array(signature.args[0])(context, builder, args[0]), [args[1]])
        result = builder.cmpxchg(pointer, args[2], args[3], "acq_rel", "acquire")
        return builder.extract_value(result, 1)
    return types.boolean(array, index, expected, value), codegen


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@intrinsic
def _spin_hint(typingctx):
    """x86's ``pause`` (the other core's hyperthread runs meanwhile); nothing elsewhere."""
    def codegen(context, builder, signature, args):
        if _X86:
            pause = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
            builder.call(pause, [])
        return context.get_dummy_value()
    return types.void(), codegen


@njit(cache=True, nogil=True)
def wait_for_change(flags, index, old, spins):
    """Spin until ``flags[index]`` is no longer ``old``, at most ``spins`` times: the new
    value, or ``old`` if it did not change."""
    for _ in range(spins):
        value = _load_acquire(flags, index)
        if value != old:
            return value
        _spin_hint()
    return old


@njit(cache=True, nogil=True)
def wait_for_value(flags, index, value, spins):
    """Spin until ``flags[index]`` is ``value``, at most ``spins`` times: whether it is."""
    for _ in range(spins):
        if _load_acquire(flags, index) == value:
            return True
        _spin_hint()
    return False


@njit(cache=True, nogil=True)
def publish(flags, index, value):
    _store_release(flags, index, value)


@njit(cache=True, nogil=True)
def claim(flags, number):
    """Take job ``number`` of a worker's ``flags`` to run it: True for the one thread (the
    worker, or the caller taking back a block the worker has not started) that gets it."""
    while True:
        claimed = _load_acquire(flags, _CLAIM)
        if claimed >= number:
            return False
        if _compare_and_swap(flags, _CLAIM, claimed, number):
            return True


@njit(cache=True, nogil=True)
def wait_for_job(flags, seen, spins):
    """Spin on a worker's job flag until a job it has not seen and nobody has done comes (a
    block the caller took back and finished is passed over), at most ``spins`` times after
    the last: ``(number, timed out)``."""
    while True:
        number = wait_for_change(flags, _JOB, seen, spins)
        if number == seen:
            return seen, True
        if number != STOP and _load_acquire(flags, _DONE) == number:
            seen = number
            continue
        return number, False


@njit(cache=True, nogil=True)
def serve_compiled(flags, description, sgemm, seen, spins):
    """``wait_for_job`` that runs GEMM and compiled jobs itself (the call its ``description``
    holds, then its done flag), waiting ``spins`` again after each: the first job it does not
    run (a Python call, ``STOP``), or the last one seen when it timed out."""
    while True:
        number, timed_out = wait_for_job(flags, seen, spins)
        if timed_out or number == STOP or flags[_KIND] == _PYTHON:
            return number, timed_out
        if claim(flags, number):   # else the caller took it back, and runs it
            run_described(flags[_KIND], description, sgemm)
            publish(flags, _DONE, number)
        seen = number


@njit(cache=True, nogil=True)
def run_described(kind, description, sgemm):
    """A GEMM job's CBLAS call, or a compiled job's record."""
    if kind == _GEMM:
        cblas.run(description, sgemm)
    else:
        compiled_call.run(description[0])


_spin_rate = None


def spins_in(seconds):
    """How many spins of ``wait_for_change`` take about ``seconds`` (measured once: the
    pause hint takes 25 ns on the EPYC, longer on other CPUs)."""
    global _spin_rate
    if _spin_rate is None:
        flags = np.zeros(1, dtype=np.int64)
        wait_for_change(flags, 0, 0, 1)   # compiled or loaded first
        start = time.perf_counter()
        wait_for_change(flags, 0, 0, 1 << 15)
        _spin_rate = (1 << 15) / max(time.perf_counter() - start, 1e-6)
    return max(1, int(seconds * _spin_rate))


def _run(call):
    """Run ``call``: what it raised (raised again on the calling thread), or None."""
    try:
        call[0](*call[1])
    except BaseException as error:
        return error
    return None


class _Worker:
    """One thread, its flags (the job's number and kind, and the number of the last job
    done, on two cache lines), what it is handed (a GEMM's description, a compiled call's
    record, or a Python call) and what that call raised."""

    def __init__(self, slot, sgemm):
        self.flags = np.zeros(2 * FLAG_STRIDE, dtype=np.int64)
        self.description = np.zeros(cblas.DESCRIPTION_SIZE, dtype=np.int64)
        self.sgemm = sgemm   # cblas.available(): NumPy's cblas_sgemm, or None
        self.number = self.seen = 0   # of the last job handed over, and the last one seen
        self.call = self.error = self.record = None
        self.kernel_name = ""
        self.sleeping = False
        self.wake = threading.Condition(threading.Lock())
        self.thread = threading.Thread(target=self._loop, name=f"engine-split-{slot}",
                                       daemon=True)
        self.thread.start()

    def hand(self, call):
        """Give the worker ``call`` (a ``(function, args)`` pair). A float32 block of ``out =
        a @ b`` by NumPy (a function marked ``is_matmul``, args ``(a, b, out)``) goes as its
        CBLAS call, a call of an ``@njit`` kernel as its record (``ops.compiled_call``; a
        ``Kept`` one as it is): all run without the GIL. (Without NumPy's CBLAS the worker's
        loop is the plain one: every block a Python call.)"""
        self.error, self.record = None, None
        self.flags[_KIND], self.call = _PYTHON, call
        if self.sgemm is not None:
            function, args = call
            if getattr(function, "is_matmul", False):
                if cblas.describable(*args) and cblas.describe(self.description, *args):
                    self.flags[_KIND], self.call = _GEMM, None
            elif type(function) is compiled_call.Kept:
                function.fields[compiled_call.STATUS] = 0
                self.description[0], self.record = function.address, function.fields
                self.kernel_name = function.__name__
                self.flags[_KIND], self.call = _COMPILED, None
            elif (record := compiled_call.record(function, args)) is not None:
                self.description[0], self.record = record.ctypes.data, record
                self.kernel_name = getattr(function, "__name__", "a kernel")
                self.flags[_KIND], self.call = _COMPILED, None
        self._publish(self.number + 1)

    def stop(self):
        self.call = None
        self.flags[_KIND] = _PYTHON
        self._publish(STOP)

    def _publish(self, number):
        if number != STOP:
            self.number = number
        publish(self.flags, _JOB, number)
        with self.wake:   # under the lock, so a worker on its way to sleep sees the number
            if self.sleeping:
                self.wake.notify()

    def wait(self):
        """Until the worker's job is done, running it here if the worker has not started it
        (a worker waiting for a core: another thread spins on it); what it raised, or None."""
        if claim(self.flags, self.number):
            self._run_claimed(self.number)
        else:
            while not wait_for_value(self.flags, _DONE, self.number, SPINS_PER_CHECK):
                os.sched_yield()
        if self.record is not None and compiled_call.failed(self.record):
            self.error = RuntimeError(
                f"{self.kernel_name}: a block a split's worker ran raised; "
                f"engine.set_num_threads(1) runs every block on this thread, which shows the "
                f"error")
        return self.error

    def _loop(self):
        while True:
            number = self._next_job()
            if number == STOP:
                return
            self.seen = number
            if claim(self.flags, number):   # else the caller took it back, and runs it
                self._run_claimed(number)

    def _run_claimed(self, number):
        """Run job ``number``, which this thread claimed (a GEMM here only if it came while
        the worker slept), then mark it done."""
        if self.flags[_KIND] != _PYTHON:
            run_described(self.flags[_KIND], self.description, self.sgemm)
        else:
            call, self.call = self.call, None
            self.error = _run(call)
        publish(self.flags, _DONE, number)

    def _next_job(self):
        """The next job's number: spinning up to ``SPIN_S`` in compiled code (GEMM and
        compiled jobs that come meanwhile run there and start the spin again), then
        asleep. The spin never comes back to Python before a job comes: it would take the GIL
        every time, which the caller's Python holds, and in an eager step (Python between
        every kernel) the worker then missed blocks for hundreds of us."""
        spins = spins_in(SPIN_S)
        if self.sgemm is None:
            number, timed_out = wait_for_job(self.flags, self.seen, spins)
        else:
            number, timed_out = serve_compiled(self.flags, self.description, self.sgemm,
                                               self.seen, spins)
        if not timed_out:
            return number
        self.seen = number
        with self.wake:
            self.sleeping = True
            while (number := int(self.flags[_JOB])) == self.seen:
                self.wake.wait()
            self.sleeping = False
        return number


_workers = []
_workers_process = None   # a forked child has the list but none of the threads
_lock = threading.Lock()


def workers(count):
    """``count`` workers, started at the first split that needs them."""
    global _workers, _workers_process
    if len(_workers) < count or _workers_process != os.getpid():
        with _lock:
            if _workers_process != os.getpid():
                _workers, _workers_process = [], os.getpid()
            while len(_workers) < count:
                _workers.append(_Worker(len(_workers), cblas.available()))
    return _workers[:count]


# Held by the thread whose split the workers run. A worker holds one job at a time, so a
# second thread's split (backwards on several Python threads at once) handed over meanwhile
# replaced the first's job: one block ran twice or not at all, and a test of four threads'
# backwards into one FlatBuffer saw wrong sums in CI. That thread runs its blocks itself.
_splitting = threading.Lock()


def run_calls(calls):
    """Run ``calls`` (``(function, args)`` pairs) at once, the first on this thread, the
    others on workers (or all on this thread while another thread's split holds them);
    returns the seconds the first took, once all are done, and raises the first error any
    of them raised."""
    if not _splitting.acquire(blocking=False):
        return _run_here(calls)
    try:
        helpers = workers(len(calls) - 1)
        for worker, call in zip(helpers, calls[1:]):
            worker.hand(call)
        own, error = _timed(calls[0])
        for worker in helpers:   # all done before returning: they write into the caller's arrays
            raised = worker.wait()
            error = error or raised
    finally:
        _splitting.release()
    if error is not None:
        raise error
    return own


def _timed(call):
    """Run ``call`` here: its seconds, and what it raised (or None)."""
    function, args = call
    start = time.perf_counter()
    try:
        function(*args)
    except BaseException as raised:
        return time.perf_counter() - start, raised
    return time.perf_counter() - start, None


def _run_here(calls):
    """``run_calls`` on this thread alone: every call in turn, then the first error."""
    results = [_timed(call) for call in calls]
    error = next((raised for _, raised in results if raised is not None), None)
    if error is not None:
        raise error
    return sum(seconds for seconds, _ in results)


def _stop_workers():
    if _workers_process == os.getpid():
        for worker in _workers:
            worker.stop()


atexit.register(_stop_workers)
