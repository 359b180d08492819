"""torchvision's ``datasets.MNIST`` and ``datasets.FashionMNIST`` on the engine's readers.

``MNIST(root, train=True, transform=None, target_transform=None, download=False)`` is a
map-style data set: ``len(d)``, ``d[i] == (image, label)`` (the image a uint8 NumPy array
``[28, 28]``, where torchvision gives a PIL image, through ``transform``; the label an int,
through ``target_transform``), ``d.data`` (uint8 Tensor ``[N, 28, 28]``), ``d.targets``
(int64 Tensor ``[N]``), ``d.classes``, ``d.class_to_idx``.

Where the files are looked for, in order:

1. torchvision's layout, ``root/MNIST/raw/`` (``root/FashionMNIST/raw/``): the four IDX
   files, each ``.gz`` or unpacked, as torchvision leaves them (read as they are: a folder
   of yours is checked for structure, not checksums, as ``data.mnist.load(root=...)``);
2. the engine's own places: MNIST's copy shipped with the package (sha256-checked) or
   ``$ENGINE_MNIST_DIR``; Fashion-MNIST's ``$ENGINE_FASHION_MNIST_DIR`` or Debian's
   ``/usr/share/datasets/fashion-mnist``;
3. with ``download=True``, the upstream files fetched into ``root/<Name>/raw/`` through
   ``data.download`` (each kept only when its sha256 matches ``files_sha256``; each URL of
   ``mirrors`` tried in turn).

Without any of these: a FileNotFoundError in one line naming the folder and the remedy.

A DataLoader takes a whole set at once (through ``loader_arrays``, not sample by sample) when
its ``transform`` is None, ``ToTensor()`` or ``ToTensor()`` then ``Normalize`` and its
``target_transform`` is None: the uint8 images go to the loader as they are and it scales
them once, as it does any uint8 images; any other transform runs per sample.
"""
import os
from pathlib import Path

from data import fashion_mnist, mnist
from data.download import download as download_files
from data.mnist import FILES, read_set
from engine.tensor import Tensor
from engine.vision.transforms import loader_form


class MNIST:
    """The handwritten digits: 60,000 training and 10,000 test images (module docstring)."""

    mirrors = [mnist.UPSTREAM_URL]
    files_sha256 = mnist.UPSTREAM_SHA256   # the .gz files a download must match
    classes = ["0 - zero", "1 - one", "2 - two", "3 - three", "4 - four",
               "5 - five", "6 - six", "7 - seven", "8 - eight", "9 - nine"]

    def __init__(self, root, train=True, transform=None, target_transform=None,
                 download=False):
        self.root = os.path.expanduser(os.fspath(root))
        self.train, self.transform, self.target_transform = train, transform, target_transform
        training, test = self._read(download)
        images, labels = training if train else test
        self.data = Tensor(images)
        self.targets = Tensor(labels.astype("int64"))

    @property
    def raw_folder(self):
        """``root/<Name>/raw``: where torchvision keeps the files, and a download puts them."""
        return os.path.join(self.root, type(self).__name__, "raw")

    @property
    def class_to_idx(self):
        return {name: index for index, name in enumerate(self.classes)}

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        image, target = self.data.numpy()[index], int(self.targets.numpy()[index])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target

    def loader_arrays(self):
        """``(x, y, normalize)`` for a DataLoader that takes this set whole: arrays whose
        conversion by the loader (uint8 scaled by 1/255, then ``normalize``) gives exactly
        the stacked ``self[i]``; None when the transforms must run per sample."""
        if self.target_transform is not None:
            return None
        images, labels = self.data.numpy(), self.targets.numpy()
        if self.transform is None:
            return images, labels, None
        form = loader_form(self.transform, channels=1)
        if form is None:
            return None
        return images[:, None], labels, form.normalize   # ToTensor's [1, H, W]

    def __repr__(self):
        lines = [f"Dataset {type(self).__name__}", f"    Number of datapoints: {len(self)}",
                 f"    Root location: {self.root}",
                 f"    Split: {'Train' if self.train else 'Test'}"]
        for name, transform in (("Transform", self.transform),
                                ("Target transform", self.target_transform)):
            if transform is not None:
                lines.append(f"    {name}: {transform}")
        return "\n".join(lines)

    def _read(self, download):
        """The ``(training, test)`` pairs from the first place that has all four files."""
        raw = self.raw_folder
        if _holds_the_files(raw):
            return read_set(raw, type(self).__name__, missing_hint=self._remedy())
        own = self._own_folder()
        if _holds_the_files(own):
            return self._read_own()
        if not download:
            raise FileNotFoundError(f"{type(self).__name__}: {raw} does not hold the four "
                                    f"files ({', '.join(FILES)}, .gz or unpacked), nor does "
                                    f"{own}; " + self._remedy())
        self._download(raw)
        return read_set(raw, type(self).__name__, missing_hint=self._remedy())

    def _own_folder(self):
        """The engine's own copy: ``$ENGINE_MNIST_DIR`` or the package's."""
        return os.environ.get(mnist.ENV_VAR) or mnist.PACKAGE_DIR

    def _read_own(self):
        return mnist.load()

    def _remedy(self):
        return "pass download=True (internet access), or " + self._by_hand()

    def _by_hand(self):
        return f"put the four files there, or set ${mnist.ENV_VAR} to a folder holding them"

    def _download(self, folder):
        failures = []
        for mirror in self.mirrors:
            try:
                download_files(mirror, self.files_sha256, folder)
                return
            except OSError as error:   # the next mirror; a checksum mismatch is not retried
                failures.append(str(error))
        raise OSError(f"{type(self).__name__}: cannot download into {folder} "
                      f"({'; '.join(failures)}); " + self._by_hand())


class FashionMNIST(MNIST):
    """Zalando's clothes in MNIST's format: 60,000 training and 10,000 test images."""

    mirrors = [fashion_mnist.UPSTREAM_URL]
    files_sha256 = fashion_mnist.UPSTREAM_SHA256
    classes = list(fashion_mnist.CLASSES)

    def _own_folder(self):
        return os.environ.get(fashion_mnist.ENV_VAR) or fashion_mnist.DEBIAN_DIR

    def _read_own(self):
        return fashion_mnist.load(root=self._own_folder())

    def _by_hand(self):
        return ("put the four upstream files "
                "(https://github.com/zalandoresearch/fashion-mnist) there, or "
                "`apt-get install dataset-fashion-mnist` (Debian/Ubuntu), or set "
                f"${fashion_mnist.ENV_VAR} to a folder holding them")


def _holds_the_files(folder):
    folder = Path(folder)
    return all((folder / name).is_file() or (folder / (name + ".gz")).is_file()
               for name in FILES)
