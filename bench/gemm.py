"""GEMM benchmark: our CUDA GEMM vs cuBLAS (torch.matmul, TF32 off), our @njit BLAS path vs
NumPy, at square sizes and at the shapes of an MNIST MLP (784-256-128-10, batch 128) with
their backward products.

    python -m bench.gemm                 # every device found; CUDA part skipped without a GPU
    python -m bench.gemm --device cpu    # CPU only (no GPU, no torch needed)
    python -m bench.gemm --device cuda --sweep   # every candidate GEMM config per MLP shape
    python -m bench.gemm --device cuda --precision highest,high,medium   # fp32, TF32, bf16

``--precision``: the CUDA table once per float32 matmul precision
(``engine.set_float32_matmul_precision``), cuBLAS beside at the same setting: "high" with
``torch.backends.cuda.matmul.allow_tf32``, "medium" as torch.matmul of bf16 copies of the
operands (bf16 inputs, float32 accumulation inside cuBLAS; its bf16 output is what torch
returns). The error column is against the float64 product of the float32 operands, so it
shows each format's rounding.

Times are wall-clock per call, launch and Python wrapper included: ``iters`` calls back to
back, then one synchronisation, best of ``repeats``. GFLOP/s counts 2*M*N*K per call. On
CUDA a second column gives the GPU time alone: CUDA events around calls queued behind a long
product, so launch overhead is hidden (``bench.gpu_time``; a call's wall time is roughly the
larger of the two).

``--sweep`` times, at each MLP product, the fused Dense kernel an MLP step runs there
(forward x·W: bias + relu epilogue; dX = G·Wᵀ: relu' prologue; dW = xᵀ·G with the bias row)
under every candidate config of ``ops.gemm`` (tiling x split-K count), with cuBLAS's plain
product beside, and prints the ``GEMM_CHOICES`` entries of the winners.
"""
import argparse
import importlib.util
import time

import numpy as np

from bench.gpu_time import engine_timer, torch_timer
from bench.wall_time import best_seconds

# (label, M, K, N, trans_a, trans_b): out (M, N) = op(A) (M, K) @ op(B) (K, N)
SQUARE = [("256³", 256, 256, 256, False, False),
          ("1024³", 1024, 1024, 1024, False, False),
          ("4096³", 4096, 4096, 4096, False, False)]
MLP = [("fwd L1 x·W1", 128, 784, 256, False, False),
       ("fwd L2 x·W2", 128, 256, 128, False, False),
       ("fwd L3 x·W3", 128, 128, 10, False, False),
       ("dW1 = xᵀ·G", 784, 128, 256, True, False),
       ("dX2 = G·W2ᵀ", 128, 128, 256, False, True),
       ("dW2 = xᵀ·G", 256, 128, 128, True, False),
       ("dX3 = G·W3ᵀ", 128, 10, 128, False, True),
       ("dW3 = xᵀ·G", 128, 128, 10, True, False)]


def _operands(m, k, n, trans_a, trans_b, rng):
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    return a, b


def _reference(a, b, trans_a, trans_b):
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return (a64.T if trans_a else a64) @ (b64.T if trans_b else b64)


def _iterations(flops):
    return int(min(300, max(5, 3e10 / flops)))


def _time(call, sync, iters, repeats=3):
    call()
    sync()
    return best_seconds(call, sync, iters, repeats)


def _cell(seconds, flops):
    if seconds is None:
        return "         - |         -"
    return f"{seconds * 1e6:10.1f} | {flops / seconds / 1e9:9.0f}"


def _row(label, m, k, n, trans_a, trans_b, error, *seconds):
    flops = 2.0 * m * n * k
    shape = f"{m}x{k}x{n}" + (" Aᵀ" if trans_a else "") + (" Bᵀ" if trans_b else "")
    cells = " | ".join(_cell(s, flops) for s in seconds)
    return f"| {label:<13} | {shape:<16} | {cells} | {error:8.1e} |"


def _header(*names):
    cells = " | ".join(f"{name + ' us':>10} | {name + ' GF/s':>9}" for name in names)
    rule = "|".join("-----------:|----------:" for _ in names)
    return (f"| shape         | MxKxN            | {cells} | max err  |\n"
            f"|---------------|------------------|{rule}|---------:|")


PRECISION_NAMES = {"highest": ("fp32", "TF32 off"), "high": ("TF32", "TF32 on"),
                   "medium": ("bf16", "bf16 inputs")}


