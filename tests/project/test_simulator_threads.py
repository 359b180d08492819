"""The simulator's shared arrays are one per call site even when its threads interleave
(tests/support/simulator_threads.py: numba-cuda's own lookup handed 7 of 200 such rounds a second
array)."""
import sys
import threading

import numpy as np
import pytest

from ops.device import SIMULATOR
from tests.support import simulator_threads


@pytest.mark.cuda
@pytest.mark.skipif(not SIMULATOR, reason="Numba's CUDA simulator only")
def test_threads_that_ask_for_a_shared_array_at_once_get_the_same_one():
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    assert FakeCUDAShared.array is simulator_threads.shared_array
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # a thread switch at nearly every chance
    try:
        for _ in range(200):
            shared, start, arrays = FakeCUDAShared(0), threading.Barrier(16), []

            def allocate():
                start.wait()
                arrays.append(shared.array(4, np.float32))

            threads = [threading.Thread(target=allocate) for _ in range(16)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert len(arrays) == 16 and all(array is arrays[0] for array in arrays)
            assert shared.array(4, np.float32) is not arrays[0]   # another line, another array
    finally:
        sys.setswitchinterval(interval)
