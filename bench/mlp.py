"""The reference MLP benchmark: the engine against PyTorch eager on the same model and data.

    python -m bench.mlp --device cpu [--epochs 5] [--json results.json]

Model 784-256-128-10 with ReLU, Adam (lr 1e-3), batch 128, MNIST standardised as by
``python -m engine.train``; both frameworks see the same batches in the same order (the
engine loader's permutation of each epoch). After one warm-up epoch each, timed epochs
alternate engine, torch, engine, torch, ... so both share the machine's state; s/epoch is
the median. The engine epoch is ``engine.fit.fit`` (what users run), so it includes the
per-step bookkeeping of the loop. On the CPU each row trains in a process of its own
(``bench.framework_process``), as a user runs one framework, so no framework's thread pool
takes the cores from another's epoch; on CUDA all rows share this process.

Also measured: kernel launches per training step (CUDA: counted by an
``ops.launch.LaunchRecorder`` during one instrumented epoch), driver allocations of the
CUDA caching allocator across steady-state steps, the autograd tape's size between steps,
and the first training steps' times from a cold cache (a fresh ``NUMBA_CACHE_DIR``, in a
subprocess) and a warm one (the same directory again); on CUDA also cold without the shipped
kernels of ops/kernels/ (``ENGINE_SHIPPED_KERNELS=0``).
"""
import argparse
import os
import statistics

import numpy as np

from bench.framework_process import open_side
from bench.harness import (BATCH_SIZE, LEARNING_RATE, PROCESSES_NOTE, add_step_rates,
                           busy_neighbour_line, close_sides, compile_times, engine_training,
                           format_first_steps, machine_description, mnist_arrays, timed_sides,
                           torch_training, torch_usable)
from bench.precision import add_option, set_for_engine, set_for_torch
from ops.matmul_precision import get_float32_matmul_precision
from bench.report import emit, require_device


# ------------------------------------------------------------------ the engine side

def _engine_run(x_train, y_train, x_test, y_test, normalize, device, hidden, capture=True):
    import engine
    from engine.losses import cross_entropy
    from engine.models import build_mlp

    engine.manual_seed(0)
    model = build_mlp(x_train.shape[1:], hidden, 10).to(device)
    optimizer, loader, train_epoch, test_accuracy = engine_training(
        model, x_train, y_train, x_test, y_test, normalize, device, capture)

    def instrumented_epoch():
        """One epoch of plain steps, counting launches, driver allocations and tape nodes.
        A step's counts run from the end of the previous step, so they include the
        loader's batch gather."""
        from engine.autograd import current_tape
        from ops.launch import LaunchRecorder
        from ops.memory import allocator_stats

        def driver_allocations():   # asked only on CUDA: it needs a CUDA context
            return allocator_stats()["driver_allocations"] if device == "cuda" else 0

        launches, tape_sizes, allocations = [], [], []
        with LaunchRecorder() as recorder:
            previous_allocations = driver_allocations()
            for inputs, labels in loader:
                optimizer.zero_grad()
                cross_entropy(model(inputs), labels).backward()
                optimizer.step()
                launches.append(recorder.cuda_launches())
                recorder.clear()   # the runs hold their arrays: keep none past the step
                allocations.append(driver_allocations() - previous_allocations)
                previous_allocations = driver_allocations()
                tape_sizes.append(len(current_tape()))
        steady = allocations[1:] or allocations   # the first step may fill the pool
        return {"launches_per_step": statistics.median(launches) if device == "cuda" else None,
                "launches_per_step_max": max(launches) if device == "cuda" else None,
                "driver_allocations_steady_steps": int(sum(steady)) if device == "cuda" else None,
                "steady_steps": len(steady),
                "tape_nodes_between_steps_max": max(tape_sizes)}

    return train_epoch, instrumented_epoch, test_accuracy, loader


# ------------------------------------------------------------------ the PyTorch side

