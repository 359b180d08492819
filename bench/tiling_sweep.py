"""Candidate tilings of the CUDA GEMM template timed one by one (GPU time): the sweeps behind
the choice of ``ops.gemm``'s large tilings and of the tensor-core tile rule.

    python -m bench.tiling_sweep tensor-cores   # TF32/bf16 tilings at 4096³ and 1024³
    python -m bench.tiling_sweep pipelined      # the cp.async pipelines: tiles x stages
    python -m bench.tiling_sweep wide-mlp       # TF32 tiling x split-K at the 784-4096-4096 MLP
    python -m bench.tiling_sweep wide-mlp --only pipelined   # those whose name holds the text
    python -m bench.tiling_sweep fp32           # fp32 (FMA) tilings at 4096³
    python -m bench.tiling_sweep gpt            # fp32 tiling x split-K at the GPT's Dense GEMMs
    python -m bench.tiling_sweep gpt --precision high   # the same in TF32's tilings

Each candidate is forced by replacing ``ops.gemm.plans.pick_config`` for the timed calls, so the
plan, the kernels and the launch are those of ``ops.matmul.gemm``; a sweep's winner is what
the tilings' comments in ``ops/gemm/tilings.py`` quote. GPU time from ``bench.gpu_time`` (events
around calls queued behind a long product); the error is against the float64 product of the
first 64 rows. Needs a CUDA GPU.
"""
import argparse

import numpy as np

from bench.gemm_plan import GPT_DENSE, GPT_ROWS, dense_gemm, forced, planned
from bench.gpu_time import engine_timer
from ops.matmul_precision import TENSOR_CORE_FORMATS

PRECISION_OF_FORMAT = {format_: precision for precision, format_ in TENSOR_CORE_FORMATS.items()}
# the wide MLP's products that tensor cores take: (M, K, N, trans_a, trans_b)
WIDE_MLP = {"fwd L1 x·W1": (128, 784, 4096, False, False),
            "fwd L2 x·W2": (128, 4096, 4096, False, False),
            "dX2 = G·W2ᵀ": (128, 4096, 4096, False, True),
            "dW1 = xᵀ·G": (784, 128, 4096, True, False),
            "dW2 = xᵀ·G": (4096, 128, 4096, True, False)}


