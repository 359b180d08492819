"""Where one replayed CPU training step of the reference MLP, the CNN or the GPT spends its
time, kernel by kernel.

    python -m bench.cpu_step [--model mlp|cnn|gpt] [--steps 400] [--threads 2] [--json PATH]

The step of ``bench.mlp`` (784-256-128-10 ReLU) or of ``bench.cnn`` (``--model cnn``:
``engine.models.build_cnn``, ``engine.train --model cnn``'s network), Adam lr 1e-3, batch
128 of MNIST gathered at the loader's epoch cursor, or of ``bench.gpt``'s CPU configuration
(``--model gpt``: AdamW, batches of Shakespeare's windows), as ``engine.fit`` runs it (the
GPT's without its gradient clipping), is recorded once with an ``ops.launch.LaunchRecorder``
and its kernel runs are replayed ``--steps`` times the way a captured step replays them on
the CPU (each run's function on its arguments, in order), each run timed on its own. The
table gives each run's median and mean microseconds, and for the Dense runs the time of
their BLAS calls on the calling thread and the time it waited for the pool's workers after
its own block (``ops.cpu_threads.run_blocks``: the hand-off and any imbalance). The gather
walks the epoch's batches, as in training.
"""
import argparse
import os
import statistics
import time

from bench.report import at_least, emit

BATCH_SIZE = 128


def _mnist_training(model_name):
    """``(model, optimizer, cursor, batch size, loss function)`` of bench.mlp's or bench.cnn's
    training (Adam lr 1e-3, shuffled MNIST, normalised)."""
    import data
    import optim
    from data.datasets import load_dataset, pixel_statistics
    from engine.losses import cross_entropy
    from engine.models import build_cnn, build_mlp

    (x_train, y_train), _ = load_dataset("mnist")
    loader = data.DataLoader(x_train, y_train, batch_size=BATCH_SIZE, shuffle=True, seed=0,
                             device="cpu", normalize=pixel_statistics(x_train))
    model = (build_cnn(x_train.shape[1:], 10) if model_name == "cnn"
             else build_mlp(x_train.shape[1:], (256, 128), 10))
    return (model, optim.Adam(model.parameters(), lr=1e-3), loader.epoch_cursor(), BATCH_SIZE,
            cross_entropy)


def _gpt_training():
    """The same for bench.gpt's CPU configuration (AdamW, its windows of Shakespeare)."""
    from bench.harness import GPT_PRESETS, gpt_corpus, gpt_training
    from engine import models

    config = GPT_PRESETS["cpu"]
    tokenizer, train_ids, _ = gpt_corpus()
    model, optimizer, loader = gpt_training(config, tokenizer.vocab_size, train_ids)
    return model, optimizer, loader.epoch_cursor(), config["batch_size"], models.gpt_loss


def _recorded_step(model_name, threads):
    """The kernel runs of one training step at the loader's cursor (its third: the cursor
    at the epoch's fourth batch now), the cursor, and the epoch's full batches."""
    import engine
    from ops.launch import LaunchRecorder

    engine.set_num_threads(threads)
    engine.manual_seed(0)
    model, optimizer, cursor, batch_size, loss_function = (
        _gpt_training() if model_name == "gpt" else _mnist_training(model_name))

    def step():
        inputs, labels = cursor.next_batch(batch_size)
        optimizer.zero_grad()
        loss_function(model(inputs), labels).backward()
        optimizer.step()

    spans = cursor.start_epoch()
    for _ in range(2):   # compile, and let the optimizer make its state
        step()
    with LaunchRecorder() as recorder:
        step()
    return list(recorder.runs), cursor, sum(count == batch_size for _, count in spans)


def _label(kernel_run):
    """The run's kernel, with a Dense run's layer (its weight's shape: in->out) and a
    convolution's (channels in->out, from its geometry)."""
    name = kernel_run.kernel.name
    if name.startswith("dense_"):
        rows, cols = kernel_run.args[1].shape
        return f"{name} {rows}->{cols}"
    if name.startswith("conv2d_"):
        geometry = next(arg for arg in kernel_run.args if isinstance(arg, tuple))   # ops.conv's
        _, channels_in, height, width, channels_out = geometry[:5]
        return f"{name} {channels_in}->{channels_out} {height}x{width}"
    return name