def _torch_run(x_train, y_train, x_test, y_test, normalize, device, hidden, order_of_epoch,
               cuda_graph=False):
    """PyTorch on the same model and batches: eager, or (``cuda_graph``, CUDA only) each full
    batch's step replayed as one CUDA graph (``torch.cuda.graph``, Adam with
    ``capturable=True``); the last partial batch runs eagerly."""
    import torch
    torch_device = "cuda" if device == "cuda" else "cpu"
    torch.manual_seed(0)
    set_for_torch(torch)
    mean, std = normalize

    def standardised(images):
        return torch.from_numpy(((images.reshape(len(images), -1).astype(np.float32) / 255)
                                 - np.float32(mean)) / np.float32(std)).to(torch_device)

    x_train_t, x_test_t = standardised(x_train), standardised(x_test)
    y_train_t = torch.from_numpy(y_train.astype(np.int64)).to(torch_device)
    widths = (x_train_t.shape[1],) + tuple(hidden)
    layers = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(widths[-1], 10))
    model = torch.nn.Sequential(*layers).to(torch_device)
    for layer in model:   # He-normal weights and zero biases, as the engine's Dense(relu)
        if isinstance(layer, torch.nn.Linear):
            torch.nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
            torch.nn.init.zeros_(layer.bias)
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE, capturable=cuda_graph)
    train_epoch = torch_training(model, optimizer, x_train_t, y_train_t, torch_device,
                                 order_of_epoch, cuda_graph)

    def test_accuracy():
        with torch.no_grad():
            predicted = model(x_test_t).argmax(dim=1).cpu().numpy()
        return float(np.mean(predicted == y_test))

    return train_epoch, test_accuracy, torch.__version__


# ------------------------------------------------------------------ the run

def engine_side(device, limit, hidden, capture, precision, orders):
    """``bench.framework_process``'s build of an engine row: its epochs, test accuracy,
    thread count and instrumented epoch; its info the data's sizes and the loader's
    permutations of the first ``orders`` epochs (the batches the other rows take)."""
    import engine
    set_for_engine(precision)
    x_train, y_train, x_test, y_test, normalize = mnist_arrays(limit)
    train_epoch, instrumented_epoch, test_accuracy, loader = _engine_run(
        x_train, y_train, x_test, y_test, normalize, device, hidden, capture)
    return ({"epoch": train_epoch, "test_accuracy": test_accuracy,
             "instrumented": instrumented_epoch, "threads": engine.get_num_threads},
            {"train_samples": len(x_train), "test_samples": len(x_test),
             "orders": [loader.order(epoch) for epoch in range(orders)]})


def torch_side(device, limit, hidden, cuda_graph, precision, orders):
    """``bench.framework_process``'s build of a PyTorch row, on the batches of ``orders``
    (one permutation per epoch)."""
    set_for_engine(precision)   # set_for_torch reads the engine's setting
    x_train, y_train, x_test, y_test, normalize = mnist_arrays(limit)
    train_epoch, test_accuracy, version = _torch_run(
        x_train, y_train, x_test, y_test, normalize, device, hidden, orders.__getitem__,
        cuda_graph=cuda_graph)
    return {"epoch": train_epoch, "test_accuracy": test_accuracy}, {"version": version}


def run(device, epochs, hidden, limit, measure_compile, loaded=False):
    separate = device == "cpu"   # each row's thread pools alone on the cores
    precision = get_float32_matmul_precision()
    epochs_trained = 1 + epochs * (2 if loaded else 1)
    sides = {"engine": open_side(separate, "engine", engine_side, device, limit, hidden, True,
                                 precision, epochs_trained),
             "engine eager": open_side(separate, "engine eager", engine_side, device, limit,
                                       hidden, False, precision, 0)}
    try:
        sizes = sides["engine"].info
        if torch_usable(device):
            for name, cuda_graph in (("torch", False), ("torch graph", True)):
                if cuda_graph and device != "cuda":
                    continue
                sides[name] = open_side(separate, name, torch_side, device, limit, hidden,
                                        cuda_graph, precision, sizes["orders"])
        rows, threads, loaded_threads = timed_sides(sides, epochs, loaded)
        instrumented = sides["engine"].call("instrumented")
        accuracies = {name: side.call("test_accuracy") for name, side in sides.items()}
        torch_version = sides["torch"].info["version"] if "torch" in sides else None
    finally:
        close_sides(sides)

    steps = add_step_rates(rows, sizes["train_samples"], accuracies, "us")
    for name, row in rows.items():
        if name.startswith("torch"):
            row["version"] = torch_version
    rows["engine"].update(**instrumented)
    result = {"device": device, "machine": machine_description(device),
              "model": "-".join(map(str, (784,) + tuple(hidden) + (10,))) + " ReLU",
              "optimizer": f"Adam lr {LEARNING_RATE:g}", "batch_size": BATCH_SIZE,
              "train_samples": sizes["train_samples"], "steps_per_epoch": steps,
              "timed_epochs": epochs, "separate_processes": separate,
              "engine_threads": threads, "engine_threads_loaded": loaded_threads,
              "matmul_precision": precision,
              "load_average": os.getloadavg(),
              "results": rows,
              "engine_over_torch": (rows["engine"]["s_per_epoch"] / rows["torch"]["s_per_epoch"]
                                    if torch_version else None)}
    if measure_compile:
        result["jit"] = compile_times(device, "mlp:" + ",".join(map(str, hidden)))
    return result


