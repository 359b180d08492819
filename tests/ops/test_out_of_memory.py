"""GPU memory exhaustion: the caching pool frees its cache and retries once, then raises one
``OutOfMemoryError`` naming the request, the device's memory and what the pool holds; the
process goes on. On the CPU the pool runs against a fake driver of a fixed capacity; on the
H200 a request larger than the card is the real thing."""
import gc
import weakref

import numpy as np
import pytest

import engine
from ops.cuda import SIMULATOR
from ops.out_of_memory import OutOfMemoryError

if SIMULATOR:   # the simulator has no memory manager, so no pool
    pytest.skip("the caching pool needs Numba's real CUDA driver module", allow_module_level=True)

from ops.cuda import OUT_OF_MEMORY, CachingMemoryManager, CudaAPIError  # noqa: E402

MiB = 1 << 20


class FakeBlock:
    """A driver allocation: alive (holding device memory) while referenced."""

    def __init__(self, address, size):
        self.device_pointer, self.size = address, size


class FakeDriverPool(CachingMemoryManager):
    """The pool over a device of ``capacity`` bytes: the driver refuses a block that does not
    fit beside the live ones (cached blocks are live until the pool drops them)."""

    def __init__(self, capacity, failure=OUT_OF_MEMORY):
        super().__init__(context=None)
        self.capacity, self.failure, self.calls = capacity, failure, 0
        self.live = weakref.WeakSet()

    def _driver_memalloc(self, nbytes):
        self.calls += 1
        gc.collect()
        if sum(block.size for block in self.live) + nbytes > self.capacity:
            raise CudaAPIError(self.failure, "Call to cuMemAlloc results in "
                                             "CUDA_ERROR_OUT_OF_MEMORY")
        block = FakeBlock(0x1000 * self.calls, nbytes)
        self.live.add(block)
        return block

    def get_memory_info(self):
        return self.capacity - sum(block.size for block in self.live), self.capacity


def test_a_request_that_fits_once_the_cache_is_freed_succeeds():
    pool = FakeDriverPool(capacity=8 * MiB)
    held = [pool.memalloc(3 * MiB) for _ in range(2)]
    del held
    gc.collect()
    assert pool.cached_bytes == 6 * MiB and pool.in_use_bytes == 0
    pointer = pool.memalloc(5 * MiB)   # another bucket: only fits without the cache
    assert pointer.size == 5 * MiB
    assert pool.cached_bytes == 0 and pool.in_use_bytes == 5 * MiB
    assert pool.calls == 4   # two blocks, the refused request, its retry


def test_a_request_that_never_fits_is_one_memory_error_and_the_pool_goes_on():
    pool = FakeDriverPool(capacity=8 * MiB)
    kept = pool.memalloc(2 * MiB)
    released = pool.memalloc(1 * MiB)
    del released
    gc.collect()
    with pytest.raises(OutOfMemoryError) as failure:
        pool.memalloc(7 * MiB)
    assert isinstance(failure.value, MemoryError)
    assert str(failure.value) == (
        "CUDA out of memory: tried to allocate 7.00 MiB; the GPU has 6.00 MiB free of "
        "8.00 MiB, of which this process's memory pool holds 2.00 MiB in tensors and "
        "0 bytes cached (its cache was freed and the request retried once). Free tensors "
        "that are no longer needed, or use a smaller batch")
    assert (failure.value.requested, failure.value.pool_in_use) == (7 * MiB, 2 * MiB)
    assert pool.in_use_bytes == 2 * MiB and pool.cached_bytes == 0
    smaller = pool.memalloc(4 * MiB)   # the smaller batch then works
    assert smaller.size == 4 * MiB and kept.size == 2 * MiB
    assert pool.in_use_bytes == 6 * MiB


def test_other_driver_errors_pass_through_unchanged():
    pool = FakeDriverPool(capacity=1 * MiB, failure="CUDA_ERROR_ILLEGAL_ADDRESS")
    with pytest.raises(CudaAPIError) as failure:
        pool.memalloc(2 * MiB)
    assert not isinstance(failure.value, MemoryError) and pool.calls == 1


def test_the_command_reports_it_as_one_line(monkeypatch, capsys):
    import engine.cli.train
    from tests.support.training_command import TINY, run_main

    def fit_out_of_memory(*args, **options):
        raise OutOfMemoryError(40 * 2**30, 2**30, 140 * 2**30, 130 * 2**30, 0)

    monkeypatch.setattr(engine.cli.train, "fit", fit_out_of_memory)
    code, captured = run_main(TINY, capsys)
    assert code == 1
    assert captured.err.strip().splitlines() == [
        "engine-train: error: CUDA out of memory: tried to allocate 40.00 GiB; the GPU has "
        "1.00 GiB free of 140.00 GiB, of which this process's memory pool holds 130.00 GiB "
        "in tensors and 0 bytes cached (its cache was freed and the request retried once). "
        "Free tensors that are no longer needed, or use a smaller batch (--batch-size)"]


@pytest.mark.gpu
def test_more_than_the_card_has_is_refused_and_a_small_tensor_then_works():
    with pytest.raises(engine.OutOfMemoryError, match=r"tried to allocate 149\.01 GiB; the "
                                                      r"GPU has .* free of .* GiB") as failure:
        engine.zeros((40_000_000_000,), device="cuda")   # 160 GB of float32: a plain alloc
    assert isinstance(failure.value, MemoryError)
    assert failure.value.requested == 160_000_000_000
    assert 0 < failure.value.device_total < failure.value.requested   # H100 80 GB, H200 141
    small = engine.zeros((1000,), device="cuda") + 1
    assert small.sum().item() == 1000
    x = engine.randn(256, 512, device="cuda")   # and a GEMM of a small batch runs
    np.testing.assert_allclose((x @ x.T).numpy(), x.numpy() @ x.numpy().T, rtol=1e-4, atol=1e-3)
