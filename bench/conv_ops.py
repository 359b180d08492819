"""Per-op times of the CNN's layers: the engine's ops against PyTorch eager, forward and backward.

    python -m bench.conv_ops [--device cpu|cuda] [--threads N] [--json PATH] [--quick]
    python -m bench.conv_ops --device cpu --cpu-path both   # direct loops against im2col
    python -m bench.conv_ops --device cuda --sweep   # every conv GEMM config at the CNN's shapes

The shapes are those of the network of API.md's "Convolutional networks" at batch 128:
conv2d + relu 1->32 3x3 "same" on 28x28 (the first layer: its input needs no gradient),
max_pool2d 2 on its output, conv2d + relu 32->64 3x3 "same" on 14x14, batch_norm in
training mode on its output, and avg_pool2d 2. Everything is float32.

The engine runs its ops (``ops.conv.Conv2DOp``, ``ops.pool``, ``ops.batch_norm``) through
their op classes: the forward as ``op(*arrays)``, the backward as ``op.backward`` from a
fixed upstream gradient with the gradients the network needs; torch runs
``torch.nn.functional`` eagerly, its backward as ``torch.autograd.grad`` of the same
output (for conv2d + relu that includes relu's backward, which the engine's conv fuses).
The time per call is the best of several rounds, each long enough to be timed reliably,
with the device synchronised at the end of a round (the best round is the least disturbed
one on a shared machine). GFLOP/s count the multiply-adds of the convolution (2 flops
each): the forward's once, the backward's once per gradient among dx and dw.

On CUDA each row also has GPU time per call (``bench.gpu_time``: calls queued behind a long
product, timed by CUDA events, so launches are hidden), and each conv gets a row per GEMM:
``grad_input`` (dx alone) and ``grad_weight`` (dw and db), against
``torch.ops.aten.convolution_backward`` with the same output mask and relu's derivative
already applied to its gradient: cuDNN's kernels alone.

``--sweep`` times, for each conv GEMM of the CNN (the forward, dx where the layer needs it,
dw), every candidate config of ``SWEEP_CANDIDATES`` forced through
``ops.gemm.choices.CONV_CHOICES``, and prints the winners as entries to paste there; each output
is compared with the one the rule's config gives (max relative difference).

``--cpu-path direct|im2col|both`` (CPU) forces the CPU convolution's loops
(``ops.conv_cpu``: the direct loops of ``ops.conv_direct_cpu`` or im2col + GEMM) instead of
its per-shape rule; ``both`` gives each conv row once per path, the paths timed in turn: the
figures the rule was set from.

``--threads N`` runs the engine's parallel CPU loops (``engine.set_num_threads``) and torch's
intra-op pool on N threads each; by default the engine follows the usable CPUs and their
load, torch keeps its own.
"""
import argparse
import importlib.util
import time

import numpy as np

from bench import gpu_time
from bench.gpu_time import CALLS, engine_timer, torch_timer
from bench.report import emit, require_device
from bench.wall_time import seconds_per_call, synchronizers

ROUND_SECONDS = 0.3
QUICK_ROUND_SECONDS = 0.01
ROUNDS = 5
GPU_CALLS = CALLS   # calls per GPU-timed round
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
    from ops.batch_norm import BatchNormOp
    from ops.conv import Conv2DOp
    from ops.device import to_device
    from ops.pool import AvgPool2DOp, MaxPool2DOp
    data = [to_device(a, device) for a in arrays]
    if name == "conv2d relu":
        def make():
            return Conv2DOp(padding="same", activation="relu")
        needs = (params["needs_x"], True, True)
    elif name == "batch_norm":
        def make():
            return BatchNormOp(training=True)
        needs = (True, False, False, True, True)
    else:
        kind = MaxPool2DOp if name == "max_pool2d" else AvgPool2DOp

        def make():
            return kind(kernel_size=params["kernel_size"])
        needs = (True,)
    op = make()
    op.needs_input_grad = needs
    y = op(*data)
    upstream = to_device(np.random.default_rng(1).standard_normal(y.shape).astype(np.float32),
                         device)
    no_destinations = (None,) * len(data)
    calls = {"forward": lambda: make()(*data),
             "backward": lambda: op.backward(upstream, no_destinations)}
    if name == "conv2d relu":   # each GEMM of the backward alone
        for phase, phase_needs in _conv_gemm_phases(params):
            phase_op = make()
            phase_op.needs_input_grad = phase_needs
            phase_op(*data)
            calls[phase] = (lambda o=phase_op: o.backward(upstream, no_destinations))
    return calls


