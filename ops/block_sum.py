"""The fixed-order sum of one CUDA block's per-thread values (no float atomics).

Every thread writes its value to ``partial`` (a shared array of blockDim.x entries, a power
of two), then pairs are added in a tree that halves each round: the same order every run,
so the sum is reproducible bit for bit. Used by the single-block kernels of the losses and
the training metrics."""
from numba import cuda


@cuda.jit(device=True)
def block_sum_cuda(partial, t, value):
    """The sum of ``value`` over the block's threads, valid in thread 0 after the call."""
    partial[t] = value
    cuda.syncthreads()
    step = partial.shape[0] // 2
    while step > 0:
        if t < step:
            partial[t] += partial[t + step]
        cuda.syncthreads()
        step //= 2
    return partial[0]
