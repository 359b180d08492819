"""Data-parallel throughput: 1 and 2 ranks, and what the gradient all-reduce costs per step.

    python -m bench.distributed [--device cpu|cuda] [--steps 200] [--wide-steps 40]
                                [--batch-size 128] [--threads N] [--json results.json]

For each model (the reference MLP 784-256-128-10 and a wide 784-2048-2048-10, ReLU, Adam)
and each world size, the script starts ``mpiexec -n RANKS python -m bench.distributed
--rank-run ...``: every rank trains on its shard of MNIST (``batch-size`` samples per rank
and step, so 2 ranks take twice the samples per step), calling
``engine.distributed.all_reduce_gradients`` between backward and the optimizer step, as the
CLI does. After warm-up steps it times ``steps`` steps; samples/s counts the samples of all
ranks. Two all-reduce times: inside the loop (the call, which on the CPU also waits for the
slower rank; not measured on CUDA, where the call only queues work), and alone (after a
barrier and a device sync, the median of repeated calls: the communication itself).

On CUDA one rank per GPU: 2 ranks only where 2 GPUs are visible. CPU ranks run their GEMMs
on the engine's default of 1 BLAS thread each unless ``--threads`` says otherwise.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench.harness import machine_description
from bench.report import emit, require_device

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"reference": (256, 128), "wide": (2048, 2048)}
WARMUP_STEPS = 5
ALONE_REPEATS = 20
LEARNING_RATE = 1e-3
RANK_TIMEOUT_S = 600   # a world that takes longer hangs: the benchmark fails, never waits


# ------------------------------------------------------------------ one rank (under mpiexec)

def rank_run(device, hidden, steps, batch_size, threads):
    """Train ``steps`` timed steps on this rank; rank 0 returns the measurements."""
    from mpi4py import MPI

    import data
    import engine
    import optim
    from data.datasets import load_dataset, pixel_statistics
    from engine import distributed as dist
    from engine.losses import cross_entropy
    from engine.models import build_mlp
    from ops.cuda import cuda

    dist.init(device=device)
    if threads:
        engine.set_num_threads(threads)
    (x_train, y_train), _ = load_dataset("mnist")
    engine.manual_seed(0)
    model = dist.broadcast_model(build_mlp(x_train.shape[1:], hidden, 10).to(device))
    optimizer = optim.Adam(model.parameters(), lr=LEARNING_RATE)
    loader = data.DataLoader(x_train, y_train, batch_size=batch_size, shuffle=True, seed=0,
                             device=device, normalize=pixel_statistics(x_train),
                             shard=(dist.rank(), dist.world_size()))

    def synchronize():
        if device == "cuda":
            cuda.synchronize()

    def batches():
        while True:   # epoch after epoch
            yield from loader

    stream = batches()

    def step():
        """One training step; returns the seconds its all-reduce call took."""
        inputs, labels = next(stream)
        optimizer.zero_grad()
        cross_entropy(model(inputs), labels).backward()
        start = time.perf_counter()
        dist.all_reduce_gradients(model)
        seconds = time.perf_counter() - start
        optimizer.step()
        return seconds

    for _ in range(WARMUP_STEPS):
        step()
    synchronize()
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    in_loop = sum(step() for _ in range(steps))
    synchronize()
    elapsed = time.perf_counter() - start

    alone = []
    for _ in range(ALONE_REPEATS):
        synchronize()
        MPI.COMM_WORLD.Barrier()
        begin = time.perf_counter()
        dist.all_reduce_gradients(model)
        synchronize()
        alone.append(time.perf_counter() - begin)
    gradient_bytes = sum(b.size * b.dtype.itemsize for b in model.flat_buffers())
    return {"ranks": dist.world_size(), "steps": steps, "seconds": elapsed,
            "samples_per_s": dist.world_size() * batch_size * steps / elapsed,
            "ms_per_step": 1e3 * elapsed / steps,
            "allreduce_ms_in_loop": None if device == "cuda" else 1e3 * in_loop / steps,
            "allreduce_ms_alone": 1e3 * statistics.median(alone),
            "gradient_mb": gradient_bytes / 1e6, "buffers": len(model.flat_buffers())}


def _mpiexec():
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.path.exists(beside) else "mpiexec"


def run_world(ranks, device, hidden, steps, batch_size, threads):
    """``rank_run`` on ``ranks`` MPI ranks; rank 0's measurements."""
    with tempfile.TemporaryDirectory(prefix="bench-distributed-") as folder:
        out = os.path.join(folder, "rank0.json")
        command = [_mpiexec(), "-n", str(ranks), sys.executable, "-m", "bench.distributed",
                   "--rank-run", out, "--device", device, "--hidden", ",".join(map(str, hidden)),
                   "--steps", str(steps), "--batch-size", str(batch_size),
                   "--threads", str(threads or 0)]
        child = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                               timeout=RANK_TIMEOUT_S)
        if child.returncode != 0:
            raise RuntimeError(f"bench.distributed: {' '.join(command)} failed:\n"
                               f"{child.stdout}{child.stderr}")
        with open(out) as file:
            return json.load(file)


