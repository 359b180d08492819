"""``DataLoader``: mini-batches of a whole in-memory data set, resident on its device.

The images are converted once, at construction (uint8 -> float32 in [0, 1], then the
optional mean/std normalisation), not per batch. With ``device="cuda"`` the converted set is
copied to the GPU once; every epoch uploads one permutation, and every batch is one kernel
launch that gathers its rows of x and y on the device (``ops.gather``). No batch crosses
the PCIe bus.

Shuffling is reproducible: epoch ``k`` (the k-th ``iter()``, counting from 0) uses the
permutation of a generator seeded with ``(seed, k)``, so a CPU and a CUDA loader with the
same seed yield the same batches, and a run can be resumed at any epoch.

Sharding for data-parallel training: ``shard=(rank, world_size)`` gives each of
``world_size`` processes its part of every step. All ranks draw the same permutation of
epoch ``k`` from ``(seed, k)``; step ``i``'s global batch is the ``world_size * batch_size``
samples at positions ``i * world_size * batch_size ...`` of it, as one process with that
batch size would take, and rank ``r`` takes the ``r``-th run of ``batch_size`` of them. So
the ranks' batches are disjoint, cover the epoch, and averaging their gradients is one
process's step on the global batch. Every rank yields the same number of batches, so no
rank waits in a collective for a batch that never comes: a last global batch of ``rest``
samples (fewer than ``world_size * batch_size``) is dropped with ``drop_last=True``; else
each rank takes ``ceil(rest / world_size)`` of them, and the fewer than ``world_size``
positions missing at the end repeat the epoch's first samples (padding: those samples count
twice in that epoch).
"""
import math

import numpy as np

from engine.random import generator
from engine.tensor import Tensor
from ops.device import check_device, copy_into, to_device
from ops.gather import gather_rows
from ops.step_counter import advance, new_counter, set_counter


