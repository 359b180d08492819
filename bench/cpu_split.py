"""The CPU GEMMs of the reference MLP split across the engine's threads, against one call.

    python -m bench.cpu_split [--rounds 300] [--threads 2] [--busy-neighbour] [--json results.json]

Each product of the 784-256-128-10 MLP's step at batch 128 (the fused Dense forward, and its
backward: G, dX and dW) runs at 1 and ``--threads`` engine threads (``engine.set_num_threads``;
2 by default), the two counts alternating call by call so that both see the same machine;
the table gives the median and mean microseconds per call, the blocks each product splits
into at that count (``ops.cpu_threads.row_blocks``: at most one per ``MIN_BLOCK_MACS`` of
work), and where ``SPLIT_MIN_MACS`` puts the split. The machine's 1-minute load average is printed with it: beside busy processes two
threads lose (a block waits for its core), which the engine's default avoids by following
the load. With ``--busy-neighbour`` every call is timed again beside a busy process that the
run starts and stops (``bench.harness.busy_neighbour``): what two fixed threads lose there, and
one thread, against the quiet figures.
"""
import argparse
import os
import statistics
import time

import numpy as np

from bench.report import at_least, emit

# (name, batch, inputs, units, x needs a gradient): the reference MLP's three layers
LAYERS = (("dense 784->256", 128, 784, 256, False), ("dense 256->128", 128, 256, 128, True),
          ("dense 128->10", 128, 128, 10, True))


def _layer_calls(batch, inputs, units, needs_x):
    from ops.dense import DENSE
    from ops.pointwise import ACTIVATIONS
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, inputs), np.float32)
    w = rng.standard_normal((inputs, units), np.float32) * np.float32(0.05)
    b = rng.standard_normal(units, np.float32)
    out, grad_out = np.empty((batch, units), np.float32), rng.standard_normal((batch, units),
                                                                             np.float32)
    grad_x = np.empty_like(x) if needs_x else np.empty((0, 0), np.float32)
    grad_w, grad_b, alpha = np.empty_like(w), np.empty_like(b), np.float32(0.01)
    forward, backward = DENSE[ACTIVATIONS["relu"]]
    return {"forward": lambda: forward.cpu(x, w, b, out, alpha),
            "backward": lambda: backward.cpu(x, w, out, grad_out, grad_x, grad_w, grad_b,
                                             alpha, needs_x, True)}


def _alternating(call, rounds, counts):
    """Seconds of each call of ``call`` at each of the engine thread ``counts``, the counts
    alternating."""
    import engine
    seconds = {threads: [] for threads in counts}
    for _ in range(rounds):
        for threads in counts:
            engine.set_num_threads(threads)
            start = time.perf_counter()
            call()
            seconds[threads].append(time.perf_counter() - start)
    return seconds


def _statistics(seconds, prefix=""):
    return {f"{prefix}{stat}_us_{threads}": 1e6 * f(values) for threads, values in seconds.items()
            for stat, f in (("median", statistics.median), ("mean", statistics.mean))}


def _blocks(part, batch, inputs, units, needs_x):
    """How many blocks the part's largest GEMM splits into at the engine's count now."""
    from ops.cpu_threads import row_blocks
    gemms = ([(batch, batch * inputs * units)] if part == "forward" else
             [(inputs, batch * inputs * units)] + ([(batch, batch * inputs * units)]
                                                   if needs_x else []))
    return max(len(row_blocks(rows, macs) or [()]) for rows, macs in gemms)


def run(rounds, loaded=False, threads=2):
    import engine
    from bench.harness import busy_neighbour
    from ops import cpu_threads
    rows, counts = [], (1, threads)
    try:
        for name, batch, inputs, units, needs_x in LAYERS:
            for part, call in _layer_calls(batch, inputs, units, needs_x).items():
                for count in counts:   # compile and start the pool outside the timing
                    engine.set_num_threads(count)
                    call()
                blocks = _blocks(part, batch, inputs, units, needs_x)
                macs = batch * inputs * units * (1 if part == "forward" else 1 + needs_x)
                rows.append({"layer": name, "part": part, "macs": macs, "blocks": blocks,
                             **_statistics(_alternating(call, rounds, counts))})
                if loaded:
                    neighbour = busy_neighbour()
                    try:
                        rows[-1].update(_statistics(_alternating(call, rounds, counts),
                                                    "loaded_"))
                    finally:
                        neighbour.kill()
                        neighbour.wait()
    finally:
        cpu_threads.set_threads(None)
    return {"rounds": rounds, "threads": threads, "split_min_macs": cpu_threads.SPLIT_MIN_MACS,
            "min_block_macs": cpu_threads.MIN_BLOCK_MACS,
            "cpus": cpu_threads.usable_cpus(), "load_average": os.getloadavg(), "rows": rows}


def format_table(result):
    n = result["threads"]
    lines = [f"bench.cpu_split: {result['rounds']} calls at each thread count, alternating; "
             f"{result['cpus']} usable CPUs; split from {result['split_min_macs'] / 2**20:g}M "
             f"multiply-adds per GEMM, at most one block per "
             f"{result['min_block_macs'] / 2**20:g}M; 1-minute load average "
             f"{result['load_average'][0]:.2f}",
             "", f"| layer | part | MACs | blocks at {n} | 1 thread median / mean us | {n} threads "
             f"median / mean us | {n} / 1 (median) |", "|---|---|---:|---:|---:|---:|---:|"]
    loaded = "loaded_median_us_1" in result["rows"][0]
    if loaded:
        lines[-2] += f" beside a busy process: 1 thread | {n} threads | {n} / 1 |"
        lines[-1] += "---:|---:|---:|"
    for row in result["rows"]:
        line = (f"| {row['layer']} | {row['part']} | {row['macs'] / 1e6:.1f}M | {row['blocks']} | "
                f"{row['median_us_1']:.0f} / {row['mean_us_1']:.0f} | "
                f"{row[f'median_us_{n}']:.0f} / {row[f'mean_us_{n}']:.0f} | "
                f"{row[f'median_us_{n}'] / row['median_us_1']:.2f} |")
        if loaded:
            line += (f" {row['loaded_median_us_1']:.0f} / {row['loaded_mean_us_1']:.0f} | "
                     f"{row[f'loaded_median_us_{n}']:.0f} / {row[f'loaded_mean_us_{n}']:.0f} | "
                     f"{row[f'loaded_median_us_{n}'] / row['loaded_median_us_1']:.2f} |")
        lines.append(line)
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_split",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=at_least(1), default=300,
                        help="calls per thread count")
    parser.add_argument("--threads", type=at_least(2), default=2,
                        help="the thread count timed against 1 (e.g. the host's cores)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--busy-neighbour", action="store_true",
                        help="time every call again beside a busy process (one core) that "
                             "the run starts and stops")
    args = parser.parse_args(argv)
    result = run(args.rounds, args.busy_neighbour, args.threads)
    return emit(result, format_table(result), args.json)


if __name__ == "__main__":
    main()
