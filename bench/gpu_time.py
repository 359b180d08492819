"""GPU time per call, without the launch overhead: CUDA events around ``n`` calls queued behind
busy products long enough to outlast the calls' launches. While the GPU is still on them
Python launches the calls, so they then run back to back and the events see the kernels
alone; a call's wall time is roughly the larger of its GPU time and its launch time.

How many busy products: as many as take twice the ``n`` calls' launch time (measured first,
the GPU idle). One product was too few for calls slower to launch than it is: the queue
drained and the events timed the launches. On an H100 (``bench.attention``'s rows at the GPU
shapes), the engine's LayerNorm fwd+bwd took 545 us a call to launch, 20 calls 10.9 ms behind
its 4.0 ms product: 328-341 us a call measured, 196 behind eight products; torch's Embedding
(651 us a call to launch, behind a 2.8 ms product) 459-580 against 324.

The engine's calls are timed with numba events behind an ``ops.matmul`` product, torch's with
``torch.cuda.Event`` behind a ``torch.matmul`` one: each framework on its own default stream.
"""
import math
import time

import numpy as np

BUSY_SIZE = 4096   # the product that keeps the GPU busy while timed calls queue behind it
CALLS = 20
QUEUE_MARGIN = 2   # busy time queued ahead of the timed calls, in units of their launch time


class GpuTimer:
    def __init__(self, busy, start, end):
        self.busy, self.start, self.end = busy, start, end
        self.busy()   # warm-up: compiles, allocations
        self.start.record()
        self.busy()
        self.end.record()
        self.end.synchronize()
        seconds = self.start.elapsed_time(self.end) / 1e3
        # the simulator's events time nothing (a negative time): one product a measure there
        self.busy_seconds = seconds if seconds > 0 else math.inf

    def seconds_per_call(self, call, n=CALLS):
        """GPU seconds per call (``measure``'s first)."""
        return self.measure(call, n)[0]

    def measure(self, call, n=CALLS):
        """``(GPU seconds, launch seconds)`` per call: the host time of ``n`` calls launched
        on an idle GPU, then their GPU time queued behind busy products that take
        ``QUEUE_MARGIN`` times as long (one call before, so compiles and first allocations
        are not timed)."""
        call()
        self.end.record()
        self.end.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            call()
        launch = time.perf_counter() - start
        self.end.record()
        self.end.synchronize()
        for _ in range(max(1, math.ceil(QUEUE_MARGIN * launch / self.busy_seconds))):
            self.busy()
        self.start.record()
        for _ in range(n):
            call()
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3 / n, launch / n


class _NumbaEvent:
    """A numba CUDA event with torch.cuda.Event's methods."""

    def __init__(self):
        from ops.cuda import cuda
        self.event = cuda.event()

    def record(self):
        self.event.record()

    def synchronize(self):
        self.event.synchronize()

    def elapsed_time(self, other):   # milliseconds, as torch.cuda.Event
        return self.event.elapsed_time(other.event)


def engine_timer():
    """A timer of engine calls; its busy work is ``ops.matmul.gemm`` of two BUSY_SIZE²
    float32 matrices at "highest" whatever the precision set: at "high" and "medium" the
    pipelined tensor-core product took 0.8-1.0 ms, shorter than 20 calls' launches, and the
    small products' GPU times rose 2.5-4x with the launch gaps (fwd L1 128x784x256 at
    "medium": 47.6 us against 11.0 before the pipelines)."""
    from ops.cuda import cuda
    from ops.device import to_device
    from ops.matmul import gemm
    from ops.matmul_precision import (get_float32_matmul_precision,
                                      set_float32_matmul_precision)

    rng = np.random.default_rng(0)
    a, b = (to_device(rng.standard_normal((BUSY_SIZE, BUSY_SIZE)).astype(np.float32), "cuda")
            for _ in range(2))
    out = cuda.device_array((BUSY_SIZE, BUSY_SIZE), np.float32)

    def busy():
        precision = get_float32_matmul_precision()
        set_float32_matmul_precision("highest")
        try:
            gemm(a, b, out=out)
        finally:
            set_float32_matmul_precision(precision)

    return GpuTimer(busy, _NumbaEvent(), _NumbaEvent())


def torch_timer():
    """A timer of torch CUDA calls; its busy work is ``torch.matmul`` of a BUSY_SIZE² float32
    matrix by itself."""
    import torch

    big = torch.randn((BUSY_SIZE, BUSY_SIZE), device="cuda")
    return GpuTimer(lambda: torch.matmul(big, big), torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True))


def gpu_timers(device, has_torch):
    """``{"engine": timer, "torch": timer}`` on CUDA (torch's only where ``has_torch``); on the
    CPU none."""
    timers = {}
    if device == "cuda":
        timers["engine"] = engine_timer()
        if has_torch:
            timers["torch"] = torch_timer()
    return timers
