"""The one fixed-order reduction of a CUDA block's per-thread values (no float atomics).

Every thread writes its value into a shared array of ``REDUCE_THREADS`` entries (a power of
two), then pairs are combined in a tree that halves each round: the same order every run, so
sums are reproducible bit for bit. Sum, mean, max, the losses, the training metrics and the
gradient norm all reduce through it, with one block of ``REDUCE_THREADS`` threads per output
(or per chunk of one: ``ops.reduce``). The tree is written once, in ``group_reduce_cuda``,
within aligned groups of a block's threads (softmax: a group per row); ``block_reduce_cuda`` is
its group of the whole block. Inside a warp its rounds are shuffles, without a barrier.
"""
from numba import float64, njit

from ops.cuda import SIMULATOR, cuda

REDUCE_THREADS = 8 if SIMULATOR else 256   # the simulator starts one OS thread per CUDA thread
WARP, FULL_MASK = 32, 0xFFFFFFFF
# The tree's rounds of a step below this go by warp shuffles (none in the simulator). H100,
# LayerNorm at 16384 x 384, 32 lanes a row, each kernel replayed alone (GPU us, forward /
# dx): 42.6 / 49.1 through the shared array, 41.0 / 47.6 with the shuffles
SHUFFLE_BELOW = 1 if SIMULATOR else WARP
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
    thread of the block must call it.

    Round by round lane l combines its value with lane l + step's, step halving from group /
    2: rounds across warps through a shared array and a barrier each, the last five (steps
    16 to 1, inside a warp) by warp shuffles without one, the same pairs in the same order.
    Numba's simulator has no shuffles: there every round goes through the shared array."""
    partial = cuda.shared.array(REDUCE_THREADS, float64)
    t = cuda.threadIdx.x
    lane = t % group
    value = float64(value)
    step = group // 2
    if group > SHUFFLE_BELOW:
        partial[t] = value
        cuda.syncthreads()
        while step >= SHUFFLE_BELOW:
            if lane < step:
                partial[t] = combine_cuda(code, partial[t], partial[t + step])
            cuda.syncthreads()
            step //= 2
        value = partial[t]
    while step > 0:
        other = cuda.shfl_down_sync(FULL_MASK, value, step)
        if lane < step:
            value = combine_cuda(code, value, other)
        step //= 2
    if group > SHUFFLE_BELOW:   # the group's first thread holds the total
        if lane == 0:
            partial[t] = value
        cuda.syncthreads()
        value = partial[t - lane]
        cuda.syncthreads()   # a second call in the same kernel may reuse the shared array
    elif group > 1:
        value = cuda.shfl_sync(FULL_MASK, value, t % WARP - lane)
    return value


@cuda.jit(device=True)
def block_reduce_cuda(code, value):
    """``value`` combined over the block's threads in a fixed order; every thread gets it."""
    return group_reduce_cuda(code, value, REDUCE_THREADS)
