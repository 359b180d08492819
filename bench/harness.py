"""What the training benchmarks share (``bench.mlp``, ``bench.cnn``, ``bench.distributed``,
``bench.cpu_split``, and ``bench.gpt``'s recipe with ``bench.cpu_step``): the engine's side
of a training row (``engine.fit.fit`` with Adam), PyTorch's training step (eager or one CUDA
graph), the rows' epochs alternated round by round (and again beside a busy process), the
first training steps timed from a cold and a warm Numba cache in fresh processes, and the
machine's description. A benchmark imports this module, never another benchmark."""
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

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH_SIZE = 128
LEARNING_RATE = 1e-3
PROCESSES_NOTE = ", each row in a process of its own"   # the table's note on separate processes
# the character-level GPT's configurations (nanoGPT's CPU one and its shakespeare-char one)
# and optimizer (AdamW, weight decay on the matrices only, the gradient norm clipped)
GPT_PRESETS = {"cpu": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12,
                           dropout=0.0),
               "gpu": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64,
                           dropout=0.2)}
GPT_LR, GPT_BETAS, GPT_WEIGHT_DECAY, GPT_CLIP = 1e-3, (0.9, 0.99), 0.1, 1.0


def gpt_training(config, vocab, train_ids, device="cpu", seed=0):
    """``(model, optimizer, loader)`` of the GPT recipe: ``engine.models.build_gpt`` of
    ``config`` (one of ``GPT_PRESETS``) from ``engine.manual_seed(seed)``, AdamW with weight
    decay on the matrices only, and the windows of ``train_ids`` in batches."""
    import engine
    from engine import data, models, optim
    engine.manual_seed(seed)
    model = models.build_gpt(vocab, config["block_size"], config["n_layer"], config["n_head"],
                             config["n_embd"], config["dropout"], device=device)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    keep = [p for p in model.parameters() if p.ndim < 2]
    optimizer = optim.AdamW([{"params": decay, "weight_decay": GPT_WEIGHT_DECAY},
                             {"params": keep, "weight_decay": 0.0}], lr=GPT_LR,
                            betas=GPT_BETAS)
    loader = data.SequenceLoader(train_ids, config["block_size"], config["batch_size"],
                                 seed=seed, device=device)
    return model, optimizer, loader


def gpt_update(model, optimizer, parameters, inputs, targets):
    """One step of the GPT recipe on a batch (the gradient norm clipped at ``GPT_CLIP``): its
    loss."""
    from engine import models, optim
    optimizer.zero_grad()
    loss = models.gpt_loss(model(inputs), targets)
    loss.backward()
    optim.clip_grad_norm_(parameters, GPT_CLIP)
    optimizer.step()
    return loss


def gpt_corpus():
    """``(tokenizer, training ids, validation ids)``: the shipped Shakespeare, 90% to train."""
    from engine import data
    text = data.shakespeare.load()
    tok = data.CharTokenizer(text)
    ids = tok.encode(text)
    cut = int(0.9 * len(ids))
    return tok, ids[:cut], ids[cut:]


# ------------------------------------------------------------------ the rows

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


def torch_training(model, optimizer, x_train, y_train, torch_device, order_of_epoch,
                   cuda_graph):
    """PyTorch's side of a training row: ``train_epoch()`` trains one epoch (the next) over the
    batches of ``order_of_epoch(epoch)`` (the engine loader's permutation, so both frameworks
    see the same batches) through ``torch_step`` and returns its seconds, the GPU
    synchronised at both ends."""
    import torch
    model.train()   # the CUDA-graph step trains three warm-up steps when it is made
    step = torch_step(model, optimizer, x_train, y_train, cuda_graph)
    epochs_done = 0

    def synchronize():
        if torch_device == "cuda":
            torch.cuda.synchronize()

    def train_epoch():
        nonlocal epochs_done
        model.train()   # after an evaluation in eval mode
        order = torch.from_numpy(order_of_epoch(epochs_done)).to(torch_device)
        epochs_done += 1
        synchronize()
        start = time.perf_counter()
        for first in range(0, len(order), BATCH_SIZE):
            rows = order[first:first + BATCH_SIZE]
            step(x_train[rows], y_train[rows])
        synchronize()
        return time.perf_counter() - start

    return train_epoch


def torch_usable(device):
    """PyTorch is installed and, for ``cuda``, built with CUDA and seeing a GPU."""
    if importlib.util.find_spec("torch") is None:
        return False
    if device != "cuda":
        return True
    import torch
    return torch.cuda.is_available()


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


# How a row waits for the machine to go quiet before its epoch (``settle``)
SETTLE_LOOKS, SETTLE_LOOK_GAP_S, SETTLE_TIMEOUT_S = 3, 0.005, 1.0


