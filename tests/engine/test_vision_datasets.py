"""engine.vision.datasets: torchvision's MNIST and FashionMNIST — samples, attributes, where
the files are looked for, download=True over a local HTTP server (this machine has no
network: the shipped MNIST files stand in for upstream's, with their own checksums), and the
DataLoader taking such a set whole with the batches the per-sample path gives."""
import shutil

import numpy as np
import pytest

import data
import engine
from engine.archive import TEMPORARY_SUFFIX
from engine.data import DataLoader
from engine.vision import datasets
from engine.vision.transforms import Compose, Normalize, ToTensor
from tests.support.http_folder import served_folder


@pytest.fixture(scope="module")
def mnist_test_split():
    return datasets.MNIST("no-such-root", train=False)


@pytest.fixture
def no_fashion_copy(monkeypatch, tmp_path):
    """Neither $ENGINE_FASHION_MNIST_DIR nor Debian's folder holds Fashion-MNIST."""
    monkeypatch.delenv(data.fashion_mnist.ENV_VAR, raising=False)
    monkeypatch.setattr(data.fashion_mnist, "DEBIAN_DIR", str(tmp_path / "no-debian-copy"))


@pytest.fixture
def served_mnist(tmp_path, monkeypatch):
    """The shipped MNIST .gz files over HTTP on 127.0.0.1: ``(base_url, requested paths)``."""
    folder = tmp_path / "served"
    shutil.copytree(data.mnist.PACKAGE_DIR, folder / "files")
    with served_folder(folder, monkeypatch) as served:
        yield served


def test_mnist_as_torchvision_gives_it(mnist_test_split):
    split = mnist_test_split
    (_, _), (x_test, y_test) = data.mnist.load()
    assert len(split) == 10000 and not split.train
    assert split.data.dtype == np.uint8 and split.data.shape == (10000, 28, 28)
    assert split.targets.dtype == np.int64 and np.array_equal(split.targets.numpy(), y_test)
    assert np.array_equal(split.data.numpy(), x_test)
    image, label = split[0]
    assert isinstance(image, np.ndarray) and np.array_equal(image, x_test[0])
    assert type(label) is int and label == 7
    assert split.classes[7] == "7 - seven" and split.class_to_idx["7 - seven"] == 7
    assert repr(split).splitlines() == ["Dataset MNIST", "    Number of datapoints: 10000",
                                        "    Root location: no-such-root", "    Split: Test"]
    train = datasets.MNIST("no-such-root", train=True, transform=ToTensor(),
                           target_transform=lambda y: y + 100)
    image, label = train[0]
    assert image.shape == (1, 28, 28) and image.dtype == np.float32 and label == 105
    assert np.array_equal(image.numpy()[0], train.data.numpy()[0] / np.float32(255))
    assert "Transform: ToTensor()" in repr(train)


@pytest.mark.parametrize("compressed", [True, False])
def test_torchvision_layout_wins_over_the_shipped_copy(tmp_path, compressed):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in data.mnist.FILES:
        shipped = data.mnist.PACKAGE_DIR / (name + ".gz")
        if compressed and name != data.mnist.TRAIN_LABELS and shipped.is_file():
            # the shipped gzip as it is: write_idx's level-9 gzip of the 47 MB of training
            # images took 20-25 s of the CPU phase
            shutil.copyfile(shipped, raw / (name + ".gz"))
            continue
        array = data.read_idx(shipped)
        if name == data.mnist.TRAIN_LABELS:
            array[0] = 3   # the shipped first label is 5: this copy is the one read
        data.write_idx(raw / (name + ".gz" if compressed else name), array)
    train = datasets.MNIST(tmp_path, train=True)
    assert int(train.targets[0]) == 3 and train.raw_folder == str(raw)


def test_missing_files_name_the_folder_and_the_remedy(tmp_path, no_fashion_copy):
    with pytest.raises(FileNotFoundError) as caught:
        datasets.FashionMNIST(tmp_path, train=True, transform=ToTensor())
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"FashionMNIST: {tmp_path / 'FashionMNIST' / 'raw'} does not "
                              "hold the four files (train-images-idx3-ubyte")
    assert "pass download=True" in message and data.fashion_mnist.ENV_VAR in message