def format_table(result):
    rows = result["results"]
    lines = [f"bench.mlp: MLP {result['model']}, {result['optimizer']}, "
             f"batch {result['batch_size']}, "
             f"MNIST {result['train_samples']} samples ({result['steps_per_epoch']} steps/epoch), "
             f"device {result['device']} ({result['machine']}); median of {result['timed_epochs']} "
             f"epochs after 1 warm-up, the rows alternating epoch by epoch"
             f"{PROCESSES_NOTE if result.get('separate_processes') else ''}; engine threads "
             f"{result['engine_threads']}, float32 matmul precision "
             f"{result.get('matmul_precision', 'highest')!r} (engine and torch), 1-minute load "
             f"average at the end "
             f"{result['load_average'][0]:.2f}; launches/step: the "
             "kernels of one eager step (a captured step replays them in one graph launch)", "",
             "| framework | s/epoch | us/step | samples/s | test acc | launches/step |",
             "|---|---:|---:|---:|---:|---:|"]
    labels = {"engine": "engine, fit (captured step)", "engine eager": "engine, fit(capture=False)",
              "torch": "torch {version} eager", "torch graph": "torch {version}, CUDA graph step"}
    for name, row in rows.items():
        label = labels[name].format(version=row.get("version"))
        launches = row.get("launches_per_step")
        lines.append(f"| {label} | {row['s_per_epoch']:.3f} | {row['us_per_step']:.0f} | "
                     f"{row['samples_per_s']:.0f} | {100 * row['test_acc']:.2f}% | "
                     f"{'-' if launches is None else f'{launches:g}'} |")
    lines.append("")
    if result["engine_over_torch"] is not None:
        eager = rows["engine eager"]["s_per_epoch"] / rows["torch"]["s_per_epoch"]
        lines.append(f"engine / torch eager s/epoch: {result['engine_over_torch']:.2f}x "
                     f"captured, {eager:.2f}x eager")
    loaded = busy_neighbour_line(result, rows, 3)
    if loaded is not None:
        lines.append(loaded)
    engine = rows["engine"]
    lines.append("autograd tape between steps: at most "
                 f"{engine['tape_nodes_between_steps_max']} nodes")
    if engine["driver_allocations_steady_steps"] is not None:
        lines.append(f"CUDA driver allocations over {engine['steady_steps']} steady-state steps: "
                     f"{engine['driver_allocations_steady_steps']}")
    if "jit" in result:
        lines += format_first_steps(result["jit"])
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.mlp", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--epochs", type=int, default=5, help="timed epochs per framework")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--hidden", default="256,128", help="hidden widths (smoke tests: small)")
    parser.add_argument("--limit", type=int, help="first N training/test samples (smoke tests)")
    parser.add_argument("--no-compile-time", action="store_true",
                        help="skip the cold/warm JIT cache subprocesses")
    parser.add_argument("--busy-neighbour", action="store_true",
                        help="time the epochs again beside a busy process (one core) that the "
                             "run starts and stops")
    add_option(parser)
    args = parser.parse_args(argv)
    if args.epochs < 1 or (args.limit is not None and args.limit < 1):
        parser.error("--epochs and --limit must be positive")
    set_for_engine(args.matmul_precision)
    from engine.models import parse_widths
    try:
        hidden = parse_widths(args.hidden)
    except ValueError as error:
        parser.error(f"--hidden {error}")
    require_device(parser, args.device)
    result = run(args.device, args.epochs, hidden, args.limit, not args.no_compile_time,
                 args.busy_neighbour)
    return emit(result, format_table(result), args.json)


if __name__ == "__main__":
    main()
