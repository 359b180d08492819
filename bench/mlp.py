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
import functools
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.framework_process import open_side
from bench.precision import add_option, set_for_engine, set_for_torch
from ops.matmul_precision import get_float32_matmul_precision
from bench.report import emit, require_device

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH_SIZE = 128
LEARNING_RATE = 1e-3


# ------------------------------------------------------------------ the engine side

def engine_training(model, x_train, y_train, x_test, y_test, normalize, device, capture):
    """The engine's side of a benchmark, as users run it: Adam on ``model`` through
    ``engine.fit.fit``, one epoch per call of ``train_epoch()`` (its training seconds),
    over shuffled batches of ``BATCH_SIZE``. Returns ``(optimizer, loader, train_epoch,
    test_accuracy)``."""
    import data
    import optim
    from engine.losses import cross_entropy
    from engine.fit import evaluate, fit

    optimizer = optim.Adam(model.parameters(), lr=LEARNING_RATE)
    loader = data.DataLoader(x_train, y_train, batch_size=BATCH_SIZE, shuffle=True, seed=0,
                             device=device, normalize=normalize)
    test_loader = data.DataLoader(x_test, y_test, batch_size=1000, device=device,
                                  normalize=normalize)
    epochs_done = 0

    def train_epoch():
        nonlocal epochs_done
        record = fit(model, loader, optimizer, cross_entropy, epochs_done + 1,
                     start_epoch=epochs_done, progress=False, verbose=False,
                     capture=capture)[-1]
        epochs_done += 1
        return record["seconds"]

    def test_accuracy():
        return evaluate(model, test_loader)

    return optimizer, loader, train_epoch, test_accuracy


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

