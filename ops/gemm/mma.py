"""The tensor-core (MMA) parts of the GEMM template: ``mma_parts``, a warp's m16n8 fragments
of a tile (TF32 or bf16, ``ops.cuda.ptx``'s instructions), and ``pipelined_accumulate``,
the main loop of a pipelined tiling, whose tiles asynchronous copies fill stages ahead
(``pipeline_suits``: which operands allow it)."""
import functools

from numba import uint32
from numba import uint64 as U

from ops import cuda as cuda_runtime
from ops.cuda import cuda
from ops.gemm.tilings import FORWARD, GRAD_A, GRAD_B, MMA_K, MMA_TILINGS, PLAIN, pipeline_layout
from ops.pointwise import IDENTITY, derivative_cuda


@functools.cache
def tensor_core_module():
    """``ops.cuda.ptx``, imported by the first kernel that needs its instructions."""
    from ops.cuda import ptx as tensor_core   # numba-cuda's extension API: tensor-core kernels only
    return tensor_core


def mma_parts(tiling, numba_type, A_STRIDES, B_STRIDES, A_BUFFER, B_BUFFER, B_START=0,
               raw=False, act=IDENTITY, A_AUX=None, B_AUX=None):
    """``multiply_buffer`` and ``acc_position`` of a tensor-core tiling. Warp w takes rows
    (w // WARPS_N)·WM and columns (w % WARPS_N)·WN of the tile, FM x FN fragments of m16n8;
    its lane 4·group + index holds, of fragment (f, g), acc[2f + h, 2g + v] = C[16f + 8h +
    group, 8g + 2·index + v] (the PTX ISA's accumulator layout: ops.cuda.ptx).

    ``A_STRIDES``, ``B_STRIDES``: (row, k) element strides of a shared tile, (1, row length)
    for a tile stored k row by k row, (row length, 1) for one stored row by row (a row of A
    is an m, of B an n); buffer ``cur`` of B starts at ``B_START + cur·B_BUFFER`` of
    ``b_tile``. ``raw``: TF32 tiles hold float32 values as copied, rounded (``to_tf32``) as
    the fragments are read, instead of rounded once as they were stashed. ``A_AUX``,
    ``B_AUX``: where the operand's tile holds G = grad_out · act'(y) as grad_out and y apart,
    y this many elements further on: the prologue applies as the fragments are read, with
    act's ``alpha``, ``multiply_buffer``'s sixth argument."""
    BM, BN, BK, TM, TN = tiling[:5]
    WM, WN = 8 * TM, 4 * TN
    WARPS_N = BN // WN
    FM, FN = TM // 2, TN // 2
    tensor_core = tensor_core_module()
    TF32 = tiling.mma == "tf32"
    mma = tensor_core.mma_tf32 if TF32 else tensor_core.mma_bf16
    pack_bf16, to_tf32 = tensor_core.pack_bf16, tensor_core.to_tf32
    load_float2 = tensor_core.load_float2
    K_STEP = MMA_K[tiling.mma]
    # a lane's first k row: index (TF32's a0 = A[group, index]) or 2·index (bf16's pairs)
    INDEX_ROWS = 1 if TF32 else 2
    A_FRAGMENT, B_FRAGMENT = 4 * FM, 2 * FN
    register_type = numba_type if TF32 and not raw else uint32
    (A_RS, A_KS), (B_RS, B_KS) = A_STRIDES, B_STRIDES

    @cuda.jit(device=True)
    def acc_position(tid, i, j):
        """(row, column) in the block's tile of the thread's acc[i, j]."""
        warp, lane = tid // U(32), tid % U(32)
        return ((warp // U(WARPS_N)) * U(WM) + U((i // 2) * 16 + (i % 2) * 8) + lane // U(4),
                (warp % U(WARPS_N)) * U(WN) + U((j // 2) * 8 + j % 2) + U(2) * (lane % U(4)))

    def register_reader(K_STRIDE, AUX):
        @cuda.jit(device=True)
        def element(tile, at, alpha):
            value = tile[at]
            if AUX is not None:
                y = tile[at + U(AUX)]
                value = value * numba_type(derivative_cuda(act, y, y, alpha))
            return value

        @cuda.jit(device=True)
        def operand(tile, at, alpha):
            """A fragment register: TF32 the element at ``at``; bf16 it and the next k's,
            the lower k in the low half: adjacent in a row by row tile (K_STRIDE 1), one
            8-byte load (two 4-byte ones met in the same banks there, 2-way)."""
            if TF32:
                value = element(tile, at, alpha)
                return to_tf32(value) if raw else value
            if K_STRIDE == 1 and AUX is None:
                low, high = load_float2(tile, at)
                return pack_bf16(low, high)
            return pack_bf16(element(tile, at, alpha), element(tile, at + U(K_STRIDE), alpha))
        return operand

    a_register, b_register = register_reader(A_KS, A_AUX), register_reader(B_KS, B_AUX)

    @cuda.jit(device=True)
    def multiply_buffer(a_tile, b_tile, cur, acc, tid, alpha):
        """acc += the warp's fragments of buffer ``cur``'s A (BM x BK) @ B (BK x BN)."""
        a_frag = cuda.local.array(A_FRAGMENT, register_type)
        b_frag = cuda.local.array(B_FRAGMENT, register_type)
        warp, lane = tid // U(32), tid % U(32)
        group, index = lane // U(4), lane % U(4)
        a_at = (cur * U(A_BUFFER) + index * U(INDEX_ROWS * A_KS)
                + ((warp // U(WARPS_N)) * U(WM) + group) * U(A_RS))
        b_at = (U(B_START) + cur * U(B_BUFFER) + index * U(INDEX_ROWS * B_KS)
                + ((warp % U(WARPS_N)) * U(WN) + group) * U(B_RS))
        kk = U(0)
        while kk < U(BK):
            a_row, b_row = a_at + kk * U(A_KS), b_at + kk * U(B_KS)
            for f in range(FM):   # rows 16f + group (+ 8) of the warp's part
                for h in range(4):   # a0..a3: (+8 rows) x (+4 k rows, or +8 under bf16)
                    a_frag[4 * f + h] = a_register(
                        a_tile, a_row + U((16 * f + 8 * (h % 2)) * A_RS
                                          + (h // 2) * (K_STEP // 2) * A_KS), alpha)
            for g in range(FN):
                for h in range(2):   # b0, b1: (+4 k rows, or +8 under bf16)
                    b_frag[2 * g + h] = b_register(
                        b_tile, b_row + U(8 * g * B_RS + h * (K_STEP // 2) * B_KS), alpha)
            for f in range(FM):
                for g in range(FN):
                    d = mma(a_frag[4 * f], a_frag[4 * f + 1], a_frag[4 * f + 2],
                            a_frag[4 * f + 3], b_frag[2 * g], b_frag[2 * g + 1],
                            acc[2 * f, 2 * g], acc[2 * f, 2 * g + 1],
                            acc[2 * f + 1, 2 * g], acc[2 * f + 1, 2 * g + 1])
                    acc[2 * f, 2 * g], acc[2 * f, 2 * g + 1] = d[0], d[1]
                    acc[2 * f + 1, 2 * g], acc[2 * f + 1, 2 * g + 1] = d[2], d[3]
            kk += U(K_STEP)

    return multiply_buffer, acc_position


def y_reads(mode, act):
    """Whether Dense's ``mode`` GEMM reads y for act'(y) on A (dX) and on B (dW): not for a
    linear layer, whose act' is 1 and G grad_out itself."""
    nonlinear = act != IDENTITY
    return mode == GRAD_A and nonlinear, mode == GRAD_B and nonlinear


def pipelined_accumulate(tiling, trans_a, trans_b, numba_type, THREADS, mode, act):
    """``(accumulate, acc_position)`` of a tensor-core tiling with ``stages``: the tiles are
    filled by asynchronous copies (``cp.async``, 16 bytes each, zeros past the operand's
    edges) ``stages - 1`` K steps ahead of the step being multiplied, in dynamic shared
    memory (``pipeline_layout``). No value passes through registers on its way to shared
    memory, so the operands are taken as they are (16-byte aligned, rows of a multiple of 4
    elements: ``pipeline_suits``): the prologue's y is copied beside its operand and applied
    as the fragments are read, and GRAD_B's row of ones is written over the zeros copied
    into that row, in the one row of blocks that holds it."""
    BM, BN, BK = tiling[:3]
    STAGES = tiling.stages
    A_PROLOGUE, B_PROLOGUE = y_reads(mode, act)
    layout = pipeline_layout(tiling, trans_a, trans_b, mode, A_PROLOGUE or B_PROLOGUE)
    ONES_ROW = mode == GRAD_B
    A_STAGE, B_STAGE, B_START = layout.a_stage, layout.b_stage, layout.b_start
    AUX_START = layout.aux_start
    multiply_buffer, acc_position = mma_parts(
        tiling, numba_type, layout.a_strides, layout.b_strides, A_STAGE, B_STAGE, B_START,
        raw=True, act=act, A_AUX=AUX_START if A_PROLOGUE else None,
        B_AUX=AUX_START - B_START if B_PROLOGUE else None)
    tensor_core = tensor_core_module()
    copy_async, commit_copies = tensor_core.copy_async, tensor_core.commit_copies
    wait_copies = tensor_core.wait_copies[STAGES - 2]
    TM, TN = tiling.TM, tiling.TN
    ZERO, ONE = numba_type(0), numba_type(1)
    A_RS, A_KS = layout.a_strides

    def copier(ROWS, k_contiguous, strides):
        CHUNKS_PER_ROW = BK // 4 if k_contiguous else ROWS // 4   # 16-byte chunks
        COPIES = ROWS * BK // 4 // THREADS
        ROW = strides[0] if k_contiguous else strides[1]

        @cuda.jit(device=True)
        def copy(tiles, at, x, first, size, k0, k_end, tid):
            """Start the copies of x's tile rows first.. (of ``size``) at k0.. into the stage
            starting at tiles[at]: consecutive threads take consecutive chunks of a row."""
            stride = U(x.shape[1])
            for v in range(COPIES):
                c = tid + U(v * THREADS)
                line, chunk = c // U(CHUNKS_PER_ROW), (c % U(CHUNKS_PER_ROW)) * U(4)
                if k_contiguous:   # line a row, chunk along k
                    row, k = first + line, k0 + chunk
                    source = row * stride + k
                else:              # line a k row, chunk along the rows
                    row, k = first + chunk, k0 + line
                    source = k * stride + row
                valid = row < size and k < k_end
                copy_async(tiles, at + line * U(ROW) + chunk, x, source if valid else U(0),
                           valid)
        return copy

    copy_a = copier(BM, not trans_a, layout.a_strides)
    copy_b = copier(BN, trans_b, layout.b_strides)

    @cuda.jit(device=True)
    def copy_stage(tiles, stage, a, b, aux, row0, col0, m_data, n_size, k0, k_end, tid):
        copy_a(tiles, stage * U(A_STAGE), a, row0, m_data, k0, k_end, tid)
        copy_b(tiles, U(B_START) + stage * U(B_STAGE), b, col0, n_size, k0, k_end, tid)
        if A_PROLOGUE:
            copy_a(tiles, U(AUX_START) + stage * U(A_STAGE), aux, row0, m_data, k0, k_end, tid)
        if B_PROLOGUE:
            copy_b(tiles, U(AUX_START) + stage * U(B_STAGE), aux, col0, n_size, k0, k_end,
                   tid)

    @cuda.jit(device=True)
    def accumulate(a, b, aux, acc, row0, col0, m_data, n_size, k_begin, k_end, group, alpha):
        """acc = this thread's sub-tile of op(A)[row0:, k_begin:k_end] @ op(B)[k_begin:k_end,
        col0:], the rows below ``m_data`` (and GRAD_B's ones at m_data) and columns below
        ``n_size``."""
        tiles = cuda.shared.array(0, numba_type)
        tid = U(cuda.threadIdx.x)
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = ZERO
        steps = (k_end - k_begin + U(BK - 1)) // U(BK)
        for s in range(STAGES - 1):
            if U(s) < steps:
                copy_stage(tiles, U(s), a, b, aux, row0, col0, m_data, n_size,
                           k_begin + U(s * BK), k_end, tid)
            commit_copies()
        ones_here = ONES_ROW and row0 <= m_data and m_data < row0 + U(BM)
        read, write = U(0), U(STAGES - 1)
        for step in range(steps):
            wait_copies()      # this thread's copies of step's stage have landed,
            cuda.syncthreads()  # everyone's have, and nobody still reads the stage to refill
            if ones_here:      # over the zeros copied past A's rows, before anyone reads them
                k = k_begin + step * U(BK) + tid
                if tid < U(BK) and k < k_end:
                    tiles[read * U(A_STAGE) + (m_data - row0) * U(A_RS) + tid * U(A_KS)] = ONE
                cuda.syncthreads()
            ahead = step + U(STAGES - 1)
            if ahead < steps:
                copy_stage(tiles, write, a, b, aux, row0, col0, m_data, n_size,
                           k_begin + ahead * U(BK), k_end, tid)
            commit_copies()    # an empty group past the end keeps the count of wait_copies
            multiply_buffer(tiles, tiles, read, acc, tid, alpha)
            read = read + U(1) if read + U(1) < U(STAGES) else U(0)
            write = write + U(1) if write + U(1) < U(STAGES) else U(0)

    return accumulate, acc_position


def pipelined_tiling(mma, mode, args):
    """The pipelined tiling of tensor-core format ``mma`` for the ``mode`` GEMM of ``args``,
    or None: no tensor cores, or operands that do not suit one (``pipeline_suits``)."""
    if not mma or not pipeline_suits(mode, args):
        return None
    tilings = MMA_TILINGS[mma]
    return tilings.pipelined_prologue if mode in (GRAD_A, GRAD_B) else tilings.pipelined


def pipeline_suits(mode, args):
    """Whether a GEMM's operands can be copied as they are into a pipelined tiling's tiles
    (``pipelined_accumulate``): A, B and the prologue's y (the first two or three of the
    entry point's ``args``) 16-byte aligned, with rows of a multiple of 4 elements."""
    if mode not in (PLAIN, FORWARD, GRAD_A, GRAD_B):
        return False
    return all(cuda_runtime.device_address(x) % 16 == 0 and x.shape[1] % 4 == 0
               for x in args[:3 if mode in (GRAD_A, GRAD_B) else 2])
