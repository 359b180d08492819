"""Where one GPU training step of the GPT spends its time, kernel by kernel.

    python -m bench.gpu_step [--preset gpu|cpu] [--precision highest|high|medium]
                             [--dropout P] [--repeats 5] [--json PATH]

``bench.gpt``'s training step (nanoGPT's architecture; ``--preset gpu``: 6 layers, 6 heads,
384 wide, block 256, batch 64, dropout 0.2; AdamW, the gradient norm clipped) on CUDA is run
eagerly to warm up, then recorded once with an ``ops.launch.LaunchRecorder``. Each recorded
launch is then replayed alone, ``--repeats`` times back to back between two CUDA events
(after one launch untimed), so a row is GPU time plus, for a kernel shorter than its launch,
the launch's own time (a launch that depends on the one before it, as Embedding's backward
counts ids into buckets, is timed on what its own replays leave: right for time, not for
values). The table sums the launches of each kernel (the op's ``Kernel`` and
the ``@cuda.jit`` function it launched), largest first, with the step's eager wall time
beside. It answers "which kernel", not "how fast is the step": ``bench.gpt`` times the
captured step against torch's.
"""
import argparse
import collections
import statistics
import time

from bench.report import at_least, emit, require_device


def _training(preset, dropout):
    """``step()``: one eager training step of bench.gpt's recipe on CUDA."""
    from bench.harness import GPT_CLIP, GPT_PRESETS, gpt_corpus, gpt_training
    from engine import models, optim

    config = dict(GPT_PRESETS[preset])
    if dropout is not None:
        config["dropout"] = dropout
    tokenizer, train_ids, _ = gpt_corpus()
    model, optimizer, loader = gpt_training(config, tokenizer.vocab_size, train_ids, "cuda")
    cursor = loader.epoch_cursor()
    cursor.start_epoch()
    parameters = model.parameters()

    def step():
        inputs, targets = cursor.next_batch(config["batch_size"])
        optimizer.zero_grad()
        models.gpt_loss(model(inputs), targets).backward()
        optim.clip_grad_norm_(parameters, GPT_CLIP)
        optimizer.step()

    return config, step


def run(preset="gpu", precision="highest", dropout=None, repeats=5):
    import engine
    from ops import cuda as cuda_runtime
    from ops.cuda import cuda
    from ops.launch import LaunchRecorder

    if precision != "highest":
        engine.set_float32_matmul_precision(precision)
    config, step = _training(preset, dropout)
    for _ in range(2):   # compile (or load the shipped kernels), make the optimizer's state
        step()
    cuda.synchronize()
    walls = []
    for _ in range(5):
        start = time.perf_counter()
        step()
        cuda.synchronize()
        walls.append(time.perf_counter() - start)
    with LaunchRecorder() as recorder:
        step()
    cuda.synchronize()
    launches = [r for r in recorder.runs if r.device == "cuda" and r.grid]
    begin, end = cuda.event(), cuda.event()
    totals, counts = collections.defaultdict(float), collections.Counter()
    for kernel_run in launches:
        function = getattr(kernel_run.function, "py_func", kernel_run.function).__name__
        name = f"{kernel_run.kernel.name}: {function}"
        arguments = (kernel_run.function, kernel_run.grid, kernel_run.block, kernel_run.args)
        cuda_runtime.launch(*arguments)
        begin.record()
        for _ in range(repeats):
            cuda_runtime.launch(*arguments)
        end.record()
        end.synchronize()
        totals[name] += cuda.event_elapsed_time(begin, end) / repeats
        counts[name] += 1
    rows = [{"kernel": name, "launches": counts[name], "ms": ms}
            for name, ms in sorted(totals.items(), key=lambda item: -item[1])]
    return {"preset": preset, "precision": precision, "dropout": config["dropout"],
            "launches": len(launches), "eager_step_ms": 1e3 * statistics.median(walls),
            "kernels_ms": sum(totals.values()), "rows": rows}


def format_table(result):
    lines = [f"bench.gpu_step: the GPT's {result['preset']} configuration on CUDA, float32 "
             f"matmul precision {result['precision']!r}, dropout {result['dropout']}: "
             f"{result['launches']} launches a step, each replayed alone; their GPU times "
             f"add to {result['kernels_ms']:.2f} ms (the eager step's wall time "
             f"{result['eager_step_ms']:.1f} ms)", "",
             "| kernel | launches | ms a step | share |", "|---|---:|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['kernel']} | {row['launches']} | {row['ms']:.3f} | "
                     f"{100 * row['ms'] / result['kernels_ms']:.1f}% |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_step",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=("gpu", "cpu"), default="gpu",
                        help="bench.gpt's configuration (gpu: nanoGPT's shakespeare-char)")
    parser.add_argument("--precision", choices=("highest", "high", "medium"),
                        default="highest", help="engine.set_float32_matmul_precision")
    parser.add_argument("--dropout", type=float, default=None,
                        help="in place of the configuration's dropout")
    parser.add_argument("--repeats", type=at_least(1), default=5,
                        help="timed replays of each launch")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    require_device(parser, "cuda")
    result = run(args.preset, args.precision, args.dropout, args.repeats)
    return emit(result, format_table(result), args.json)


if __name__ == "__main__":
    main()