def _conv_gemm_phases(params):
    """(phase, the gradients it asks for) of each backward GEMM of a conv layer."""
    phases = [("grad_input", (True, False, False))] if params["needs_x"] else []
    return phases + [("grad_weight", (False, True, True))]


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
    calls = {"forward": no_grad_forward,
             "backward": lambda: torch.autograd.grad(y, inputs, upstream, retain_graph=True)}
    if name == "conv2d relu":   # cuDNN's dx and dw alone, relu's derivative applied before
        gradient = (upstream * (y > 0)).detach()
        x, w, b = (t.detach() for t in tensors)
        masks = {"grad_input": [True, False, False], "grad_weight": [False, True, True]}
        for phase, _ in _conv_gemm_phases(params):
            calls[phase] = (lambda mask=masks[phase]: torch.ops.aten.convolution_backward(
                gradient, x, w, [w.shape[0]], [1, 1], [params["kernel"] // 2] * 2, [1, 1],
                False, [0, 0], 1, mask))
    return calls


def _flops(name, x_shape, params, phase):
    """Multiply-add flops of ``phase``, or None (not a convolution)."""
    if name != "conv2d relu":
        return None
    batch, channels, h, w = x_shape
    forward = 2 * batch * params["out"] * h * w * channels * params["kernel"] ** 2
    if phase == "backward":
        return forward * (2 if params["needs_x"] else 1)
    return forward


CPU_PATHS = ("direct", "im2col")


def _cpu_path_kernels(path):
    """``(forward, backward)`` CPU functions of ops.conv's kernels forced onto ``path`` (one
    of ``CPU_PATHS``), or its own for "rule"."""
    from ops import conv_cpu
    if path == "rule":
        return conv_cpu.conv2d_forward_cpu, conv_cpu.conv2d_backward_cpu
    forced = conv_cpu.DIRECT if path == "direct" else conv_cpu.IM2COL
    return conv_cpu.conv2d_cpu_functions(forced)


def _on_cpu_path(kernels, call):
    """``call`` with ops.conv's CPU kernels set to ``kernels`` while it runs."""
    from ops import conv

    def on_path():
        saved = conv.CONV2D_FORWARD.cpu, conv.CONV2D_BACKWARD.cpu
        conv.CONV2D_FORWARD.cpu, conv.CONV2D_BACKWARD.cpu = kernels
        try:
            return call()
        finally:
            conv.CONV2D_FORWARD.cpu, conv.CONV2D_BACKWARD.cpu = saved
    return on_path


def run(device, quick=False, threads=None, cpu_path="rule"):
    import engine
    if threads is not None:
        engine.set_num_threads(threads)
    has_torch = importlib.util.find_spec("torch") is not None
    torch_device, torch_threads = None, None
    if has_torch:
        import torch
        if threads is not None:
            torch.set_num_threads(threads)
        torch_device = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
        torch_threads = torch.get_num_threads()
        # fp32 against fp32: cuDNN's convolutions default to TF32 tensor cores (the 32->64
        # conv's grad_input measured 29 us in TF32 against 80 in fp32 on the H200)
        torch.backends.cudnn.allow_tf32 = False
        if device == "cuda" and torch_device != "cuda":
            has_torch = False   # a CPU-only torch is no GPU baseline

    engine_sync, torch_sync = synchronizers(device, torch_device)
    gpu_timers = gpu_time.gpu_timers(device, has_torch)

    rng = np.random.default_rng(0)
    batch = QUICK_BATCH if quick else BATCH
    round_seconds = QUICK_ROUND_SECONDS if quick else ROUND_SECONDS
    rows = []
    paths = (CPU_PATHS if cpu_path == "both" else (cpu_path,)) if device == "cpu" else ("rule",)
    for name, shape, params in LAYERS:
        x_shape = (batch,) + shape
        arrays = _arrays(name, x_shape, params, rng)
        calls, syncs = {}, {}
        for path in (paths if name == "conv2d relu" else ("rule",)):
            label = "engine" if path == "rule" else f"engine {path}"
            kernels = _cpu_path_kernels(path) if device == "cpu" else None
            engine_calls = (_engine_calls(name, arrays, params, device) if kernels is None
                            else _on_cpu_path(kernels, lambda: _engine_calls(name, arrays,
                                                                             params, device))())
            calls[label] = (engine_calls if kernels is None else
                            {phase: _on_cpu_path(kernels, call)
                             for phase, call in engine_calls.items()})
            syncs[label] = engine_sync
        if has_torch:
            calls["torch"] = _torch_calls(name, arrays, params, torch_device)
            syncs["torch"] = torch_sync
        # the per-GEMM rows are GPU rows: on the CPU the backward is one loop per sample
        phases = list(calls["engine"]) if device == "cuda" else ["forward", "backward"]
        for phase in phases:
            flops = _flops(name, x_shape, params, phase)
            seconds = {framework: seconds_per_call(framework_calls[phase], syncs[framework],
                                                    round_seconds, ROUNDS)
                       for framework, framework_calls in calls.items()}
            gpu_seconds = {framework: min(timer.seconds_per_call(calls[framework][phase],
                                                                 GPU_CALLS)
                                          for _ in range(ROUNDS))
                           for framework, timer in gpu_timers.items()}
            rows.append({"op": name, "phase": phase, "x_shape": list(x_shape),
                         "us_per_call": {k: 1e6 * v for k, v in seconds.items()},
                         "c_in": shape[0], "c_out": params.get("out"),
                         "gpu_us_per_call": ({k: 1e6 * v for k, v in gpu_seconds.items()}
                                             if gpu_timers else None),
                         "gflops": None if flops is None else
                         {k: flops / v / 1e9 for k, v in
                          (gpu_seconds if gpu_timers else seconds).items()}})
    return {"device": device, "engine_threads": engine.get_num_threads(),
            "torch_threads": torch_threads, "rows": rows}


def _rows_per_engine_path(rows):
    """A row per engine path (``--cpu-path both``: "engine direct", "engine im2col"), each
    with its times under "engine" and the path in its op's name."""
    for row in rows:
        paths = [k for k in row["us_per_call"] if k.startswith("engine ")]
        if not paths:
            yield row
            continue
        for path in paths:
            def of(values):
                return values and {"engine": values[path], **{k: v for k, v in values.items()
                                                               if not k.startswith("engine")}}
            yield {**row, "op": f"{row['op']} [{path[len('engine '):]}]",
                   "us_per_call": of(row["us_per_call"]),
                   "gpu_us_per_call": of(row.get("gpu_us_per_call")),
                   "gflops": of(row["gflops"])}


def format_table(result):
    frameworks = list(next(_rows_per_engine_path(result["rows"]))["us_per_call"])
    gpu_frameworks = list(result["rows"][0].get("gpu_us_per_call") or ())
    threads = ""
    if result["device"] == "cpu":
        threads = f"; CPU threads: engine loops {result['engine_threads']}"
        if result["torch_threads"]:
            threads += f", torch {result['torch_threads']}"
    lines = [f"bench.conv_ops on {result['device']}, float32{threads}"]
    if gpu_frameworks:
        lines.append(f"us: wall time per call, launch included; gpu us: GPU time alone "
                     f"({GPU_CALLS} calls queued behind a {gpu_time.BUSY_SIZE}³ product, timed "
                     f"by CUDA events); the ratio and GFLOP/s from GPU time")
    times_of = "gpu_us_per_call" if gpu_frameworks else "us_per_call"
    lines += ["", "| op | phase | x | " + " | ".join(
                  [f"{k} us" for k in frameworks] + [f"{k} gpu us" for k in gpu_frameworks])
              + " | engine / torch | engine GFLOP/s |",
              "|---|---|---|" + "---:|" * (len(frameworks) + len(gpu_frameworks) + 2)]
    for row in _rows_per_engine_path(result["rows"]):
        times = row[times_of]
        ratio = f"{times['engine'] / times['torch']:.2f}" if "torch" in times else "-"
        rate = f"{row['gflops']['engine']:.1f}" if row["gflops"] else "-"
        columns = ([f"{row['us_per_call'][k]:.0f}" for k in frameworks]
                   + [f"{row['gpu_us_per_call'][k]:.1f}" for k in gpu_frameworks])
        lines.append(f"| {row['op']} | {row['phase']} | {'x'.join(map(str, row['x_shape']))} | "
                     + " | ".join(columns) + f" | {ratio} | {rate} |")
    return "\n".join(lines)


# The sweep's candidates: every tiling of ops.gemm.tilings but the simulator's, and for the weight
# gradient these split counts (a split that makes the same K slices as a smaller one is timed
# once). Each tiling costs a compile per GEMM, two for a split dw (about 1 s each on the H200
# host, so the sweep's two convs compile about 60 kernels).
SWEEP_SPLITS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SWEEP_ROUNDS = 3


def _host_outputs(result):
    """The host copies of what an engine call returned (an array, or gradients and Nones)."""
    results = result if isinstance(result, tuple) else (result,)
    return [r.copy_to_host() for r in results if r is not None]


def _relative_difference(outputs, references):
    return max(float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
               for got, want in zip(outputs, references))


def sweep_cuda(batch=BATCH):
    """Per conv GEMM of the CNN: GPU time of every candidate config, cuDNN's beside; the
    winners as ``CONV_CHOICES`` entries to paste into ops/gemm/choices.py."""
    from ops.conv import Conv2DOp
    from ops.cuda import cuda
    from ops.gemm import choices, tilings
    from ops.gemm.choices import CONV_MODE_NAMES
    from ops.gemm.conv_operands import ConvGeometry, conv_gemm_shape
    from ops.gemm.tilings import CONV_FORWARD, CONV_GRAD_INPUT, CONV_GRAD_WEIGHT

    started = time.perf_counter()
    torch = None
    if importlib.util.find_spec("torch") is not None:
        import torch
        if not torch.cuda.is_available():
            torch = None
        else:
            torch.backends.cudnn.allow_tf32 = False
    name = getattr(cuda.get_current_device(), "name", "the CUDA simulator")
    name = name.decode() if isinstance(name, bytes) else name
    print(f"\n## Conv GEMM config sweep on {name}, batch {batch}, float32: GPU time per call "
          f"(* the config the table/rule picks now); cuDNN: torch's kernel for the same "
          f"gradients\n")
    engine_gpu = engine_timer()
    torch_gpu = torch_timer() if torch is not None else None
    rng = np.random.default_rng(0)
    winners = []
    for layer, shape, params in LAYERS:
        if layer != "conv2d relu":
            continue
        x_shape = (batch,) + shape
        arrays = _arrays(layer, x_shape, params, rng)
        op = Conv2DOp(padding="same", activation="relu")
        op.check(*arrays)
        geometry = ConvGeometry(*op.meta[1:])
        engine_calls = _engine_calls(layer, arrays, params, "cuda")
        torch_calls = (_torch_calls(layer, arrays, params, "cuda") if torch is not None
                       else None)
        label = f"conv {shape[0]}->{params['out']} on {shape[1]}x{shape[2]}"
        for phase, mode in (("forward", CONV_FORWARD), ("grad_input", CONV_GRAD_INPUT),
                            ("grad_weight", CONV_GRAD_WEIGHT)):
            if phase not in engine_calls:
                continue
            call = engine_calls[phase]
            m, n, k = conv_gemm_shape(mode, geometry, batch)
            key = (CONV_MODE_NAMES[mode], m, n, k)
            picked = choices.pick_conv_config(mode, m, n, k, geometry.GROUPS)
            picked = choices.GemmConfig(picked.tiling, choices.k_slices(k, picked.split,
                                                              picked.tiling.BK))
            references = _host_outputs(call())
            cudnn = (min(torch_gpu.seconds_per_call(torch_calls[phase], GPU_CALLS)
                         for _ in range(SWEEP_ROUNDS)) if torch is not None else None)
            print(f"### {label}, {phase}: GEMM {m}x{n}, K {k}; cuDNN "
                  f"{'-' if cudnn is None else f'{cudnn * 1e6:.1f}'} us GPU\n")
            print("| tiling | threads | slices | blocks | gpu us | vs cuDNN | max rel diff |")
            print("|---|---:|---:|---:|---:|---:|---:|")
            results = []
            seen = set()
            splits = SWEEP_SPLITS if mode == CONV_GRAD_WEIGHT else (1,)
            # the rule's own split too: the 32->64 grad_weight's (53) beat every listed one
            candidates = [(name, tiling, split) for name, tiling in tilings.TILINGS.items()
                          if tiling is not tilings.SIMULATED for split in splits]
            candidates += [(name, tiling, picked.split) for name, tiling in tilings.TILINGS.items()
                           if tiling is picked.tiling]
            for tiling_name, tiling, split in candidates:
                config = choices.GemmConfig(tiling, choices.k_slices(k, split, tiling.BK))
                if config in seen:
                    continue
                seen.add(config)
                previous = choices.CONV_CHOICES.get(key)
                choices.CONV_CHOICES[key] = config
                try:
                    gpu = min(engine_gpu.seconds_per_call(call, GPU_CALLS)
                              for _ in range(SWEEP_ROUNDS))
                    difference = _relative_difference(_host_outputs(call()), references)
                finally:
                    if previous is None:
                        del choices.CONV_CHOICES[key]
                    else:
                        choices.CONV_CHOICES[key] = previous
                blocks = (-(-m // tiling.BM) * -(-n // tiling.BN) * geometry.GROUPS
                          * config.split)
                mark = "*" if config == picked else ""
                versus = f"{gpu / cudnn:.2f}x" if cudnn else "-"
                print(f"| {mark}{tiling_name} | {tilings.threads_of(tiling)} | {config.split} | "
                      f"{blocks} | {gpu * 1e6:.1f} | {versus} | {difference:.1e} |",
                      flush=True)
                results.append((gpu, tiling_name, config))
            gpu, tiling_name, config = min(results, key=lambda result: result[0])
            print(f"\nwinner: {tiling_name} split {config.split}, {gpu * 1e6:.1f} us GPU"
                  + (f", {gpu / cudnn:.2f}x cuDNN" if cudnn else "") + "\n")
            winners.append((key, tiling_name, config.split, gpu, cudnn, f"{label} {phase}"))
    print("## CONV_CHOICES entries of the winners (paste into ops/gemm/choices.py)\n")
    for key, tiling_name, split, gpu, cudnn, label in winners:
        versus = "-" if cudnn is None else f"{cudnn * 1e6:.1f}"
        print(f"    {key}: GemmConfig({tiling_name}, {split}),   # {label}: {gpu * 1e6:.1f} us "
              f"GPU, cuDNN {versus} (H200 sweep)")
    print(f"\n(sweep took {time.perf_counter() - started:.0f} s, compiles included)")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.conv_ops",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="CPU threads of the engine's parallel loops and of torch "
                             "(default: each library's own)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--cpu-path", choices=("rule",) + CPU_PATHS + ("both",), default="rule",
                        help="CPU: the convolution's loops, the per-shape rule's (default), "
                             "forced direct or im2col, or a row for each")
    parser.add_argument("--quick", action="store_true",
                        help=f"batch {QUICK_BATCH}, short rounds (a smoke test, not a "
                             "measurement)")
    parser.add_argument("--sweep", action="store_true",
                        help="with --device cuda: time every conv GEMM config at the CNN's "
                             "shapes and print the winners as CONV_CHOICES entries")
    args = parser.parse_args(argv)
    require_device(parser, args.device)
    if args.sweep:
        if args.device != "cuda":
            parser.error("--sweep needs --device cuda")
        sweep_cuda(QUICK_BATCH if args.quick else BATCH)
        return None
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.cpu_path != "rule" and args.device != "cpu":
        parser.error("--cpu-path is a CPU option")
    result = run(args.device, args.quick, args.threads, args.cpu_path)
    return emit(result, format_table(result), args.json)


if __name__ == "__main__":
    main()
