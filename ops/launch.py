"""The one way a kernel runs: a twin ``Kernel`` called with the arrays of one device.

A ``Kernel`` pairs an ``@njit`` CPU kernel with the ``@cuda.jit`` kernel that takes the same
arguments, plus the grid rule that sizes the CUDA launch from those arguments. Calling it
runs the CPU kernel when its arrays are NumPy arrays and launches the CUDA one when they are
device arrays, so no op branches on the device by hand. Every run passes here, so this is
where runs are recorded (``LaunchRecorder``: the registry test checks what each op really
launches, the benchmarks count launches, a captured step replays them).

A host NumPy array passed to a CUDA kernel is copied to the device and synchronised on every
launch (191 us measured on the H200), so a CUDA launch refuses it.
"""
import math
import threading
from typing import NamedTuple

import numpy as np

from ops import cuda as cuda_runtime
from ops.cuda import SIMULATOR, is_device_array

THREADS_PER_BLOCK = 256
# The options of a CPU kernel (``@njit(**CPU_KERNEL)``): cached, and without the C-callable
# wrapper Numba otherwise builds for every compiled signature, which only a dispatcher passed
# as a first-class function value calls (kernels are called from Python, helpers inlined):
# 15-20 ms of every cold compile (thread CPU time: fill 0.075 -> 0.060 s, the batch gather
# 0.314 -> 0.295).
CPU_KERNEL = {"cache": True, "no_cfunc_wrapper": True}


class _ThreadState(threading.local):
    """This thread's active ``LaunchRecorder``s (None: none). A class default,
    not ``getattr(local, name, None)``, whose miss raised and caught an AttributeError on
    every kernel run: 0.52 us against 0.08."""
    recorders = None


_thread = _ThreadState()


class KernelRun(NamedTuple):
    """One recorded kernel run: ``function(*args)`` on the CPU, or ``function[grid, block](*args)``."""
    kernel: "Kernel"
    device: str
    function: object
    grid: object
    block: object
    args: tuple