def run(steps, threads, model="mlp"):
    import threading

    from ops import cpu_threads
    from ops.gemm import cpu as gemm_cpu
    runs, cursor, full_batches = _recorded_step(model, threads)
    left_in_epoch = full_batches - 3
    here = threading.get_ident()
    spent = {"blas": 0.0, "wait": 0.0}   # of the run being timed, on this thread
    stalled, product = cpu_threads.split_stalled, gemm_cpu.blas_product

    def waited(own_s, waited_s):   # what run_blocks asks after each split
        spent["wait"] += waited_s
        return stalled(own_s, waited_s)

    def timed_product(a, b, out):
        start = time.perf_counter()
        product(a, b, out)
        if threading.get_ident() == here:
            spent["blas"] += time.perf_counter() - start

    # a worker's block still runs as its CBLAS call (ops.cpu_pool): only this thread's is timed
    timed_product.is_matmul = getattr(product, "is_matmul", False)
    seconds = {part: [[] for _ in runs] for part in ("run", "blas", "wait")}
    whole = []
    cpu_threads.split_stalled, gemm_cpu.blas_product = waited, timed_product
    try:
        for _ in range(steps):
            if left_in_epoch == 0:   # the cursor at the epoch's end: the next epoch's batches
                cursor.start_epoch()
                left_in_epoch = full_batches
            left_in_epoch -= 1
            step_start = time.perf_counter()
            for index, kernel_run in enumerate(runs):
                spent["blas"] = spent["wait"] = 0.0
                start = time.perf_counter()
                kernel_run.function(*kernel_run.args)
                seconds["run"][index].append(time.perf_counter() - start)
                seconds["blas"][index].append(spent["blas"])
                seconds["wait"][index].append(spent["wait"])
            whole.append(time.perf_counter() - step_start)
    finally:
        cpu_threads.split_stalled, gemm_cpu.blas_product = stalled, product
        cpu_threads.set_threads(None)
    rows = [{"run": _label(kernel_run),
             **{f"{part}_median_us": 1e6 * statistics.median(seconds[part][index])
                for part in seconds},
             "mean_us": 1e6 * statistics.mean(seconds["run"][index])}
            for index, kernel_run in enumerate(runs)]
    return {"model": model, "steps": steps, "threads": threads,
            "cpus": cpu_threads.usable_cpus(),
            "load_average": os.getloadavg(), "rows": rows,
            "step_median_us": 1e6 * statistics.median(whole),
            "step_mean_us": 1e6 * statistics.mean(whole)}


def format_table(result):
    lines = [f"bench.cpu_step: the {result['model'].upper()}'s CPU step replayed "
             f"{result['steps']} times on "
             f"{result['threads']} engine threads ({result['cpus']} usable CPUs), each kernel "
             f"run timed on its own, in the step's order; 1-minute load average "
             f"{result['load_average'][0]:.2f}. Of a Dense run: its BLAS calls on the calling "
             "thread, and its wait for the split's workers after its own block",
             "", "| run | median us | mean us | share of the step | of it: BLAS here | "
             "waiting for workers |", "|---|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        dense = row["run"].startswith("dense_")
        lines.append(f"| {row['run']} | {row['run_median_us']:.0f} | {row['mean_us']:.0f} | "
                     f"{100 * row['run_median_us'] / result['step_median_us']:.0f}% | " +
                     (f"{row['blas_median_us']:.0f} | {row['wait_median_us']:.0f} |" if dense
                      else "| |"))
    lines.append(f"| the whole step | {result['step_median_us']:.0f} | "
                 f"{result['step_mean_us']:.0f} | 100% | | |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_step",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("mlp", "cnn", "gpt"), default="mlp",
                        help="bench.mlp's network, bench.cnn's or bench.gpt's (its CPU "
                             "configuration)")
    parser.add_argument("--steps", type=at_least(1), default=400, help="replayed steps")
    parser.add_argument("--threads", type=at_least(1), default=2, help="engine threads")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    result = run(args.steps, args.threads, args.model)
    return emit(result, format_table(result), args.json)


if __name__ == "__main__":
    main()
