"""Which tiling and split-K count a GEMM takes: the measured choices (``GEMM_CHOICES``,
``CONV_CHOICES``) and, for shapes they do not list, the size rules (``pick_config``,
``pick_conv_config``); the tensor-core format of a dtype (``mma_format``). Pure Python:
the GPU's facts (multiprocessors, compute capability, the simulator) come from
``ops.gemm.gpu_facts``, imported at the first pick (ops/gemm/README.md)."""
from collections import namedtuple

import numpy as np

from ops import matmul_precision
from ops.gemm.tilings import (COMPACT, COMPACT_128, COMPACT_K32, CONV_FORWARD, CONV_GRAD_INPUT,
                              CONV_GRAD_WEIGHT, LARGE, LARGE_K16, MEDIUM, MEDIUM_128,
                              MEDIUM_MIN_BLOCKS, MMA_MIN_CAPABILITY, MMA_TILINGS, SIMULATED,
                              SMALL, TALL, TALL_128, TF32_PIPELINED_PROLOGUE, WIDE)


def _multiprocessors():
    from ops.gemm import gpu_facts   # numba-cuda's: at the first pick, not at this import
    return gpu_facts.multiprocessors()


def _compute_capability():
    from ops.gemm import gpu_facts
    return gpu_facts.compute_capability()


def _simulator():
    from ops.gemm import gpu_facts
    return gpu_facts.SIMULATOR


def mma_format(dtype):
    """The tensor-core format (``"tf32"``, ``"bf16"``) that products of ``dtype`` take now:
    the float32 matmul precision's (ops.matmul_precision), for float32 on a GPU that has the
    instructions; None otherwise (the FMA tilings)."""
    format_ = matmul_precision.tensor_core_format()
    if (format_ is None or _simulator() or np.dtype(dtype) != np.float32
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
    if _simulator():
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
    # The GPT's Dense products (bench.gpt's gpu preset: 16384 rows, 384 wide, a 4x MLP), from
    # `python -m bench.tiling_sweep gpt` on an H100 (132 multiprocessors) on 2026-12-05, GPU
    # time beside the rule's then: forward x·W, dX = G·Wᵀ, dW = xᵀ·G with db
    (16384, 1152, 384, False, False): GemmConfig(LARGE_K16, 1),   # qkv fwd: 425.5 us, LARGE 471.5
    (16384, 384, 1152, False, True): GemmConfig(LARGE_K16, 1),   # qkv dX: 424.6 us, LARGE 450.8
    (384, 1152, 16384, True, False): GemmConfig(MEDIUM_128, 24),   # qkv dW: 500.1 us, MEDIUM x3 591.9
    (16384, 384, 384, False, False): GemmConfig(MEDIUM_128, 1),   # proj fwd: 159.3 us, LARGE 202.3
    (16384, 384, 384, False, True): GemmConfig(LARGE_K16, 1),   # proj dX: 157.3 us, LARGE 166.1
    (384, 384, 16384, True, False): GemmConfig(MEDIUM_128, 24),   # proj dW: 177.4 us, MEDIUM x6 214.2 (the rule's SMALL untimed)
    (16384, 1536, 384, False, False): GemmConfig(LARGE_K16, 1),   # fc fwd: 553.8 us, LARGE 580.1
    (16384, 384, 1536, False, True): GemmConfig(LARGE_K16, 1),   # fc dX: 557.6 us, LARGE 594.2
    (384, 1536, 16384, True, False): GemmConfig(MEDIUM_128, 24),   # fc dW: 658.6 us, MEDIUM 1215.0
    (16384, 384, 1536, False, False): GemmConfig(LARGE_K16, 1),   # fc2 fwd: 552.5 us, LARGE 577.7
    (16384, 1536, 384, False, True): GemmConfig(TALL_128, 1),   # fc2 dX: 570.6 us, LARGE 599.7
    (1536, 384, 16384, True, False): GemmConfig(MEDIUM_128, 24),   # fc2 dW: 583.6 us, MEDIUM 1214.0
}