class DataLoader:
    """Iterate ``(xb, yb)`` Tensor pairs over ``x`` and ``y`` in batches of ``batch_size``.

    - ``x``: ``[N, ...]`` array (or Tensor). uint8 images become float32 scaled by 1/255;
      float32 and float64 are used as given (float16 becomes float32).
    - ``y``: ``[N, ...]`` labels or targets. Integers become int64; floats are used as given.
    - ``normalize``: ``(mean, std)``, scalars or arrays broadcasting against one sample;
      applied once, after the scaling: ``(x - mean) / std``.
    - ``transform``: a callable applied to every image batch Tensor, returning a Tensor on
      the same device (e.g. ``data.GaussianNoise``). A device-keyed augmentation
      (``data.RandomShift``, ``RandomCrop``, ``RandomFlip``, a ``Compose`` of them) draws each
      sample's window from ``(its seed, the epoch, the sample's position in the epoch)``, so
      a captured step can fetch and augment its batches on the device.
    - ``seed``: None draws one from the engine's generator (``engine.manual_seed``); a
      sharded loader that shuffles needs one, the same on every rank.
    - ``shard``: ``(rank, world_size)``, this process's part of each step (module
      docstring); ``batch_size`` is then the batch of one rank. None: the whole epoch.

    Every batch comes in freshly allocated buffers, so keeping a batch is safe.

    PyTorch's form works too: ``DataLoader(dataset, batch_size=64, shuffle=True)`` with a
    map-style dataset (``__len__`` and ``__getitem__`` giving ``(sample, target)``, as a
    ``torch.utils.data.Dataset`` does) reads every sample once into memory. ``loader.dataset``
    is that dataset, or the ``(x, y)`` pairs given (``len(loader.dataset)``: the samples).
    A ``TensorDataset`` is taken whole, and so is a dataset whose ``loader_arrays()`` gives
    ``(x, y, normalize)``: arrays this loader converts (``normalize`` as its own, or None)
    into exactly the stacked samples, as ``engine.vision.datasets.MNIST`` does for
    ``ToTensor``.
    """

    def __init__(self, x, y=None, batch_size=128, shuffle=False, seed=None, drop_last=False,
                 device="cpu", normalize=None, transform=None, shard=None):
        if _is_map_dataset(x):
            if isinstance(y, (int, np.integer)) and not isinstance(y, bool):
                batch_size, y = y, None   # torch's DataLoader(dataset, 64)
            if y is not None:
                raise TypeError("DataLoader: a dataset gives its own targets; pass it alone "
                                "(DataLoader(dataset, batch_size=...))")
            self.dataset = x
            x, y, normalize = _dataset_arrays(x, normalize)
        elif y is None:
            raise TypeError(f"DataLoader: expects (x, y) arrays or a dataset with __len__ and "
                            f"__getitem__, got {type(x).__name__} and no y")
        else:
            self.dataset = ArrayDataset(x, y)
        x, y = _host_array(x, "x"), _host_array(y, "y")
        if x.ndim == 0 or y.ndim == 0:
            raise ValueError(f"DataLoader: x and y need a sample dimension, got shapes "
                             f"{x.shape} and {y.shape}")
        if len(x) != len(y):
            raise ValueError(f"DataLoader: x has {len(x)} samples but y has {len(y)} "
                             f"(shapes {x.shape} and {y.shape})")
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"DataLoader: batch_size must be a positive integer, "
                             f"got {batch_size!r}")
        if seed is not None and (not isinstance(seed, (int, np.integer)) or seed < 0):
            raise ValueError(f"DataLoader: seed must be a non-negative integer or None, "
                             f"got {seed!r}")
        if transform is not None and not callable(transform):
            raise TypeError(f"DataLoader: transform must be callable, got {transform!r}")
        self.batch_size = int(batch_size)
        self.shard = _checked_shard(shard)
        if shuffle and self.shard[1] > 1 and seed is None:   # each rank would draw its own
            raise ValueError("DataLoader: a sharded loader that shuffles needs seed=..., the "
                             "same on every rank (else the ranks' shards overlap)")
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.device = check_device(device)
        self.transform = transform
        self.seed = int(generator().integers(2 ** 63)) if seed is None else int(seed)
        self.epoch = 0   # the next iter() runs this epoch; set it to resume a run
        self.num_samples = len(x)
        self.sample_shape = x.shape[1:]
        self.target_shape = y.shape[1:]
        # 2-D [N, columns]: the gather kernel copies whole rows
        self._x = _resident(_features(x, normalize), x, self.device)
        self._y = _resident(_targets(y), y, self.device)
        self._in_order = None   # the unshuffled order on the device, made once
        self._cursor = None

    def __len__(self):
        return len(self._spans())

    def order(self, epoch):
        """The host int64 sample order of ``epoch`` (every rank's, before sharding)."""
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        return np.random.default_rng((self.seed, epoch)).permutation(self.num_samples)

    def _spans(self):
        """``[(start, count)]``: this rank's batches as runs of positions in the padded order
        (``_padded``). Unsharded, the shard is ``(0, 1)`` and these are plain batches."""
        rank, ranks = self.shard
        step = self.batch_size * ranks   # one global batch: all ranks' batches of a step
        full, rest = divmod(self.num_samples, step)
        spans = [(index * step + rank * self.batch_size, self.batch_size)
                 for index in range(full)]
        if rest and not self.drop_last:
            count = math.ceil(rest / ranks)
            spans.append((full * step + rank * count, count))
        return spans

    def _padded(self, order):
        """``order`` with its first samples repeated at the end up to a multiple of the ranks
        in the last global batch (fewer than ``world_size`` of them; none unsharded)."""
        ranks = self.shard[1]
        rest = self.num_samples % (self.batch_size * ranks)
        if self.drop_last or rest % ranks == 0:
            return order
        missing = ranks - rest % ranks
        return np.concatenate([order, order[np.arange(missing) % self.num_samples]])

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        return self._batches(self._device_order(epoch), epoch)

    def _device_order(self, epoch):
        if self.shuffle:   # one upload per epoch
            return to_device(self._padded(self.order(epoch)), self.device)
        if self._in_order is None:
            self._in_order = to_device(self._padded(self.order(epoch)), self.device)
        return self._in_order

    @property
    def fetches_on_device(self):
        """Whether a captured step can fetch this loader's batches by its device cursor:
        no transform, or one keyed on the device (``epoch_cursor``)."""
        return self.transform is None or getattr(self.transform, "device_keyed", False)

    def _batches(self, order, epoch):
        keyed = getattr(self.transform, "device_keyed", False)
        if keyed:
            epoch_counter, position = new_counter(self.device, epoch), new_counter(self.device)
        for start, count in self._spans():
            xb, yb = self._gathered(order, start, count)
            if keyed:
                set_counter(position, start)
                xb = self.transform.apply(xb, epoch_counter, position)
            elif self.transform is not None:
                xb = self.transform(xb)
            yield xb, yb

    def _gathered(self, order, start, count, cursor=None):
        """The ``count`` samples at ``order[start:]`` (after ``cursor[0]`` when given) as
        ``(xb, yb)`` Tensors in the samples' and targets' shapes."""
        x_rows, y_rows = gather_rows(self._x, self._y, order, start, count, cursor)
        return (Tensor(x_rows.reshape((count,) + self.sample_shape)),
                Tensor(y_rows.reshape((count,) + self.target_shape)))

    def epoch_cursor(self):
        """This loader's ``EpochCursor`` (one per loader, kept: a recorded step that fetches
        its batches through it stays valid for later epochs)."""
        if self._cursor is None:
            self._cursor = EpochCursor(self)
        return self._cursor

    def __repr__(self):
        shard = f", shard={self.shard}" if self.shard != (0, 1) else ""
        return (f"DataLoader({self.num_samples} samples of shape {self.sample_shape}, "
                f"batch_size={self.batch_size}, shuffle={self.shuffle}, "
                f"drop_last={self.drop_last}, device='{self.device}'{shard}, "
                f"batches={len(self)})")


