"""Per-op times of the CNN's layers: the engine's ops against PyTorch eager, forward and backward.

    python -m bench.conv_ops [--device cpu|cuda] [--threads N] [--json PATH] [--quick]

The shapes are those of the network of API.md's "Convolutional networks" at batch 128:
conv2d + relu 1->32 3x3 "same" on 28x28 (the first layer: its input needs no gradient),
max_pool2d 2 on its output, conv2d + relu 32->64 3x3 "same" on 14x14, batch_norm in
training mode on its output, and avg_pool2d 2. Everything is float32.

The engine runs its ops (``ops.conv.Conv2D``, ``ops.pool``, ``ops.batch_norm``) through
their op classes: the forward as ``op(*arrays)``, the backward as ``op.backward`` from a
fixed upstream gradient with the gradients the network needs; torch runs
``torch.nn.functional`` eagerly, its backward as ``torch.autograd.grad`` of the same
output (for conv2d + relu that includes relu's backward, which the engine's conv fuses).
The time per call is the best of several rounds, each long enough to be timed reliably,
with the device synchronised at the end of a round (the best round is the least disturbed
one on a shared machine). GFLOP/s count the multiply-adds of the convolution (2 flops
each): the forward's once, the backward's once per gradient among dx and dw.

``--threads N`` runs the engine's parallel CPU loops (``numba.set_num_threads``) and torch's
intra-op pool on N threads each; by default each library keeps its own (Numba: one thread
per core). The engine's BLAS calls keep ``engine.blas_threads``' count inside each loop.
"""
import argparse
import importlib.util
import time

import numpy as np

from bench.report import emit, require_device

ROUND_SECONDS = 0.3
QUICK_ROUND_SECONDS = 0.01
ROUNDS = 5
BATCH = 128
QUICK_BATCH = 4

# (name, x shape without the batch, params, per-op extras)
LAYERS = [
    ("conv2d relu", (1, 28, 28), dict(out=32, kernel=3, needs_x=False)),
    ("max_pool2d", (32, 28, 28), dict(kernel_size=2)),
    ("conv2d relu", (32, 14, 14), dict(out=64, kernel=3, needs_x=True)),
    ("batch_norm", (64, 14, 14), {}),
    ("avg_pool2d", (64, 14, 14), dict(kernel_size=2)),
]


def _seconds_per_call(call, synchronize, round_seconds):
    """Best over ``ROUNDS`` rounds of the mean time per call; a round repeats the call for
    about ``round_seconds``."""
    call()
    synchronize()
    start = time.perf_counter()
    call()
    synchronize()
    repeats = max(1, int(round_seconds / max(time.perf_counter() - start, 1e-7)))
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        synchronize()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def _arrays(name, x_shape, params, rng):
    """The layer's float32 inputs: x, then its parameters (and running statistics)."""
    x = rng.standard_normal(x_shape).astype(np.float32)
    if name == "conv2d relu":
        w = rng.standard_normal((params["out"], x_shape[1], params["kernel"],
                                 params["kernel"])).astype(np.float32) * 0.1
        return [x, w, np.zeros(params["out"], np.float32)]
    if name == "batch_norm":
        channels = x_shape[1]
        return [x, np.zeros(channels, np.float32), np.ones(channels, np.float32),
                np.ones(channels, np.float32), np.zeros(channels, np.float32)]
    return [x]


def _engine_calls(name, arrays, params, device):
    """``(forward, backward)`` calls of the engine's op on ``device``."""
    from ops.batch_norm import BatchNorm
    from ops.conv import Conv2D
    from ops.device import to_device
    from ops.pool import AvgPool2D, MaxPool2D
    data = [to_device(a, device) for a in arrays]
    if name == "conv2d relu":
        def make():
            return Conv2D(padding="same", activation="relu")
        needs = (params["needs_x"], True, True)
    elif name == "batch_norm":
        def make():
            return BatchNorm(training=True)
        needs = (True, False, False, True, True)
    else:
        kind = MaxPool2D if name == "max_pool2d" else AvgPool2D

        def make():
            return kind(kernel_size=params["kernel_size"])
        needs = (True,)
    op = make()
    op.needs_input_grad = needs
    y = op(*data)
    upstream = to_device(np.random.default_rng(1).standard_normal(y.shape).astype(np.float32),
                         device)
    no_destinations = (None,) * len(data)
    return (lambda: make()(*data)), (lambda: op.backward(upstream, no_destinations))


