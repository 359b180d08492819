"""Wall time per call, launch included: the best of rounds of back-to-back calls, the device
synchronised at the end of each round (``bench.ops``, ``bench.conv_ops``, ``bench.gemm``)."""
import time


def best_seconds(call, synchronize, repeats, rounds):
    """The best over ``rounds`` rounds of the mean time per call, a round being ``repeats``
    calls and one ``synchronize()``."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        synchronize()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def seconds_per_call(call, synchronize, round_seconds, rounds):
    """``best_seconds`` over rounds of about ``round_seconds``: after a warm-up call, one timed
    call sets the repeats of a round."""
    call()
    synchronize()
    start = time.perf_counter()
    call()
    synchronize()
    repeats = max(1, int(round_seconds / max(time.perf_counter() - start, 1e-7)))
    return best_seconds(call, synchronize, repeats, rounds)


def synchronizers(device, torch_device):
    """``(engine_sync, torch_sync)``: each waits for its framework's queued GPU work (on the
    CPU, nothing to wait for)."""
    def engine_sync():
        if device == "cuda":
            from ops.cuda import cuda
            cuda.synchronize()

    def torch_sync():
        if torch_device == "cuda":
            import torch
            torch.cuda.synchronize()

    return engine_sync, torch_sync
