"""The GEMM template's tilings, and what a tiling may be: the catalogue (``Tiling``, FMA and
tensor-core, ``TILINGS`` by name), the modes the template computes, each tiling's threads,
padding and shared memory (``pipeline_layout`` for a pipelined one), and ``check_tiling``.
Pure Python: the sweep and the tests read it without Numba (ops/gemm/README.md)."""
import math
from collections import namedtuple

import numpy as np

# vec: a thread owns runs of 4 adjacent rows/columns (16-byte aligned shared reads that the
# compiler merges into vector loads; runs of 2 when its sub-tile is 2 wide) instead of
# rows/columns strided by the thread count. With the template's unsigned flat indexing (see
# ops.gemm.template) the PTX (sm_90) reads a run of 4 with one ld.shared.v4 and a run of 2 with
# one ld.shared.v2; before it, runs of 4 were pairs of v2 loads and runs of 2 scalar loads.
# Measured on the H200 (bench/gemm.py): vec took 4096³ from 16.0 to 22.0 TFLOP/s and 1024³ from
# 13.4 to 14.9; the indexing then took them to 30.4 and 24.0. For the one-element-per-thread
# SMALL tiling BK=32 beat 64 and 128. LARGE is capped at 128 registers (two blocks per
# multiprocessor instead of one): it took 4096³ from 22.0 to 25.0 TFLOP/s when the kernel needed
# more; it now needs 121 (ptxas).
Tiling = namedtuple("Tiling", "BM BN BK TM TN vec max_registers mma stages",
                    defaults=(False, None, None, None))
LARGE = Tiling(128, 128, 8, 8, 8, True, 128)
MEDIUM = Tiling(64, 64, 16, 4, 4, True)
SMALL = Tiling(16, 16, 32, 1, 1)
# 2x2 per thread: half SMALL's shared-memory reads per multiply-add, a quarter of its blocks
COMPACT = Tiling(32, 32, 16, 2, 2, True)
SIMULATED = Tiling(4, 4, 4, 2, 2)   # the simulator starts one OS thread per CUDA thread

# Candidates for the latency-bound MLP products, for the sweep to measure (not yet measured:
# none is picked unless GEMM_CHOICES names it). On the H200 MEDIUM took 21.8 us of GPU time for
# dW1's 8 K steps of 16 in 52 blocks: each step waits on its global loads and a barrier, so
# these take more K per step (more loads in flight per thread, fewer barriers), other tile
# shapes, or fewer threads doing more each.
COMPACT_K32 = Tiling(32, 32, 32, 2, 2, True)
COMPACT_K64 = Tiling(32, 32, 64, 2, 2, True)
COMPACT_128 = Tiling(32, 32, 32, 4, 2, True)   # 128 threads, 4x2 per thread
WIDE = Tiling(32, 64, 32, 2, 4, True)    # 32x64 for 256 threads
TALL = Tiling(64, 32, 32, 4, 2, True)    # 64x32 for 256 threads
MEDIUM_K32 = Tiling(64, 64, 32, 4, 4, True)
MEDIUM_128 = Tiling(64, 64, 16, 8, 4, True)   # 128 threads, 8x4 per thread
# The GPT's Dense products (`python -m bench.tiling_sweep gpt`, an H100, GPU us): LARGE's tile
# with K steps of 16 ran the 16384-row forwards and dX in 424.6-557.6 us against LARGE's
# 450.8-599.7; MEDIUM_128 in 24 K slices ran their dW (K = 16384) in 177.4-658.6 us, 1.2-1.8x
# faster than MEDIUM (the rule's), 1.07-1.1x than LARGE_K16 in as many slices.
LARGE_K16 = Tiling(128, 128, 16, 8, 8, True, 128)
TALL_128 = Tiling(128, 64, 16, 8, 8, True)    # 128 threads, 8x8 per thread

