"""Per-op throughput: the engine's ops against NumPy (and PyTorch when installed).

    python -m bench.ops [--device cpu|cuda] [--json PATH]

Each op runs at the reference MLP's size (batch 128, where per-call overhead dominates) and
at a large size (where memory bandwidth or FLOPs dominate; the large sum is 1024x1024, 2^20
elements). The engine calls are the public ones (``a + b``, ``x.relu()``, ``x.sum()``,
``x.softmax()``, ``a @ b``, an ``nn.Dense`` layer) under ``engine.no_grad()``; the wall time
per call is the best of several rounds, each long enough to be timed reliably, with the
device synchronised at the end of a round. Throughput, from the wall time, is GB/s of
compulsory traffic (inputs read once, outputs written once) for the memory-bound ops and
GFLOP/s for matmul and dense. On ``--device cuda`` NumPy still runs on the host: it is the
CPU baseline.

On ``--device cuda`` the wall time of a small op is mostly Python's launch, so a second
column per GPU framework (the engine, and torch when it has CUDA; ``gpu_us_per_call`` in the
JSON, None on the CPU) gives its GPU time per call: CUDA events around 20 calls queued
behind a long product, which hides the launches (``bench.gpu_time``), best of ``ROUNDS``.
The large sum's two GPU columns are the engine's 1M-element sum against torch's.
"""
import argparse
import importlib.util

import numpy as np

from bench import gpu_time
from bench.gpu_time import BUSY_SIZE, CALLS
from bench.report import emit, require_device
from bench.wall_time import seconds_per_call, synchronizers

ROUND_SECONDS = 0.2
QUICK_ROUND_SECONDS = 0.01
ROUNDS = 3

MLP_SIZE = {"add": [(128, 256)] * 2, "relu": [(128, 256)], "sum": [(128, 256)],
            "softmax": [(128, 10)], "matmul": [(128, 784), (784, 256)],
            "dense relu": [(128, 784), (784, 256)],
            "bmm": [(48, 64, 32), (48, 32, 64)]}   # nanoGPT's CPU scores: 12 x 4 heads, T 64
LARGE_SIZE = {"add": [(1024, 1024)] * 2, "relu": [(1024, 1024)], "sum": [(1024, 1024)],
              "softmax": [(4096, 1000)], "matmul": [(1024, 1024)] * 2,
              "dense relu": [(1024, 1024)] * 2,
              "bmm": [(384, 256, 64), (384, 64, 256)]}   # nanoGPT's: 64 x 6 heads, T 256
# float32 arrays moved per element of the first input: read inputs once, write outputs once
TRAFFIC = {"add": 3, "relu": 2, "sum": 1, "softmax": 2}


def _work(name, shapes):
    """``(unit, amount)`` of one call: GB moved, or GFLOP for the matrix products."""
    if name in TRAFFIC:
        return "GB", TRAFFIC[name] * 4 * int(np.prod(shapes[0]))
    *batch, rows, inner = shapes[0]
    columns = shapes[1][-1]
    return "GFLOP", 2 * int(np.prod(batch)) * rows * inner * columns


def _engine_calls(name, arrays, device):
    import engine
    from engine import nn
    tensors = [engine.tensor(a, device=device) for a in arrays]
    if name == "add":
        return lambda: tensors[0] + tensors[1]
    if name == "relu":
        return lambda: tensors[0].relu()
    if name == "sum":
        return lambda: tensors[0].sum()
    if name == "softmax":
        return lambda: tensors[0].softmax(axis=-1)
    if name in ("matmul", "bmm"):
        return lambda: tensors[0] @ tensors[1]
    features, units = arrays[1].shape
    layer = nn.Sequential([nn.Dense(units, activation="relu", input_shape=(features,))]).to(device)
    return lambda: layer(tensors[0])


