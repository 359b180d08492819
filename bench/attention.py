"""Sequence ops, the engine against torch's eager ops: attention, LayerNorm and Embedding,
forward and backward together.

    python -m bench.attention [--device cpu|cuda] [--rounds 15] [--threads N] [--torch-threads N]
                              [--json PATH]

CPU rows at nanoGPT's CPU configuration (batch 12, 4 heads, block 64, head 32: width 128;
the character vocabulary of 65): causal attention (N, H, T, hd) fwd+bwd, LayerNorm of the
12*64 rows of 128 with its weight and bias fwd+bwd, and Embedding of (12, 64) ids into a
65 x 128 table fwd+bwd. The GPU rows (``--device cuda``) are GPT-2-small-like: batch 64,
6 heads, block 256, head 64, causal; LayerNorm of 64*256 rows of 384; Embedding of 50304 x
384. A call is the forward, then the backward from a fixed gradient g (``out.backward(g)``;
the parameters' gradients accumulate, as in training without zero_grad). In
one process, engine and torch alternate round by round (a round: enough calls for about
``ROUND_SECONDS``, mean time per call; on the CPU each round starts once the other side's
threads sleep, ``bench.harness.settle``); the table gives each side's median over the rounds
and the ratio engine / torch. On CUDA the times are GPU times from CUDA events
(``bench.gpu_time``), with each side's host time to launch a call beside them; the ratio
target here is 1.5 on the CPU.
"""
import argparse
import statistics
import time

import numpy as np

from bench.harness import settle
from bench.report import emit, require_device

ROUND_SECONDS = 0.2
# Calls that warm a side up and then size its round: one call after the first had taken 20-60
# ms (the first split's compiled call, a worker waking), so the engine's LayerNorm rounds were
# 3 calls long and timed the first calls after torch's round alone (500-700 us a call against
# 190 in long rounds, on the 2-core EPYC)
SIZING_CALLS = 5
CPU_SHAPES = {"batch": 12, "heads": 4, "block": 64, "head": 32, "vocab": 65}
GPU_SHAPES = {"batch": 64, "heads": 6, "block": 256, "head": 64, "vocab": 50304}


def _inputs(shapes, seed=0):
    rng = np.random.default_rng(seed)
    n, h, t, d = shapes["batch"], shapes["heads"], shapes["block"], shapes["head"]
    width = h * d
    f32 = np.float32
    return {
        "attention": [rng.standard_normal((n, h, t, d)).astype(f32) for _ in range(4)],
        "layer_norm": [rng.standard_normal((n * t, width)).astype(f32),
                       rng.standard_normal(width).astype(f32),
                       rng.standard_normal(width).astype(f32),
                       rng.standard_normal((n * t, width)).astype(f32)],
        "embedding": [rng.integers(0, shapes["vocab"], (n, t)),
                      rng.standard_normal((shapes["vocab"], width)).astype(f32),
                      rng.standard_normal((n, t, width)).astype(f32)],
    }


def _calls(arrays, tensor, functions):
    """The timed calls, each a forward and a backward from a fixed gradient:
    ``tensor(array, requires_grad)`` makes the framework's tensors and ``functions`` holds
    its ``scaled_dot_product_attention``, ``layer_norm`` and ``embedding``."""
    def tensors(values, grads):
        return [tensor(a, g) for a, g in zip(values, grads)]

    q, k, v, g_att = tensors(arrays["attention"], (True, True, True, False))
    x, w, b, g_ln = tensors(arrays["layer_norm"], (True, True, True, False))
    ids, table, g_emb = tensors(arrays["embedding"], (False, True, False))

    def attention():
        functions.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g_att)

    def layer_norm():
        functions.layer_norm(x, (x.shape[-1],), w, b).backward(g_ln)

    def embedding():
        functions.embedding(ids, table).backward(g_emb)

    return {"attention": attention, "layer_norm": layer_norm, "embedding": embedding}


def _engine_calls(arrays, device):
    import engine
    return _calls(arrays, lambda a, g: engine.tensor(a, device=device, requires_grad=g), engine)


def _torch_calls(arrays, device):
    import torch
    return _calls(arrays, lambda a, g: torch.tensor(a, device=device, requires_grad=g),
                  torch.nn.functional)


def _wall_timer(call, repeats):
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


def run(device="cpu", rounds=15):
    shapes = CPU_SHAPES if device == "cpu" else GPU_SHAPES
    arrays = _inputs(shapes)
    sides = {"engine": _engine_calls(arrays, device), "torch": _torch_calls(arrays, device)}
    if device == "cuda":
        from bench.gpu_time import engine_timer, torch_timer
        timers = {"engine": engine_timer().measure, "torch": torch_timer().measure}
    rows = []
    for name in sides["engine"]:
        repeats = {}
        for side, calls in sides.items():   # warm up (compiles), then size a round
            for _ in range(SIZING_CALLS):
                calls[name]()
            repeats[side] = max(1, int(ROUND_SECONDS / _wall_timer(calls[name], SIZING_CALLS)))
        times = {side: [] for side in sides}
        launches = {side: [] for side in sides}   # CUDA: the host's time to launch a call
        for _ in range(rounds):
            for side, calls in sides.items():
                if device == "cuda":
                    gpu_seconds, launch_seconds = timers[side](calls[name])
                    times[side].append(gpu_seconds)
                    launches[side].append(launch_seconds)
                else:
                    settle()   # the other side's threads asleep: no neighbour spinning
                    times[side].append(_wall_timer(calls[name], repeats[side]))
        medians = {side: statistics.median(values) for side, values in times.items()}
        row = {"op": name, "engine_us": medians["engine"] * 1e6,
               "torch_us": medians["torch"] * 1e6, "ratio": medians["engine"] / medians["torch"]}
        if device == "cuda":
            row.update({f"{side}_launch_us": statistics.median(values) * 1e6
                        for side, values in launches.items()})
        rows.append(row)
    import engine
    import torch
    return {"device": device, "shapes": shapes, "rounds": rounds, "rows": rows,
            "engine_threads": engine.get_num_threads(), "torch_threads": torch.get_num_threads()}


def format_table(result):
    cuda = result["device"] == "cuda"
    lines = [f"sequence ops fwd+bwd on {result['device']} ({result['shapes']}), medians of "
             f"{result['rounds']} alternating rounds; threads: engine "
             f"{result['engine_threads']}, torch {result['torch_threads']}"
             + ("; GPU time a call, then the host's time to launch one" if cuda else ""),
             f"{'op':<12}{'engine us':>12}{'torch us':>12}{'engine/torch':>14}"
             + (f"{'engine launch':>15}{'torch launch':>14}" if cuda else "")]
    for row in result["rows"]:
        lines.append(f"{row['op']:<12}{row['engine_us']:>12.1f}{row['torch_us']:>12.1f}"
                     f"{row['ratio']:>14.2f}"
                     + (f"{row['engine_launch_us']:>15.1f}{row['torch_launch_us']:>14.1f}"
                        if cuda else ""))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch's CPU threads (default: torch's own choice)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of both engine and torch (default: the engine "
                             "follows the load, torch its own choice)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    require_device(parser, args.device)
    if args.threads:
        import engine
        engine.set_num_threads(args.threads)
    if args.torch_threads or args.threads:
        import torch
        torch.set_num_threads(args.torch_threads or args.threads)
    result = run(args.device, args.rounds)
    return emit(result, format_table(result), args.json)


if __name__ == "__main__":
    main()