def bench_cuda(shapes, precision="highest"):
    from ops.cuda import cuda

    from ops.device import to_device
    from ops.matmul import gemm
    from ops.matmul_precision import set_float32_matmul_precision

    set_float32_matmul_precision(precision)
    torch = _torch_or_none()
    if torch is not None:
        torch.backends.cuda.matmul.allow_tf32 = precision == "high"
    ours_name, cublas_name = PRECISION_NAMES[precision]
    name = getattr(cuda.get_current_device(), "name", "the CUDA simulator")
    name = name.decode() if isinstance(name, bytes) else name
    versus = (f"torch.matmul (cuBLAS, {cublas_name})" if torch else
              "nothing (torch not installed)")
    print(f"\n## CUDA on {name}, precision {precision!r}: ours ({ours_name}) vs {versus}\n")
    print("wall = per call, launch included; gpu = kernel time alone\n")
    print(_header("ours wall", "ours gpu", "cuBLAS wall", "cuBLAS gpu"))
    rng = np.random.default_rng(0)
    ours_timer = engine_timer()
    cublas_timer = torch_timer() if torch is not None else None
    for label, m, k, n, trans_a, trans_b in shapes:
        a, b = _operands(m, k, n, trans_a, trans_b, rng)
        da, db = to_device(a, "cuda"), to_device(b, "cuda")
        out = cuda.device_array((m, n), np.float32)
        iters = _iterations(2.0 * m * n * k)

        def ours_call():
            gemm(da, db, trans_a, trans_b, out=out)

        ours = _time(ours_call, cuda.synchronize, iters)
        ours_gpu = ours_timer.seconds_per_call(ours_call, min(iters, 20))
        expected = _reference(a, b, trans_a, trans_b)
        error = np.abs(out.copy_to_host() - expected).max() / max(np.abs(expected).max(), 1e-30)
        ref = ref_gpu = None
        if torch is not None:
            ta, tb = torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda()
            if precision == "medium":
                ta, tb = ta.bfloat16(), tb.bfloat16()
            ta, tb = (ta.t() if trans_a else ta), (tb.t() if trans_b else tb)
            tc = torch.empty((m, n), device="cuda", dtype=ta.dtype)

            def torch_call():
                torch.matmul(ta, tb, out=tc)

            ref = _time(torch_call, torch.cuda.synchronize, iters)
            ref_gpu = cublas_timer.seconds_per_call(torch_call, min(iters, 20))
        print(_row(label, m, k, n, trans_a, trans_b, error, ours, ours_gpu, ref, ref_gpu),
              flush=True)


# The sweep's candidates: tiling name -> split counts, per Dense kernel (its layout: forward
# x·W, dX = G·Wᵀ, dW = xᵀ·G). A split that makes the same K slices as a smaller one at some
# shape is timed once there; splits add no compile (the partial kernel takes its slice count
# from the grid), but each tiling costs two compiles (its kernel and its partial kernel) per
# layout it is swept in, about 1 s each on the H200 host: the 3 tilings of the first sweep
# in 3 layouts compiled 18 kernels, 35 s in all; these 23 tilings-by-layout compile 46. The
# candidates for latency (ops.gemm.tilings) go mostly to forward and dW, where the two big products
# fwd L1 and dW1 are (dX's are small); the 64x64 ones only to dW, as MEDIUM lost fwd L1 to
# COMPACT (25.6 vs 16.9 us) but won dW1.
BASE_CANDIDATES = {"SMALL": (1, 2, 4, 8), "COMPACT": (1, 2, 4, 8), "MEDIUM": (1, 4)}
LATENCY_SPLITS = (1, 2, 4, 8, 16)
SMALL_TILE_CANDIDATES = {name: LATENCY_SPLITS for name in
                         ("COMPACT_K32", "COMPACT_K64", "COMPACT_128", "WIDE", "TALL")}
SWEEP_CANDIDATES = {   # (trans_a, trans_b) of the MLP product -> its candidates
    (False, False): {**BASE_CANDIDATES, **SMALL_TILE_CANDIDATES},
    (False, True): {**BASE_CANDIDATES, "COMPACT_K32": LATENCY_SPLITS,
                    "COMPACT_128": LATENCY_SPLITS},
    (True, False): {**BASE_CANDIDATES, **SMALL_TILE_CANDIDATES, "MEDIUM_K32": LATENCY_SPLITS,
                    "MEDIUM_128": LATENCY_SPLITS},
}
SWEEP_ALPHA = 0.01


def _candidates(k, trans_a, trans_b):
    """(tiling name, config) of every candidate for this layout at inner dimension k, each
    slicing once."""
    from ops.gemm import choices, tilings
    seen, configs = set(), []
    for name, splits in SWEEP_CANDIDATES[trans_a, trans_b].items():
        tiling = tilings.TILINGS[name]
        for split in splits:
            slices = choices.k_slices(k, split, tiling.BK)
            if (name, slices) not in seen:
                seen.add((name, slices))
                configs.append((name, choices.GemmConfig(tiling, slices)))
    return configs


