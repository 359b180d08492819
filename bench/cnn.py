"""The CNN benchmark: the engine against PyTorch eager on the same network, data and batches.

    python -m bench.cnn --device cpu|cuda [--epochs 3] [--limit N] [--json results.json]

The network is ``python -m engine.train --model cnn``'s (``engine.models.build_cnn``, the one
of API.md's "Convolutional networks"): Conv2D 32 3x3 same relu, MaxPool2D 2, Conv2D 64 3x3
same relu, BatchNorm, AvgPool2D 2, Dense 128 relu, Dense 10, on MNIST standardised as by
the command, Adam (lr 1e-3), batch 128. PyTorch's copy starts from the engine model's
initial weights (conv layouts agree; Dense kernels are transposed into ``nn.Linear``) and
sees the same batches in the same order (the engine loader's permutation of each epoch).
After one warm-up epoch each, timed epochs alternate engine, engine eager, torch, ... so all
share the machine's state; s/epoch is the median. On the CPU each row trains in a process of
its own (``bench.framework_process``), as a user runs one framework; on CUDA all rows share
this process. The engine epochs are
``engine.fit.fit`` (captured step, and ``capture=False``), what users run. Test accuracy is
measured after the last epoch, in eval mode (BatchNorm on its running statistics).

On CUDA a row runs PyTorch's step as one CUDA graph (``torch.cuda.graph``, as bench.mlp's).
Where jax is importable (``pip install -e '.[bench]'``; on a GPU ``jax[cuda12]``) two rows run
the same network, weights and batches in JAX, fp32 ("highest" precision): the step under
``jit``, and each epoch's full batches as one ``lax.scan`` under ``jit``.

Also measured: the first training steps' times in fresh processes, from a cold Numba cache
and a warm one (on CUDA also cold without the shipped kernels), as bench.mlp measures them.

Per-op times of the layers at these shapes are ``python -m bench.conv_ops``.
"""
import argparse
import importlib.util
import os
import time

import numpy as np

from bench.framework_process import open_side
from bench.harness import (BATCH_SIZE, LEARNING_RATE, PROCESSES_NOTE, add_step_rates,
                           busy_neighbour_line, close_sides, compile_times, engine_training,
                           format_first_steps, machine_description, mnist_arrays, timed_sides,
                           torch_training, torch_usable)
from bench.precision import add_option, set_for_engine, set_for_torch
from ops.matmul_precision import get_float32_matmul_precision
from bench.report import emit, require_device


def _engine_run(x_train, y_train, x_test, y_test, normalize, device, capture=True):
    import engine
    from engine.models import build_cnn

    engine.manual_seed(0)
    model = build_cnn(x_train.shape[1:], 10).to(device)
    initial_state = model.state_dict()
    _, loader, train_epoch, test_accuracy = engine_training(
        model, x_train, y_train, x_test, y_test, normalize, device, capture)
    return train_epoch, test_accuracy, loader, initial_state


def _torch_run(x_train, y_train, x_test, y_test, normalize, device, order_of_epoch,
               initial_state, cuda_graph=False):
    """PyTorch on the same network, starting from the engine's ``initial_state``: eager, or
    (``cuda_graph``, CUDA only) each full batch's step replayed as one CUDA graph
    (``torch.cuda.graph``, Adam with ``capturable=True``, as bench.mlp's); the last partial
    batch runs eagerly."""
    import torch
    torch_device = "cuda" if device == "cuda" else "cpu"
    set_for_torch(torch)   # the engine's matmul precision ("highest": fp32, as JAX's rows)
    mean, std = normalize

    def standardised(images):
        scaled = (images.astype(np.float32) / 255 - np.float32(mean)) / np.float32(std)
        return torch.from_numpy(scaled[:, None]).to(torch_device)

    x_train_t, x_test_t = standardised(x_train), standardised(x_test)
    y_train_t = torch.from_numpy(y_train.astype(np.int64)).to(torch_device)
    nn = torch.nn
    model = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding="same"), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding="same"), nn.ReLU(), nn.BatchNorm2d(64), nn.AvgPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))
    ours = {"0": "conv2d", "3": "conv2d_1", "5": "batchnorm", "8": "dense", "10": "dense_1"}
    state = {}
    for name, value in model.state_dict().items():
        layer, _, entry = name.partition(".")
        if entry == "num_batches_tracked":
            state[name] = value
            continue
        array = initial_state[f"{ours[layer]}.{entry}"]
        state[name] = torch.from_numpy(np.ascontiguousarray(
            array.T if isinstance(model[int(layer)], nn.Linear) and entry == "weight"
            else array))
    model.load_state_dict(state)
    model.to(torch_device)
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE, capturable=cuda_graph)
    train_epoch = torch_training(model, optimizer, x_train_t, y_train_t, torch_device,
                                 order_of_epoch, cuda_graph)

    def test_accuracy():
        model.eval()
        with torch.no_grad():
            predicted = torch.cat([model(x_test_t[first:first + 1000]).argmax(dim=1)
                                   for first in range(0, len(x_test_t), 1000)])
        return float(np.mean(predicted.cpu().numpy() == y_test))

    return train_epoch, test_accuracy, torch.__version__, torch.get_num_threads()