# Tensor-core tilings (``mma``: "tf32" or "bf16", ops.cuda.ptx), for float32 products
# under engine.set_float32_matmul_precision("high"/"medium"): each warp computes an (8·TM) x
# (4·TN) part of the tile from m16n8 fragments, a thread holding TM x TN accumulators in the
# fragments' layout (acc_position); the shared tiles, their double buffering and the fetches
# are the FMA tilings'. TF32 rounds each element once, as it is stashed; bf16 packs pairs as
# the fragments are read.
# LARGE: 4 warps of 64x64. At 4096³ on the H200 (16-byte loads) they did TF32 96.8 and bf16
# 111.9 TFLOP/s against 68.3 and 76.3 for 8 warps of 64x32 (128 accumulators a thread,
# fragments reused across twice the columns); 64x128 and 128x64 tiles did 70.8-71.0, 64x64x32
# 64.3 (`python -m bench.tiling_sweep tensor-cores`, 11 tilings, 2026-12-02).
TF32_LARGE = Tiling(128, 128, 16, 8, 16, mma="tf32")
TF32_MEDIUM = Tiling(64, 64, 16, 4, 8, mma="tf32")    # 4 warps of 32x32
TF32_WIDE = Tiling(32, 128, 16, 4, 8, mma="tf32")     # 4 warps of 32x32: a conv's 32 filters
BF16_LARGE = Tiling(128, 128, 16, 8, 16, mma="bf16")
BF16_MEDIUM = Tiling(64, 64, 16, 4, 8, mma="bf16")
BF16_WIDE = Tiling(32, 128, 16, 4, 8, mma="bf16")
# LARGE's tiles filled by asynchronous copies, stages - 1 K steps ahead (ops.gemm.mma's
# pipelined_accumulate), where the operands allow (pipeline_suits); a prologue's y takes a third
# tile per stage, so the backward's tiling keeps to BK 16 (92 KB: two blocks a multiprocessor).
# At 4096³ on the H200, 128x128x32 in 3 stages did TF32 131.8 and bf16 177.2 TFLOP/s (LARGE:
# 96.7, 112.0); 4 stages 100.0/134.4 (one block a multiprocessor), 128x128x16 in 4 stages
# 119.7/183.6, 128x256 and 256x128 124.9-127.8/165.5-173.7 (`python -m bench.tiling_sweep
# pipelined`). The wide MLP's TF32 epoch: 0.321-0.327 s -> 0.297-0.302 with BK 16 for the
# backward, 0.306-0.309 with 16 in 4 stages, 0.318-0.325 with 32 in 3 (one block a
# multiprocessor).
TF32_PIPELINED = Tiling(128, 128, 32, 8, 16, mma="tf32", stages=3)
BF16_PIPELINED = Tiling(128, 128, 32, 8, 16, mma="bf16", stages=3)
TF32_PIPELINED_PROLOGUE = Tiling(128, 128, 16, 8, 16, mma="tf32", stages=3)
BF16_PIPELINED_PROLOGUE = Tiling(128, 128, 16, 8, 16, mma="bf16", stages=3)
MmaTilings = namedtuple("MmaTilings", "large medium wide pipelined pipelined_prologue")
MMA_TILINGS = {"tf32": MmaTilings(TF32_LARGE, TF32_MEDIUM, TF32_WIDE, TF32_PIPELINED,
                                  TF32_PIPELINED_PROLOGUE),
               "bf16": MmaTilings(BF16_LARGE, BF16_MEDIUM, BF16_WIDE, BF16_PIPELINED,
                                  BF16_PIPELINED_PROLOGUE)}
MMA_K = {"tf32": 8, "bf16": 16}   # the K of one mma.sync
MMA_MIN_CAPABILITY = (8, 0)   # mma.sync's TF32 and bf16 shapes: Ampere and newer

# every tiling by the name the sweep and GEMM_CHOICES use
TILINGS = {name: tiling for name, tiling in globals().items() if isinstance(tiling, Tiling)}