def _dense_product(m, k, n, trans_a, trans_b, rng):
    """The fused Dense call that computes this MLP product in a step (relu), its output arrays
    and their float64 references: x·W (forward), G·Wᵀ (dX), xᵀ·G (dW and db)."""
    from ops.cuda import cuda
    from ops.dense import DENSE
    from ops.device import to_device
    from ops.pointwise import RELU

    forward, backward = DENSE[RELU]
    alpha = np.float32(SWEEP_ALPHA)

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    def dev(array):
        return to_device(array, "cuda")

    none_2d, none_1d = cuda.device_array((0, 0), np.float32), cuda.device_array((0,), np.float32)
    if not trans_a and not trans_b:   # forward: batch m, fan-in k, fan-out n
        x, w, b = normal(m, k), normal(k, n), normal(n)
        out = cuda.device_array((m, n), np.float32)
        args = (dev(x), dev(w), dev(b), out, alpha)
        z = x.astype(np.float64) @ w + b
        return lambda: forward(*args), [(out, np.maximum(z, 0))]
    if trans_b:   # dX = G·Wᵀ: batch m, fan-out k, fan-in n
        x, w, grad_out = normal(m, n), normal(n, k), normal(m, k)
        y = np.maximum(normal(m, k), 0)
        grad_x = cuda.device_array((m, n), np.float32)
        args = (dev(x), dev(w), dev(y), dev(grad_out), grad_x, none_2d, none_1d, alpha, True,
                False)
        g = grad_out.astype(np.float64) * (y > 0)
        return lambda: backward(*args), [(grad_x, g @ w.T)]
    # dW = xᵀ·G: fan-in m, batch k, fan-out n
    x, w, grad_out = normal(k, m), normal(m, n), normal(k, n)
    y = np.maximum(normal(k, n), 0)
    grad_w, grad_b = cuda.device_array((m, n), np.float32), cuda.device_array((n,), np.float32)
    args = (dev(x), dev(w), dev(y), dev(grad_out), none_2d, grad_w, grad_b, alpha, False, True)
    g = grad_out.astype(np.float64) * (y > 0)
    return lambda: backward(*args), [(grad_w, x.T @ g), (grad_b, g.sum(axis=0))]


def _relative_error(outputs):
    return max(np.abs(out.copy_to_host() - want).max() / max(np.abs(want).max(), 1e-30)
               for out, want in outputs)