def _jax_usable(device):
    """JAX is installed and, for ``cuda``, sees a GPU."""
    if importlib.util.find_spec("jax") is None:
        return False
    import jax
    if device == "cpu":
        return True
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:   # a CPU-only jaxlib
        return False


def _jax_run(x_train, y_train, x_test, y_test, normalize, device, order_of_epoch,
             initial_state, scan=False):
    """JAX on the same network, initial weights and batches, in fp32 (matmul and conv
    precision "highest"): the Adam step (torch's formula, BatchNorm's running statistics as
    torch updates them) under ``jit``, or (``scan``) each epoch's full batches as one
    ``lax.scan`` under ``jit``; the last partial batch runs through the jitted step."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    jax.config.update("jax_default_matmul_precision", "highest")
    target = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    mean, std = normalize

    def put(array):
        return jax.device_put(array, target)

    def standardised(images):
        return put(((images.astype(np.float32) / 255 - np.float32(mean)) / np.float32(std))
                   [:, None])

    x_train_j, x_test_j = standardised(x_train), standardised(x_test)
    y_train_j = put(y_train.astype(np.int32))
    params = {name: put(np.asarray(value)) for name, value in initial_state.items()
              if "running" not in name}
    running = {name: put(np.asarray(value)) for name, value in initial_state.items()
                   if "running" in name}
    momentum, eps, (beta1, beta2), adam_eps = 0.1, 1e-5, (0.9, 0.999), 1e-8

    def conv_relu(x, p, layer):
        y = lax.conv_general_dilated(x, p[layer + ".weight"], (1, 1), "SAME",
                                     dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                     precision=lax.Precision.HIGHEST)
        return jax.nn.relu(y + p[layer + ".bias"][None, :, None, None])

    def channels(vector):
        return vector[None, :, None, None]

    def forward(p, stats, x, training):
        y = conv_relu(x, p, "conv2d")
        y = lax.reduce_window(y, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
        y = conv_relu(y, p, "conv2d_1")
        if training:
            batch_mean, batch_var = y.mean(axis=(0, 2, 3)), y.var(axis=(0, 2, 3))
            count = y.size // y.shape[1]
            stats = {"batchnorm.running_mean": (1 - momentum) * stats["batchnorm.running_mean"]
                     + momentum * batch_mean,
                     "batchnorm.running_var": (1 - momentum) * stats["batchnorm.running_var"]
                     + momentum * batch_var * count / (count - 1)}
        else:
            batch_mean, batch_var = (stats["batchnorm.running_mean"],
                                     stats["batchnorm.running_var"])
        y = ((y - channels(batch_mean)) * channels(lax.rsqrt(batch_var + eps))
             * channels(p["batchnorm.weight"]) + channels(p["batchnorm.bias"]))
        y = lax.reduce_window(y, 0.0, lax.add, (1, 1, 2, 2), (1, 1, 2, 2), "VALID") / 4
        y = y.reshape(y.shape[0], -1)
        y = jax.nn.relu(jnp.dot(y, p["dense.weight"], precision=lax.Precision.HIGHEST)
                        + p["dense.bias"])
        logits = jnp.dot(y, p["dense_1.weight"], precision=lax.Precision.HIGHEST)
        return logits + p["dense_1.bias"], stats

    def loss_of(p, stats, x, labels):
        logits, stats = forward(p, stats, x, True)
        picked = jnp.take_along_axis(logits, labels[:, None], axis=1)[:, 0]
        return (jax.nn.logsumexp(logits, axis=1) - picked).mean(), stats

    def step(state, x, labels):
        p, stats, m, v, t = state
        (_, stats), grads = jax.value_and_grad(loss_of, has_aux=True)(p, stats, x, labels)
        t = t + 1
        m = jax.tree_util.tree_map(lambda m_, g: beta1 * m_ + (1 - beta1) * g, m, grads)
        v = jax.tree_util.tree_map(lambda v_, g: beta2 * v_ + (1 - beta2) * g * g, v, grads)
        first, second = 1 - beta1 ** t, 1 - beta2 ** t
        p = jax.tree_util.tree_map(
            lambda p_, m_, v_: p_ - LEARNING_RATE * (m_ / first)
            / (jnp.sqrt(v_ / second) + adam_eps), p, m, v)
        return p, stats, m, v, t

    jit_step = jax.jit(lambda state, rows, x, y: step(state, x[rows], y[rows]))

    @jax.jit
    def epoch_scan(state, batches, x, y):
        return lax.scan(lambda carry, rows: (step(carry, x[rows], y[rows]), None), state,
                        batches)[0]

    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    state = (params, running, zeros, zeros, jnp.float32(0))
    epochs_done = 0

    def train_epoch():
        nonlocal state, epochs_done
        order = order_of_epoch(epochs_done).astype(np.int32)
        epochs_done += 1
        full = len(order) // BATCH_SIZE
        batches = put(order[:full * BATCH_SIZE].reshape(full, BATCH_SIZE))
        rest = put(order[full * BATCH_SIZE:])
        jax.block_until_ready(state)
        start = time.perf_counter()
        if scan:
            state = epoch_scan(state, batches, x_train_j, y_train_j)
        else:
            for rows in batches:
                state = jit_step(state, rows, x_train_j, y_train_j)
        if len(rest):
            state = jit_step(state, rest, x_train_j, y_train_j)
        jax.block_until_ready(state)
        return time.perf_counter() - start

    evaluate = jax.jit(lambda p, stats, x: forward(p, stats, x, False)[0].argmax(axis=1))

    def test_accuracy():
        predicted = np.concatenate([np.asarray(evaluate(state[0], state[1],
                                                        x_test_j[first:first + 1000]))
                                    for first in range(0, len(y_test), 1000)])
        return float(np.mean(predicted == y_test))

    return train_epoch, test_accuracy, jax.__version__

def engine_side(device, limit, capture, precision, orders):
    """``bench.framework_process``'s build of an engine row: its epochs, test accuracy and
    thread count; its info the data's sizes, the model's initial weights and the loader's
    permutations of the first ``orders`` epochs (what the other rows start from and take)."""
    import engine
    set_for_engine(precision)
    x_train, y_train, x_test, y_test, normalize = mnist_arrays(limit)
    train_epoch, test_accuracy, loader, initial_state = _engine_run(
        x_train, y_train, x_test, y_test, normalize, device, capture)
    return ({"epoch": train_epoch, "test_accuracy": test_accuracy,
             "threads": engine.get_num_threads},
            {"train_samples": len(x_train), "test_samples": len(x_test),
             "initial_state": initial_state,
             "orders": [loader.order(epoch) for epoch in range(orders)]})


def torch_side(device, limit, cuda_graph, precision, orders, initial_state):
    """``bench.framework_process``'s build of a PyTorch row from the engine's
    ``initial_state``, on the batches of ``orders`` (one permutation per epoch)."""
    set_for_engine(precision)   # set_for_torch reads the engine's setting
    x_train, y_train, x_test, y_test, normalize = mnist_arrays(limit)
    train_epoch, test_accuracy, version, threads = _torch_run(
        x_train, y_train, x_test, y_test, normalize, device, orders.__getitem__,
        initial_state, cuda_graph=cuda_graph)
    return ({"epoch": train_epoch, "test_accuracy": test_accuracy},
            {"version": version, "threads": threads})


def jax_side(device, limit, scan, orders, initial_state):
    """``bench.framework_process``'s build of a JAX row (fp32)."""
    x_train, y_train, x_test, y_test, normalize = mnist_arrays(limit)
    train_epoch, test_accuracy, version = _jax_run(
        x_train, y_train, x_test, y_test, normalize, device, orders.__getitem__,
        initial_state, scan=scan)
    return {"epoch": train_epoch, "test_accuracy": test_accuracy}, {"version": version}