class Kernel:
    """A twin pair: ``cpu`` (``@njit``) and ``cuda`` (``@cuda.jit``) take the same arguments.

    ``grid(*args)`` gives the CUDA launch: a thread count (1-D blocks of
    ``THREADS_PER_BLOCK``) or ``(blocks, threads_per_block)``. A kernel whose CUDA side is
    chosen per call (the GEMM template: one compiled kernel per dtype, tiling and layout)
    passes ``cuda_plan(args)`` instead of ``cuda`` and ``grid``: a list of launches
    ``(cuda kernel, blocks, threads_per_block, cuda args)``, run in order (the fused Dense
    backward is one CPU call and two GEMM launches)."""

    def __init__(self, name, cpu, cuda=None, grid=None, cuda_plan=None):
        if (cuda is None or grid is None) == (cuda_plan is None):
            raise TypeError(f"Kernel {name}: give cuda and grid, or cuda_plan")
        self.name, self.cpu, self.cuda, self.grid, self.cuda_plan = name, cpu, cuda, grid, cuda_plan

    def __repr__(self):
        return f"Kernel({self.name})"

    def __call__(self, *args):
        """Run on the device of the array arguments; returns what the CPU kernel returns (None
        on CUDA, where a kernel returns nothing)."""
        return self.run_on(device_of_args(args), args)

    def run_on(self, device, args):
        """``self(*args)`` when the caller already knows the arrays' device."""
        recorders = _thread.recorders
        if device == "cpu":
            if recorders:
                _record(recorders, KernelRun(self, "cpu", self.cpu, None, None, args))
            return self.cpu(*args)
        launches = self.cuda_plan(args) if self.cuda_plan is not None else (self._launch(args),)
        for function, blocks, block, cuda_args in launches:
            if recorders:
                _record(recorders, KernelRun(self, "cuda", function, blocks, block, cuda_args))
            _refuse_host_arrays(self.name, cuda_args)
            if _launches_something(blocks):
                cuda_runtime.launch(function, blocks, block, cuda_args)
        return None

    def _launch(self, args):
        size = self.grid(*args)
        if isinstance(size, tuple):
            return (self.cuda, size[0], size[1], args)
        threads = threads_for(size)
        return (self.cuda, (size + threads - 1) // threads, threads, args)


def threads_for(count, threads=THREADS_PER_BLOCK):
    """The threads of a 1-D block over ``count`` elements: ``threads``, or in the simulator,
    which runs one OS thread per CUDA thread, no more than ``count`` (no idle ones)."""
    return max(1, min(threads, count)) if SIMULATOR else threads


def device_of_args(args):
    """The device of the first array among ``args``: every array of one run lives there (a
    host array among device ones is refused at launch)."""
    for arg in args:
        if type(arg) is np.ndarray:   # the common case first: 2 us a step of is_device_array
            return "cpu"
        if is_device_array(arg):
            return "cuda"
    return "cpu"


def elements(position):
    """The grid rule of a kernel with one thread per element of argument ``position``."""
    def threads(*args):
        return args[position].size
    return threads


def blocks_of(count, threads):
    """The grid rule ``count(*args)`` blocks of ``threads`` threads (block reductions)."""
    def grid(*args):
        return (count(*args), threads)
    return grid


def _refuse_host_arrays(name, args):
    for position, arg in enumerate(args):
        if isinstance(arg, np.ndarray):
            raise TypeError(
                f"{name}: argument {position} is a host NumPy array of shape {arg.shape}; "
                "CUDA kernels take device arrays only (move it with Tensor.to('cuda'))"
            )


# ------------------------------------------------------------------ recording

def recording():
    """True while a ``LaunchRecorder`` is active on this thread."""
    return bool(_thread.recorders)


def note_unrecordable(reason):
    """Tell the active recorders that the code just did work no kernel run holds (a host copy,
    a host read of a tensor's values, a collective), so replaying the runs would skip it."""
    for recorder in _thread.recorders or ():
        recorder.unrecordable.append(reason)


def note_participant(participant):
    """Tell the active recorders that ``participant`` decides on the host what the step's
    kernels are (an optimizer, a model): its ``capture_key()`` (a hashable of those decisions:
    which parameters require grad, train/eval modes, the state's layout) is part of what a
    recording was made for, and its ``sync_device()``, if it has one, runs before each replay
    (as it runs in the eager step) to move host-written values (``param_groups``) to the
    device arrays the kernels read."""
    for recorder in _thread.recorders or ():
        if not any(participant is known for known in recorder.participants):
            recorder.participants.append(participant)


class unrecorded:
    """``with unrecorded():`` runs kernels that no recording may hold: one-time state set-up
    (a zeroed optimizer state, a counter written from the host) and host-to-device syncs,
    which a replay would otherwise repeat with stale values. (A class: a generator's context
    manager took 1.5 us of each optimizer step's Python.)"""

    def __enter__(self):
        self.recorders = _thread.recorders
        _thread.recorders = None

    def __exit__(self, *exception):
        _thread.recorders = self.recorders


def _record(recorders, run):
    for recorder in recorders:
        recorder.runs.append(run)


class LaunchRecorder:
    """Records every kernel run of this thread while active::

        with LaunchRecorder() as recorder:
            train_step()
        recorder.cuda_launches()   # how many CUDA launches the step made

    A kernel's arguments are fixed once recorded: what changes from step to step lives in
    device arrays the kernels read (``ops.step_counter``)."""

    def __init__(self):
        self.runs = []
        self.unrecordable = []   # why a replay of these runs would not do what the code did
        self.participants = []   # objects whose host decisions the runs depend on

    def __enter__(self):
        if _thread.recorders is None:
            _thread.recorders = []
        _thread.recorders.append(self)
        return self

    def __exit__(self, *exc):
        _thread.recorders.remove(self)

    def clear(self):
        self.runs.clear()

    def kernels(self):
        """The set of ``Kernel`` pairs that ran."""
        return {run.kernel for run in self.runs}

    def cuda_kernel_names(self):
        """The names of the ``@cuda.jit`` kernels launched, in order."""
        return [getattr(run.function, "py_func", run.function).__name__ for run in self.runs
                if run.device == "cuda" and _launches_something(run.grid)]

    def cuda_launches(self):
        """How many CUDA launches were made (runs over an empty grid launch nothing)."""
        return sum(1 for run in self.runs if run.device == "cuda" and _launches_something(run.grid))


def _launches_something(blocks):
    return (math.prod(blocks) if isinstance(blocks, tuple) else blocks) > 0   # np.prod: +2.7 us
