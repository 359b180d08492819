"""Candidate tilings of the CUDA GEMM template timed one by one (GPU time): the sweeps behind
the choice of ``ops.matmul``'s large tilings and of the tensor-core tile rule.

    python -m bench.tiling_sweep tensor-cores   # TF32/bf16 tilings at 4096³ and 1024³
    python -m bench.tiling_sweep pipelined      # the cp.async pipelines: tiles x stages
    python -m bench.tiling_sweep wide-mlp       # TF32 tiling x split-K at the 784-4096-4096 MLP
    python -m bench.tiling_sweep wide-mlp --only pipelined   # those whose name holds the text
    python -m bench.tiling_sweep fp32           # fp32 (FMA) tilings at 4096³

Each candidate is forced by replacing ``ops.matmul.pick_config`` for the timed calls, so the
plan, the kernels and the launch are those of ``ops.matmul.gemm``; a sweep's winner is what
the tilings' comments in ``ops/matmul.py`` quote. GPU time from ``bench.gpu_time`` (events
around calls queued behind a long product); the error is against the float64 product of the
first 64 rows. Needs a CUDA GPU.
"""
import argparse
import contextlib

import numpy as np

from bench.gpu_time import engine_timer

PRECISION_OF_FORMAT = {"tf32": "high", "bf16": "medium", None: "highest"}
# the wide MLP's products that tensor cores take: (M, K, N, trans_a, trans_b)
WIDE_MLP = {"fwd L1 x·W1": (128, 784, 4096, False, False),
            "fwd L2 x·W2": (128, 4096, 4096, False, False),
            "dX2 = G·W2ᵀ": (128, 4096, 4096, False, True),
            "dW1 = xᵀ·G": (784, 128, 4096, True, False),
            "dW2 = xᵀ·G": (4096, 128, 4096, True, False)}


def tensor_core_candidates():
    from ops import matmul as mm
    tiling = mm.Tiling
    return {"128x128x16, warps of 64x32": tiling(128, 128, 16, 8, 8, mma="tf32"),
            "the same, 128 registers": tiling(128, 128, 16, 8, 8, max_registers=128, mma="tf32"),
            "64x128x16, warps of 32x32": tiling(64, 128, 16, 4, 8, mma="tf32"),
            "64x64x32, warps of 32x32": tiling(64, 64, 32, 4, 8, mma="tf32"),
            "128x64x16, warps of 64x32": tiling(128, 64, 16, 8, 8, mma="tf32"),
            "128x128x16, warps of 64x64": tiling(128, 128, 16, 8, 16, mma="tf32"),
            "64x64x32, warps of 32x16": tiling(64, 64, 32, 4, 4, mma="tf32"),
            "128x128x16, warps of 32x64": tiling(128, 128, 16, 4, 16, mma="tf32"),
            "bf16 128x128x16, warps of 64x32": tiling(128, 128, 16, 8, 8, mma="bf16"),
            "bf16 128x128x16, warps of 64x64": tiling(128, 128, 16, 8, 16, mma="bf16"),
            "bf16 64x64x32, warps of 32x32": tiling(64, 64, 32, 4, 8, mma="bf16")}