def run(device, epochs, limit, eager=True, loaded=False):
    separate = device == "cpu"   # each row's thread pools alone on the cores
    precision = get_float32_matmul_precision()
    epochs_trained = 1 + epochs * (2 if loaded else 1)   # the warm-up, the loaded ones
    sides = {"engine": open_side(separate, "engine", engine_side, device, limit, True,
                                 precision, epochs_trained)}
    try:
        if eager:
            sides["engine eager"] = open_side(separate, "engine eager", engine_side, device,
                                              limit, False, precision, 0)
        built = sides["engine"].info
        state, orders = built["initial_state"], built["orders"]
        if torch_usable(device):
            for name, cuda_graph in (("torch", False), ("torch graph", True)):
                if cuda_graph and device != "cuda":
                    continue
                sides[name] = open_side(separate, name, torch_side, device, limit, cuda_graph,
                                        precision, orders, state)
        if _jax_usable(device) and precision == "highest":   # fp32 rows
            for name, scan in (("jax", False), ("jax scan", True)):
                sides[name] = open_side(separate, name, jax_side, device, limit, scan, orders,
                                        state)
        rows, threads, loaded_threads = timed_sides(sides, epochs, loaded)
        accuracies = {name: side.call("test_accuracy") for name, side in sides.items()}
        info = {name: side.info for name, side in sides.items()}
    finally:
        close_sides(sides)

    steps = add_step_rates(rows, built["train_samples"], accuracies, "ms")
    for name, row in rows.items():
        if name.startswith("torch"):
            row.update(version=info[name]["version"], threads=info[name]["threads"])
        elif name.startswith("jax"):
            row.update(version=info[name]["version"])
    return {"device": device, "machine": machine_description(device),
            "model": "conv32-maxpool-conv64-batchnorm-avgpool-dense128-10",
            "optimizer": f"Adam lr {LEARNING_RATE:g}", "batch_size": BATCH_SIZE,
            "train_samples": built["train_samples"], "test_samples": built["test_samples"],
            "steps_per_epoch": steps, "timed_epochs": epochs, "epochs_trained": epochs_trained,
            "separate_processes": separate,
            "engine_threads": threads, "engine_threads_loaded": loaded_threads,
            "matmul_precision": precision,
            "load_average": os.getloadavg(), "results": rows,
            "engine_over_torch": (rows["engine"]["s_per_epoch"] / rows["torch"]["s_per_epoch"]
                                  if "torch" in rows else None)}


