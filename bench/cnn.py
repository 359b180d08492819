"""The CNN benchmark: the engine against PyTorch eager on the same network, data and batches.

    python -m bench.cnn --device cpu|cuda [--epochs 3] [--limit N] [--json results.json]

The network is ``python -m engine.train --model cnn``'s (``engine.train.build_cnn``, the one
of API.md's "Convolutional networks"): Conv2D 32 3x3 same relu, MaxPool2D 2, Conv2D 64 3x3
same relu, BatchNorm, AvgPool2D 2, Dense 128 relu, Dense 10, on MNIST standardised as by
the command, Adam (lr 1e-3), batch 128. PyTorch's copy starts from the engine model's
initial weights (conv layouts agree; Dense kernels are transposed into ``nn.Linear``) and
sees the same batches in the same order (the engine loader's permutation of each epoch).
After one warm-up epoch each, timed epochs alternate engine, engine eager, torch, ... so all
share the machine's state; s/epoch is the median. The engine epochs are
``engine.train.fit`` (captured step, and ``capture=False``), what users run. Test accuracy is
measured after the last epoch, in eval mode (BatchNorm on its running statistics).

Per-op times of the layers at these shapes are ``python -m bench.conv_ops``.
"""
import argparse
import statistics
import time

import numpy as np

from bench.mlp import (BATCH_SIZE, LEARNING_RATE, _torch_usable, engine_training,
                       machine_description)
from bench.report import emit, require_device


def _engine_run(x_train, y_train, x_test, y_test, normalize, device, capture=True):
    import engine
    from engine.train import build_cnn

    engine.manual_seed(0)
    model = build_cnn(x_train.shape[1:], 10).to(device)
    initial_state = model.state_dict()
    _, loader, train_epoch, test_accuracy = engine_training(
        model, x_train, y_train, x_test, y_test, normalize, device, capture)
    return train_epoch, test_accuracy, loader, initial_state


def _torch_run(x_train, y_train, x_test, y_test, normalize, device, order_of_epoch,
               initial_state):
    """PyTorch eager on the same network, starting from the engine's ``initial_state``."""
    import torch
    torch_device = "cuda" if device == "cuda" else "cpu"
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
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    epochs_done = 0

    def synchronize():
        if torch_device == "cuda":
            torch.cuda.synchronize()

    def train_epoch():
        nonlocal epochs_done
        model.train()
        order = torch.from_numpy(order_of_epoch(epochs_done)).to(torch_device)
        epochs_done += 1
        synchronize()
        start = time.perf_counter()
        for first in range(0, len(order), BATCH_SIZE):
            rows = order[first:first + BATCH_SIZE]
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x_train_t[rows]), y_train_t[rows])
            loss.backward()
            optimizer.step()
        synchronize()
        return time.perf_counter() - start

    def test_accuracy():
        model.eval()
        with torch.no_grad():
            predicted = torch.cat([model(x_test_t[first:first + 1000]).argmax(dim=1)
                                   for first in range(0, len(x_test_t), 1000)])
        return float(np.mean(predicted.cpu().numpy() == y_test))

    return train_epoch, test_accuracy, torch.__version__, torch.get_num_threads()


def run(device, epochs, limit, eager=True):
    import engine
    from engine.train import load_dataset, pixel_statistics
    (x_train, y_train), (x_test, y_test) = load_dataset("mnist", limit=limit)
    normalize = pixel_statistics(x_train)
    steps = -(-len(x_train) // BATCH_SIZE)

    engine_epoch, engine_accuracy, loader, initial_state = _engine_run(
        x_train, y_train, x_test, y_test, normalize, device)
    frameworks, accuracies = {"engine": engine_epoch}, {"engine": engine_accuracy}
    if eager:
        frameworks["engine eager"], accuracies["engine eager"], _, _ = _engine_run(
            x_train, y_train, x_test, y_test, normalize, device, capture=False)
    torch_version = torch_threads = None
    if _torch_usable(device):
        frameworks["torch"], accuracies["torch"], torch_version, torch_threads = _torch_run(
            x_train, y_train, x_test, y_test, normalize, device, loader.order, initial_state)
    warmup = {name: epoch() for name, epoch in frameworks.items()}
    seconds = {name: [] for name in frameworks}
    for _ in range(epochs):   # A B C A B C: all see the same machine state
        for name, epoch in frameworks.items():
            seconds[name].append(epoch())
    rows = {}
    for name in frameworks:
        median = statistics.median(seconds[name])
        rows[name] = {"s_per_epoch": median, "ms_per_step": 1e3 * median / steps,
                      "samples_per_s": len(x_train) / median, "warmup_epoch_s": warmup[name],
                      "epoch_s": seconds[name], "test_acc": accuracies[name]()}
    if torch_version:
        rows["torch"].update(version=torch_version, threads=torch_threads)
    return {"device": device, "machine": machine_description(device),
            "model": "conv32-maxpool-conv64-batchnorm-avgpool-dense128-10",
            "optimizer": f"Adam lr {LEARNING_RATE:g}", "batch_size": BATCH_SIZE,
            "train_samples": len(x_train), "test_samples": len(x_test),
            "steps_per_epoch": steps, "timed_epochs": epochs, "epochs_trained": epochs + 1,
            "engine_threads": engine.get_num_threads(), "results": rows,
            "engine_over_torch": (rows["engine"]["s_per_epoch"] / rows["torch"]["s_per_epoch"]
                                  if torch_version else None)}


def format_table(result):
    rows = result["results"]
    lines = [f"bench.cnn: CNN {result['model']}, {result['optimizer']}, batch "
             f"{result['batch_size']}, MNIST {result['train_samples']} samples "
             f"({result['steps_per_epoch']} steps/epoch), device {result['device']} "
             f"({result['machine']}); median of {result['timed_epochs']} epochs after 1 "
             f"warm-up, the rows alternating epoch by epoch; test accuracy on "
             f"{result['test_samples']} images after all {result['epochs_trained']} epochs", "",
             "| framework | s/epoch | ms/step | samples/s | test acc |",
             "|---|---:|---:|---:|---:|"]
    labels = {"engine": "engine, fit (captured step)", "engine eager": "engine, fit(capture=False)",
              "torch": "torch {version} eager ({threads} threads)"}
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
    args = parser.parse_args(argv)
    if args.epochs < 1 or (args.limit is not None and args.limit < 1):
        parser.error("--epochs and --limit must be positive")
    require_device(parser, args.device)
    result = run(args.device, args.epochs, args.limit, eager=not args.no_eager)
    return emit(result, format_table(result), args.json)


if __name__ == "__main__":
    main()