def _numpy_calls(name, arrays):
    a = arrays[0]
    if name == "add":
        return lambda: a + arrays[1]
    if name == "relu":
        return lambda: np.maximum(a, 0)
    if name == "sum":
        return lambda: a.sum()

    def softmax():
        e = np.exp(a - a.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    if name == "softmax":
        return softmax
    if name in ("matmul", "bmm"):
        return lambda: a @ arrays[1]
    bias = np.zeros(arrays[1].shape[1], np.float32)
    return lambda: np.maximum(a @ arrays[1] + bias, 0)


def _torch_calls(name, arrays, device):
    import torch
    tensors = [torch.from_numpy(a).to(device) for a in arrays]
    a = tensors[0]
    if name == "add":
        return lambda: a + tensors[1]
    if name == "relu":
        return lambda: torch.relu(a)
    if name == "sum":
        return lambda: a.sum()
    if name == "softmax":
        return lambda: torch.softmax(a, dim=-1)
    if name in ("matmul", "bmm"):
        return lambda: a @ tensors[1]
    weight = tensors[1].T.contiguous()
    bias = torch.zeros(weight.shape[0], device=device)
    return lambda: torch.relu(torch.nn.functional.linear(a, weight, bias))


def run(device, quick=False):
    import engine
    has_torch = importlib.util.find_spec("torch") is not None
    torch_device = None
    if has_torch:
        import torch
        torch_device = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
        if device == "cuda" and torch_device != "cuda":
            has_torch = False   # a CPU-only torch is no GPU baseline

    engine_sync, torch_sync = synchronizers(device, torch_device)
    gpu_timers = gpu_time.gpu_timers(device, has_torch)

    rng = np.random.default_rng(0)
    rows = []
    cases = [(name, sizes[name]) for name in MLP_SIZE
             for sizes in ((MLP_SIZE,) if quick else (MLP_SIZE, LARGE_SIZE))]
    for name, shapes in cases:
        arrays = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
        unit, amount = _work(name, shapes)
        round_seconds = QUICK_ROUND_SECONDS if quick else ROUND_SECONDS
        calls = {"engine": _engine_calls(name, arrays, device),
                 "numpy": _numpy_calls(name, arrays)}
        synchronize = {"engine": engine_sync, "numpy": lambda: None}
        if has_torch:
            calls["torch"] = _torch_calls(name, arrays, torch_device)
            synchronize["torch"] = torch_sync
        with engine.no_grad():
            seconds = {k: seconds_per_call(call, synchronize[k], round_seconds, ROUNDS)
                       for k, call in calls.items()}
            gpu_seconds = {k: min(timer.seconds_per_call(calls[k]) for _ in range(ROUNDS))
                           for k, timer in gpu_timers.items()}
        rows.append({"op": name, "shapes": [list(s) for s in shapes], "unit": f"{unit}/s",
                     "us_per_call": {k: 1e6 * v for k, v in seconds.items()},
                     "gpu_us_per_call": ({k: 1e6 * v for k, v in gpu_seconds.items()}
                                         if gpu_timers else None),
                     "throughput": {k: amount / v / 1e9 for k, v in seconds.items()}})
    return {"device": device, "rows": rows}


def format_table(result):
    frameworks = list(result["rows"][0]["us_per_call"])
    gpu_frameworks = list(result["rows"][0]["gpu_us_per_call"] or ())
    header = " | ".join([f"{name} us" for name in frameworks]
                        + [f"{name} gpu us" for name in gpu_frameworks])
    rates = " | ".join(f"{name}" for name in frameworks)
    lines = [f"bench.ops on {result['device']} (NumPy on the host); throughput in GB/s "
             "(memory-bound ops) or GFLOP/s (matmul, bmm, dense)"]
    if gpu_frameworks:
        lines.append(f"us: wall time per call, launch included; gpu us: GPU time alone ({CALLS} "
                     f"calls queued behind a {BUSY_SIZE}³ product, timed by CUDA events)")
    lines += ["", f"| op | shape | {header} | unit | {rates} |",
              "|---|---|" + "---:|" * (2 * len(frameworks) + len(gpu_frameworks) + 1)]
    for row in result["rows"]:
        shapes = " @ ".join("x".join(map(str, shape)) for shape in row["shapes"])
        if row["op"] not in ("matmul", "dense relu", "bmm"):
            shapes = "x".join(map(str, row["shapes"][0]))
        times = " | ".join([f"{row['us_per_call'][k]:.1f}" for k in frameworks]
                           + [f"{row['gpu_us_per_call'][k]:.1f}" for k in gpu_frameworks])
        throughput = " | ".join(f"{row['throughput'][k]:.2f}" for k in frameworks)
        lines.append(f"| {row['op']} | {shapes} | {times} | {row['unit']} | {throughput} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.ops", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--quick", action="store_true",
                        help="MLP sizes only, short rounds (a smoke test, not a measurement)")
    args = parser.parse_args(argv)
    require_device(parser, args.device)
    result = run(args.device, args.quick)
    return emit(result, format_table(result), args.json)


if __name__ == "__main__":
    main()