# ------------------------------------------------------------------ the table

def world_sizes(device):
    if device == "cpu":
        return [1, 2]
    from ops.cuda import cuda
    return [1, 2] if len(cuda.gpus) >= 2 else [1]


def run(device, steps, wide_steps, batch_size, threads):
    rows = []
    for name, hidden in MODELS.items():
        model_steps = steps if name == "reference" else wide_steps
        single = None
        for ranks in world_sizes(device):
            row = run_world(ranks, device, hidden, model_steps, batch_size, threads)
            single = single or row["samples_per_s"]
            rows.append({"model": "-".join(map(str, (784,) + hidden + (10,))), **row,
                         "speed_up": row["samples_per_s"] / single})
    return {"device": device, "machine": machine_description(device),
            "batch_size_per_rank": batch_size, "blas_threads_per_rank": threads or 1,
            "warmup_steps": WARMUP_STEPS, "alone_repeats": ALONE_REPEATS, "results": rows}


def format_table(result):
    def ms(value):
        return "-" if value is None else f"{value:.3f}"
    threads = (f", {result['blas_threads_per_rank']} BLAS thread(s) per rank"
               if result["device"] == "cpu" else "")
    lines = [f"bench.distributed: Adam, batch {result['batch_size_per_rank']} per rank, MNIST, "
             f"device {result['device']} ({result['machine']}){threads}; all-reduce alone: "
             f"median of {result['alone_repeats']} calls after a barrier", "",
             "| model | gradients | ranks | samples/s | speed-up | ms/step | "
             "all-reduce ms/step (in the loop) | all-reduce ms (alone) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["results"]:
        lines.append(f"| {row['model']} | {row['gradient_mb']:.2f} MB | {row['ranks']} | "
                     f"{row['samples_per_s']:.0f} | {row['speed_up']:.2f}x | "
                     f"{row['ms_per_step']:.2f} | {ms(row['allreduce_ms_in_loop'])} | "
                     f"{ms(row['allreduce_ms_alone'])} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.distributed",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=200,
                        help="timed steps of the reference MLP (default 200)")
    parser.add_argument("--wide-steps", type=int, default=40,
                        help="timed steps of the wide MLP (default 40)")
    parser.add_argument("--batch-size", type=int, default=128,
                        help="samples per rank and step (default 128)")
    parser.add_argument("--threads", type=int, default=0,
                        help="BLAS threads per CPU rank (default 0: the engine's default, 1)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--rank-run", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("--hidden", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.steps, args.wide_steps, args.batch_size) < 1 or args.threads < 0:
        parser.error("--steps, --wide-steps and --batch-size must be positive, "
                     "--threads at least 0")
    if args.rank_run:
        hidden = tuple(int(width) for width in args.hidden.split(","))
        result = rank_run(args.device, hidden, args.steps, args.batch_size, args.threads)
        from engine import distributed as dist
        if dist.rank() == 0:
            with open(args.rank_run, "w") as file:
                json.dump(result, file)
        return result
    require_device(parser, args.device)
    result = run(args.device, args.steps, args.wide_steps, args.batch_size, args.threads)
    return emit(result, format_table(result), args.json)


if __name__ == "__main__":
    main()