class EpochCursor:
    """A loader's batches fetched by position on the device, for a captured training step
    that fetches its own batch (``engine.fit``'s default)::

        cursor = loader.epoch_cursor()
        spans = cursor.start_epoch()    # the loader's next epoch: [(start, count)] of its batches
        xb, yb = cursor.next_batch(count)   # inside the step: the batch at the cursor

    ``start_epoch`` writes the epoch's order into one device buffer (same address every
    epoch) and sets the device cursor to the first batch; ``next_batch`` gathers ``count``
    rows at the cursor and advances it by one step of batches (every rank's), so replays of
    the step walk the epoch with no Python between them. The batches are exactly those of
    iterating the loader (same order, same shards, the same augmentation of a device-keyed
    transform, which reads the epoch and the cursor on the device); ``seek`` moves the cursor
    to a batch whose start does not follow the one before (a sharded last batch). A loader
    with another ``transform`` has no cursor: that transform is Python run per batch."""

    def __init__(self, loader):
        if not loader.fetches_on_device:
            raise ValueError("DataLoader.epoch_cursor: a loader with a transform that is not "
                             "device-keyed fetches its batches by iteration, not on the device")
        self.loader = loader
        self.order = None
        self.cursor = new_counter(loader.device, 0)
        self.epoch = new_counter(loader.device, 0)   # what a device-keyed transform reads
        self.stride = loader.batch_size * loader.shard[1]

    def start_epoch(self):
        """Start the loader's next epoch (``loader.epoch`` moves on, as ``iter()`` does);
        returns its batches as ``[(start, count)]``."""
        loader = self.loader
        epoch, loader.epoch = loader.epoch, loader.epoch + 1
        order = loader._padded(loader.order(epoch))
        if self.order is None:
            self.order = to_device(order, loader.device)
        else:   # into the buffer a recorded step reads
            copy_into(self.order, order)
        spans = loader._spans()
        if spans:
            set_counter(self.cursor, spans[0][0])
        set_counter(self.epoch, epoch)
        return spans

    def seek(self, start):
        set_counter(self.cursor, start)

    def next_batch(self, count):
        """The ``count`` samples at the cursor as ``(xb, yb)``; the cursor moves one step on."""
        xb, yb = self.loader._gathered(self.order, 0, count, self.cursor)
        if self.loader.transform is not None:   # device-keyed: the batch at the cursor
            xb = self.loader.transform.apply(xb, self.epoch, self.cursor)
        advance(self.cursor, self.stride)
        return xb, yb


def _checked_shard(shard):
    """``shard`` as ``(rank, world_size)``; None is the whole epoch, ``(0, 1)``."""
    if shard is None:
        return (0, 1)
    try:
        rank, world_size = shard
    except (TypeError, ValueError):
        raise ValueError(f"DataLoader: shard must be a pair (rank, world_size), "
                         f"got {shard!r}") from None
    if not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool)
               for n in (rank, world_size)):
        raise TypeError(f"DataLoader: shard (rank, world_size) must be integers, got {shard!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"DataLoader: shard {tuple(shard)} needs world_size >= 1 and "
                         f"0 <= rank < world_size")
    return (int(rank), int(world_size))


