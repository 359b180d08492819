"""How the tests run Numba's CUDA simulator, which runs each CUDA thread as an OS thread: with
a short switch interval, and with its shared arrays made one per call site under a lock.

The launching thread polls the kernel's threads in a loop that holds the GIL until Python's
switch interval (5 ms by default) takes it away, so a shorter interval hands the GIL on to
the kernel's threads sooner. Two simulator tests (test_reduce_blocks' max (149, 2) and
test_ops_core's broadcast sub, one process, two runs each at load 5-10) took 10.2 CPU s at
5 ms, 6.3 at 0.5 ms, 5.6 at 0.2 ms, 6.1 at 0.1 ms.

The threads then lose the GIL mid-kernel far more often, and numba-cuda 0.30's
``cuda.shared.array`` (simulator/kernelapi.py, ``FakeCUDAShared.array``) looks the block's
array up and stores a new one without a lock: a thread preempted between the two gets an
array of its own, writes its value where no other thread reads, and the kernel computes a
wrong value. With coverage.py slowing every line, 3 of 498 simulator tests computed wrong
values at 0.2 ms (the mean of 7 values, a conv2d and a SyncBatchNorm gradcheck: all reduce
through ops.block_reduce's shared array), and 1 of 300 means of 7 values was wrong at a
10 us interval. ``shared_array`` is that lookup under a lock, the call site read from the
caller's frame (the original walks the whole stack for it).
"""
import sys
import threading

import numpy as np

SWITCH_INTERVAL_S = 0.0002
_shared_arrays_lock = threading.Lock()
_original_shared_array = None   # numba-cuda's, for dynamic shared memory


def shared_array(shared, shape, dtype, alignment=None):
    """``FakeCUDAShared.array``: the block's array allocated at the caller's line (one per
    file and line, as numba-cuda's), made once under a lock."""
    from numba.core import types
    from numba.np import numpy_support
    if shape == 0 or alignment is not None:   # dynamic shared memory: one buffer, no lookup
        return _original_shared_array(shared, shape, dtype, alignment)
    if isinstance(dtype, types.Type):
        dtype = numpy_support.as_dtype(dtype)
    caller = sys._getframe(1)
    call_site = (caller.f_code.co_filename, caller.f_lineno)
    with _shared_arrays_lock:
        array = shared._allocations.get(call_site)
        if array is None:
            array = shared._allocations[call_site] = np.empty(shape, dtype)
    return array


def configure():
    """Set both up; called once per test process that runs the simulator."""
    global _original_shared_array
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    if FakeCUDAShared.array is not shared_array:
        _original_shared_array = FakeCUDAShared.array
        FakeCUDAShared.array = shared_array