def format_table(result):
    rows = result["results"]
    lines = [f"bench.cnn: CNN {result['model']}, {result['optimizer']}, batch "
             f"{result['batch_size']}, MNIST {result['train_samples']} samples "
             f"({result['steps_per_epoch']} steps/epoch), device {result['device']} "
             f"({result['machine']}); median of {result['timed_epochs']} epochs after 1 "
             f"warm-up, the rows alternating epoch by epoch"
             f"{PROCESSES_NOTE if result.get('separate_processes') else ''}; float32 matmul "
             f"precision "
             f"{result.get('matmul_precision', 'highest')!r} (engine and torch); test accuracy on "
             f"{result['test_samples']} images after all {result['epochs_trained']} epochs", "",
             "| framework | s/epoch | ms/step | samples/s | test acc |",
             "|---|---:|---:|---:|---:|"]
    labels = {"engine": "engine, fit (captured step)", "engine eager": "engine, fit(capture=False)",
              "torch": "torch {version} eager ({threads} threads)",
              "torch graph": "torch {version}, the step as a CUDA graph",
              "jax": "JAX {version}, the step under jit (fp32)",
              "jax scan": "JAX {version}, the epoch as one lax.scan under jit (fp32)"}
    for name, row in rows.items():
        label = labels[name].format(version=row.get("version"), threads=row.get("threads"))
        lines.append(f"| {label} | {row['s_per_epoch']:.2f} | {row['ms_per_step']:.1f} | "
                     f"{row['samples_per_s']:.0f} | {100 * row['test_acc']:.2f}% |")
    if result["engine_over_torch"] is not None:
        ratio = f"engine / torch eager s/epoch: {result['engine_over_torch']:.2f}x captured"
        if "engine eager" in rows:
            eager = rows["engine eager"]["s_per_epoch"] / rows["torch"]["s_per_epoch"]
            ratio += f", {eager:.2f}x eager"
        lines += ["", ratio]
    loaded = busy_neighbour_line(result, rows, 2)
    if loaded is not None:
        lines.append(loaded)
    lines.append(f"engine threads {result['engine_threads']}, 1-minute load average at the "
                 f"end {result['load_average'][0]:.2f}")
    if "jit" in result:
        lines += [""] + format_first_steps(result["jit"])
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.cnn",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per framework")
    parser.add_argument("--limit", type=int, help="first N training/test samples (smoke tests)")
    parser.add_argument("--no-eager", action="store_true",
                        help="leave out the engine's fit(capture=False) row")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--busy-neighbour", action="store_true",
                        help="time the epochs again beside a busy process (one core) that the "
                             "run starts and stops")
    parser.add_argument("--no-compile-time", action="store_true",
                        help="skip the cold/warm first-step subprocesses")
    add_option(parser)
    args = parser.parse_args(argv)
    if args.epochs < 1 or (args.limit is not None and args.limit < 1):
        parser.error("--epochs and --limit must be positive")
    require_device(parser, args.device)
    set_for_engine(args.matmul_precision)
    result = run(args.device, args.epochs, args.limit, eager=not args.no_eager,
                 loaded=args.busy_neighbour)
    if not args.no_compile_time:   # bench.mlp's first-step runs, each in a fresh process
        result["jit"] = compile_times(args.device, "cnn")
    return emit(result, format_table(result), args.json)


if __name__ == "__main__":
    main()
