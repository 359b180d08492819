"""Hybrid MNIST: a PyTorch conv feature extractor feeding an engine MLP head, trained end to
end with ONE optimizer; beside it the same CNN in the engine alone.

    python -m bench.hybrid_mnist [--epochs 2] [--batch-size 64] [--lr 1e-3] [--limit N]
                                 [--json results.json]

The loss is torch's cross-entropy on the logits of the engine head. Its gradient reaches the
head as ``grad_output``, our tape carries it through the head's kernels, and the gradient of
the head's input goes back to torch for the conv layers: one chain rule across both
libraries. A single ``torch.optim.Adam`` owns every parameter; the engine head's are torch
views of its flat parameter buffer, updated in place.

The pure-engine row trains the same network as ``engine.nn`` layers (Conv2D with its fused
relu, MaxPool2D, Dense) from the hybrid's initial weights, with ``optim.Adam`` on the same
batches in the same order (each epoch's permutation drawn from a generator of the same
seed), so the two rows differ only in who computes the convolutions.
"""
import argparse
import json
import time

import numpy as np
import torch

import data
import engine
import optim
from engine import nn
from engine.losses import cross_entropy
from engine.interop.torch import as_function

FEATURES = 16 * 7 * 7   # the conv extractor's output per image


def build_model(seed=0):
    """conv(8) -> pool -> conv(16) -> pool in torch, Dense(128, relu) -> Dense(10) in the engine."""
    torch.manual_seed(seed)
    engine.manual_seed(seed)
    features = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, kernel_size=5, padding=2), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, kernel_size=5, padding=2), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten())
    head = nn.Sequential([nn.Dense(128, activation="relu", input_shape=(FEATURES,)),
                          nn.Dense(10)])
    return torch.nn.Sequential(features, as_function(head))


def build_engine_cnn(hybrid):
    """The hybrid's network in the engine alone, starting from the hybrid's weights."""
    model = nn.Sequential([
        nn.Reshape((1, 28, 28), input_shape=(1, 28, 28)),
        nn.Conv2D(8, 5, padding=2, activation="relu"), nn.MaxPool2D(2),
        nn.Conv2D(16, 5, padding=2, activation="relu"), nn.MaxPool2D(2),
        nn.Flatten(), nn.Dense(128, activation="relu"), nn.Dense(10)])
    features, head = hybrid[0], hybrid[1]
    state = {f"{name}.{entry}": features[index].state_dict()[entry].numpy()
             for name, index in (("conv2d", 0), ("conv2d_1", 3)) for entry in ("weight", "bias")}
    state.update(head.model.state_dict())
    model.load_state_dict(state)
    return model


def as_batches(images):
    """uint8 [N, 28, 28] -> float32 [N, 1, 28, 28] in [0, 1]."""
    return torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)


def train_epoch(model, optimizer, x, y, batch_size, generator):
    """One pass over (x, y) in a shuffled order; returns the mean training loss."""
    model.train()
    order = torch.randperm(len(x), generator=generator)
    total, seen = 0.0, 0
    for start in range(0, len(x), batch_size):
        index = order[start:start + batch_size]
        loss = torch.nn.functional.cross_entropy(model(x[index]), y[index])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += loss.item() * len(index)
        seen += len(index)
    return total / seen


def engine_train_epoch(model, optimizer, x, y, batch_size, generator):
    """``train_epoch`` for the pure-engine model (x, y: torch tensors, read as NumPy)."""
    model.train()
    order = torch.randperm(len(x), generator=generator).numpy()
    images, labels = x.numpy(), y.numpy()
    total, seen = 0.0, 0
    for start in range(0, len(images), batch_size):
        index = order[start:start + batch_size]
        optimizer.zero_grad()
        loss = cross_entropy(model(engine.tensor(images[index])), labels[index])
        loss.backward()
        optimizer.step()
        total += loss.item() * len(index)
        seen += len(index)
    return total / seen


def engine_accuracy(model, x, y, batch_size=1000):
    model.eval()
    images, labels = x.numpy(), y.numpy()
    correct = 0
    with engine.no_grad():
        for start in range(0, len(images), batch_size):
            logits = model(engine.tensor(images[start:start + batch_size])).numpy()
            correct += int((logits.argmax(axis=1) == labels[start:start + batch_size]).sum())
    return correct / len(images)


def accuracy(model, x, y, batch_size=1000):
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            logits = model(x[start:start + batch_size])
            correct += int((logits.argmax(dim=1) == y[start:start + batch_size]).sum())
    return correct / len(x)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.hybrid_mnist", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--limit", type=int, default=0,
                        help="train on the first N images only (0: all 60000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)

    (x_train, y_train), (x_test, y_test) = data.mnist.load()
    if args.limit:
        x_train, y_train = x_train[:args.limit], y_train[:args.limit]
    x_train, x_test = as_batches(x_train), as_batches(x_test)
    y_train, y_test = (torch.from_numpy(labels.astype(np.int64)) for labels in (y_train, y_test))

    model = build_model(args.seed)
    engine_model = build_engine_cnn(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)   # conv AND engine head
    engine_optimizer = optim.Adam(engine_model.parameters(), lr=args.lr)
    generators = [torch.Generator().manual_seed(args.seed) for _ in range(2)]
    setup = {"torch": torch.__version__, "threads": torch.get_num_threads(),
             "parameters": sum(p.numel() for p in model.parameters()),
             "train_images": len(x_train), "batch_size": args.batch_size, "lr": args.lr}
    print(f"torch {setup['torch']}, {setup['threads']} threads; {setup['parameters']} "
          f"parameters (torch conv + engine head), one torch.optim.Adam; the pure-engine CNN "
          f"from the same weights with optim.Adam; {setup['train_images']} training images\n")
    print("| model | epoch | train loss | test acc | seconds |")
    print("|---|---|---|---|---|")
    results = {"hybrid": [], "engine": []}
    runs = {"hybrid": (lambda: train_epoch(model, optimizer, x_train, y_train, args.batch_size,
                                           generators[0]),
                       lambda: accuracy(model, x_test, y_test)),
            "engine": (lambda: engine_train_epoch(engine_model, engine_optimizer, x_train,
                                                  y_train, args.batch_size, generators[1]),
                       lambda: engine_accuracy(engine_model, x_test, y_test))}
    labels = {"hybrid": "torch conv + engine head", "engine": "engine CNN"}
    for epoch in range(1, args.epochs + 1):
        for name, (train, test) in runs.items():   # alternating: both see the same machine
            start = time.perf_counter()
            loss = train()
            seconds = time.perf_counter() - start
            row = {"epoch": epoch, "loss": loss, "test_acc": test(), "seconds": seconds}
            results[name].append(row)
            print(f"| {labels[name]} | {epoch} | {loss:.4f} | {row['test_acc']:.4f} | "
                  f"{seconds:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"setup": setup, "epochs": results["hybrid"],
                       "engine_cnn_epochs": results["engine"]}, file, indent=2)
    return results


if __name__ == "__main__":
    main()
