"""A caching CUDA allocator, plugged into Numba as an External Memory Management plugin.

A ``cuda.device_array`` costs 33-60 us per alloc+free on the H200, as much as a kernel launch.
Here a freed block goes back to a size bucket and the next request of that bucket reuses it,
so a steady-state training step asks the driver for nothing.

When the driver is out of memory, the pool gives every cached block back and asks once
more (as torch's caching allocator does); a second refusal is an ``OutOfMemoryError``
naming the request, the device's free and total memory and what the pool holds, not the
driver's ``CUDA_ERROR_OUT_OF_MEMORY``. The pool's counts are untouched by a failed request,
so the process goes on.
"""
from collections import defaultdict

from numba.cuda.cudadrv.driver import CudaAPIError, MemoryPointer, binding
from numba.cuda.cudadrv.driver import NumbaCUDAMemoryManager as MemoryManagerBase

from ops.out_of_memory import OutOfMemoryError

OUT_OF_MEMORY = binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY


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
        self.in_use_bytes = 0   # handed-out blocks, by their bucket sizes

    def memalloc(self, size):
        bucket = _bucket(size)
        free = self._free_blocks[bucket]
        if free:
            block = free.pop()
            self.cached_bytes -= bucket
        else:
            block = self._driver_alloc(bucket, size)
        self.in_use_bytes += bucket
        return MemoryPointer(
            self.context, block.device_pointer, size, owner=None,
            finalizer=_Release(self, bucket, block),
        )

    def _driver_alloc(self, nbytes, requested):
        try:
            block = self._driver_memalloc(nbytes)
        except CudaAPIError as error:
            if error.code != OUT_OF_MEMORY:
                raise
            self.empty_cache()   # give cached blocks back and try once more
            try:
                block = self._driver_memalloc(nbytes)
            except CudaAPIError as error:
                if error.code != OUT_OF_MEMORY:
                    raise
                raise self._out_of_memory(requested) from None
        self.driver_allocations += 1
        return block

    def _driver_memalloc(self, nbytes):
        """A block from the driver (Numba's manager: it flushes its pending frees and retries
        once itself before it raises)."""
        return super().memalloc(nbytes)

    def _out_of_memory(self, requested):
        try:
            free, total = self.get_memory_info()
        except CudaAPIError:   # the driver cannot say: the error still names the rest
            free = total = None
        return OutOfMemoryError(requested, free, total, self.in_use_bytes, self.cached_bytes)

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
        self.manager.in_use_bytes -= self.bucket