def _runnable_threads():
    """Threads runnable on the machine now, this one included (Linux; None elsewhere)."""
    try:
        with open("/proc/stat") as stat:
            for line in stat:
                if line.startswith("procs_running"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def settle(timeout_s=SETTLE_TIMEOUT_S):
    """Wait (at most ``timeout_s``) until this thread is the only runnable one in
    ``SETTLE_LOOKS`` looks in a row: the row that has just ended its epoch leaves threads
    spinning before they sleep (PyTorch's OpenMP threads, the engine's split workers), and
    the next row found them as a busy neighbour: the engine's load-following thread count
    began 1 of 2 MLP epochs on one thread after PyTorch's (probe of bench.mlp, 5 December)."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while quiet < SETTLE_LOOKS and time.monotonic() < deadline:
        running = _runnable_threads()
        if running is None:
            return
        quiet = quiet + 1 if running <= 1 else 0
        time.sleep(SETTLE_LOOK_GAP_S)


def alternating_epochs(frameworks, epochs, quiet=True):
    """Each framework's epoch in turn, ``epochs`` rounds: their seconds. ``quiet``: each
    epoch starts on a settled machine (``settle``); False beside a busy process."""
    seconds = {name: [] for name in frameworks}
    for _ in range(epochs):   # A B A B: both see the same machine state
        for name, epoch in frameworks.items():
            if quiet:
                settle()
            seconds[name].append(epoch())
    return seconds


def beside_a_busy_neighbour(frameworks, epochs, engine_threads):
    """``alternating_epochs`` again, timed from the start of a busy process that is stopped
    at the end; also the engine's thread count while it ran (``engine_threads()``)."""
    neighbour = busy_neighbour()
    try:
        return alternating_epochs(frameworks, epochs, quiet=False), engine_threads()
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


def add_step_rates(rows, train_samples, accuracies, unit):
    """Each row's time per step (``unit`` "us" or "ms": the key ``us_per_step`` or
    ``ms_per_step``), samples per second and test accuracy, added to the row; returns the
    steps per epoch."""
    steps = -(-train_samples // BATCH_SIZE)
    scale = {"us": 1e6, "ms": 1e3}[unit]
    for name, row in rows.items():
        row.update({f"{unit}_per_step": scale * row["s_per_epoch"] / steps,
                    "samples_per_s": train_samples / row["s_per_epoch"],
                    "test_acc": accuracies[name]})
    return steps


def close_sides(sides):
    for side in sides.values():
        side.close()


def mnist_arrays(limit):
    """MNIST's first ``limit`` training and test images and labels (all for None), and the
    training images' pixel mean and standard deviation (the loaders' ``normalize``)."""
    from data.datasets import load_dataset, pixel_statistics
    (x_train, y_train), (x_test, y_test) = load_dataset("mnist", limit=limit)
    return x_train, y_train, x_test, y_test, pixel_statistics(x_train)


# ------------------------------------------------------------------ JIT compile time

class Compiles:
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
    (``Compiles``). ``model``: ``"mlp:256,128"`` (the hidden widths), ``"cnn"``
    (``engine.models.build_cnn``) or ``"gpt:cpu"`` / ``"gpt:gpu"`` (``gpt_training``'s
    model and its step captured, as ``python -m engine.train --model gpt`` runs it)."""
    import engine
    import data
    import optim
    from engine.losses import cross_entropy
    from engine.models import build_cnn, build_mlp

    if model.startswith("gpt:"):
        return _gpt_first_steps(device, GPT_PRESETS[model.partition(":")[2]], process_start)
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
    batches = iter(loader)

    def step(_):
        inputs, targets = next(batches)
        optimizer.zero_grad()
        loss = cross_entropy(network(inputs), targets)
        loss.backward()
        optimizer.step()
        loss.item()   # waits for the GPU

    return _two_steps_timed(step, process_start)


def _two_steps_timed(step, process_start):
    """``time_first_steps``' result: ``step(0)`` and ``step(1)`` timed, what the first
    compiled, and the process's time before them."""
    step_seconds, step_cpu_seconds = [], []
    for index in range(2):
        with Compiles() as compiles:
            start, cpu_start = time.perf_counter(), time.process_time()
            step(index)
            step_seconds.append(time.perf_counter() - start)
            step_cpu_seconds.append(time.process_time() - cpu_start)
        if index == 0:
            first_compiles = sorted(compiles, key=lambda compiled: -compiled[1])
    return {"import_and_setup_s": time.perf_counter() - process_start - sum(step_seconds),
            "first_step_s": step_seconds[0], "second_step_s": step_seconds[1],
            "first_step_cpu_s": step_cpu_seconds[0], "first_step_compiles": first_compiles}


def _gpt_first_steps(device, config, process_start):
    """``time_first_steps`` of the GPT recipe's captured step (``gpt_training``): the first
    call records the step (running it), the second replays it."""
    from engine.step_capture import capture

    tokenizer, train_ids, _ = gpt_corpus()
    model, optimizer, loader = gpt_training(config, tokenizer.vocab_size, train_ids, device)
    parameters = model.parameters()

    @capture
    def step(inputs, targets):
        return gpt_update(model, optimizer, parameters, inputs, targets)

    def batch_step(index):
        step(*loader.batch(index)).item()   # waits for the device

    return _two_steps_timed(batch_step, process_start)


# each a fresh process; the cold ones with an empty NUMBA_CACHE_DIR, the warm one with the
# cache the cold one filled; on CUDA a second cold run without the shipped kernels
# (ENGINE_SHIPPED_KERNELS=0), which compiles every kernel as a fresh install without them did
FIRST_STEP_RUNS = {"cpu": (("cold", "1"), ("warm", "1")),
                   "cuda": (("cold", "1"), ("warm", "1"), ("cold, no shipped kernels", "0"))}


def compile_times(device, model, runs=None):
    """``{"cold": ..., "warm": ..., ...}``: first-step timings (``time_first_steps``) of
    ``model`` in fresh processes, as ``runs`` (default ``FIRST_STEP_RUNS[device]``) lists
    them, and how long each whole process took."""
    code = ("import time; start = time.perf_counter(); import json, sys; "
            "from bench.harness import time_first_steps; "
            "print(json.dumps(time_first_steps(sys.argv[1], sys.argv[2], start)))")
    results = {}
    with tempfile.TemporaryDirectory(prefix="numba-cache-") as root:
        for label, shipped in runs or FIRST_STEP_RUNS[device]:
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
