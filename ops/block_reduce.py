"""The one fixed-order reduction of a CUDA block's per-thread values (no float atomics).

Every thread writes its value into a shared array of ``REDUCE_THREADS`` entries (a power of
two), then pairs are combined in a tree that halves each round: the same order every run, so
sums are reproducible bit for bit. Sum, mean, max, the losses, the training metrics and the
gradient norm all reduce through it, with one block of ``REDUCE_THREADS`` threads per output
(or per chunk of one: ``ops.reduce``). The tree is written once, in ``group_reduce_cuda``,
within aligned groups of a block's threads (softmax: a group per row); ``block_reduce_cuda`` is
its group of the whole block.
"""
from numba import float64, njit

from ops.cuda import SIMULATOR, cuda

REDUCE_THREADS = 8 if SIMULATOR else 256   # the simulator starts one OS thread per CUDA thread
SUM, MAX = 0, 1


def combine(code, left, right):
    """``left + right``, or the larger of the two where NaN wins (as NumPy's max)."""
    if code == SUM:
        return left + right
    return right if (right > left or right != right) else left


combine_cpu = njit(inline="always", error_model="numpy")(combine)
combine_cuda = cuda.jit(device=True)(combine)


@cuda.jit(device=True)
def group_reduce_cuda(code, value, group):
    """``value`` combined over each aligned group of ``group`` consecutive threads (a power of
    two dividing ``REDUCE_THREADS``) in the fixed halving tree; every thread gets its group's
    result. Several short rows share one block this way (softmax: a group per row). Every
    thread of the block must call it."""
    partial = cuda.shared.array(REDUCE_THREADS, float64)
    t = cuda.threadIdx.x
    lane = t % group
    partial[t] = value
    cuda.syncthreads()
    step = group // 2
    while step > 0:
        if lane < step:
            partial[t] = combine_cuda(code, partial[t], partial[t + step])
        cuda.syncthreads()
        step //= 2
    total = partial[t - lane]
    cuda.syncthreads()   # a second call in the same kernel may reuse the shared array
    return total


@cuda.jit(device=True)
def block_reduce_cuda(code, value):
    """``value`` combined over the block's threads in a fixed order; every thread gets it."""
    return group_reduce_cuda(code, value, REDUCE_THREADS)
