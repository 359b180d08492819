"""PyTorch's Quickstart port (``bench/ports/pytorch_quickstart.py``, the tutorial but for its
five imports) run on MNIST instead of Fashion-MNIST, for machines that have neither
Fashion-MNIST nor a network to download it: MNIST ships with the engine.

The program's text is run with one substitution, printed before it runs:
``datasets.FashionMNIST(`` becomes ``datasets.MNIST(`` (same format, same arguments; the
files come from ``data/MNIST/raw`` if there, else the shipped copy). ``--epochs N``
replaces the tutorial's ``epochs = 5``. Where Fashion-MNIST can be had,
``python -m bench.ports.pytorch_quickstart`` runs the port as it is.

``--beside-torch`` times the port's training epochs (its ``train``) against the same loop
in PyTorch (``pytorch_quickstart_torch.py``, the reference), each program in a process of
its own as a user runs it, their epochs alternating after one warm-up each, the prints
silenced on both sides; it prints the median seconds per epoch and per step.

    python -m bench.ports.quickstart_on_mnist [--epochs N] [--beside-torch]
"""
import argparse
import contextlib
import functools
import io
import os
import pathlib
import statistics
import time

from bench.framework_process import open_side
from bench.harness import alternating_epochs, machine_description

PORT = pathlib.Path(__file__).with_name("pytorch_quickstart.py")
TORCH_REFERENCE = pathlib.Path(__file__).with_name("pytorch_quickstart_torch.py")
FASHION, MNIST = "datasets.FashionMNIST(", "datasets.MNIST("


def _with_epochs(source, path, epochs):
    """``source`` (the text of ``path``) with ``epochs = N`` for the tutorial's ``epochs = 5``
    (unchanged for None)."""
    if "epochs = 5\n" not in source:
        raise ValueError(f"{path}: expected the tutorial's `epochs = 5`; the program changed, "
                         "update this runner")
    return source if epochs is None else source.replace("epochs = 5\n", f"epochs = {epochs}\n")


def source_on_mnist(epochs=None):
    """The port's text with MNIST in place of Fashion-MNIST (and ``epochs`` when given)."""
    source = PORT.read_text()
    if source.count(FASHION) != 2:
        raise ValueError(f"{PORT}: expected the tutorial's two {FASHION}...) lines; the port "
                         "changed, update this runner")
    return _with_epochs(source.replace(FASHION, MNIST), PORT, epochs)


def run(epochs=None, scope=None):
    """Run the port on MNIST in ``scope`` (a fresh module namespace by default); returns it."""
    scope = {"__name__": "__main__"} if scope is None else scope
    exec(compile(source_on_mnist(epochs), str(PORT), "exec"), scope)
    return scope


def training_side(program):
    """``bench.framework_process``'s build of one program's training: its text run with
    ``epochs = 0`` (model, data, optimizer and ``train`` defined, nothing trained), then
    ``"epoch"`` runs its ``train`` once, silenced, and returns the seconds."""
    if program == "port":
        source, path = source_on_mnist(epochs=0), PORT
    else:
        source, path = _with_epochs(TORCH_REFERENCE.read_text(), TORCH_REFERENCE, 0), \
            TORCH_REFERENCE
    scope = {"__name__": "__main__"}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(source, str(path), "exec"), scope)

    def epoch():
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            scope["train"](scope["train_dataloader"], scope["model"], scope["loss_fn"],
                           scope["optimizer"])
        return time.perf_counter() - start

    return {"epoch": epoch, "steps": lambda: len(scope["train_dataloader"])}, None


def beside_torch(epochs):
    """The port's and PyTorch's training epochs, alternating: ``{side: [seconds]}``, the
    steps per epoch."""
    sides = {name: open_side(True, name, training_side, name) for name in ("port", "torch")}
    try:
        for side in sides.values():
            side.call("epoch")   # warm-up: compiles, caches, first allocations
        seconds = alternating_epochs({name: functools.partial(side.call, "epoch")
                                      for name, side in sides.items()}, epochs)
        return seconds, sides["port"].call("steps")
    finally:
        for side in sides.values():
            side.close()


def report_beside_torch(seconds, steps):
    port, torch = (statistics.median(seconds[name]) for name in ("port", "torch"))
    print(f"PyTorch's Quickstart on MNIST (784-512-512-10, SGD lr 1e-3, batches of 64, "
          f"{steps} steps an epoch), {machine_description('cpu')}; median of "
          f"{len(seconds['port'])} epochs alternating, each program in a process of its own, "
          f"1-minute load average at the end {os.getloadavg()[0]:.2f}")
    print(f"port (the engine): {port:.3f} s/epoch, {port / steps * 1e3:.2f} ms/step")
    print(f"torch reference:   {torch:.3f} s/epoch, {torch / steps * 1e3:.2f} ms/step")
    print(f"port / torch: {port / torch:.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=None,
                        help="in place of the tutorial's 5 (with --beside-torch: timed epochs, "
                             "default 3)")
    parser.add_argument("--beside-torch", action="store_true",
                        help="time the port's training epochs against PyTorch's")
    arguments = parser.parse_args()
    if arguments.beside_torch:
        report_beside_torch(*beside_torch(arguments.epochs or 3))
    else:
        print(f"{PORT.name} with {FASHION}...) run as {MNIST}...)"
              + (f", epochs = {arguments.epochs}" if arguments.epochs else ""))
        run(arguments.epochs)
