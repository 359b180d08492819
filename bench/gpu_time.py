"""GPU time per call, without the launch overhead: CUDA events around ``n`` calls queued behind
a long busy product. While the GPU is still on that product Python launches the calls, so
they then run back to back and the events see the kernels alone; a call's wall time is
roughly the larger of its GPU time and its launch time.

The engine's calls are timed with numba events behind an ``ops.matmul`` product, torch's with
``torch.cuda.Event`` behind a ``torch.matmul`` one: each framework on its own default stream.
"""
import numpy as np

BUSY_SIZE = 4096   # the product that keeps the GPU busy while timed calls queue behind it
CALLS = 20


class GpuTimer:
    def __init__(self, busy, start, end):
        self.busy, self.start, self.end = busy, start, end

    def seconds_per_call(self, call, n=CALLS):
        """GPU seconds per call: ``n`` calls queued behind the busy product, timed by events
        (one call before, so compiles and first allocations are not timed)."""
        call()
        self.busy()
        self.start.record()
        for _ in range(n):
            call()
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3 / n


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
