"""The batches of a batched GEMM: their description on the host (``batch_meta``) and the
offsets a block reads from it on the device (``batch_offsets``)."""
from numba import uint64 as U

from ops.cuda import cuda


def batch_meta(batch_shape, a_strides, b_strides):
    """The batched GEMM's batch description as one tuple of ints: the count d of batch dims,
    their sizes, then A's and B's strides along them in whole matrices of the operand (0
    where it is broadcast). Adjacent dims that both operands walk as one merge, so a
    contiguous batch is one dim whatever its rank."""
    dims = []
    for size, sa, sb in zip(batch_shape, a_strides, b_strides):
        if size == 1:
            continue
        if dims and dims[-1][1] == sa * size and dims[-1][2] == sb * size:
            outer = dims.pop()
            dims.append((outer[0] * size, sa, sb))
        else:
            dims.append((size, sa, sb))
    return (len(dims), *(d[0] for d in dims), *(d[1] for d in dims), *(d[2] for d in dims))


@cuda.jit(device=True)
def batch_offsets(batches, z):
    """``(i, j)``: the matrices of a and b that the output's batch ``z`` multiplies, from
    ``batch_meta``'s tuple in ``batches`` (the last batch dim varies fastest)."""
    dims = U(batches[0])
    rest, at_a, at_b = z, U(0), U(0)
    d = dims
    while d > U(0):
        d -= U(1)
        size = U(batches[U(1) + d])
        index = rest % size
        rest //= size
        at_a += index * U(batches[U(1) + dims + d])
        at_b += index * U(batches[U(1) + dims + dims + d])
    return at_a, at_b