def _torch_calls(name, arrays, params, device):
    import torch
    functional = torch.nn.functional
    tensors = [torch.from_numpy(a).to(device) for a in arrays]
    if name == "conv2d relu":
        x, w, b = tensors
        x.requires_grad_(params["needs_x"])
        w.requires_grad_(True)
        b.requires_grad_(True)

        def forward():
            return torch.relu(functional.conv2d(x, w, b, padding="same"))
    elif name == "batch_norm":
        x, mean, var, weight, bias = tensors
        for t in (x, weight, bias):
            t.requires_grad_(True)

        def forward():
            return functional.batch_norm(x, mean, var, weight, bias, training=True)
    else:
        (x,) = tensors
        x.requires_grad_(True)
        pool = functional.max_pool2d if name == "max_pool2d" else functional.avg_pool2d

        def forward():
            return pool(x, params["kernel_size"])
    y = forward()
    upstream = torch.from_numpy(
        np.random.default_rng(1).standard_normal(tuple(y.shape)).astype(np.float32)).to(device)
    inputs = [t for t in tensors if t.requires_grad]

    def no_grad_forward():
        with torch.no_grad():
            return forward()
    return no_grad_forward, (lambda: torch.autograd.grad(y, inputs, upstream,
                                                         retain_graph=True))


def _flops(name, x_shape, params):
    """Multiply-add flops of the forward and of the backward, or None (not a convolution)."""
    if name != "conv2d relu":
        return None, None
    batch, channels, h, w = x_shape
    forward = 2 * batch * params["out"] * h * w * channels * params["kernel"] ** 2
    return forward, forward * (2 if params["needs_x"] else 1)


def run(device, quick=False, threads=None):
    import numba

    import engine  # noqa: F401  (sets the BLAS threads of the engine's CPU GEMMs)
    if threads is not None:
        numba.set_num_threads(threads)
    has_torch = importlib.util.find_spec("torch") is not None
    torch_device, torch_threads = None, None
    if has_torch:
        import torch
        if threads is not None:
            torch.set_num_threads(threads)
        torch_device = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
        torch_threads = torch.get_num_threads()
        if device == "cuda" and torch_device != "cuda":
            has_torch = False   # a CPU-only torch is no GPU baseline

    def engine_sync():
        if device == "cuda":
            from ops.cuda_backend import cuda
            cuda.synchronize()

    def torch_sync():
        if torch_device == "cuda":
            import torch
            torch.cuda.synchronize()

    rng = np.random.default_rng(0)
    batch = QUICK_BATCH if quick else BATCH
    round_seconds = QUICK_ROUND_SECONDS if quick else ROUND_SECONDS
    rows = []
    for name, shape, params in LAYERS:
        x_shape = (batch,) + shape
        arrays = _arrays(name, x_shape, params, rng)
        calls = {"engine": _engine_calls(name, arrays, params, device)}
        syncs = {"engine": engine_sync}
        if has_torch:
            calls["torch"] = _torch_calls(name, arrays, params, torch_device)
            syncs["torch"] = torch_sync
        for phase, flops in zip(("forward", "backward"), _flops(name, x_shape, params)):
            index = 0 if phase == "forward" else 1
            seconds = {framework: _seconds_per_call(pair[index], syncs[framework],
                                                    round_seconds)
                       for framework, pair in calls.items()}
            rows.append({"op": name, "phase": phase, "x_shape": list(x_shape),
                         "us_per_call": {k: 1e6 * v for k, v in seconds.items()},
                         "gflops": None if flops is None else
                         {k: flops / v / 1e9 for k, v in seconds.items()}})
    return {"device": device, "engine_threads": numba.get_num_threads(),
            "torch_threads": torch_threads, "rows": rows}


def format_table(result):
    frameworks = list(result["rows"][0]["us_per_call"])
    threads = ""
    if result["device"] == "cpu":
        threads = f"; CPU threads: engine loops {result['engine_threads']}"
        if result["torch_threads"]:
            threads += f", torch {result['torch_threads']}"
    lines = [f"bench.conv_ops on {result['device']}, float32{threads}", "",
             "| op | phase | x | " + " | ".join(f"{k} us" for k in frameworks)
             + " | engine / torch | engine GFLOP/s |",
             "|---|---|---|" + "---:|" * (len(frameworks) + 2)]
    for row in result["rows"]:
        times = row["us_per_call"]
        ratio = f"{times['engine'] / times['torch']:.2f}" if "torch" in times else "-"
        rate = f"{row['gflops']['engine']:.1f}" if row["gflops"] else "-"
        lines.append(f"| {row['op']} | {row['phase']} | {'x'.join(map(str, row['x_shape']))} | "
                     + " | ".join(f"{times[k]:.0f}" for k in frameworks)
                     + f" | {ratio} | {rate} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.conv_ops",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="CPU threads of the engine's parallel loops and of torch "
                             "(default: each library's own)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--quick", action="store_true",
                        help=f"batch {QUICK_BATCH}, short rounds (a smoke test, not a "
                             "measurement)")
    args = parser.parse_args(argv)
    require_device(parser, args.device)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    result = run(args.device, args.quick, args.threads)
    return emit(result, format_table(result), args.json)


if __name__ == "__main__":
    main()
