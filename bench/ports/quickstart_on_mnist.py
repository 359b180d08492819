"""PyTorch's Quickstart port (``bench/ports/pytorch_quickstart.py``, the tutorial but for its
five imports) run on MNIST instead of Fashion-MNIST, for machines that have neither
Fashion-MNIST nor a network to download it: MNIST ships with the engine.

The program's text is run with one substitution, printed before it runs:
``datasets.FashionMNIST(`` becomes ``datasets.MNIST(`` (same format, same arguments; the
files come from ``data/MNIST/raw`` if there, else the shipped copy). ``--epochs N``
replaces the tutorial's ``epochs = 5``. Where Fashion-MNIST can be had,
``python -m bench.ports.pytorch_quickstart`` runs the port as it is.

    python -m bench.ports.quickstart_on_mnist [--epochs N]
"""
import argparse
import pathlib

PORT = pathlib.Path(__file__).with_name("pytorch_quickstart.py")
FASHION, MNIST = "datasets.FashionMNIST(", "datasets.MNIST("


def source_on_mnist(epochs=None):
    """The port's text with MNIST in place of Fashion-MNIST (and ``epochs`` when given)."""
    source = PORT.read_text()
    if source.count(FASHION) != 2 or "epochs = 5\n" not in source:
        raise ValueError(f"{PORT}: expected the tutorial's two {FASHION}...) lines and "
                         "`epochs = 5`; the port changed, update this runner")
    source = source.replace(FASHION, MNIST)
    return source if epochs is None else source.replace("epochs = 5\n", f"epochs = {epochs}\n")


def run(epochs=None, scope=None):
    """Run the port on MNIST in ``scope`` (a fresh module namespace by default); returns it."""
    scope = {"__name__": "__main__"} if scope is None else scope
    exec(compile(source_on_mnist(epochs), str(PORT), "exec"), scope)
    return scope


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=None, help="in place of the tutorial's 5")
    arguments = parser.parse_args()
    print(f"{PORT.name} with {FASHION}...) run as {MNIST}...)"
          + (f", epochs = {arguments.epochs}" if arguments.epochs else ""))
    run(arguments.epochs)