def sweep_cuda(shapes):
    """Per MLP product: GPU and wall time of the Dense kernel under every candidate config,
    cuBLAS's plain product beside; the winners as ``GEMM_CHOICES`` entries to paste."""
    from ops.gemm import choices, tilings
    from ops.cuda import cuda

    started = time.perf_counter()
    torch = _torch_or_none()
    name = getattr(cuda.get_current_device(), "name", "the CUDA simulator")
    name = name.decode() if isinstance(name, bytes) else name
    print(f"\n## GEMM config sweep on {name}: the fused Dense kernel of each MLP product "
          f"(relu), GPU time per call; cuBLAS: torch.matmul's plain product, TF32 off\n")
    rng = np.random.default_rng(0)
    timer = engine_timer()
    cublas_timer = torch_timer() if torch is not None else None
    winners = []
    for label, m, k, n, trans_a, trans_b in shapes:
        key = (m, n, k, trans_a, trans_b)
        call, outputs = _dense_product(m, k, n, trans_a, trans_b, rng)
        extra_rows = 1 if trans_a else 0   # dW's kernel adds the bias row
        default = choices.pick_config(m, n, k, trans_a, trans_b, extra_rows)
        default_slices = choices.GemmConfig(default.tiling,
                                       choices.k_slices(k, default.split, default.tiling.BK))
        reference = _cublas_gpu_time(torch, cublas_timer, m, k, n, trans_a, trans_b, rng)
        print(f"### {label}: {m}x{k}x{n}" + (" Aᵀ" if trans_a else "") + (" Bᵀ" if trans_b
              else "") + f", cuBLAS {_us(reference)} us GPU\n")
        print("| tiling           | threads | slices | blocks | gpu us | wall us | vs cuBLAS "
              "| max err  |")
        print("|------------------|--------:|-------:|-------:|-------:|--------:|----------:"
              "|---------:|")
        results = []
        for tiling_name, config in _candidates(k, trans_a, trans_b):
            previous = choices.GEMM_CHOICES.get(key)
            choices.GEMM_CHOICES[key] = config
            try:
                gpu = timer.seconds_per_call(call)
                wall = _time(call, cuda.synchronize, 100)
                error = _relative_error(outputs)
            finally:
                if previous is None:
                    del choices.GEMM_CHOICES[key]
                else:
                    choices.GEMM_CHOICES[key] = previous
            tiling = config.tiling
            blocks = -(-(m + extra_rows) // tiling.BM) * -(-n // tiling.BN) * config.split
            mark = "*" if config == default_slices else " "
            ratio = f"{gpu / reference:9.2f}x" if reference else "        -"
            threads = tilings.threads_of(tiling)
            print(f"| {mark}{tiling_name:<15} | {threads:7} | {config.split:6} | {blocks:6} | "
                  f"{gpu * 1e6:6.1f} | {wall * 1e6:7.1f} | {ratio} | {error:8.1e} |", flush=True)
            results.append((gpu, tiling_name, config))
        gpu, tiling_name, config = min(results, key=lambda result: result[0])
        versus = f", {gpu / reference:.2f}x cuBLAS" if reference else ""
        print(f"\nwinner: {tiling_name} split {config.split}, {gpu * 1e6:.1f} us GPU{versus} "
              f"(* marks the config the table/rule picks now)\n")
        winners.append((key, tiling_name, config.split, gpu, reference, label))
    print("## GEMM_CHOICES entries of the winners (paste into ops/gemm/choices.py)\n")
    for key, tiling_name, split, gpu, reference, label in winners:
        print(f"    {key}: GemmConfig({tiling_name}, {split}),   # {label}: {gpu * 1e6:.1f} us "
              f"GPU, cuBLAS {_us(reference)} (H200 sweep)")
    print(f"\n(sweep took {time.perf_counter() - started:.0f} s, compiles included)")


def _us(seconds):
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"


def _torch_or_none():
    if importlib.util.find_spec("torch") is None:
        return None
    import torch
    if not torch.cuda.is_available():
        return None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch


def _cublas_gpu_time(torch, timer, m, k, n, trans_a, trans_b, rng):
    """GPU seconds of torch.matmul's plain product at this shape and layout (None without
    torch)."""
    if torch is None:
        return None
    a, b = _operands(m, k, n, trans_a, trans_b, rng)
    ta, tb = torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda()
    ta, tb = (ta.t() if trans_a else ta), (tb.t() if trans_b else tb)
    tc = torch.empty((m, n), device="cuda")
    return timer.seconds_per_call(lambda: torch.matmul(ta, tb, out=tc))


def bench_cpu(shapes):
    from ops.matmul import gemm

    print("\n## CPU: our @njit np.dot (BLAS) vs NumPy's matmul (4096³ left out: seconds)\n")
    print(_header("ours", "NumPy"))
    rng = np.random.default_rng(0)
    for label, m, k, n, trans_a, trans_b in shapes:
        a, b = _operands(m, k, n, trans_a, trans_b, rng)
        out = np.empty((m, n), np.float32)
        iters = max(2, _iterations(2.0 * m * n * k) // 10)
        ours = _time(lambda: gemm(a, b, trans_a, trans_b, out=out), lambda: None, iters)
        na, nb = (a.T if trans_a else a), (b.T if trans_b else b)
        ref = _time(lambda: np.matmul(na, nb, out=out), lambda: None, iters)
        expected = _reference(a, b, trans_a, trans_b)
        gemm(a, b, trans_a, trans_b, out=out)
        error = np.abs(out - expected).max() / max(np.abs(expected).max(), 1e-30)
        print(_row(label, m, k, n, trans_a, trans_b, error, ours, ref))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["all", "cpu", "cuda"], default="all")
    parser.add_argument("--no-4096", action="store_true", help="skip the 4096³ product")
    parser.add_argument("--sweep", action="store_true",
                        help="time every candidate GEMM config at the MLP shapes (CUDA only)")
    parser.add_argument("--precision", default="highest",
                        help="comma-separated float32 matmul precisions for the CUDA table: "
                             "highest (fp32), high (TF32), medium (bf16)")
    args = parser.parse_args(argv)
    precisions = args.precision.split(",")
    unknown = [p for p in precisions if p not in PRECISION_NAMES]
    if unknown:
        parser.error(f"--precision: {', '.join(unknown)}: not one of highest, high, medium")
    if args.sweep:
        from ops.device import SIMULATOR, cuda_available
        if not cuda_available() or SIMULATOR:
            raise SystemExit("bench.gemm --sweep: needs a CUDA GPU")
        sweep_cuda(MLP)
        return
    shapes = [s for s in SQUARE if not (args.no_4096 and s[1] == 4096)] + MLP
    if args.device in ("all", "cuda"):
        from ops.device import SIMULATOR, cuda_available
        if cuda_available() and not SIMULATOR:
            for precision in precisions:
                bench_cuda(shapes, precision)
        else:
            print("\n(no CUDA GPU: CUDA part skipped)")
    if args.device in ("all", "cpu"):
        bench_cpu([s for s in shapes if s[1] != 4096])


if __name__ == "__main__":
    main()
