"""A caching CUDA allocator, plugged into Numba as an External Memory Management plugin.

A ``cuda.device_array`` costs 33-60 us per alloc+free on the H200, as much as a kernel launch.
Here a freed block goes back to a size bucket and the next request of that bucket reuses it,
so a steady-state training step asks the driver for nothing.
"""
from collections import defaultdict

from ops.cuda_backend import CudaAPIError, MemoryManagerBase, MemoryPointer


def _bucket(nbytes):
    """Round a request up so that near-equal sizes share a bucket (512 B below 1 MiB, 1 MiB above)."""
    step = 512 if nbytes < (1 << 20) else (1 << 20)
    return max(step, -(-nbytes // step) * step)


class CachingMemoryManager(MemoryManagerBase):
    """Numba's own manager, but freed blocks are kept per size bucket and reused."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._free_blocks = defaultdict(list)   # bucket size -> blocks owned by the driver
        self.driver_allocations = 0
        self.cached_bytes = 0

    def memalloc(self, size):
        bucket = _bucket(size)
        free = self._free_blocks[bucket]
        if free:
            block = free.pop()
            self.cached_bytes -= bucket
        else:
            block = self._driver_alloc(bucket)
        return MemoryPointer(
            self.context, block.device_pointer, size, owner=None,
            finalizer=_Release(self, bucket, block),
        )

    def _driver_alloc(self, nbytes):
        try:
            block = super().memalloc(nbytes)
        except CudaAPIError:
            self.empty_cache()   # out of memory: give cached blocks back and try once more
            block = super().memalloc(nbytes)
        self.driver_allocations += 1
        return block

    def empty_cache(self):
        self._free_blocks.clear()   # dropping the owned pointers frees them through Numba
        self.cached_bytes = 0


class _Release:
    """Finalizer of a handed-out pointer: its block goes back to the bucket, not the driver.

    All our kernels run on the default stream, so a later kernel that reuses the block is
    ordered after every kernel that used it before."""

    def __init__(self, manager, bucket, block):
        self.manager, self.bucket, self.block = manager, bucket, block

    def __call__(self):
        self.manager._free_blocks[self.bucket].append(self.block)
        self.manager.cached_bytes += self.bucket
