"""PyTorch's Quickstart as ported in bench/ports/pytorch_quickstart.py (the tutorial but for its
five imports: its model class, torchvision-style Fashion-MNIST, SGD lr 1e-3,
CrossEntropyLoss), run short on MNIST as ``bench.ports.quickstart_on_mnist`` runs it here
(no Fashion-MNIST, no network): 320 samples, two epochs. The full run:
``python -m bench.ports.quickstart_on_mnist``."""
import re

import engine
from bench.ports import quickstart_on_mnist
from data import mnist


def test_the_quickstart_port_tracks_its_parameters_and_learns(monkeypatch, capsys):
    (x, y), _ = mnist.load()
    monkeypatch.setattr(mnist, "load", lambda: ((x[:320], y[:320]), (x[:320], y[:320])))
    engine.manual_seed(0)
    scope = quickstart_on_mnist.run(epochs=2, scope={"__name__": "quickstart_port"})
    assert len(scope["training_data"]) == 320 and type(scope["test_data"]).__name__ == "MNIST"
    model = scope["model"]
    assert [name for name, _ in model.named_parameters()] == [
        f"linear_relu_stack.{layer}.{kind}" for layer in ("linear", "linear_1", "linear_2")
        for kind in ("weight", "bias")]
    assert sum(p.size for p in model.parameters()) == 784 * 512 + 512 + 512 * 512 + 512 + 5130
    losses = [float(v) for v in re.findall(r"Avg loss: ([0-9.]+)", capsys.readouterr().out)]
    assert len(losses) == 2 and losses[1] < losses[0]


def test_the_port_reads_fashion_mnist_as_the_tutorial_does():
    port = quickstart_on_mnist.PORT.read_text()
    assert port.count('datasets.FashionMNIST(root="data", train=') == 2
    assert quickstart_on_mnist.source_on_mnist().count("datasets.MNIST(") == 2


def test_beside_torch_times_the_port_s_and_the_reference_s_training_epochs(monkeypatch, capsys):
    import pytest
    pytest.importorskip("torch")
    (x, y), _ = mnist.load()
    monkeypatch.setattr(mnist, "load", lambda: ((x[:320], y[:320]), (x[:320], y[:320])))
    for program in ("port", "torch"):   # each side as its process builds it, here
        methods, _ = quickstart_on_mnist.training_side(program)
        assert methods["steps"]() == 5   # 320 samples in batches of 64
        assert methods["epoch"]() > 0
    assert capsys.readouterr().out == ""   # the programs' prints silenced
    quickstart_on_mnist.report_beside_torch({"port": [2.0, 1.0, 3.0], "torch": [4.0, 5.0, 3.0]},
                                            938)
    report = capsys.readouterr().out
    assert "port (the engine): 2.000 s/epoch, 2.13 ms/step" in report
    assert "port / torch: 0.50x" in report
