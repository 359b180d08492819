"""Hybrid MNIST: a PyTorch conv feature extractor feeding an engine MLP head, trained end to
end with ONE optimizer.

    python -m bench.hybrid_mnist [--epochs 2] [--batch-size 64] [--lr 1e-3] [--limit N]
                                 [--json results.json]

The loss is torch's cross-entropy on the logits of the engine head. Its gradient reaches the
head as ``grad_output``, our tape carries it through the head's kernels, and the gradient of
the head's input goes back to torch for the conv layers: one chain rule across both
libraries. A single ``torch.optim.Adam`` owns every parameter; the engine head's are torch
views of its flat parameter buffer, updated in place.
"""
import argparse
import json
import time

import numpy as np
import torch

import data
import engine
from engine import nn
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
    y_train, y_test = torch.from_numpy(y_train.astype(np.int64)), torch.from_numpy(y_test.astype(np.int64))

    model = build_model(args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)   # conv AND engine head
    generator = torch.Generator().manual_seed(args.seed)
    setup = {"torch": torch.__version__, "threads": torch.get_num_threads(),
             "parameters": sum(p.numel() for p in model.parameters()),
             "train_images": len(x_train), "batch_size": args.batch_size, "lr": args.lr}
    print(f"torch {setup['torch']}, {setup['threads']} threads; {setup['parameters']} "
          f"parameters (torch conv + engine head), one torch.optim.Adam; "
          f"{setup['train_images']} training images\n")
    print("| epoch | train loss | test acc | seconds |")
    print("|---|---|---|---|")
    epochs = []
    for epoch in range(1, args.epochs + 1):
        start = time.perf_counter()
        loss = train_epoch(model, optimizer, x_train, y_train, args.batch_size, generator)
        seconds = time.perf_counter() - start
        row = {"epoch": epoch, "loss": loss, "test_acc": accuracy(model, x_test, y_test),
               "seconds": seconds}
        epochs.append(row)
        print(f"| {epoch} | {loss:.4f} | {row['test_acc']:.4f} | {seconds:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"setup": setup, "epochs": epochs}, file, indent=2)


if __name__ == "__main__":
    main()