class ArrayDataset:
    """The ``(x[i], y[i])`` pairs of two arrays: ``loader.dataset`` of a loader made from
    arrays (torch's ``TensorDataset``, also ``data.TensorDataset``). A DataLoader given one
    takes its two arrays whole, without reading it sample by sample."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


def _is_map_dataset(x):
    return (hasattr(x, "__getitem__") and hasattr(x, "__len__")
            and not isinstance(x, (np.ndarray, Tensor, list, tuple)) and not hasattr(x, "shape"))


def _dataset_arrays(dataset, normalize):
    """``(x, y, normalize)`` of a map-style dataset: its arrays whole when it offers them,
    else its samples read one by one."""
    if type(dataset) is ArrayDataset:
        return dataset.x, dataset.y, normalize
    whole = getattr(dataset, "loader_arrays", None)
    arrays = whole() if callable(whole) else None
    if arrays is None:
        return (*_read_dataset(dataset), normalize)
    x, y, own_normalize = arrays
    if own_normalize is not None and normalize is not None:
        raise ValueError(f"DataLoader: the {type(dataset).__name__}'s transform normalizes "
                         "already; pass normalize= or a Normalize transform, not both")
    return x, y, normalize if own_normalize is None else own_normalize


def _read_dataset(dataset):
    """The samples and targets of a map-style dataset as two stacked arrays."""
    samples, targets = [], []
    for index in range(len(dataset)):
        try:
            sample, target = dataset[index]
        except (TypeError, ValueError) as error:
            raise TypeError(f"DataLoader: dataset[{index}] must be a (sample, target) pair: "
                            f"{error}") from None
        samples.append(np.asarray(sample.numpy() if isinstance(sample, Tensor) else sample))
        targets.append(np.asarray(target.numpy() if isinstance(target, Tensor) else target))
    if not samples:
        raise ValueError("DataLoader: the dataset is empty")
    try:
        return np.stack(samples), np.stack(targets)
    except ValueError as error:
        raise ValueError(f"DataLoader: the dataset's samples differ in shape ({error})") from None


def _host_array(values, name):
    if isinstance(values, Tensor):
        values = values.numpy()
    array = np.asarray(values)
    if array.dtype == object:
        raise TypeError(f"DataLoader: {name} is not a numeric array")
    return array


def _features(x, normalize):
    if x.dtype == np.uint8:
        return _scaled_images(x, normalize)
    if x.dtype in (np.float32, np.float64):
        features = x
    elif x.dtype == np.float16:
        features = x.astype(np.float32)
    else:
        raise TypeError(f"DataLoader: x has dtype {x.dtype}; expected uint8 images (scaled to "
                        "[0, 1]) or float32/float64 features")
    if normalize is not None:
        mean, std = _checked_normalize(normalize, features.dtype, x.shape[1:])
        features = features - mean   # a new array: the caller's x is never modified
        features /= std
    return np.ascontiguousarray(features)


def _scaled_images(x, normalize):
    """uint8 images as float32 ``(x / 255 - mean) / std``, in place on one float copy."""
    features = x.astype(np.float32)
    features /= np.float32(255)
    if normalize is not None:
        mean, std = _checked_normalize(normalize, np.float32, x.shape[1:])
        features -= mean
        features /= std
    return features


def _checked_normalize(normalize, dtype, sample_shape):
    try:
        mean, std = normalize
    except (TypeError, ValueError):
        raise ValueError(f"DataLoader: normalize must be (mean, std), got {normalize!r}") from None
    mean, std = np.asarray(mean, dtype=dtype), np.asarray(std, dtype=dtype)
    if np.any(std <= 0):
        raise ValueError(f"DataLoader: normalize std must be positive, got {std}")
    for stat in (mean, std):
        try:
            fits = np.broadcast_shapes(stat.shape, sample_shape) == sample_shape
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(f"DataLoader: normalize mean {mean.shape} / std {std.shape} "
                             f"must broadcast against one sample of shape {sample_shape}")
    return mean, std


def _resident(converted, original, device):
    """``converted`` as a 2-D array on ``device``, never sharing memory with the caller's array."""
    rows = converted.reshape(len(converted), math.prod(converted.shape[1:]))
    if device == "cpu" and not np.may_share_memory(rows, original):
        return rows   # already a private copy: the conversion made it
    return to_device(rows, device)


def _targets(y):
    if y.dtype.kind in "iub":
        return np.ascontiguousarray(y, dtype=np.int64)
    if y.dtype in (np.float32, np.float64):
        return np.ascontiguousarray(y)
    raise TypeError(f"DataLoader: y has dtype {y.dtype}; expected integer labels or "
                    "float32/float64 targets")