# The tensor-core choices measured as GEMM_CHOICES are: (format, M, N, K, trans_a, trans_b) ->
# config. A pipelined tiling here stands where the operands suit one (else the rule's). From
# `python -m bench.tiling_sweep gpt --precision high` on an H100 on 2026-12-06: the GPT's
# forwards run K steps of 16 in 3 stages faster than the rule's 32 (its dX, already so, and
# its dW in the rule's splits, 68-255 us, were each within 1% of the sweep's best or ahead)
MMA_CHOICES = {
    ("tf32", 16384, 1152, 384, False, False): GemmConfig(TF32_PIPELINED_PROLOGUE, 1),   # qkv fwd: 202.6 us, the rule's 220.8
    ("tf32", 16384, 384, 384, False, False): GemmConfig(TF32_PIPELINED_PROLOGUE, 1),   # proj fwd: 76.4 us, the rule's 94.1
    ("tf32", 16384, 1536, 384, False, False): GemmConfig(TF32_PIPELINED_PROLOGUE, 1),   # fc fwd: 259.5 us, the rule's 272.2
    ("tf32", 16384, 384, 1536, False, False): GemmConfig(TF32_PIPELINED_PROLOGUE, 1),   # fc2 fwd: 194.2 us, the rule's 237.7
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


# A long product: K many times the output's sides (a weight gradient over a large batch, the
# GPT's dW of K = 16384). Its output tiles are few and each would walk all of K, so it splits
# K however many tiles it has, into slices of at least LONG_SLICE_K, until every multiprocessor
# has about LONG_BLOCKS_PER_SM blocks, in MEDIUM_128's tiles: the GPT's four dW took 1.2-1.8x
# less time so than under the size rule (MEDIUM, at most 3 slices), 24 slices of 177-3600
# blocks within 1% of 12 (the gpt sweep above). A guess elsewhere until swept.
LONG_K_RATIO = 8
LONG_SLICE_K = 512
LONG_BLOCKS_PER_SM = 24


def long_config(rows, n, k):
    """The long-product choice for an (rows, n) output with inner size k, or None."""
    if _simulator() or k < LONG_K_RATIO * max(rows, n):
        return None
    tiles = -(-rows // MEDIUM_128.BM) * -(-n // MEDIUM_128.BN)
    slices = -(-LONG_BLOCKS_PER_SM * _multiprocessors() // tiles)
    return GemmConfig(MEDIUM_128, max(1, min(k // LONG_SLICE_K, slices)))


def pick_config(m, n, k, trans_a, trans_b, extra_rows=0, mma=None, pipelined=None):
    """The tiling and split count for op(A) (m, k) @ op(B) (k, n): the table's measured choice,
    else the rule (``extra_rows``: output rows the kernel adds, Dense's bias row). ``mma``: a
    tensor-core format, whose measured choices are in MMA_CHOICES; ``pipelined``: the
    pipelined tiling that takes LARGE's place, where the operands suit it
    (``pipelined_tiling``)."""
    key = (m, n, k, bool(trans_a), bool(trans_b))
    if mma and not mma_suits(m + extra_rows, n, k):
        mma = None
    table, key = (MMA_CHOICES, (mma,) + key) if mma else (GEMM_CHOICES, key)
    choice = table.get(key)
    if choice is not None and choice.tiling.stages and pipelined is None:
        choice = None   # operands a pipeline cannot copy as they are
    if choice is not None:
        if choice.split < 1:
            name = "MMA_CHOICES" if mma else "GEMM_CHOICES"
            raise ValueError(f"matmul: {name}[{key}] asks for split {choice.split}; a "
                             f"split is at least 1")
        return choice
    long = None if mma else long_config(m + extra_rows, n, k)
    if long is not None:
        return long
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
    if _simulator():
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