def torch_step(model, optimizer, x_train, y_train, cuda_graph):
    """PyTorch's training step (cross-entropy, backward, ``optimizer.step()``) on a batch of
    tensors: eager, or with ``cuda_graph`` each full batch's step replayed as one CUDA graph
    (torch's recipe: warm-up steps on a side stream, capture, copies into static inputs;
    the optimizer made with ``capturable=True``); a short last batch runs eagerly."""
    import torch

    def eager_step(inputs, labels):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()

    if not cuda_graph:
        return eager_step
    static_x = x_train[:BATCH_SIZE].clone()
    static_y = y_train[:BATCH_SIZE].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up steps off the default stream, as torch asks
        for _ in range(3):
            eager_step(static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        loss = torch.nn.functional.cross_entropy(model(static_x), static_y)
        loss.backward()
        optimizer.step()

    def graph_step(inputs, labels):
        if len(inputs) != BATCH_SIZE:
            return eager_step(inputs, labels)
        static_x.copy_(inputs)
        static_y.copy_(labels)
        graph.replay()
    return graph_step


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
    epochs_done = 0

    step = torch_step(model, optimizer, x_train_t, y_train_t, cuda_graph)

    def synchronize():
        if torch_device == "cuda":
            torch.cuda.synchronize()

    def train_epoch():
        nonlocal epochs_done
        order = torch.from_numpy(order_of_epoch(epochs_done)).to(torch_device)
        epochs_done += 1
        synchronize()
        start = time.perf_counter()
        for first in range(0, len(order), BATCH_SIZE):
            rows = order[first:first + BATCH_SIZE]
            step(x_train_t[rows], y_train_t[rows])
        synchronize()
        return time.perf_counter() - start

    def test_accuracy():
        with torch.no_grad():
            predicted = model(x_test_t).argmax(dim=1).cpu().numpy()
        return float(np.mean(predicted == y_test))

    return train_epoch, test_accuracy, torch.__version__


def _torch_usable(device):
    """PyTorch is installed and, for ``cuda``, built with CUDA and seeing a GPU."""
    if importlib.util.find_spec("torch") is None:
        return False
    if device != "cuda":
        return True
    import torch
    return torch.cuda.is_available()


# ------------------------------------------------------------------ JIT compile time

class _Compiles:
    """The functions Numba compiles while it is installed (its ``numba:compile`` event, which
    a load from the cache does not raise): ``(name, seconds)`` of each outermost compile, the
    functions it compiles on the way counted in its time."""

    def __init__(self):
        from numba.core import event

        class Listener(event.Listener):
            def on_start(listener, ev):
                self.started.append(time.perf_counter())

            def on_end(listener, ev):
                seconds = time.perf_counter() - self.started.pop()
                if not self.started:
                    dispatcher = (ev.data or {}).get("dispatcher")
                    name = getattr(getattr(dispatcher, "py_func", None), "__qualname__",
                                   None) or repr(dispatcher)
                    self.compiles.append((name.replace("<locals>.", ""), seconds))

        self.started, self.compiles, self.listener = [], [], Listener()
        self.event = event

    def __enter__(self):
        self.event.register("numba:compile", self.listener)
        return self.compiles

    def __exit__(self, *exc):
        self.event.unregister("numba:compile", self.listener)


def time_first_steps(device, model, process_start):
    """Run in a subprocess: seconds to import the engine and build a model and loader, and to
    run each of the first two training steps (the first compiles every kernel it needs, or
    loads it from Numba's cache or the shipped kernels), and what the first step compiled
    (``_Compiles``). ``model``: ``"mlp:256,128"`` (the hidden widths) or ``"cnn"``
    (``engine.models.build_cnn``)."""
    import engine
    import data
    import optim
    from engine.losses import cross_entropy
    from engine.models import build_cnn, build_mlp

    engine.manual_seed(0)
    images = np.random.default_rng(0).integers(0, 256, (2 * BATCH_SIZE, 28, 28), dtype=np.uint8)
    labels = np.arange(2 * BATCH_SIZE) % 10
    kind, _, widths = model.partition(":")
    network = (build_cnn(images.shape[1:], 10) if kind == "cnn" else
               build_mlp(images.shape[1:], tuple(map(int, widths.split(","))), 10))
    network = network.to(device)
    optimizer = optim.Adam(network.parameters(), lr=LEARNING_RATE)
    loader = data.DataLoader(images, labels, batch_size=BATCH_SIZE, shuffle=True, seed=0,
                             device=device, normalize=(0.13, 0.31))
    step_seconds, step_cpu_seconds = [], []
    batches = iter(loader)
    for step in range(2):
        with _Compiles() as compiles:
            start, cpu_start = time.perf_counter(), time.process_time()
            inputs, targets = next(batches)
            optimizer.zero_grad()
            loss = cross_entropy(network(inputs), targets)
            loss.backward()
            optimizer.step()
            loss.item()   # waits for the GPU
            step_seconds.append(time.perf_counter() - start)
            step_cpu_seconds.append(time.process_time() - cpu_start)
        if step == 0:
            first_compiles = sorted(compiles, key=lambda compiled: -compiled[1])
    return {"import_and_setup_s": time.perf_counter() - process_start - sum(step_seconds),
            "first_step_s": step_seconds[0], "second_step_s": step_seconds[1],
            "first_step_cpu_s": step_cpu_seconds[0], "first_step_compiles": first_compiles}


# each a fresh process; the cold ones with an empty NUMBA_CACHE_DIR, the warm one with the
# cache the cold one filled; on CUDA a second cold run without the shipped kernels
# (ENGINE_SHIPPED_KERNELS=0), which compiles every kernel as a fresh install without them did
FIRST_STEP_RUNS = {"cpu": (("cold", "1"), ("warm", "1")),
                   "cuda": (("cold", "1"), ("warm", "1"), ("cold, no shipped kernels", "0"))}


def compile_times(device, model):
    """``{"cold": ..., "warm": ..., ...}``: first-step timings (``time_first_steps``) of
    ``model`` in fresh processes, as ``FIRST_STEP_RUNS`` lists them, and how long each whole
    process took."""
    code = ("import time; start = time.perf_counter(); import json, sys; "
            "from bench.mlp import time_first_steps; "
            "print(json.dumps(time_first_steps(sys.argv[1], sys.argv[2], start)))")
    results = {}
    with tempfile.TemporaryDirectory(prefix="numba-cache-") as root:
        for label, shipped in FIRST_STEP_RUNS[device]:
            # the warm run reuses the first cold run's cache; every other run starts empty
            cache = os.path.join(root, "cold" if label == "warm" else label.replace(" ", "_"))
            environment = {**os.environ, "NUMBA_CACHE_DIR": cache,
                           "ENGINE_SHIPPED_KERNELS": shipped}
            started = time.perf_counter()
            child = subprocess.run([sys.executable, "-c", code, device, model],
                                   cwd=REPO_ROOT, env=environment, capture_output=True, text=True)
            if child.returncode != 0:
                raise RuntimeError(f"bench: the {label}-cache first-step subprocess failed:\n"
                                   f"{child.stderr}")
            results[label] = {**json.loads(child.stdout.strip().splitlines()[-1]),
                              "process_s": time.perf_counter() - started}
    return results


def format_first_steps(jit):
    """The lines of ``compile_times``' result, one per run, and what a run's first step
    compiled (the costliest first)."""
    lines = []
    for label, row in jit.items():
        lines.append(f"first step, {label} cache: {row['first_step_s']:.2f} s (process CPU "
                     f"time {row['first_step_cpu_s']:.2f} s; second "
                     f"{1000 * row['second_step_s']:.1f} ms), import and setup "
                     f"{row['import_and_setup_s']:.2f} s, whole process {row['process_s']:.1f} s")
        compiles = row["first_step_compiles"]
        if compiles:
            lines.append(f"  functions Numba compiled in that first step: {len(compiles)}, "
                         f"{sum(seconds for _, seconds in compiles):.2f} s: " +
                         ", ".join(f"{name} {seconds:.2f}" for name, seconds in compiles))
    return lines


# ------------------------------------------------------------------ the run

def machine_description(device):
    if device == "cuda":
        from ops.cuda import cuda
        name = getattr(cuda.get_current_device(), "name", "Numba's CUDA simulator")
        return name.decode() if isinstance(name, bytes) else str(name)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next(line.split(":", 1)[1].strip() for line in cpuinfo
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} CPU cores"


def busy_neighbour():
    """A process that keeps one core busy (a pure-Python loop) until it is killed."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def alternating_epochs(frameworks, epochs):
    seconds = {name: [] for name in frameworks}
    for _ in range(epochs):   # A B A B: both see the same machine state
        for name, epoch in frameworks.items():
            seconds[name].append(epoch())
    return seconds


def beside_a_busy_neighbour(frameworks, epochs, engine_threads):
    """``alternating_epochs`` again, timed from the start of a busy process that is stopped
    at the end; also the engine's thread count while it ran (``engine_threads()``)."""
    neighbour = busy_neighbour()
    try:
        return alternating_epochs(frameworks, epochs), engine_threads()
    finally:
        neighbour.kill()
        neighbour.wait()


def busy_neighbour_line(result, rows, digits):
    """The table's line of the epochs beside a busy process (``--busy-neighbour``), s/epoch
    to ``digits`` decimals; None when the run had none."""
    if "loaded_s_per_epoch" not in rows["engine"]:
        return None
    return (f"beside a busy process (started and stopped by this run; engine threads "
            f"{result['engine_threads_loaded']}), s/epoch: " +
            ", ".join(f"{name} {row['loaded_s_per_epoch']:.{digits}f} "
                      f"({row['loaded_over_quiet']:.2f}x its quiet epoch)"
                      for name, row in rows.items()))


def timed_sides(sides, epochs, loaded):
    """The sides' epochs: one warm-up each, then ``epochs`` alternating rounds, and with
    ``loaded`` as many again beside a busy process. Returns ``(rows, threads,
    loaded_threads)``: per side its warm-up, epoch seconds and median (and the loaded ones),
    and the engine's thread count after the quiet and the loaded rounds."""
    frameworks = {name: functools.partial(side.call, "epoch") for name, side in sides.items()}
    engine_threads = functools.partial(sides["engine"].call, "threads")
    warmup = {name: epoch() for name, epoch in frameworks.items()}
    seconds = alternating_epochs(frameworks, epochs)   # A B C A B C: one machine state
    threads = engine_threads()
    loaded_seconds = loaded_threads = None
    if loaded:   # the same epochs again beside a busy process this run starts and stops
        loaded_seconds, loaded_threads = beside_a_busy_neighbour(frameworks, epochs,
                                                                 engine_threads)
    rows = {}
    for name in frameworks:
        median = statistics.median(seconds[name])
        rows[name] = {"s_per_epoch": median, "warmup_epoch_s": warmup[name],
                      "epoch_s": seconds[name]}
        if loaded_seconds is not None:
            loaded_median = statistics.median(loaded_seconds[name])
            rows[name].update(loaded_s_per_epoch=loaded_median,
                              loaded_epoch_s=loaded_seconds[name],
                              loaded_over_quiet=loaded_median / median)
    return rows, threads, loaded_threads


def close_sides(sides):
    for side in sides.values():
        side.close()


def _mnist(limit):
    from data.datasets import load_dataset, pixel_statistics
    (x_train, y_train), (x_test, y_test) = load_dataset("mnist", limit=limit)
    return x_train, y_train, x_test, y_test, pixel_statistics(x_train)


def engine_side(device, limit, hidden, capture, precision, orders):
    """``bench.framework_process``'s build of an engine row: its epochs, test accuracy,
    thread count and instrumented epoch; its info the data's sizes and the loader's
    permutations of the first ``orders`` epochs (the batches the other rows take)."""
    import engine
    set_for_engine(precision)
    x_train, y_train, x_test, y_test, normalize = _mnist(limit)
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
    x_train, y_train, x_test, y_test, normalize = _mnist(limit)
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
        if _torch_usable(device):
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

    steps = -(-sizes["train_samples"] // BATCH_SIZE)
    for name, row in rows.items():
        row.update(us_per_step=1e6 * row["s_per_epoch"] / steps,
                   samples_per_s=sizes["train_samples"] / row["s_per_epoch"],
                   test_acc=accuracies[name])
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


PROCESSES_NOTE = ", each row in a process of its own"


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