def tensor_core_candidates():
    from ops.gemm import tilings
    tiling = tilings.Tiling
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
    from ops.gemm import tilings
    tiling = tilings.Tiling
    candidates = {}
    for mma in ("tf32", "bf16"):
        candidates[f"{mma} LARGE 128x128x16, 2 register stages"] = tilings.MMA_TILINGS[mma].large
        for bm, bn, bk, tm, tn, stages in ((128, 128, 32, 8, 16, 3), (128, 128, 32, 8, 16, 4),
                                           (128, 128, 16, 8, 16, 4), (128, 128, 64, 8, 16, 3),
                                           (128, 256, 32, 8, 16, 3), (256, 128, 32, 8, 16, 3),
                                           (128, 128, 32, 4, 16, 3)):
            warps = (bm // (8 * tm)) * (bn // (4 * tn))
            candidates[f"{mma} {bm}x{bn}x{bk}, {stages} stages, {warps} warps of "
                       f"{8 * tm}x{4 * tn}"] = tiling(bm, bn, bk, tm, tn, mma=mma, stages=stages)
    return candidates


def fp32_candidates():
    from ops.gemm import tilings
    tiling = tilings.Tiling
    return {"LARGE 128x128x8 8x8, 128 registers": tilings.LARGE,
            "128x128x16 8x8, 128 registers": tiling(128, 128, 16, 8, 8, True, 128),
            "128x128x16 8x8": tiling(128, 128, 16, 8, 8, True),
            "128x128x8 8x8": tiling(128, 128, 8, 8, 8, True),
            "128x128x8 8x16": tiling(128, 128, 8, 8, 16, True),
            "256x128x8 16x8": tiling(256, 128, 8, 16, 8, True),
            "128x64x16 8x8": tiling(128, 64, 16, 8, 8, True)}


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
    from ops.gemm import tilings
    a, b, out, reference = operands
    set_float32_matmul_precision(PRECISION_OF_FORMAT[tiling.mma])
    try:
        tilings.check_tiling(tiling)
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
    from ops.gemm import tilings
    tiling = tilings.Tiling
    register = ([("MEDIUM", tilings.TF32_MEDIUM, split) for split in (1, 2, 3, 6)]
                + [("LARGE", tilings.TF32_LARGE, split) for split in (1, 4, 8, 16)]
                + [("64x128, warps of 64x64", tiling(64, 128, 16, 8, 16, mma="tf32"), split)
                   for split in (1, 2, 4)])
    pipelined = ([("PIPELINED 128x128x32", tilings.TF32_PIPELINED, split)
                  for split in (1, 4, 8, 9, 16)]
                 + [("PIPELINED 128x128x16", tilings.TF32_PIPELINED_PROLOGUE, split)
                    for split in (1, 8, 9)])
    for bm, bn, tm, tn in ((64, 128, 8, 16), (128, 64, 8, 16), (64, 64, 8, 8)):
        pipelined += [(f"pipelined {bm}x{bn}x32, 3 stages",
                       tiling(bm, bn, 32, tm, tn, mma="tf32", stages=3), split)
                      for split in (1, 2, 4, 8)]
    return register + pipelined


def sweep_wide_mlp(calls=20, only=None):
    from ops.gemm import choices, tilings
    candidates = [c for c in wide_mlp_candidates() if only is None or only in c[0]]
    timer, rng = engine_timer(), np.random.default_rng(0)
    for label, (m, k, n, trans_a, trans_b) in WIDE_MLP.items():
        rule = choices.pick_config(m, n, k, trans_a, trans_b, 0, "tf32",
                                   pipelined=tilings.MMA_TILINGS["tf32"].pipelined)
        print(f"{label} {m}x{k}x{n}: the rule picks {tuple(rule.tiling[:5])}"
              f"{', pipelined' if rule.tiling.stages else ''} in {rule.split} slices",
              flush=True)
        operands = _operands(m, k, n, trans_a, trans_b, rng)
        for name, tiling, split in candidates:
            seconds, _ = time_candidate(timer, operands, trans_a, trans_b, tiling, split, calls)
            print(f"  {name:32s} split {split:2d}: {seconds * 1e6:8.1f} us", flush=True)


# the GPT's Dense products (bench.gpt's gpu preset: batch 64 x block 256 rows, 384 wide, a 4x
# MLP), each as its three Dense GEMMs: (layer, in, out)


def gpt_candidates(mma=None):
    """The tilings swept at the GPT's products: FMA ones, or those of tensor-core format mma."""
    from ops.gemm import tilings
    tiling = tilings.Tiling
    if mma is None:
        return {"LARGE 128x128x8 8x8": tilings.LARGE, "MEDIUM 64x64x16 4x4": tilings.MEDIUM,
                "MEDIUM_128 64x64x16 8x4": tilings.MEDIUM_128,
                "128x64x16 8x8": tiling(128, 64, 16, 8, 8, True),
                "128x128x16 8x8": tiling(128, 128, 16, 8, 8, True, 128)}
    own = tilings.MMA_TILINGS[mma]
    return {"LARGE 128x128x16": own.large, "MEDIUM 64x64x16": own.medium,
            "PIPELINED 128x128x32 3 stages": own.pipelined,
            "PIPELINED 128x128x16 3 stages": own.pipelined_prologue,
            "pipelined 128x128x16 4 stages": tiling(128, 128, 16, 8, 16, mma=mma, stages=4),
            "pipelined 128x64x32 3 stages": tiling(128, 64, 32, 8, 16, mma=mma, stages=3),
            "pipelined 64x128x32 3 stages": tiling(64, 128, 32, 8, 16, mma=mma, stages=3),
            # 8 warps a block: the 4-warp kernel waits on latency with 2 warps a scheduler
            # (ncu, fc forward on the H200: 0.48 eligible), and a wider tile reads L2 less
            "pipelined 128x256x16 3 stages, 8 warps": tiling(128, 256, 16, 8, 16, mma=mma,
                                                             stages=3),
            "pipelined 256x128x16 3 stages, 8 warps": tiling(256, 128, 16, 8, 16, mma=mma,
                                                             stages=3),
            "pipelined 128x128x32 3 stages, 8 warps of 32x64": tiling(128, 128, 32, 4, 16,
                                                                      mma=mma, stages=3)}


def _dense_launches(mode, rows, features, outputs, rng):
    """``bench.gemm_plan.dense_gemm`` on random operands on the GPU."""
    from ops.cuda import cuda
    from ops.device import to_device
    return dense_gemm(mode, rows, features, outputs,
                      lambda *shape: to_device(rng.standard_normal(shape).astype(np.float32),
                                               "cuda"),
                      lambda *shape: cuda.device_array(shape, np.float32))


def sweep_gpt(calls=10, precision="highest"):
    """Each of the GPT's Dense GEMMs (forward, dX, dW with db) under every candidate tiling
    of ``precision``'s format and split, through ``ops.gemm.plans.gemm_plan`` as Dense
    launches them; first the rule's (or the table's) choice."""
    from ops.gemm.tilings import FORWARD, GRAD_A, GRAD_B
    mma = TENSOR_CORE_FORMATS[precision]
    timer, rng = engine_timer(), np.random.default_rng(0)
    for layer, features, outputs in GPT_DENSE:
        for mode, label in ((FORWARD, "forward"), (GRAD_A, "dX"), (GRAD_B, "dW, db")):
            m, n, k, trans_a, trans_b, args = _dense_launches(mode, GPT_ROWS, features,
                                                              outputs, rng)
            extra = int(mode == GRAD_B)
            rule_launches, rule = planned(mode, m, n, k, trans_a, trans_b, args, precision)
            print(f"{layer} {label} {m}x{k}x{n}: the rule picks {tuple(rule.tiling[:5])}"
                  f"{f', {rule.tiling.stages} stages' if rule.tiling.stages else ''} in "
                  f"{rule.split} slices", flush=True)
            candidates = [("the rule", rule.tiling, rule.split, rule_launches)]
            # the tensor-core tilings fill the GPU without a split but in the weight gradients
            splits = [s for s in (1, 2, 3, 4, 6, 8, 12, 16, 24) if k // s >= 128
                      and (mma is None or mode == GRAD_B or s == 1)]
            for name, tiling in gpt_candidates(mma).items():
                for split in splits:
                    try:
                        launches, _ = planned(mode, m, n, k, trans_a, trans_b, args,
                                               precision, tiling, split)
                    except Exception as error:   # a tiling this mode cannot take: say so
                        print(f"  {name:30s} split {split:2d}: not run ({error})", flush=True)
                        break
                    candidates.append((name, tiling, split, launches))
            for name, tiling, split, launches in candidates:
                _time_launches(timer, name, tiling, split, launches, (m, n, k, extra), calls)


def _time_launches(timer, name, tiling, split, launches, shape, calls):
    from ops import cuda as cuda_runtime
    from ops.gemm import choices
    m, n, k, extra = shape

    def call():
        for launch in launches:
            cuda_runtime.launch(*launch)
    try:
        seconds = timer.seconds_per_call(call, calls)
    except Exception as error:   # compiled or launched past a limit of this GPU: say so
        print(f"  {name:30s} split {split:2d}: failed ({type(error).__name__}: {error})",
              flush=True)
        return
    blocks = -(-(m + extra) // tiling.BM) * -(-n // tiling.BN) * \
        choices.k_slices(k, split, tiling.BK)
    print(f"  {name:30s} split {split:2d} ({blocks:5d} blocks): {seconds * 1e6:8.1f} us "
          f"{2 * m * n * k / seconds / 1e12:5.1f} TFLOP/s", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.tiling_sweep",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("sweep", choices=["tensor-cores", "pipelined", "wide-mlp", "fp32",
                                                    "gpt"])
    parser.add_argument("--only", help="wide-mlp: the candidates whose name holds this text")
    parser.add_argument("--precision", choices=("highest", "high", "medium"),
                        default="highest", help="gpt: the float32 matmul precision swept")
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
    elif args.sweep == "gpt":
        sweep_gpt(precision=args.precision)
    else:
        sweep_square(fp32_candidates(), (4096,))


if __name__ == "__main__":
    main()
