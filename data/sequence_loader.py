"""``SequenceLoader``: random windows of a token sequence for language models, drawn on
the loader's device, as nanoGPT's ``get_batch``::

    loader = data.SequenceLoader(ids, block_size=64, batch_size=12, seed=0, device="cpu")
    xb, yb = next(iter(loader))     # (12, 64) int64; yb[:, t] is the token after xb[:, t]

Batch ``s`` (counting every batch the loader has given, across epochs) takes row ``r``'s
window at ``hash(seed, s, r) mod (len(ids) - block_size)``: the batches are a function of
``(seed, step)``, the same on either device and on a resumed run. The ids are copied to the
device once; a batch is one kernel that gathers both windows. An *epoch* is
``steps_per_epoch`` batches (default: as many as cover the ids once,
``len(ids) // (batch_size * block_size)``), so ``fit``'s epochs, logs and checkpoints apply;
its captured step fetches its own batches through ``epoch_cursor()``, reading the step
count on the device.
"""
import numpy as np

from data.transforms import _GOLDEN, _mix64, stream_key
from engine.tensor import Tensor
from ops.device import check_device, to_device
from ops.dispatch import Out, run
from ops.element_kernel import element_kernel
from ops.step_counter import advance, new_counter, set_counter
from ops.twin import twin

_ROW_MIX = 0xD1B54A32D192ED03   # a second odd constant: rows and steps stir different bits


def _window_start(mix64):
    def start(seed_key, step, row, starts):
        z = mix64(seed_key + np.uint64(step) * np.uint64(_GOLDEN)
                  + np.uint64(row) * np.uint64(_ROW_MIX))
        return int(z % np.uint64(starts))
    return start


_window_starts = twin(_window_start, twin(_mix64))   # (cpu, cuda)


def _window_element(window_start):
    def element(i, ids, x, y, step, seed_key, block):
        row = i // block
        start = window_start(seed_key, step[0], row, ids.size - block)
        x[i] = ids[start + i % block]
        y[i] = ids[start + i % block + 1]
    return element


SEQUENCE_WINDOWS = element_kernel("sequence_windows", _window_element, size="x",
                                  positional=True, pairs=[_window_starts])


class SequenceLoader:
    """``(x, y)`` batches of ``batch_size`` random windows of ``block_size`` tokens of ``ids``
    (y shifted by one), on ``device``; see the module docstring."""

    fetches_on_device = True   # fit's captured step may fetch its batches (epoch_cursor)

    def __init__(self, ids, block_size, batch_size=12, seed=0, device="cpu",
                 steps_per_epoch=None):
        ids = np.asarray(ids.numpy() if isinstance(ids, Tensor) else ids)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError(f"SequenceLoader: ids must be a 1-D integer sequence, got shape "
                             f"{ids.shape} of {ids.dtype}")
        for name, value in (("block_size", block_size), ("batch_size", batch_size)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SequenceLoader: {name} must be an integer >= 1, got {value!r}")
        if ids.size < block_size + 2:
            raise ValueError(f"SequenceLoader: {ids.size} ids hold no window of block_size "
                             f"{block_size} + 1 (at least {block_size + 2} needed)")
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"SequenceLoader: seed must be a non-negative integer, got {seed!r}")
        self.block_size, self.batch_size, self.seed = int(block_size), int(batch_size), int(seed)
        self.steps_per_epoch = (max(1, ids.size // (self.batch_size * self.block_size))
                                if steps_per_epoch is None else int(steps_per_epoch))
        if self.steps_per_epoch < 1:
            raise ValueError(f"SequenceLoader: steps_per_epoch must be >= 1, got {steps_per_epoch!r}")
        self.device = check_device(device)
        self.ids = to_device(ids.astype(np.int64), self.device)
        self.seed_key = stream_key(self.seed)
        self.epoch = 0   # the next epoch that iter() gives
        self._cursor = None

    def __len__(self):
        return self.steps_per_epoch

    def batch(self, step):
        """The batch of step ``step`` (an int, or a one-element int64 array on the device)."""
        counter = step if not isinstance(step, (int, np.integer)) else new_counter(self.device, step)
        shape = (self.batch_size, self.block_size)
        x, y = run(SEQUENCE_WINDOWS, self.ids, Out(shape, np.int64), Out(shape, np.int64),
                   counter, self.seed_key, self.block_size)
        return Tensor(x), Tensor(y)

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        first = epoch * self.steps_per_epoch
        return (self.batch(first + index) for index in range(self.steps_per_epoch))

    def epoch_cursor(self):
        """The device cursor of ``fit``'s captured step (``data.loader.EpochCursor``'s
        interface): the step count lives on the device and moves on one batch at a time."""
        if self._cursor is None:
            self._cursor = _StepCursor(self)
        return self._cursor

    def __repr__(self):
        return (f"SequenceLoader({self.ids.size} ids, block_size={self.block_size}, "
                f"batch_size={self.batch_size}, seed={self.seed}, device='{self.device}', "
                f"steps_per_epoch={self.steps_per_epoch})")


class _StepCursor:
    """``start_epoch`` / ``next_batch`` / ``seek`` over a ``SequenceLoader``, as
    ``data.loader.EpochCursor``'s: a span's start is the step (every batch of an epoch is
    full, one step after the other: ``stride`` 1), and ``next_batch`` reads the step count
    on the device."""

    stride = 1

    def __init__(self, loader):
        self.loader = loader
        self.step = new_counter(loader.device, 0)

    def start_epoch(self):
        loader = self.loader
        epoch, loader.epoch = loader.epoch, loader.epoch + 1
        first = epoch * loader.steps_per_epoch
        set_counter(self.step, first)
        return [(first + index, loader.batch_size) for index in range(loader.steps_per_epoch)]

    def seek(self, start):
        set_counter(self.step, start)

    def next_batch(self, count):
        batch = self.loader.batch(self.step)
        advance(self.step)
        return batch
