"""Matrix products: BLAS on the CPU, our own tiled, register-blocked GEMM on CUDA.

CPU: ``np.dot`` inside ``@njit`` writes straight into the preallocated output (SciPy's BLAS,
measured equal to NumPy's ``@``); a transposed operand is passed as ``a.T``, a free view.
A large product runs in row blocks across the engine's threads (``gemm_split_cpu``). Dense
calls NumPy's BLAS from Python instead (``blas_product``), which compiles nothing.

CUDA: one kernel template (``_gemm_kernels``) built per dtype, tiling and operand layout.
Each block computes a ``BM x BN`` tile of the output; each of its threads (256 in the
tilings below, 128 in some sweep candidates) keeps a ``TM x TN`` sub-tile in registers
(register blocking), walking K in steps of ``BK`` through two shared-memory buffers: while
the block multiplies one buffer, every thread already holds the next K-slice in registers
and stores it into the other buffer (double buffering, one barrier per step). The tilings:

- ``LARGE`` (128x128, 8x8 per thread) when it alone gives every multiprocessor a block;
- ``MEDIUM`` (64x64, 4x4 per thread) for mid-sized outputs such as 1024x1024;
- ``SMALL`` (16x16, one element per thread, BK=32) for MLP shapes such as 128x784x256:
  as many blocks as the output allows;
- ``COMPACT`` (32x32, 2x2 per thread) a candidate between SMALL and MEDIUM;
- candidates for the sweep at latency-bound MLP shapes (BK=32/64, 32x64, 64x32, 128 threads),
  picked only where ``GEMM_CHOICES`` names one.

A product with too few output tiles to fill the GPU also splits K (split-K): its blocks write
partial tiles of their K slices into a scratch buffer, and a second kernel sums them in a
fixed order and applies the epilogue. Which tiling and split count a shape gets is
``pick_config``'s: the measured choice of ``GEMM_CHOICES`` (set from ``python -m bench.gemm
--device cuda --sweep``), else a size rule.

Transposed operands (A·Bᵀ, Aᵀ·B) only change how a tile is fetched from global memory, so
a backward pass never materialises a transpose. The same template carries the fused Dense
kernels of ``ops.dense``: bias and activation as an epilogue, the activation's derivative as
a prologue on the gradient operand, and a virtual row of ones that yields the bias gradient
as one more output row. Sums run in a fixed order: results are reproducible run to run.

The convolutions of ``ops.conv`` are the same template with gathered operands (implicit
GEMM, ``conv_gemm_shape``): the fetches take a tile's rows and columns apart into (sample,
row, column) and (channel, tap) with the geometry a compile-time constant, read zero in the
padding, and the epilogues store NCHW; the main loop (``accumulate``) is the one above.
Their configs come from ``CONV_CHOICES`` (``python -m bench.conv_ops --device cuda
--sweep``), else ``pick_conv_config``'s rule.
"""
import functools
import math
from collections import namedtuple

import numpy as np
from numba import njit
from numba import float32, uint32
from numba import uint64 as U
from numba.np.numpy_support import from_dtype

from ops import cuda_backend, matmul_precision
from ops.cpu_threads import numpy_blas_on_one_thread, row_blocks, run_blocks
from ops.cuda_backend import SIMULATOR, cuda, device_reshape
from ops.dispatch import Out, run
from ops.launch import Kernel
from ops.layout import flat
from ops.memory import empty
from ops.pointwise import IDENTITY, derivative_cuda, value_cuda
from ops.registry import Op, register

# ------------------------------------------------------------------ CPU kernel


@njit(cache=True, nogil=True)
def gemm_cpu(a, b, out, trans_a, trans_b):
    """out = op(a) @ op(b) through BLAS, op a free transpose view when asked."""
    if trans_a and trans_b:
        np.dot(a.T, b.T, out)
    elif trans_a:
        np.dot(a.T, b, out)
    elif trans_b:
        np.dot(a, b.T, out)
    else:
        np.dot(a, b, out)


def gemm_split_cpu(a, b, out, trans_a, trans_b):
    """``gemm_cpu``, a large product with an untransposed ``a`` in row blocks of ``a`` and
    ``out`` across the engine's threads (``ops.cpu_threads``): the same kernel on row
    slices, the same sums. (A transposed ``a``'s row blocks are its columns, a slice of
    another layout that would compile the kernel again: it runs whole.)"""
    blocks = None if trans_a else row_blocks(out.shape[0], out.size * a.shape[1])
    if blocks is None:
        gemm_cpu(a, b, out, trans_a, trans_b)
    else:
        run_blocks([(gemm_cpu, (a[start:stop], b, out[start:stop], trans_a, trans_b))
                    for start, stop in blocks])


gemm_split_cpu.__wrapped__ = gemm_cpu


def blas_product(a, b, out):
    """out = a @ b by NumPy's BLAS, called from Python: ``np.dot`` inside ``@njit`` compiles
    Numba's GEMM wrapper once per operand layout and again into every kernel that calls it
    (the MLP's four Dense kernels took 1.7-2.1 s of a 3.1-4.6 s cold first step, their loops
    alone 0.7 s now: ``python -m bench.mlp``). NumPy releases the GIL in the call, so the
    blocks of a split still run at once, and reads a transposed or column-sliced operand in
    place. On one BLAS thread (``ops.cpu_threads.numpy_blas_on_one_thread``)."""
    numpy_blas_on_one_thread()
    np.dot(a, b, out=out)


# ------------------------------------------------------------------ CUDA tilings

# vec: a thread owns runs of 4 adjacent rows/columns (16-byte aligned shared reads that the
# compiler merges into vector loads; runs of 2 when its sub-tile is 2 wide) instead of
# rows/columns strided by the thread count. With the template's unsigned flat indexing (see
# tile_product) the PTX (sm_90) reads a run of 4 with one ld.shared.v4 and a run of 2 with one
# ld.shared.v2; before it, runs of 4 were pairs of v2 loads and runs of 2 scalar loads.
# Measured on the H200 (bench/gemm.py): vec took 4096³ from 16.0 to 22.0 TFLOP/s and 1024³
# from 13.4 to 14.9; the indexing then took them to 30.4 and 24.0. For the
# one-element-per-thread SMALL tiling BK=32 beat 64 and 128. LARGE is capped at 128 registers
# (two blocks per multiprocessor instead of one): it took 4096³ from 22.0 to 25.0 TFLOP/s when
# the kernel needed more; it now needs 121 (ptxas).
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