def test_download_fetches_checks_and_keeps_the_files(tmp_path, no_fashion_copy, served_mnist,
                                                     monkeypatch):
    base_url, requested = served_mnist
    # the shipped MNIST bytes stand in for upstream's Fashion-MNIST; the first mirror is down
    monkeypatch.setattr(datasets.FashionMNIST, "mirrors", ["http://127.0.0.1:9/", base_url])
    monkeypatch.setattr(datasets.FashionMNIST, "files_sha256", data.mnist.SHIPPED_SHA256)
    train = datasets.FashionMNIST(tmp_path, train=True, download=True)
    raw = tmp_path / "FashionMNIST" / "raw"
    assert sorted(p.name for p in raw.iterdir()) == sorted(data.mnist.SHIPPED_SHA256)
    assert len(train) == 60000 and train.classes[9] == "Ankle boot"
    assert len(requested) == 4
    test = datasets.FashionMNIST(tmp_path, train=False, download=True)
    assert len(test) == 10000 and len(requested) == 4   # found in place: nothing fetched


def test_download_refuses_a_file_with_another_checksum(tmp_path, no_fashion_copy, served_mnist,
                                                       monkeypatch):
    base_url, _ = served_mnist
    wrong = dict(data.mnist.SHIPPED_SHA256, **{data.mnist.TRAIN_IMAGES + ".gz": "0" * 64})
    monkeypatch.setattr(datasets.FashionMNIST, "mirrors", [base_url])
    monkeypatch.setattr(datasets.FashionMNIST, "files_sha256", wrong)
    with pytest.raises(ValueError, match="sha256 .* does not match"):
        datasets.FashionMNIST(tmp_path, download=True)
    raw = tmp_path / "FashionMNIST" / "raw"
    assert not (raw / (data.mnist.TRAIN_IMAGES + ".gz")).exists()
    assert not any(p.name.endswith(TEMPORARY_SUFFIX) for p in raw.iterdir())


def test_download_failing_on_every_mirror_says_so(tmp_path, no_fashion_copy, monkeypatch):
    monkeypatch.setattr(datasets.FashionMNIST, "mirrors", ["http://127.0.0.1:9/"])
    with pytest.raises(OSError, match=r"FashionMNIST: cannot download into .*FashionMNIST/raw "
                                      r"\(download http://127.0.0.1:9/"):
        datasets.FashionMNIST(tmp_path, download=True)


class _SampleBySample:
    """The first ``count`` samples of a data set, offered only through ``__getitem__``."""

    def __init__(self, dataset, count):
        self.dataset, self.count = dataset, count

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        return self.dataset[index]


@pytest.mark.parametrize("transform", [ToTensor(), None,
                                       Compose([ToTensor(), Normalize((0.1307,), (0.3081,))])])
def test_the_loader_takes_the_set_whole_with_the_per_sample_batches(transform, monkeypatch):
    split = datasets.MNIST("no-such-root", train=False, transform=transform)
    per_sample = DataLoader(_SampleBySample(split, 300), batch_size=100)
    monkeypatch.setattr(datasets.MNIST, "__getitem__", None)   # the whole set: never called
    whole = DataLoader(split, batch_size=100)
    assert len(whole) == 100 and whole.dataset is split
    for (xb, yb), (xs, ys) in zip(whole, per_sample):
        assert xb.shape == xs.shape and xb.dtype == xs.dtype == np.float32
        assert np.array_equal(xb.numpy(), xs.numpy()) and np.array_equal(yb.numpy(), ys.numpy())
    assert xb.shape == ((100, 28, 28) if transform is None else (100, 1, 28, 28))


def test_other_transforms_run_per_sample(mnist_test_split):
    split = datasets.MNIST("no-such-root", train=False,
                           transform=Compose([ToTensor(), lambda image: image * 2.0]))
    assert split.loader_arrays() is None
    labelled = datasets.MNIST("no-such-root", train=False, transform=ToTensor(),
                              target_transform=lambda y: 9 - y)
    assert labelled.loader_arrays() is None
    xb, yb = next(iter(DataLoader(labelled, batch_size=8)))
    assert np.array_equal(yb.numpy(), 9 - mnist_test_split.targets.numpy()[:8])


def test_a_normalizing_set_and_the_loaders_normalize_conflict():
    split = datasets.MNIST("no-such-root", train=False,
                           transform=Compose([ToTensor(), Normalize((0.5,), (0.5,))]))
    with pytest.raises(ValueError, match="MNIST's transform normalizes already"):
        DataLoader(split, batch_size=10, normalize=(0.5, 0.5))
    assert engine.vision.datasets is datasets
