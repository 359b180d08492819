"""16-byte loads of the GEMM template's tiles (``vector_operand``): where a tile lies wholly
inside a 16-byte aligned operand, a thread fetches its elements 4 at a time along the
operand's contiguous dimension, without per-element bounds checks."""
from numba import uint64 as U

from ops.cuda import cuda
from ops.gemm.mma import tensor_core_module
from ops.pointwise import derivative_cuda


def vector_operand(vector, along_rows, ROWS, BK, ROW, LOADS, THREADS, has_aux, prologue,
                    fetch, stash, act, numba_type, TF32):
    """``(fast_tile, fetch, stash)`` of one operand (A, or B seen as its transpose: ROWS its
    tile rows, m or n): the scalar ``fetch``/``stash`` as they are when not ``vector``, else
    wrapped with the 16-byte path that a ``fast`` step takes. ``along_rows``: the operand's
    contiguous dimension runs along the tile's rows (A stored (K, M), B stored (K, N)), else
    along k. ``fast_tile(x, aux, first, size)``: whether the block's rows first.. lie inside
    x (of ``size`` rows) and x (and the prologue's aux) is 16-byte aligned with rows of a
    multiple of 4 elements."""
    if not vector:
        @cuda.jit(device=True)
        def fast_tile(x, aux, first, size):
            return False
        return fast_tile, fetch, stash
    tensor_core = tensor_core_module()
    load_float4, address_of = tensor_core.load_float4, tensor_core.address_of
    round_tf32 = tensor_core.round_tf32
    VECTORS = LOADS // 4

    @cuda.jit(device=True)
    def vector_slot(tid, v):
        """(k, row) of the first of the 4 elements of the thread's v-th vector: along the
        rows, consecutive threads taking consecutive vectors (coalesced); along k, two threads
        per row (one 32-byte sector), consecutive pairs on consecutive rows (2-way bank
        conflicts at the stash instead of 4-way)."""
        e = tid + U(v * THREADS)
        if along_rows:
            return e // U(ROWS // 4), (e % U(ROWS // 4)) * U(4)
        return (e % U(2) + U(2) * (e // U(2 * ROWS))) * U(4), (e // U(2)) % U(ROWS)

    @cuda.jit(device=True)
    def fast_tile(x, aux, first, size):
        aligned = address_of(x) % U(16) == U(0) and U(x.shape[1]) % U(4) == U(0)
        if has_aux:
            aligned = aligned and address_of(aux) % U(16) == U(0)
        return aligned and first + U(ROWS) <= size

    @cuda.jit(device=True)
    def vector_fetch(x, aux, regs, aux_regs, k0, first, size, k_end, tid, group, fast):
        if not fast:
            fetch(x, aux, regs, aux_regs, k0, first, size, k_end, tid, group, fast)
            return
        stride = U(x.shape[1])
        for v in range(VECTORS):
            kk, r = vector_slot(tid, v)
            at = ((k0 + kk) * stride + first + r if along_rows else
                  (first + r) * stride + k0 + kk)
            regs[4 * v], regs[4 * v + 1], regs[4 * v + 2], regs[4 * v + 3] = load_float4(x, at)
            if has_aux:
                (aux_regs[4 * v], aux_regs[4 * v + 1], aux_regs[4 * v + 2],
                 aux_regs[4 * v + 3]) = load_float4(aux, at)

    @cuda.jit(device=True)
    def vector_stash(tile, buffer, regs, aux_regs, tid, alpha, fast):
        if not fast:
            stash(tile, buffer, regs, aux_regs, tid, alpha, fast)
            return
        for v in range(VECTORS):
            kk, r = vector_slot(tid, v)
            for j in range(4):
                value = regs[4 * v + j]
                if prologue:
                    y = aux_regs[4 * v + j]
                    value = value * numba_type(derivative_cuda(act, y, y, alpha))
                if TF32:
                    value = round_tf32(value)
                if along_rows:
                    tile[buffer + kk * U(ROW) + r + U(j)] = value
                else:
                    tile[buffer + (kk + U(j)) * U(ROW) + r] = value

    return fast_tile, vector_fetch, vector_stash