def pipelined_candidates():
    from ops import matmul as mm
    tiling = mm.Tiling
    candidates = {}
    for mma in ("tf32", "bf16"):
        candidates[f"{mma} LARGE 128x128x16, 2 register stages"] = mm.MMA_TILINGS[mma].large
        for bm, bn, bk, tm, tn, stages in ((128, 128, 32, 8, 16, 3), (128, 128, 32, 8, 16, 4),
                                           (128, 128, 16, 8, 16, 4), (128, 128, 64, 8, 16, 3),
                                           (128, 256, 32, 8, 16, 3), (256, 128, 32, 8, 16, 3),
                                           (128, 128, 32, 4, 16, 3)):
            warps = (bm // (8 * tm)) * (bn // (4 * tn))
            candidates[f"{mma} {bm}x{bn}x{bk}, {stages} stages, {warps} warps of "
                       f"{8 * tm}x{4 * tn}"] = tiling(bm, bn, bk, tm, tn, mma=mma, stages=stages)
    return candidates


def fp32_candidates():
    from ops import matmul as mm
    tiling = mm.Tiling
    return {"LARGE 128x128x8 8x8, 128 registers": mm.LARGE,
            "128x128x16 8x8, 128 registers": tiling(128, 128, 16, 8, 8, True, 128),
            "128x128x16 8x8": tiling(128, 128, 16, 8, 8, True),
            "128x128x8 8x8": tiling(128, 128, 8, 8, 8, True),
            "128x128x8 8x16": tiling(128, 128, 8, 8, 16, True),
            "256x128x8 16x8": tiling(256, 128, 8, 16, 8, True),
            "128x64x16 8x8": tiling(128, 64, 16, 8, 8, True)}


@contextlib.contextmanager
def forced(tiling, split, shape):
    """Every GEMM plan inside of op(A) (m, k) @ op(B) (k, n), ``shape`` = (m, n, k), in
    ``tiling``'s format picks ``tiling`` in ``split`` K slices (the timer's busy product, at
    "highest", keeps its own)."""
    from ops import matmul as mm
    chosen = mm.pick_config

    def pick_config(m, n, k, trans_a, trans_b, extra_rows=0, mma=None, **options):
        if (m, n, k) == shape and mma == tiling.mma:
            return mm.GemmConfig(tiling, split)
        return chosen(m, n, k, trans_a, trans_b, extra_rows, mma, **options)

    mm.pick_config = pick_config
    try:
        yield
    finally:
        mm.pick_config = chosen


def _operands(m, k, n, trans_a, trans_b, rng):
    from ops.cuda import cuda
    from ops.device import to_device
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    reference = ((a.T if trans_a else a)[:64].astype(np.float64)
                 @ (b.T if trans_b else b).astype(np.float64))
    return (to_device(a, "cuda"), to_device(b, "cuda"), cuda.device_array((m, n), np.float32),
            reference)


def time_candidate(timer, operands, trans_a, trans_b, tiling, split, calls):
    """(GPU seconds per call, max error relative to the largest reference value)."""
    from engine import set_float32_matmul_precision
    from ops import matmul as mm
    a, b, out, reference = operands
    set_float32_matmul_precision(PRECISION_OF_FORMAT[tiling.mma])
    try:
        mm.check_tiling(tiling)
        m, n = out.shape
        with forced(tiling, split, (m, n, b.shape[1] if trans_b else b.shape[0])):
            seconds = timer.seconds_per_call(lambda: mm.gemm(a, b, trans_a, trans_b, out=out),
                                             calls)
    finally:
        set_float32_matmul_precision("highest")
    error = np.abs(out.copy_to_host()[:64] - reference).max() / np.abs(reference).max()
    return seconds, error


def sweep_square(candidates, sizes, calls=10):
    timer, rng = engine_timer(), np.random.default_rng(0)
    for size in sizes:
        operands = _operands(size, size, size, False, False, rng)
        for name, tiling in candidates.items():
            seconds, error = time_candidate(timer, operands, False, False, tiling, 1, calls)
            print(f"{size}³ {name:36s} {seconds * 1e6:9.1f} us "
                  f"{2 * size ** 3 / seconds / 1e12:6.1f} TFLOP/s  err {error:.1e}", flush=True)


def wide_mlp_candidates():
    """(name, tiling, split) of the TF32 tilings swept at the wide MLP's products."""
    from ops import matmul as mm
    tiling = mm.Tiling
    register = ([("MEDIUM", mm.TF32_MEDIUM, split) for split in (1, 2, 3, 6)]
                + [("LARGE", mm.TF32_LARGE, split) for split in (1, 4, 8, 16)]
                + [("64x128, warps of 64x64", tiling(64, 128, 16, 8, 16, mma="tf32"), split)
                   for split in (1, 2, 4)])
    pipelined = ([("PIPELINED 128x128x32", mm.TF32_PIPELINED, split)
                  for split in (1, 4, 8, 9, 16)]
                 + [("PIPELINED 128x128x16", mm.TF32_PIPELINED_PROLOGUE, split)
                    for split in (1, 8, 9)])
    for bm, bn, tm, tn in ((64, 128, 8, 16), (128, 64, 8, 16), (64, 64, 8, 8)):
        pipelined += [(f"pipelined {bm}x{bn}x32, 3 stages",
                       tiling(bm, bn, 32, tm, tn, mma="tf32", stages=3), split)
                      for split in (1, 2, 4, 8)]
    return register + pipelined


def sweep_wide_mlp(calls=20, only=None):
    from ops import matmul as mm
    candidates = [c for c in wide_mlp_candidates() if only is None or only in c[0]]
    timer, rng = engine_timer(), np.random.default_rng(0)
    for label, (m, k, n, trans_a, trans_b) in WIDE_MLP.items():
        rule = mm.pick_config(m, n, k, trans_a, trans_b, 0, "tf32",
                              pipelined=mm.MMA_TILINGS["tf32"].pipelined)
        print(f"{label} {m}x{k}x{n}: the rule picks {tuple(rule.tiling[:5])}"
              f"{', pipelined' if rule.tiling.stages else ''} in {rule.split} slices",
              flush=True)
        operands = _operands(m, k, n, trans_a, trans_b, rng)
        for name, tiling, split in candidates:
            seconds, _ = time_candidate(timer, operands, trans_a, trans_b, tiling, split, calls)
            print(f"  {name:32s} split {split:2d}: {seconds * 1e6:8.1f} us", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.tiling_sweep",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("sweep", choices=["tensor-cores", "pipelined", "wide-mlp", "fp32"])
    parser.add_argument("--only", help="wide-mlp: the candidates whose name holds this text")
    args = parser.parse_args(argv)
    from ops.device import SIMULATOR, cuda_available
    if SIMULATOR or not cuda_available():
        raise SystemExit("bench.tiling_sweep: needs a CUDA GPU (not Numba's simulator)")
    if args.sweep == "tensor-cores":
        sweep_square(tensor_core_candidates(), (4096, 1024))
    elif args.sweep == "pipelined":
        sweep_square(pipelined_candidates(), (4096, 1024))
    elif args.sweep == "wide-mlp":
        sweep_wide_mlp(only=args.only)
    else:
        sweep_square(fp32_candidates(), (4096,))


if __name__ == "__main__":
    main()