# Tensor-core tilings (``mma``: "tf32" or "bf16", ops.tensor_core), for float32 products
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
# LARGE's tiles filled by asynchronous copies, stages - 1 K steps ahead (_pipelined_accumulate),
# where the operands allow (pipeline_suits); a prologue's y takes a third tile per stage, so
# the backward's tiling keeps to BK 16 (92 KB: two blocks a multiprocessor). At 4096³ on the
# H200, 128x128x32 in 3 stages did TF32 131.8 and bf16 177.2 TFLOP/s (LARGE: 96.7, 112.0); 4
# stages 100.0/134.4 (one block a multiprocessor), 128x128x16 in 4 stages 119.7/183.6, 128x256
# and 256x128 124.9-127.8/165.5-173.7 (`python -m bench.tiling_sweep pipelined`). The wide
# MLP's TF32 epoch: 0.321-0.327 s -> 0.297-0.302 with BK 16 for the backward, 0.306-0.309 with
# 16 in 4 stages, 0.318-0.325 with 32 in 3 (one block a multiprocessor).
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
# of ops.conv as implicit GEMMs (see _conv_operands)
PLAIN, FORWARD, GRAD_A, GRAD_B, CONV_FORWARD, CONV_GRAD_INPUT, CONV_GRAD_WEIGHT = range(7)
PAD = 4   # shared-memory row padding: the transposing tile stores hit distinct banks


_multiprocessors = functools.cache(cuda_backend.multiprocessor_count)
_compute_capability = functools.cache(cuda_backend.compute_capability)


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


def mma_format(dtype):
    """The tensor-core format (``"tf32"``, ``"bf16"``) that products of ``dtype`` take now:
    the float32 matmul precision's (ops.matmul_precision), for float32 on a GPU that has the
    instructions; None otherwise (the FMA tilings)."""
    format_ = matmul_precision.tensor_core_format()
    if (format_ is None or SIMULATOR or np.dtype(dtype) != np.float32
            or _compute_capability() < MMA_MIN_CAPABILITY):
        return None
    return format_


# Below these an output or K fills too little of an m16n8 fragment and a BK of 16 (the CNN's
# first convolution has K = 9, its weight gradient N = 10): such products keep the FMA
# tilings and their measured choices. On the H200 the CNN's captured epoch took 0.29 s with
# every conv GEMM on tensor cores against 0.25 s in fp32.
MMA_MIN_ROWS, MMA_MIN_COLUMNS, MMA_MIN_K = 32, 32, 64


def mma_suits(m, n, k):
    return m >= MMA_MIN_ROWS and n >= MMA_MIN_COLUMNS and k >= MMA_MIN_K


# LARGE over MEDIUM when a split-K can give LARGE's tiles enough blocks, each slice at least
# this long. On the H200 (TF32, GPU us) at the wide MLP's 128x4096 outputs with K = 4096,
# LARGE in 8 slices took 68.7 us against MEDIUM's best 93.5 (x·W2) and 78.5 against 105.9
# (G·W2ᵀ); with K = 784 LARGE lost (30.2 against 27.4 us at 4 slices of 196)
# (`python -m bench.tiling_sweep wide-mlp`).
MMA_LARGE_MIN_SLICE_K = 512