MAX_THREADS = 1024
STATIC_SHARED_BYTES = 48 * 1024   # the most static shared memory a block may hold
DYNAMIC_SHARED_BYTES = 227 * 1024   # ... and dynamic, on sm_90 (sm_80: 163 KB)
MEDIUM_MIN_BLOCKS = 48   # below this many MEDIUM blocks, SMALL's many blocks win

# what the template computes besides the plain product; the CONV_ modes are the convolutions
# of ops.conv as implicit GEMMs (ops.gemm.conv_operands)
PLAIN, FORWARD, GRAD_A, GRAD_B, CONV_FORWARD, CONV_GRAD_INPUT, CONV_GRAD_WEIGHT = range(7)
PAD = 4   # shared-memory row padding: the transposing tile stores hit distinct banks


def threads_of(tiling):
    """A block's thread count: one thread per TM x TN sub-tile."""
    return (tiling.BM // tiling.TM) * (tiling.BN // tiling.TN)


def pad_of(tiling):
    """Shared-memory row padding in elements. A TF32 fragment's 32 reads are rows k0 + index
    (0..3) at columns r0 + group (0..7): a row of 8 (mod 32) words puts them in 32 distinct
    banks. bf16 reads rows k0 + 2·index: 4 (mod 32), as the FMA tilings' PAD."""
    return 8 if tiling.mma == "tf32" else PAD


def shared_bytes(tiling, dtype, mode=PLAIN):
    """Shared memory of a block: A's and B's tiles, double-buffered and padded (static); for
    a pipelined tiling its stages in the layout that needs the most under ``mode``
    (dynamic: a prologue's y takes a tile of its own)."""
    if tiling.stages:
        return max(pipeline_layout(tiling, trans_a, trans_b, mode).bytes
                   for trans_a in (False, True) for trans_b in (False, True))
    return (2 * tiling.BK * (tiling.BM + tiling.BN + 2 * pad_of(tiling))
            * np.dtype(dtype).itemsize)


def vec_run(per_thread, vec):
    """Under vec a thread owns runs of this many adjacent rows (columns): 4, or fewer when its
    sub-tile is narrower (a run must divide it); 1 is the strided layout."""
    return math.gcd(4, per_thread) if vec else 1


def check_tiling(tiling, dtype=np.float32, mode=PLAIN):
    """Raise ValueError unless the template can run ``tiling`` for ``dtype``: whole sub-tiles,
    a block size CUDA allows, tile loads that share out evenly over the threads, and shared
    memory within the static limit."""
    BM, BN, BK, TM, TN = tiling[:5]
    if min(tiling[:5]) < 1:
        raise ValueError(f"matmul: {tiling}: every extent must be at least 1")
    if BM % TM or BN % TN:
        raise ValueError(f"matmul: {tiling}: the {BM}x{BN} tile is not a whole number of "
                         f"{TM}x{TN} sub-tiles")
    threads = threads_of(tiling)
    if threads > MAX_THREADS:
        raise ValueError(f"matmul: {tiling}: {threads} threads, more than a block's "
                         f"{MAX_THREADS}")
    if (BM * BK) % threads or (BK * BN) % threads:
        raise ValueError(f"matmul: {tiling}: the A tile ({BM}x{BK}) and the B tile ({BK}x{BN}) "
                         f"must each be a whole number of loads per thread for {threads} "
                         f"threads")
    if tiling.stages is not None and tiling.mma is None:
        raise ValueError(f"matmul: {tiling}: only tensor-core tilings are pipelined")
    if tiling.mma is not None:
        _check_mma_tiling(tiling, dtype)
    needed = shared_bytes(tiling, dtype, mode)
    if tiling.stages:
        if needed > DYNAMIC_SHARED_BYTES:
            raise ValueError(f"matmul: {tiling}: {needed} bytes of shared memory in its "
                             f"stages, more than the {DYNAMIC_SHARED_BYTES} a block may hold")
    elif needed > STATIC_SHARED_BYTES:
        raise ValueError(f"matmul: {tiling}: {needed} bytes of shared memory for "
                         f"{np.dtype(dtype).name}, more than the {STATIC_SHARED_BYTES} a block "
                         f"may hold statically")


def _check_mma_tiling(tiling, dtype):
    BM, BN, BK, TM, TN = tiling[:5]
    if tiling.mma not in MMA_K:
        raise ValueError(f"matmul: {tiling}: mma is 'tf32', 'bf16' or None")
    if np.dtype(dtype) != np.float32:
        raise ValueError(f"matmul: {tiling}: tensor-core tilings multiply float32, not "
                         f"{np.dtype(dtype).name}")
    if TM % 2 or TN % 2 or BM % (8 * TM) or BN % (4 * TN):
        raise ValueError(f"matmul: {tiling}: a warp's part is (8·TM) x (4·TN) of m16n8 "
                         f"fragments: TM and TN even, and BM, BN whole numbers of such parts")
    if BK % MMA_K[tiling.mma]:
        raise ValueError(f"matmul: {tiling}: BK must be a multiple of {tiling.mma}'s mma K "
                         f"({MMA_K[tiling.mma]})")
    if tiling.stages is not None:
        threads = threads_of(tiling)
        if not 2 <= tiling.stages <= 5:
            raise ValueError(f"matmul: {tiling}: a pipeline has 2 to 5 stages")
        if (BM * BK // 4) % threads or (BN * BK // 4) % threads or BM % 4 or BN % 4:
            raise ValueError(f"matmul: {tiling}: the A and B tiles must each be a whole "
                             f"number of 16-byte copies per thread for {threads} threads")


def pipeline_layout(tiling, trans_a, trans_b, mode=PLAIN, y_tile=True):
    """The shared tiles of a pipelined tensor-core tiling (``stages``): per operand its
    (row, k) strides and the elements of one stage, the starts of B's stages and of the
    prologue's y (``mode`` GRAD_A: beside A's, GRAD_B: beside B's, in the same layout), and
    the dynamic shared bytes of all stages (``y_tile`` False: a linear layer's backward,
    whose act' is 1, copies no y). Each tile keeps its operand's layout in global
    memory (cp.async copies 16 bytes as they are): A stored (M, K) is held row by row, (K, M)
    k row by k row; B stored (N, K) row by row, (K, N) k row by k row. The padding puts the
    32 reads of a fragment register in 32 distinct banks: TF32 reads rows group (0..7) at k
    index (0..3), a row by row tile of BK + 4 (mod 32: 4) words, a k row by k row one of BM
    + 8 (8); bf16 reads k pairs 2·index, 2·index + 1 (8-byte loads in a row by row tile),
    BK + 8 and BM + 4."""
    BM, BN, BK = tiling[:3]
    TF32 = tiling.mma == "tf32"
    by_row_pad, by_k_pad = (4, 8) if TF32 else (8, 4)

    def operand(rows, k_contiguous):
        if k_contiguous:
            row = BK + by_row_pad
            return (row, 1), rows * row
        row = rows + by_k_pad
        return (1, row), BK * row

    a_strides, a_stage = operand(BM, not trans_a)
    b_strides, b_stage = operand(BN, trans_b)
    b_start = tiling.stages * a_stage
    aux_start = b_start + tiling.stages * b_stage
    aux_stage = {GRAD_A: a_stage, GRAD_B: b_stage}.get(mode, 0) if y_tile else 0
    return PipelineLayout(a_strides, a_stage, b_strides, b_stage, b_start, aux_start,
                          4 * (aux_start + tiling.stages * aux_stage))


PipelineLayout = namedtuple("PipelineLayout",
                            "a_strides a_stage b_strides b_stage b_start aux_start bytes")
