"""The GEMM kernel template (``gemm_kernels``): one ``@cuda.jit`` kernel per dtype, tiling,
operand layout, mode, activation and split, a block computing a tile of the output through
shared memory (ops/gemm/README.md)."""
import numpy as np
from numba import float32
from numba import uint64 as U
from numba.np.numpy_support import from_dtype

from ops import cuda as cuda_runtime
from ops.constant_code import kernels_of_code
from ops.gemm.batches import batch_offsets
from ops.cuda import SIMULATOR, cuda
from ops.gemm.conv_operands import conv_entry, conv_operands
from ops.gemm.mma import mma_parts, pipelined_accumulate, tensor_core_module, y_reads
from ops.gemm.tilings import (CONV_GRAD_INPUT, CONV_GRAD_WEIGHT, FORWARD, GRAD_A, GRAD_B,
                              PLAIN, check_tiling, pad_of, pipeline_layout, vec_run)
from ops.gemm.vector_operand import vector_operand
from ops.pointwise import derivative_cuda, value_cuda


@kernels_of_code("act")
def gemm_kernels(dtype, tiling, trans_a, trans_b, mode, act, partial, conv=None, batched=False):
    """The kernels for one dtype/tiling/layout/mode: a device function ``tile_product`` holding
    the whole GEMM, and the thin ``@cuda.jit`` entry point for ``mode`` with its own few
    arguments (each kernel argument costs launch time).

    The grid's z extent is the number of K slices, the block's z index its slice. ``partial``:
    the kernel of a split-K product, writing its raw slice sums (the bias row's too) into
    ``partials[slice]`` for ``ops.gemm.plans``' sum kernel to finish; its FORWARD is PLAIN (the
    epilogue moves to the sum).

    ``conv``: the ``ConvGeometry`` of a CONV_ mode, whose operands are gathered from the
    convolution's arrays (``conv_operands``) through the same main loop (``accumulate``).

    ``batched``: PLAIN's batched entry point ``gemm_batched_cuda(a, b, out, batches)`` for
    a (Ba, ., .), b (Bb, ., .), out (B, M, N): the grid's z index is the output's batch, whose
    operands' batches ``batches`` (``ops.gemm.plans.batch_meta``) gives (a stride of 0 for a
    broadcast one); no split-K."""
    if batched and (mode != PLAIN or partial or conv is not None):
        raise ValueError(f"matmul: the batched GEMM is PLAIN and unsplit, not {mode} "
                         f"(partial {partial}, conv {conv})")
    check_tiling(tiling, dtype, mode)
    BM, BN, BK, TM, TN = tiling[:5]
    # cache=True: numba-cuda keys a closure kernel's cache by the closure's contents, which
    # differ per dtype, tiling, layout, mode, activation and partial (max_registers is not
    # part of the key, and no two tilings share a closure)
    jit = (cuda.jit(cache=True, max_registers=tiling.max_registers) if tiling.max_registers
           else cuda.jit(cache=True))
    entry = jit
    # the activation-derivative prologue: on A (the gradient G = grad_out · act'(y)) for
    # Dense's dX and the conv's dw, on B for Dense's dW and the conv's dx; a linear Dense
    # layer's act' is 1, so its y is neither fetched nor multiplied (ops/gemm/README.md)
    A_READS_Y, B_READS_Y = y_reads(mode, act)
    A_PROLOGUE = A_READS_Y or mode == CONV_GRAD_WEIGHT
    B_PROLOGUE = B_READS_Y or mode == CONV_GRAD_INPUT
    if tiling.stages:
        SHARED_BYTES = pipeline_layout(tiling, trans_a, trans_b, mode,
                                       A_READS_Y or B_READS_Y).bytes

        def entry(function):   # its tiles are dynamic shared memory, given at each launch
            kernel = jit(function)
            cuda_runtime.set_dynamic_shared_bytes(kernel, SHARED_BYTES)
            return kernel
    TY, TX = BM // TM, BN // TN
    THREADS = TY * TX
    A_LOADS, B_LOADS = BM * BK // THREADS, BK * BN // THREADS
    A_AUX_LOADS = A_LOADS if A_PROLOGUE else 1
    B_AUX_LOADS = B_LOADS if B_PROLOGUE else 1
    numba_type = from_dtype(np.dtype(dtype))
    ZERO, ONE = np.dtype(dtype).type(0), np.dtype(dtype).type(1)
    ONES_ROW = mode == GRAD_B   # A gets a virtual last row of ones: that output row is db
    EXTRA_ROWS = 1 if ONES_ROW else 0
    PARTIAL = partial
    BATCHED = batched
    A_ROW, B_ROW = BM + pad_of(tiling), BN + pad_of(tiling)   # elements from one k row to the next
    A_BUFFER, B_BUFFER = BK * A_ROW, BK * B_ROW
    A_TILE, B_TILE = 2 * A_BUFFER, 2 * B_BUFFER   # two buffers each, as constants
    ACC = (TM, TN)
    RUN_M, RUN_N = vec_run(TM, tiling.vec), vec_run(TN, tiling.vec)
    ALIGN = None if SIMULATOR else 16   # bytes; the simulator takes no alignment
    MMA = tiling.mma
    TF32 = MMA == "tf32"
    round_tf32 = tensor_core_module().round_tf32 if TF32 else None

    @cuda.jit(device=True)
    def owned(t, i, count, run):
        """The i-th row (column) of the tile owned by the thread at position t of count, in
        runs of ``run`` adjacent ones (unsigned: t is, and i a constant once unrolled)."""
        return t * U(run) + U((i // run) * (count * run) + i % run)

    if MMA:
        multiply_with_alpha, acc_position = mma_parts(tiling, numba_type, (1, A_ROW),
                                                       (1, B_ROW), A_BUFFER, B_BUFFER)

        @cuda.jit(device=True)
        def multiply_buffer(a_tile, b_tile, cur, acc, tid):   # the prologue came at the stash
            multiply_with_alpha(a_tile, b_tile, cur, acc, tid, ZERO)
    else:
        @cuda.jit(device=True)
        def acc_position(tid, i, j):
            """(row, column) in the block's tile of the thread's acc[i, j]."""
            return owned(tid // U(TX), i, TY, RUN_M), owned(tid % U(TX), j, TX, RUN_N)

        @cuda.jit(device=True)
        def multiply_buffer(a_tile, b_tile, cur, acc, tid):
            """acc += the thread's sub-tile of buffer ``cur``'s A (BM x BK) @ B (BK x BN)."""
            a_frag = cuda.local.array(TM, numba_type)
            b_frag = cuda.local.array(TN, numba_type)
            # Unsigned flat offsets and a while loop: a[cur, kk, owned(...)] over range(BK)
            # was left rolled, and its signed 64-bit index arithmetic (Numba's negative-index
            # wraparound and floor-division fix-ups) was most of the loop: ~20 integer
            # instructions per 8 multiply-adds in the PTX, 6.5 instructions per multiply-add
            # under ncu at dW1. Now the loop unrolls by 4 into vector shared loads at constant
            # offsets and multiply-adds (TALL: 2 loads per 8), the registers fell from 128 to
            # 63, and the MLP step's GEMM kernels went from 72.7 to 51.6 us of H200 time.
            a_at = cur * U(A_BUFFER) + owned(tid // U(TX), 0, TY, RUN_M)
            b_at = cur * U(B_BUFFER) + owned(tid % U(TX), 0, TX, RUN_N)
            kk = U(0)
            while kk < U(BK):   # not range(): its iterator's bookkeeping stops the unrolling
                # without vec, thread (ty, tx) owns rows ty + i*TY and columns tx + j*TX:
                # a warp reads consecutive shared words (no bank conflicts), stores coalesce
                a_row, b_row = a_at + kk * U(A_ROW), b_at + kk * U(B_ROW)
                for i in range(TM):
                    a_frag[i] = a_tile[a_row + owned(U(0), i, TY, RUN_M)]
                for j in range(TN):
                    b_frag[j] = b_tile[b_row + owned(U(0), j, TX, RUN_N)]
                for i in range(TM):
                    for j in range(TN):
                        acc[i, j] += a_frag[i] * b_frag[j]
                kk += U(1)

    # The derivative prologue is applied as a tile is stashed, not as it is fetched: a
    # comparison right after its load made each load wait for the one before (relu's dW1 took
    # 10.4 us of H200 time, the same kernel without the prologue 7.7); the fetches now only
    # issue loads, which are in flight while the block multiplies the other buffer.
    @cuda.jit(device=True)
    def a_slot(tid, load):
        """(k, row) in A's tile of the thread's ``load``-th element: consecutive threads take
        consecutive m when a is stored (K, M), consecutive k when (M, K), so reads coalesce."""
        e = tid + U(load * THREADS)
        if trans_a:
            return e // U(BM), e % U(BM)
        return e % U(BK), e // U(BK)

    @cuda.jit(device=True)
    def b_slot(tid, load):
        """(k, column) in B's tile of the thread's ``load``-th element, coalesced as a_slot."""
        e = tid + U(load * THREADS)
        if trans_b:   # b is (N, K): consecutive threads read consecutive k
            return e % U(BK), e // U(BK)
        return e // U(BN), e % U(BN)

    # ``group``: the block's group of a convolution (conv_operands' fetches); one signature
    # for accumulate, unused here
    @cuda.jit(device=True)
    def fetch_a(a, aux, regs, aux_regs, k0, row0, m_data, k_end, tid, group, fast):
        for load in range(A_LOADS):
            kk, r = a_slot(tid, load)
            m, k = row0 + r, k0 + kk
            value = y = ZERO
            if k < k_end:
                if m < m_data:
                    value = a[k, m] if trans_a else a[m, k]
                    if A_READS_Y:   # G = grad_out * act'(y), y standing for x
                        y = aux[m, k]
                elif ONES_ROW and m == m_data:
                    value = ONE
            regs[load] = value
            aux_regs[load if A_READS_Y else 0] = y

    @cuda.jit(device=True)
    def stash_a(tile, buffer, regs, aux_regs, tid, alpha, fast):
        for load in range(A_LOADS):
            kk, r = a_slot(tid, load)
            value = regs[load]
            if A_PROLOGUE:   # a zero fetched outside a keeps zero: act' is finite at 0
                y = aux_regs[load]
                value = value * numba_type(derivative_cuda(act, y, y, alpha))
            if TF32:
                value = round_tf32(value)
            tile[buffer + kk * U(A_ROW) + r] = value

    @cuda.jit(device=True)
    def fetch_b(b, aux, regs, aux_regs, k0, col0, n_size, k_end, tid, group, fast):
        for load in range(B_LOADS):
            kk, c = b_slot(tid, load)
            n, k = col0 + c, k0 + kk
            value = y = ZERO
            if k < k_end and n < n_size:
                value = b[n, k] if trans_b else b[k, n]
                if B_READS_Y:
                    y = aux[k, n]
            regs[load] = value
            aux_regs[load if B_READS_Y else 0] = y

    @cuda.jit(device=True)
    def stash_b(tile, buffer, regs, aux_regs, tid, alpha, fast):
        for load in range(B_LOADS):
            kk, c = b_slot(tid, load)
            value = regs[load]
            if B_PROLOGUE:
                y = aux_regs[load]
                value = value * numba_type(derivative_cuda(act, y, y, alpha))
            if TF32:
                value = round_tf32(value)
            tile[buffer + kk * U(B_ROW) + c] = value

    if conv is not None:
        fetch_a, fetch_b = conv_operands(conv, mode, numba_type, A_LOADS, B_LOADS, a_slot,
                                          b_slot)
    # 16-byte loads of the tiles that lie wholly inside 16-byte aligned operands
    # (ops.cuda.ptx.load_float4): a thread's elements come 4 at a time along the operand's
    # contiguous dimension, and the per-element bounds checks go. Under tensor cores the
    # per-element fetch (index arithmetic, two comparisons, a 4-byte load) was most of the
    # instructions the MMA tilings issued: every tiling swept stopped at 46-52 TFLOP/s at
    # 4096³ on the H200.
    VECTOR = (not SIMULATOR and conv is None and numba_type == float32
              and (MMA is not None or BM * BN >= 64 * 64))
    VECTOR_A = VECTOR and A_LOADS % 4 == 0 and (trans_a or BK % 8 == 0) and BM % 4 == 0
    VECTOR_B = VECTOR and B_LOADS % 4 == 0 and (not trans_b or BK % 8 == 0) and BN % 4 == 0
    fast_tile_a, fetch_a, stash_a = vector_operand(
        VECTOR_A, trans_a, BM, BK, A_ROW, A_LOADS, THREADS, A_READS_Y, A_PROLOGUE,
        fetch_a, stash_a, act, numba_type, TF32)
    fast_tile_b, fetch_b, stash_b = vector_operand(
        VECTOR_B, not trans_b, BN, BK, B_ROW, B_LOADS, THREADS, B_READS_Y, B_PROLOGUE,
        fetch_b, stash_b, act, numba_type, TF32)

    @cuda.jit(device=True)
    def accumulate(a, b, aux, acc, row0, col0, m_data, n_size, k_begin, k_end, group, alpha):
        """acc = this thread's sub-tile of op(A)[row0:, k_begin:k_end] @ op(B)[k_begin:k_end,
        col0:], the rows below ``m_data`` and columns below ``n_size``."""
        # the tiles are flat: row kk of buffer s of A's tile starts at s*A_BUFFER + kk*A_ROW
        a_tile = cuda.shared.array(A_TILE, numba_type, alignment=ALIGN)
        b_tile = cuda.shared.array(B_TILE, numba_type, alignment=ALIGN)
        a_regs = cuda.local.array(A_LOADS, numba_type)
        b_regs = cuda.local.array(B_LOADS, numba_type)
        a_aux_regs = cuda.local.array(A_AUX_LOADS, numba_type)   # y under the prologue
        b_aux_regs = cuda.local.array(B_AUX_LOADS, numba_type)
        tid = U(cuda.threadIdx.x)
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = ZERO
        a_fast = fast_tile_a(a, aux, row0, m_data)   # whole rows of the tile: 16-byte loads
        b_fast = fast_tile_b(b, aux, col0, n_size)
        fast = k_begin + U(BK) <= k_end
        fetch_a(a, aux, a_regs, a_aux_regs, k_begin, row0, m_data, k_end, tid, group,
                a_fast and fast)
        fetch_b(b, aux, b_regs, b_aux_regs, k_begin, col0, n_size, k_end, tid, group,
                b_fast and fast)
        stash_a(a_tile, U(0), a_regs, a_aux_regs, tid, alpha, a_fast and fast)
        stash_b(b_tile, U(0), b_regs, b_aux_regs, tid, alpha, b_fast and fast)
        cuda.syncthreads()
        steps = (k_end - k_begin + U(BK - 1)) // U(BK)
        for step in range(steps):
            cur = step % U(2)
            more = step + U(1) < steps
            k_next = k_begin + (step + U(1)) * U(BK)
            fast = k_next + U(BK) <= k_end
            if more:   # global loads of the next slice overlap the math on this one
                fetch_a(a, aux, a_regs, a_aux_regs, k_next, row0, m_data, k_end, tid, group,
                        a_fast and fast)
                fetch_b(b, aux, b_regs, b_aux_regs, k_next, col0, n_size, k_end, tid, group,
                        b_fast and fast)
            multiply_buffer(a_tile, b_tile, cur, acc, tid)
            if more:
                stash_a(a_tile, (U(1) - cur) * U(A_BUFFER), a_regs, a_aux_regs, tid, alpha,
                        a_fast and fast)
                stash_b(b_tile, (U(1) - cur) * U(B_BUFFER), b_regs, b_aux_regs, tid, alpha,
                        b_fast and fast)
            cuda.syncthreads()

    if tiling.stages:
        accumulate, acc_position = pipelined_accumulate(tiling, trans_a, trans_b, numba_type,
                                                         THREADS, mode, act)

    @cuda.jit(device=True)
    def k_range(k_size, slice_index, slices):
        """This block's K slice: whole BK steps, the rule of k_slices (never empty there)."""
        per_slice = ((k_size + U(BK - 1)) // U(BK) + slices - U(1)) // slices
        k_begin = min(slice_index * per_slice * U(BK), k_size)
        return k_begin, min(k_begin + per_slice * U(BK), k_size)

    if conv is not None:
        return conv_entry(conv, mode, partial, act, entry, accumulate, k_range, acc_position,
                           tiling, numba_type)

    @cuda.jit(device=True)
    def put(out, side, bias, m, n, m_data, n_size, value, alpha):
        """Store the product's element (m, n): a slice sum, an output after the epilogue, or
        db from the row of ones; nothing past the edges."""
        if n < n_size:
            if PARTIAL:
                if m < m_data + U(EXTRA_ROWS):
                    out[U(cuda.blockIdx.z), m, n] = value
            elif m < m_data:
                if mode == FORWARD:
                    value = value_cuda(act, value + bias[n], alpha)
                out[m, n] = value
            elif ONES_ROW and m == m_data:
                side[n] = value

    # A tensor-core fragment holds two adjacent columns of a row (acc[i, j], acc[i, j + 1]
    # for even j): stored in one 8-byte store where the output's rows allow it. A warp's
    # 4-byte stores of them each half-fill 32-byte sectors.
    PAIRED = MMA is not None and not SIMULATOR
    OUT_DIMS = 3 if PARTIAL else 2
    address_of = tensor_core_module().address_of if PAIRED else None
    store_float2 = tensor_core_module().store_float2 if PAIRED else None

    @cuda.jit(device=True)
    def put_pair(out, side, bias, m, n, m_data, n_size, low, high, alpha, pairs):
        """``put`` of (m, n) and (m, n + 1), in one store when ``pairs`` (rows of an even
        length from an 8-byte aligned start; n is even) and both are inside."""
        inside = m < m_data + U(EXTRA_ROWS) if PARTIAL else m < m_data
        if pairs and inside and n + U(1) < n_size:
            if PARTIAL:
                at = (U(cuda.blockIdx.z) * U(out.shape[1]) + m) * n_size + n
            else:
                at = m * n_size + n
                if mode == FORWARD:
                    low = value_cuda(act, low + bias[n], alpha)
                    high = value_cuda(act, high + bias[n + U(1)], alpha)
            store_float2(out, at, low, high)
        else:
            put(out, side, bias, m, n, m_data, n_size, low, alpha)
            put(out, side, bias, m, n + U(1), m_data, n_size, high, alpha)

    @cuda.jit(device=True)
    def tile_product(a, b, out, aux, side, bias, alpha):
        acc = cuda.local.array(ACC, numba_type)
        tid = U(cuda.threadIdx.x)
        row0, col0 = U(cuda.blockIdx.y) * U(BM), U(cuda.blockIdx.x) * U(BN)
        if trans_a:
            k_size, m_data = U(a.shape[0]), U(a.shape[1])
        else:
            m_data, k_size = U(a.shape[0]), U(a.shape[1])
        n_size = U(b.shape[0]) if trans_b else U(b.shape[1])
        if BATCHED:   # the grid's z is the batch: the whole of K
            k_begin, k_end = U(0), k_size
        else:
            k_begin, k_end = k_range(k_size, U(cuda.blockIdx.z), U(cuda.gridDim.z))
        accumulate(a, b, aux, acc, row0, col0, m_data, n_size, k_begin, k_end, U(0), alpha)
        if PAIRED:
            pairs = out.shape[OUT_DIMS - 1] % 2 == 0 and address_of(out) % U(8) == U(0)
            for i in range(TM):
                for j in range(0, TN, 2):
                    r, c = acc_position(tid, i, j)
                    put_pair(out, side, bias, row0 + r, col0 + c, m_data, n_size, acc[i, j],
                             acc[i, j + 1], alpha, pairs)
        else:
            for i in range(TM):
                for j in range(TN):
                    r, c = acc_position(tid, i, j)
                    put(out, side, bias, row0 + r, col0 + c, m_data, n_size, acc[i, j], alpha)

    if PARTIAL:
        if mode == PLAIN:
            @entry
            def gemm_partial_cuda(a, b, partials):
                tile_product(a, b, partials, a, partials[0, 0], partials[0, 0], ZERO)
            return gemm_partial_cuda
        if mode == GRAD_A:
            @entry
            def dense_grad_input_partial_cuda(g, y, w, partials, alpha):
                tile_product(g, w, partials, y, partials[0, 0], partials[0, 0], alpha)
            return dense_grad_input_partial_cuda

        @entry
        def dense_grad_params_partial_cuda(x, g, y, partials, alpha):
            tile_product(x, g, partials, y, partials[0, 0], partials[0, 0], alpha)
        return dense_grad_params_partial_cuda
    if BATCHED:
        @entry
        def gemm_batched_cuda(a, b, out, batches):
            """out[z] = op(a[i]) @ op(b[j]) for the block's batch z (``batch_offsets``)."""
            z = U(cuda.blockIdx.z)
            at_a, at_b = batch_offsets(batches, z)
            c = out[z]
            tile_product(a[at_a], b[at_b], c, a[at_a], c[0], c[0], ZERO)
        return gemm_batched_cuda
    if mode == PLAIN:
        @entry
        def gemm_cuda(a, b, out):
            tile_product(a, b, out, a, out[0], out[0], ZERO)
        return gemm_cuda
    if mode == FORWARD:
        @entry
        def dense_forward_cuda(x, w, bias, out, alpha):
            tile_product(x, w, out, x, bias, bias, alpha)
        return dense_forward_cuda
    if mode == GRAD_A:
        @entry
        def dense_grad_input_cuda(g, y, w, grad_x, alpha):
            tile_product(g, w, grad_x, y, grad_x[0], grad_x[0], alpha)
        return dense_grad_input_cuda

    @entry
    def dense_grad_params_cuda(x, g, y, grad_w, grad_b, alpha):
        tile_product(x, g, grad_w, y, grad_b, grad_b, alpha)
    return dense_grad_params_cuda