def pick_mma_tiling(m, n, mma, k=0):
    """The tensor-core tiling of an (m, n) output with inner size k: 128x128 when it alone
    gives every multiprocessor a block, or does in slices of at least MMA_LARGE_MIN_SLICE_K
    of k (split-K), 32x128 for outputs of at most 32 rows (a conv's filters), else 64x64."""
    tilings = MMA_TILINGS[mma]
    if m > tilings.medium.BM:
        tiles = -(-m // tilings.large.BM) * -(-n // tilings.large.BN)
        slices = min(-(-SPLIT_BLOCKS_PER_SM * _multiprocessors() // tiles),
                     max(1, k // MMA_LARGE_MIN_SLICE_K))
        if tiles * slices >= _multiprocessors():
            return tilings.large
    return tilings.wide if m <= tilings.wide.BM else tilings.medium


def pick_tiling(m, n):
    """LARGE when it alone gives every multiprocessor a block, else MEDIUM when it still
    makes enough blocks, else SMALL."""
    if SIMULATOR:
        return SIMULATED
    if -(-m // LARGE.BM) * -(-n // LARGE.BN) >= _multiprocessors():
        return LARGE
    if -(-m // MEDIUM.BM) * -(-n // MEDIUM.BN) >= MEDIUM_MIN_BLOCKS:
        return MEDIUM
    return SMALL


# ------------------------------------------------------------------ split-K and the choice table

# Split-K: a product whose output tiles are too few to keep the GPU busy (128x784x256 makes
# 128 SMALL blocks, each walking K=784 alone) splits K into slices, one block per tile and
# slice; each block writes its partial tile into a scratch buffer (slices, M, N), and a second
# kernel sums each output element's partials in a fixed order and applies the epilogue. No float
# atomics: every sum runs in a fixed order, so results are reproducible run to run.
# One launch instead of two, the tile's last block (found by an integer atomic per tile)
# summing its partials, was measured slower on the H200: that block sums the whole tile alone
# (fwd L1's 13 slices of 64x32: 20.9 us against 11.4 + 3.8 for the two kernels), and a
# captured MLP step took 87-92 us instead of 77.
GemmConfig = namedtuple("GemmConfig", "tiling split")

# The measured choices: (M, N, K, trans_a, trans_b) of op(A) (M, K) @ op(B) (K, N) -> the
# config that won `python -m bench.gemm --device cuda --sweep` at that shape (GPU time on the
# H200; put the measurement in a comment beside each entry). M counts the product's rows only,
# not Dense's bias row. Shapes not listed take pick_config's rule.
# Measured on the H200 (132 multiprocessors) on 2026-12-01, the third sweep (after the unsigned
# flat shared-memory indexing and the prologue at stash time); another GPU takes these too (they
# are correct anywhere), but its best choice may differ: run the sweep there.
GEMM_CHOICES = {
    (128, 256, 784, False, False): GemmConfig(COMPACT_128, 13),   # fwd L1 x·W1: 9.7 us GPU, cuBLAS 9.1 (H200 sweep)
    (128, 128, 256, False, False): GemmConfig(COMPACT_K32, 8),   # fwd L2 x·W2: 5.9 us GPU, cuBLAS 7.4 (H200 sweep)
    (128, 10, 128, False, False): GemmConfig(SMALL, 1),   # fwd L3 x·W3: 4.1 us GPU, cuBLAS 7.3 (H200 sweep)
    (784, 256, 128, True, False): GemmConfig(TALL, 1),   # dW1 = xᵀ·G: 7.7 us GPU, cuBLAS 5.8 (H200 sweep)
    (128, 256, 128, False, True): GemmConfig(SMALL, 1),   # dX2 = G·W2ᵀ: 4.4 us GPU, cuBLAS 5.2 (H200 sweep)
    (256, 128, 128, True, False): GemmConfig(COMPACT_K32, 1),   # dW2 = xᵀ·G: 6.0 us GPU, cuBLAS 5.2 (H200 sweep)
    (128, 128, 10, False, True): GemmConfig(COMPACT, 1),   # dX3 = G·W3ᵀ: 2.7 us GPU, cuBLAS 8.8 (H200 sweep)
    (128, 10, 128, True, False): GemmConfig(SMALL, 1),   # dW3 = xᵀ·G: 4.3 us GPU, cuBLAS 5.1 (H200 sweep)
}

# The rule for shapes the table does not list, a guess until the sweep has measured it: split
# K when the tiles alone leave multiprocessors idle, into slices of at least SPLIT_MIN_K, up to
# SPLIT_BLOCKS_PER_SM blocks per multiprocessor.
SPLIT_MIN_K = 128
SPLIT_BLOCKS_PER_SM = 2


def split_count(tiles, k, tiling):
    """The K slices of a product of ``tiles`` output tiles (the rule above). A pipelined
    tiling's blocks fit 2 a multiprocessor (registers and shared memory), so its slices stop
    at the one wave of SPLIT_BLOCKS_PER_SM blocks a multiprocessor, where one more would start
    a second wave for a few blocks: the wide MLP's 128x4096 products of K=4096 (32 tiles) in
    8 slices, 256 blocks, against 9 (288): fwd L2 58.9 us against 69.9, dX2 56.4 against 67.4
    (TF32, H200, ``python -m bench.tiling_sweep wide-mlp``)."""
    if tiles >= _multiprocessors():   # never in the simulator: it counts one multiprocessor
        return 1
    blocks = SPLIT_BLOCKS_PER_SM * _multiprocessors()
    slices = blocks // tiles if tiling.stages else -(-blocks // tiles)
    return max(1, min(k // SPLIT_MIN_K, slices))


def pick_config(m, n, k, trans_a, trans_b, extra_rows=0, mma=None, pipelined=None):
    """The tiling and split count for op(A) (m, k) @ op(B) (k, n): the table's measured choice,
    else the rule (``extra_rows``: output rows the kernel adds, Dense's bias row). ``mma``: a
    tensor-core format, whose tilings the table (float32 FMA measurements) does not hold;
    ``pipelined``: the pipelined tiling that takes LARGE's place, where the operands suit it
    (``pipelined_tiling``)."""
    key = (m, n, k, bool(trans_a), bool(trans_b))
    if mma and not mma_suits(m + extra_rows, n, k):
        mma = None
    choice = None if mma else GEMM_CHOICES.get(key)
    if choice is not None:
        if choice.split < 1:
            raise ValueError(f"matmul: GEMM_CHOICES[{key}] asks for split {choice.split}; a "
                             f"split is at least 1")
        return choice
    tiling = (pick_mma_tiling(m + extra_rows, n, mma, k) if mma else
              pick_tiling(m + extra_rows, n))
    if pipelined and mma and tiling == MMA_TILINGS[mma].large:
        tiling = pipelined   # the same tile, so the same split below
    tiles = -(-(m + extra_rows) // tiling.BM) * -(-n // tiling.BN)
    return GemmConfig(tiling, split_count(tiles, k, tiling))


def k_slices(k, split, bk):
    """How many K slices a split into ``split`` makes: each slice is ceil(steps / split) whole
    BK steps (the kernel derives the same from its grid), so asking for more slices than K has
    steps makes fewer slices, never an empty one."""
    steps = -(-k // bk)
    if steps == 0:
        return 1
    per_slice = -(-steps // split)
    return -(-steps // per_slice)


# ------------------------------------------------------------------ CUDA kernel template

@functools.lru_cache(maxsize=None)
def _gemm_kernels(dtype, tiling, trans_a, trans_b, mode, act, partial, conv=None):
    """The kernels for one dtype/tiling/layout/mode: a device function ``tile_product`` holding
    the whole GEMM, and the thin ``@cuda.jit`` entry point for ``mode`` with its own few
    arguments (each kernel argument costs launch time).

    The grid's z extent is the number of K slices, the block's z index its slice. ``partial``:
    the kernel of a split-K product, writing its raw slice sums (the bias row's too) into
    ``partials[slice]`` for ``_split_sum_kernel`` to finish; its FORWARD is PLAIN (the
    epilogue moves to the sum).

    ``conv``: the ``ConvGeometry`` of a CONV_ mode, whose operands are gathered from the
    convolution's arrays (``_conv_operands``) through the same main loop (``accumulate``)."""
    check_tiling(tiling, dtype, mode)
    BM, BN, BK, TM, TN = tiling[:5]
    # cache=True: numba-cuda keys a closure kernel's cache by the closure's contents, which
    # differ per dtype, tiling, layout, mode, activation and partial (max_registers is not
    # part of the key, and no two tilings share a closure)
    jit = (cuda.jit(cache=True, max_registers=tiling.max_registers) if tiling.max_registers
           else cuda.jit(cache=True))
    entry = jit
    if tiling.stages:
        SHARED_BYTES = pipeline_layout(tiling, trans_a, trans_b, mode).bytes

        def entry(function):   # its tiles are dynamic shared memory, given at each launch
            kernel = jit(function)
            cuda_backend.set_dynamic_shared_bytes(kernel, SHARED_BYTES)
            return kernel
    TY, TX = BM // TM, BN // TN
    THREADS = TY * TX
    A_LOADS, B_LOADS = BM * BK // THREADS, BK * BN // THREADS
    # the activation-derivative prologue: on A (the gradient G = grad_out · act'(y)) for
    # Dense's dX and the conv's dw, on B for Dense's dW and the conv's dx
    A_PROLOGUE = mode in (GRAD_A, CONV_GRAD_WEIGHT)
    B_PROLOGUE = mode in (GRAD_B, CONV_GRAD_INPUT)
    A_AUX_LOADS = A_LOADS if A_PROLOGUE else 1
    B_AUX_LOADS = B_LOADS if B_PROLOGUE else 1
    numba_type = from_dtype(np.dtype(dtype))
    ZERO, ONE = np.dtype(dtype).type(0), np.dtype(dtype).type(1)
    ONES_ROW = mode == GRAD_B   # A gets a virtual last row of ones: that output row is db
    EXTRA_ROWS = 1 if ONES_ROW else 0
    PARTIAL = partial
    A_ROW, B_ROW = BM + pad_of(tiling), BN + pad_of(tiling)   # elements from one k row to the next
    A_BUFFER, B_BUFFER = BK * A_ROW, BK * B_ROW
    A_TILE, B_TILE = 2 * A_BUFFER, 2 * B_BUFFER   # two buffers each, as constants
    ACC = (TM, TN)
    RUN_M, RUN_N = vec_run(TM, tiling.vec), vec_run(TN, tiling.vec)
    ALIGN = None if SIMULATOR else 16   # bytes; the simulator takes no alignment
    MMA = tiling.mma
    TF32 = MMA == "tf32"
    round_tf32 = _tensor_core().round_tf32 if TF32 else None

    @cuda.jit(device=True)
    def owned(t, i, count, run):
        """The i-th row (column) of the tile owned by the thread at position t of count, in
        runs of ``run`` adjacent ones (unsigned: t is, and i a constant once unrolled)."""
        return t * U(run) + U((i // run) * (count * run) + i % run)

    if MMA:
        multiply_with_alpha, acc_position = _mma_parts(tiling, numba_type, (1, A_ROW),
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

    # ``group``: the block's group of a convolution (_conv_operands' fetches); one signature
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
                    if mode == GRAD_A:   # G = grad_out * act'(y), y standing for x
                        y = aux[m, k]
                elif ONES_ROW and m == m_data:
                    value = ONE
            regs[load] = value
            aux_regs[load if mode == GRAD_A else 0] = y

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
                if mode == GRAD_B:
                    y = aux[k, n]
            regs[load] = value
            aux_regs[load if mode == GRAD_B else 0] = y

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
        fetch_a, fetch_b = _conv_operands(conv, mode, numba_type, A_LOADS, B_LOADS, a_slot,
                                          b_slot)
    # 16-byte loads of the tiles that lie wholly inside 16-byte aligned operands
    # (ops.tensor_core.load_float4): a thread's elements come 4 at a time along the operand's
    # contiguous dimension, and the per-element bounds checks go. Under tensor cores the
    # per-element fetch (index arithmetic, two comparisons, a 4-byte load) was most of the
    # instructions the MMA tilings issued: every tiling swept stopped at 46-52 TFLOP/s at
    # 4096³ on the H200.
    VECTOR = (not SIMULATOR and conv is None and numba_type == float32
              and (MMA is not None or BM * BN >= 64 * 64))
    VECTOR_A = VECTOR and A_LOADS % 4 == 0 and (trans_a or BK % 8 == 0) and BM % 4 == 0
    VECTOR_B = VECTOR and B_LOADS % 4 == 0 and (not trans_b or BK % 8 == 0) and BN % 4 == 0
    fast_tile_a, fetch_a, stash_a = _vector_operand(
        VECTOR_A, trans_a, BM, BK, A_ROW, A_LOADS, THREADS, mode == GRAD_A, A_PROLOGUE,
        fetch_a, stash_a, act, numba_type, TF32)
    fast_tile_b, fetch_b, stash_b = _vector_operand(
        VECTOR_B, not trans_b, BN, BK, B_ROW, B_LOADS, THREADS, mode == GRAD_B, B_PROLOGUE,
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
        accumulate, acc_position = _pipelined_accumulate(tiling, trans_a, trans_b, numba_type,
                                                         THREADS, mode, act)

    @cuda.jit(device=True)
    def k_range(k_size, slice_index, slices):
        """This block's K slice: whole BK steps, the rule of k_slices (never empty there)."""
        per_slice = ((k_size + U(BK - 1)) // U(BK) + slices - U(1)) // slices
        k_begin = min(slice_index * per_slice * U(BK), k_size)
        return k_begin, min(k_begin + per_slice * U(BK), k_size)

    if conv is not None:
        return _conv_entry(conv, mode, partial, act, entry, accumulate, k_range, acc_position,
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
    address_of = _tensor_core().address_of if PAIRED else None
    store_float2 = _tensor_core().store_float2 if PAIRED else None

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


def _vector_operand(vector, along_rows, ROWS, BK, ROW, LOADS, THREADS, has_aux, prologue,
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
    tensor_core = _tensor_core()
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


@functools.cache
def _tensor_core():
    from ops import tensor_core   # numba-cuda's extension API: tensor-core kernels only
    return tensor_core


def _mma_parts(tiling, numba_type, A_STRIDES, B_STRIDES, A_BUFFER, B_BUFFER, B_START=0,
               raw=False, act=IDENTITY, A_AUX=None, B_AUX=None):
    """``multiply_buffer`` and ``acc_position`` of a tensor-core tiling. Warp w takes rows
    (w // WARPS_N)·WM and columns (w % WARPS_N)·WN of the tile, FM x FN fragments of m16n8;
    its lane 4·group + index holds, of fragment (f, g), acc[2f + h, 2g + v] = C[16f + 8h +
    group, 8g + 2·index + v] (the PTX ISA's accumulator layout: ops.tensor_core).

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
    tensor_core = _tensor_core()
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


def pipeline_layout(tiling, trans_a, trans_b, mode=PLAIN):
    """The shared tiles of a pipelined tensor-core tiling (``stages``): per operand its
    (row, k) strides and the elements of one stage, the starts of B's stages and of the
    prologue's y (``mode`` GRAD_A: beside A's, GRAD_B: beside B's, in the same layout), and
    the dynamic shared bytes of all stages. Each tile keeps its operand's layout in global
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
    aux_stage = {GRAD_A: a_stage, GRAD_B: b_stage}.get(mode, 0)
    return PipelineLayout(a_strides, a_stage, b_strides, b_stage, b_start, aux_start,
                          4 * (aux_start + tiling.stages * aux_stage))


PipelineLayout = namedtuple("PipelineLayout",
                            "a_strides a_stage b_strides b_stage b_start aux_start bytes")


def _pipelined_accumulate(tiling, trans_a, trans_b, numba_type, THREADS, mode, act):
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
    layout = pipeline_layout(tiling, trans_a, trans_b, mode)
    A_PROLOGUE, B_PROLOGUE = mode == GRAD_A, mode == GRAD_B
    ONES_ROW = mode == GRAD_B
    A_STAGE, B_STAGE, B_START = layout.a_stage, layout.b_stage, layout.b_start
    AUX_START = layout.aux_start
    multiply_buffer, acc_position = _mma_parts(
        tiling, numba_type, layout.a_strides, layout.b_strides, A_STAGE, B_STAGE, B_START,
        raw=True, act=act, A_AUX=AUX_START if A_PROLOGUE else None,
        B_AUX=AUX_START - B_START if B_PROLOGUE else None)
    tensor_core = _tensor_core()
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
    (``_pipelined_accumulate``): A, B and the prologue's y (the first two or three of the
    entry point's ``args``) 16-byte aligned, with rows of a multiple of 4 elements."""
    if mode not in (PLAIN, FORWARD, GRAD_A, GRAD_B):
        return False
    return all(cuda_backend.device_address(x) % 16 == 0 and x.shape[1] % 4 == 0
               for x in args[:3 if mode in (GRAD_A, GRAD_B) else 2])


# ------------------------------------------------------------------ convolutions as implicit GEMMs

# The geometry of a convolution (ops.conv's notation, the batch excepted: it is read from the
# arrays' sizes, so a short last batch reuses the kernels). Its values are compile-time
# constants of the kernels, as a tiling's are: the divisions that take a GEMM row or column
# apart into (sample, row, column) or (channel, tap) become multiplications. BIAS: the forward
# adds a bias; the weight gradient appends a column of ones to B, whose output column is db.
ConvGeometry = namedtuple("ConvGeometry", "C H W O OH OW KH KW SH SW PT PL DH DW GROUPS BIAS")


def conv_gemm_shape(mode, geometry, batch):
    """(M, N, K) of one group's GEMM. Positions (sample, row, column) are the output columns
    of the forward and dx, so the epilogue's NCHW stores run along a row of the image:
    - forward: y[o, p] = Σ_k w[o, k] · X[k, p], K = (c, i, j) of Cg·KH·KW, p = (n, oh, ow);
    - dx: dx[c, p] = Σ_k W[c, k] · G[k, p], k = (o, i, j) of Og·KH·KW (the flipped filter:
      G[k, p] is grad_out at the output position that tap (i, j) of p's input position
      feeds, zero where none does), p = (n, ih, iw);
    - dw: dw[o, k] = Σ_p G[o, p] · X[p, k] over the N·OH·OW positions p, k = (c, i, j), and
      with BIAS one more column of ones: db[o] = Σ_p G[o, p]."""
    g = geometry
    taps = g.KH * g.KW
    cg, og = g.C // g.GROUPS, g.O // g.GROUPS
    if mode == CONV_FORWARD:
        return og, batch * g.OH * g.OW, cg * taps
    if mode == CONV_GRAD_INPUT:
        return cg, batch * g.H * g.W, og * taps
    return og, cg * taps + (1 if g.BIAS else 0), batch * g.OH * g.OW


def _conv_operands(conv, mode, numba_type, A_LOADS, B_LOADS, a_slot, b_slot):
    """The fetches of a CONV_ mode: each loads the thread's elements of the next A or B
    K-slice, gathered from the convolution's flat NCHW arrays, zero outside the image (the
    padding) and outside the GEMM. Unsigned arithmetic throughout (see tile_product), so a
    padded row ``oh·SH + i·DH`` is compared with PT before PT is taken off: it never
    wraps. ``group`` is the block's group: its channels and filters."""
    C, H, W, O, OH, OW, KH, KW, SH, SW, PT, PL, DH, DW, GROUPS, BIAS = conv
    TAPS, CG, OG = KH * KW, C // GROUPS, O // GROUPS
    P_OUT, P_IN, NK = OH * OW, H * W, C // GROUPS * KH * KW
    ZERO, ONE = numba_type(0), numba_type(1)

    @cuda.jit(device=True)
    def image_tap(x, p, k, group):
        """x at tap k = (c, i, j) of output position p = (n, oh, ow): X[k, p] of the forward,
        X[p, k] of dw."""
        n, q = p // U(P_OUT), p % U(P_OUT)
        c, t = k // U(TAPS), k % U(TAPS)
        ih = (q // U(OW)) * U(SH) + (t // U(KW)) * U(DH)   # in the padded image
        iw = (q % U(OW)) * U(SW) + (t % U(KW)) * U(DW)
        if U(PT) <= ih < U(PT + H) and U(PL) <= iw < U(PL + W):
            return x[((n * U(C) + group * U(CG) + c) * U(H) + ih - U(PT)) * U(W) + iw - U(PL)]
        return ZERO

    @cuda.jit(device=True)
    def gradient_at(p, o, group):
        """The flat index of grad_out (and y) at output position p = (n, q) and the group's
        filter o."""
        return ((p // U(P_OUT)) * U(O) + group * U(OG) + o) * U(P_OUT) + p % U(P_OUT)

    @cuda.jit(device=True)
    def fetch_a(a, aux, regs, aux_regs, k0, row0, m_data, k_end, tid, group, fast):
        for load in range(A_LOADS):
            kk, r = a_slot(tid, load)
            m, k = row0 + r, k0 + kk
            value = y = ZERO
            if k < k_end and m < m_data:
                if mode == CONV_FORWARD:   # w as (O, Cg·KH·KW)
                    value = a[(group * U(OG) + m) * U(NK) + k]
                elif mode == CONV_GRAD_INPUT:   # w[g·Og + o, c, i, j] with k = (o, i, j)
                    value = a[((group * U(OG) + k // U(TAPS)) * U(CG) + m) * U(TAPS)
                              + k % U(TAPS)]
                else:   # grad_out and y at position k of filter m
                    at = gradient_at(k, m, group)
                    value = a[at]
                    y = aux[at]
            regs[load] = value
            aux_regs[load if mode == CONV_GRAD_WEIGHT else 0] = y

    @cuda.jit(device=True)
    def fetch_b(b, aux, regs, aux_regs, k0, col0, n_size, k_end, tid, group, fast):
        for load in range(B_LOADS):
            kk, c = b_slot(tid, load)
            n, k = col0 + c, k0 + kk
            value = y = ZERO
            if k < k_end and n < n_size:
                if mode == CONV_FORWARD:
                    value = image_tap(b, n, k, group)
                elif mode == CONV_GRAD_INPUT:   # the output position tap k = (o, i, j) of n reads
                    q, o, t = n % U(P_IN), k // U(TAPS), k % U(TAPS)
                    ph, pw = q // U(W) + U(PT), q % U(W) + U(PL)   # in the padded image
                    i, j = (t // U(KW)) * U(DH), (t % U(KW)) * U(DW)
                    th, tw = ph - i if ph >= i else U(SH * OH), pw - j if pw >= j else U(SW * OW)
                    oh, ow = th // U(SH), tw // U(SW)
                    if oh < U(OH) and ow < U(OW) and th % U(SH) == U(0) and tw % U(SW) == U(0):
                        at = gradient_at((n // U(P_IN)) * U(P_OUT) + oh * U(OW) + ow, o, group)
                        value = b[at]
                        y = aux[at]
                elif n < U(NK):
                    value = image_tap(b, k, n, group)
                else:   # dw's column of ones: its output column is db
                    value = ONE
            regs[load] = value
            aux_regs[load if mode == CONV_GRAD_INPUT else 0] = y

    return fetch_a, fetch_b


def _conv_entry(conv, mode, partial, act, entry, accumulate, k_range, acc_position, tiling,
                numba_type):
    """The ``@cuda.jit`` entry point of a CONV_ mode: block (x, y) takes a tile of one
    group's GEMM, block z its group and K slice (z = slice·GROUPS + group), and the epilogue
    writes NCHW (forward: bias and activation fused; dx), dw and db, or a split-K partial."""
    C, H, W, O, OH, OW, KH, KW, SH, SW, PT, PL, DH, DW, GROUPS, BIAS = conv
    TAPS, CG, OG = KH * KW, C // GROUPS, O // GROUPS
    P_OUT, P_IN, NK = OH * OW, H * W, C // GROUPS * KH * KW
    BM, BN, BK, TM, TN = tiling[:5]
    ACC = (TM, TN)
    COLUMNS = NK + (1 if BIAS else 0)   # dw's columns, db's included

    @cuda.jit(device=True)
    def conv_tile_product(a, b, out, aux, side, bias, alpha):
        acc = cuda.local.array(ACC, numba_type)
        tid = U(cuda.threadIdx.x)
        row0, col0 = U(cuda.blockIdx.y) * U(BM), U(cuda.blockIdx.x) * U(BN)
        z = U(cuda.blockIdx.z)
        group, slice_index = z % U(GROUPS), z // U(GROUPS)
        if mode == CONV_FORWARD:   # out is y: N·O·OH·OW
            m_data, n_size, k_size = U(OG), U(out.shape[0]) // U(O), U(NK)
        elif mode == CONV_GRAD_INPUT:   # out is dx: N·C·H·W
            m_data, n_size, k_size = U(CG), U(out.shape[0]) // U(C), U(OG * TAPS)
        else:   # a is grad_out: N·O·OH·OW
            m_data, n_size, k_size = U(OG), U(COLUMNS), U(a.shape[0]) // U(O)
        k_begin, k_end = k_range(k_size, slice_index, U(cuda.gridDim.z) // U(GROUPS))
        accumulate(a, b, aux, acc, row0, col0, m_data, n_size, k_begin, k_end, group, alpha)
        for i in range(TM):
            for j in range(TN):
                r, c = acc_position(tid, i, j)
                m, n = row0 + r, col0 + c
                if m < m_data and n < n_size:
                    value = acc[i, j]
                    if mode == CONV_FORWARD:
                        o = group * U(OG) + m
                        if BIAS:
                            value += bias[o]
                        out[((n // U(P_OUT)) * U(O) + o) * U(P_OUT) + n % U(P_OUT)] = \
                            value_cuda(act, value, alpha)
                    elif mode == CONV_GRAD_INPUT:
                        out[((n // U(P_IN)) * U(C) + group * U(CG) + m) * U(P_IN)
                            + n % U(P_IN)] = value
                    elif partial:   # partials: (slices, O, COLUMNS)
                        out[(slice_index * U(O) + group * U(OG) + m) * U(COLUMNS) + n] = value
                    elif n < U(NK):
                        out[(group * U(OG) + m) * U(NK) + n] = value
                    else:
                        side[group * U(OG) + m] = value

    if mode == CONV_FORWARD:
        @entry
        def conv2d_forward_gemm_cuda(x, w, bias, out, alpha):
            conv_tile_product(w, x, out, x, bias, bias, alpha)
        return conv2d_forward_gemm_cuda
    if mode == CONV_GRAD_INPUT:
        @entry
        def conv2d_grad_input_gemm_cuda(w, grad_out, y, grad_x, alpha):
            conv_tile_product(w, grad_out, grad_x, y, grad_x, grad_x, alpha)
        return conv2d_grad_input_gemm_cuda
    if partial:
        @entry
        def conv2d_grad_weight_partial_cuda(grad_out, y, x, partials, alpha):
            conv_tile_product(grad_out, x, partials, y, partials, partials, alpha)
        return conv2d_grad_weight_partial_cuda

    @entry
    def conv2d_grad_weight_gemm_cuda(grad_out, y, x, grad_w, grad_b, alpha):
        conv_tile_product(grad_out, x, grad_w, y, grad_b, grad_b, alpha)
    return conv2d_grad_weight_gemm_cuda


SUM_THREADS = 256


@cuda.jit(device=True)
def _slice_sum(partials, m, n):
    """Σ over slices of partials[:, m, n] in a fixed order: four running sums (sum c takes
    slices c, c + 4, ...), added in pairs at the end. One running sum made the loads wait on
    each other; four keep four in flight, and the order is still set by the slice count."""
    zero = partials.dtype.type(0)
    sum0 = sum1 = sum2 = sum3 = zero
    slices = partials.shape[0]
    s = 0
    while s + 4 <= slices:
        sum0 += partials[s, m, n]
        sum1 += partials[s + 1, m, n]
        sum2 += partials[s + 2, m, n]
        sum3 += partials[s + 3, m, n]
        s += 4
    if s < slices:
        sum0 += partials[s, m, n]
    if s + 1 < slices:
        sum1 += partials[s + 1, m, n]
    if s + 2 < slices:
        sum2 += partials[s + 2, m, n]
    return (sum0 + sum1) + (sum2 + sum3)


@functools.lru_cache(maxsize=None)
def _split_sum_kernel(mode, act):
    """The second launch of a split-K GEMM, one thread per output element: the sum of its
    partials, then ``mode``'s epilogue (bias and activation for FORWARD; for GRAD_B the bias
    row's sums are the bias gradient). GRAD_A's sum is PLAIN's."""
    if mode == FORWARD:
        @cuda.jit(cache=True)
        def dense_forward_sum_cuda(partials, bias, out, alpha):
            e = cuda.grid(1)
            cols = out.shape[1]
            if e < out.shape[0] * cols:
                m, n = e // cols, e % cols
                out[m, n] = value_cuda(act, _slice_sum(partials, m, n) + bias[n], alpha)
        return dense_forward_sum_cuda
    if mode == GRAD_B:
        @cuda.jit(cache=True)
        def dense_grad_params_sum_cuda(partials, grad_w, grad_b):
            e = cuda.grid(1)
            rows, cols = grad_w.shape
            if e < (rows + 1) * cols:
                m, n = e // cols, e % cols
                if m < rows:
                    grad_w[m, n] = _slice_sum(partials, m, n)
                else:
                    grad_b[n] = _slice_sum(partials, m, n)
        return dense_grad_params_sum_cuda

    @cuda.jit(cache=True)
    def gemm_sum_cuda(partials, out):
        e = cuda.grid(1)
        cols = out.shape[1]
        if e < out.shape[0] * cols:
            out[e // cols, e % cols] = _slice_sum(partials, e // cols, e % cols)
    return gemm_sum_cuda


def gemm_plan(mode, m, n, k, dtype, trans_a, trans_b, act, args):
    """The launches of the ``mode`` GEMM op(A) (m, k) @ op(B) (k, n), ``args`` those of the
    ``mode`` entry point: one kernel, or under split-K the partial products and their sum.

    The kernels are the cached ``@cuda.jit`` dispatchers themselves, never ``specialize()``d
    copies: a specialised dispatcher is a new one without the disk cache, and recompiling the
    seven GEMMs of an MLP step took 22 s of a warm start on the H200 (cProfile). After its
    first launch a kernel runs through ``ops.cuda_backend``'s direct path, which skips Numba's
    per-call typing anyway."""
    dtype = np.dtype(dtype)
    extra_rows = 1 if mode == GRAD_B else 0
    rows = m + extra_rows
    mma = mma_format(dtype)
    pipelined = pipelined_tiling(mma, mode, args)
    tiling, split = pick_config(m, n, k, trans_a, trans_b, extra_rows, mma, pipelined=pipelined)
    if tiling.stages and pipelined is None:
        raise ValueError(f"matmul: {tiling} copies its operands as they are, which these "
                         f"are not (pipeline_suits)")
    if not tiling.stages and shared_bytes(tiling, dtype) > STATIC_SHARED_BYTES:
        # GEMM_CHOICES holds float32 measurements; a wider dtype whose tiles would not fit in
        # shared memory (float64 under WIDE, say) takes the rule's tiling at that shape
        tiling = pick_tiling(rows, n)
    blocks = (-(-n // tiling.BN), -(-rows // tiling.BM))
    threads = threads_of(tiling)
    slices = k_slices(k, split, tiling.BK)
    if slices == 1:
        kernel = _gemm_kernels(dtype, tiling, trans_a, trans_b, mode, act, False)
        return [(kernel, blocks, threads, args)]
    partials = empty((slices, rows, n), dtype, "cuda")
    if mode == PLAIN:
        a, b, out = args
        partial_args, sum_args = (a, b, partials), (partials, out)
    elif mode == FORWARD:
        x, w, bias, out, alpha = args
        partial_args, sum_args = (x, w, partials), (partials, bias, out, alpha)
    elif mode == GRAD_A:
        g, y, w, grad_x, alpha = args
        partial_args, sum_args = (g, y, w, partials, alpha), (partials, grad_x)
    else:
        x, g, y, grad_w, grad_b, alpha = args
        partial_args, sum_args = (x, g, y, partials, alpha), (partials, grad_w, grad_b)
    # FORWARD's partials are PLAIN's; the activation matters to the prologues only
    partial_kernel = (_gemm_kernels(dtype, tiling, trans_a, trans_b, PLAIN, IDENTITY, True)
                      if mode in (PLAIN, FORWARD) else
                      _gemm_kernels(dtype, tiling, trans_a, trans_b, mode, act, True))
    sum_kernel = (_split_sum_kernel(mode, act) if mode == FORWARD else
                  _split_sum_kernel(GRAD_B if mode == GRAD_B else PLAIN, IDENTITY))
    elements = rows * n
    # the simulator runs one OS thread per CUDA thread: start no idle ones
    sum_threads = max(1, min(SUM_THREADS, elements)) if SIMULATOR else SUM_THREADS
    return [(partial_kernel, blocks + (slices,), threads, partial_args),
            (sum_kernel, -(-elements // sum_threads), sum_threads, sum_args)]


@cuda.jit(cache=True)
def conv2d_grad_weight_sum_cuda(partials, grad_w, grad_b):
    """The second launch of a split-K weight gradient, one thread per (filter, column): the
    sum of its partials (slices, O, columns) in slice order; the column past grad_w's (the
    ones column) is db."""
    e = cuda.grid(1)
    rows, columns = partials.shape[1], partials.shape[2]
    if e < rows * columns:
        m, n = e // columns, e % columns
        if n < grad_w.shape[1]:
            grad_w[m, n] = _slice_sum(partials, m, n)
        else:
            grad_b[m] = _slice_sum(partials, m, n)


# The measured choices for the convolutions' GEMMs: (mode, M, N, K) of conv_gemm_shape (one
# group's product) -> the config that won `python -m bench.conv_ops --device cuda --sweep`
# (GPU time; put the measurement beside each entry). Only the weight gradient splits K: the
# forward and dx have a tile per 64 positions or so, thousands at the CNN's shapes. Shapes not
# listed take pick_conv_config's rule, a guess until the sweep has measured it.
CONV_CHOICES = {
    # conv 1->32 on 28x28, batch 128: 39.7 us GPU against the rule's WIDE x262 69.1 us
    # (cuDNN fp32 66.7), H200 sweep
    ("grad_weight", 32, 10, 100352): GemmConfig(SMALL, 126),
}
CONV_MODE_NAMES = {CONV_FORWARD: "forward", CONV_GRAD_INPUT: "grad_input",
                   CONV_GRAD_WEIGHT: "grad_weight"}


def pick_conv_tiling(m, n, k):
    """The rows of a conv GEMM are its channels (32 or 64 in the CNN, fewer per group), so the
    tile is as tall as they need: LARGE only above 64 rows and when it fills the GPU, MEDIUM
    above 32, else WIDE (32x64, 2x4 per thread) when K fills its steps of 32, COMPACT (32x32,
    steps of 16) when it does not (the first layer's K is 9). A guess until the sweep has
    measured these shapes."""
    if SIMULATOR:
        return SIMULATED
    if m > MEDIUM.BM and -(-m // LARGE.BM) * -(-n // LARGE.BN) >= _multiprocessors():
        return LARGE
    if m > COMPACT.BM:
        return MEDIUM
    return WIDE if k >= WIDE.BK else COMPACT


def pick_conv_config(mode, m, n, k, groups, mma=None):
    """The tiling and split count of one group's conv GEMM (m, n, k): the table's measured
    choice, else the rule (the weight gradient splits K as pick_config does, counting every
    group's tiles). ``mma``: a tensor-core format (pick_mma_tiling's tilings)."""
    key = (CONV_MODE_NAMES[mode], m, n, k)
    if mma and not mma_suits(m, n, k):
        mma = None
    choice = None if mma else CONV_CHOICES.get(key)
    if choice is not None:
        if choice.split < 1 or (choice.split > 1 and mode != CONV_GRAD_WEIGHT):
            raise ValueError(f"matmul: CONV_CHOICES[{key}] asks for split {choice.split}; a "
                             f"split is at least 1, and only grad_weight splits K")
        return choice
    # only the weight gradient splits K
    tiling = (pick_mma_tiling(m, n, mma, k if mode == CONV_GRAD_WEIGHT else 0) if mma else
              pick_conv_tiling(m, n, k))
    tiles = -(-m // tiling.BM) * -(-n // tiling.BN) * groups
    return GemmConfig(tiling, split_count(tiles, k, tiling) if mode == CONV_GRAD_WEIGHT else 1)


def conv_gemm_plan(mode, geometry, batch, dtype, act, args):
    """The launches of a convolution's ``mode`` GEMM, ``args`` those of its entry point:
    forward (x, w, bias, y, alpha), dx (w, grad_out, y, grad_x, alpha), dw (grad_out, y, x,
    grad_w, grad_b, alpha), all flat NCHW arrays; dw under split-K is the partial products
    and their sum."""
    dtype = np.dtype(dtype)
    m, n, k = conv_gemm_shape(mode, geometry, batch)
    tiling, split = pick_conv_config(mode, m, n, k, geometry.GROUPS, mma_format(dtype))
    if shared_bytes(tiling, dtype) > STATIC_SHARED_BYTES:   # a float32 choice, run in float64
        tiling = MEDIUM if m > COMPACT.BM else COMPACT   # both fit any dtype up to 8 bytes
    slices = k_slices(k, split, tiling.BK)
    blocks = (-(-n // tiling.BN), -(-m // tiling.BM), geometry.GROUPS * slices)
    threads = threads_of(tiling)
    trans_b = mode == CONV_GRAD_WEIGHT   # B (positions, taps): threads read along positions
    if slices == 1:
        kernel = _gemm_kernels(dtype, tiling, False, trans_b, mode, act, False, geometry)
        return [(kernel, blocks, threads, args)]
    grad_out, y, x, grad_w, grad_b, alpha = args
    partials = empty((slices, geometry.O, n), dtype, "cuda")
    partial_kernel = _gemm_kernels(dtype, tiling, False, trans_b, mode, act, True, geometry)
    weights = grad_w.size // geometry.O
    elements = geometry.O * n
    sum_threads = max(1, min(SUM_THREADS, elements)) if SIMULATOR else SUM_THREADS
    return [(partial_kernel, blocks, threads, (grad_out, y, x, flat(partials), alpha)),
            (conv2d_grad_weight_sum_cuda, -(-elements // sum_threads), sum_threads,
             (partials, device_reshape(grad_w, (geometry.O, weights)), grad_b))]


# ------------------------------------------------------------------ array-level GEMM

def _gemm_plan(args):
    a, b, out, trans_a, trans_b = args
    m, n = out.shape
    k = a.shape[0] if trans_a else a.shape[1]
    return gemm_plan(PLAIN, m, n, k, a.dtype, trans_a, trans_b, IDENTITY, (a, b, out))


GEMM = Kernel("gemm", gemm_split_cpu, cuda_plan=_gemm_plan)


def gemm(a, b, trans_a=False, trans_b=False, out=None):
    """``op(a) @ op(b)`` for 2-D arrays of one device and dtype, ``op`` a transpose when asked.

    ``out`` (C-contiguous, the right shape) receives the result when given."""
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"matmul: gemm takes 2-D arrays, got shapes {tuple(a.shape)} "
                         f"and {tuple(b.shape)}")
    m, k = (a.shape[1], a.shape[0]) if trans_a else tuple(a.shape)
    k_b, n = (b.shape[1], b.shape[0]) if trans_b else tuple(b.shape)
    if k != k_b:
        raise ValueError(f"matmul: inner dimensions differ: {_described(a, trans_a)} @ "
                         f"{_described(b, trans_b)}")
    flags = (bool(trans_a), bool(trans_b))
    if out is None:
        return run(GEMM, a, b, Out((m, n), a.dtype, flat=False), *flags)
    if tuple(out.shape) != (m, n):
        raise ValueError(f"matmul: output buffer has shape {tuple(out.shape)}, expected {(m, n)}")
    run(GEMM, a, b, out, *flags)
    return out


def _described(x, transposed):
    return f"{tuple(x.shape)}" + ("ᵀ" if transposed else "")


# ------------------------------------------------------------------ the op

@register
class MatMul(Op):
    """``a @ b`` for a (..., K) and b (K, N); backward uses the transposed GEMMs."""
    name = "matmul"
    kernels = (GEMM,)

    def check(self, a, b):
        a_shape, b_shape = tuple(a.shape), tuple(b.shape)
        if len(a_shape) < 2 or len(b_shape) != 2:
            raise ValueError(f"matmul: expects a (..., K) @ (K, N) product (2-D x 2-D or N-D x "
                             f"2-D), got shapes {a_shape} and {b_shape}")
        if a_shape[-1] != b_shape[0]:
            raise ValueError(f"matmul: inner dimensions differ: {a_shape} @ {b_shape}")

    def forward(self, a, b):
        a_shape = tuple(a.shape)
        self.a_shape = a_shape
        self.a2 = a.reshape(math.prod(a_shape[:-1]), a_shape[-1])   # C-contiguous: a free view
        self.b = b
        return gemm(self.a2, b).reshape(a_shape[:-1] + (b.shape[1],))

    def backward(self, grad_out, grad_dst):
        needs_a, needs_b = self.needs_input_grad
        g = grad_out.reshape(self.a2.shape[0], self.b.shape[1])
        grad_a = grad_b = None
        if needs_a:   # dA = G @ Bᵀ
            dst = grad_dst[0].reshape(self.a2.shape) if grad_dst[0] is not None else None
            grad_a = gemm(g, self.b, trans_b=True, out=dst)
            grad_a = grad_dst[0] if dst is not None else grad_a.reshape(self.a_shape)
        if needs_b:   # dB = Aᵀ @ G
            grad_b = gemm(self.a2, g, trans_a=True, out=grad_dst[1])
        return grad_a, grad_b
