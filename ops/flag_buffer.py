"""The input faults of a device: where kernels record a bad input for the host to raise.

A kernel cannot raise, so one that meets a bad input (a label outside the classes, an index
out of range) records ``[1, value, where, limit]`` in its op's four words and writes NaN or
a safe value instead. Every op's words are one slice of a single array per device (its
``fault_words``), so the kernels that change training state (an optimizer's step advance)
read one array and leave the state as it was while any fault is pending: a bad batch, even
in a replayed step whose Python does not run, changes no weight.

On the CPU the caller reads its words right after the call and raises at once. On CUDA a
device-to-host copy per call would stall the pipeline, so the array is mapped (host-visible)
memory that the host reads without a synchronisation at the start of later calls and after
each host read of device data (``ops.device.to_host``): the error comes at the latest at the
next call or the next sync (``deferred``). In the simulator kernels are synchronous and the
words are read right after the call.
"""
import numpy as np

from ops.cuda import SIMULATOR, mapped_pair

WORDS = 4        # flag, value, where, limit
MAX_KINDS = 8    # ops that check their inputs in a kernel (index, cross_entropy, gather_rows)


class FlagBuffer:
    """One op's words: ``message(values, deferred)`` words the error of a flagged
    ``[1, value, where, limit]``; ``error`` is its exception type."""

    def __init__(self, device, slot, message, error):
        self.deferred = device == "cuda" and not SIMULATOR
        self.message, self.error = message, error
        host, words = _faults(device)
        span = slice(slot * WORDS, (slot + 1) * WORDS)
        self.host = None if host is None else host[span]
        self.device = words[span]

    def flagged(self):
        """The flagged words (a copy), or None; the words are cleared when flagged."""
        # the simulator's words are read directly, not through ops.device.to_host: a check of
        # a step's inputs is not step data that a captured replay would lose
        values = self.device.copy_to_host() if self.host is None else self.host.copy()
        if not values[0]:
            return None
        if self.host is None:
            self.device.copy_to_device(np.zeros(WORDS, np.int64))
        else:
            self.host[:] = 0
        return values

    def raise_if_flagged(self, context=""):
        values = self.flagged()
        if values is not None:
            raise self.error(self.message(values, self.deferred) + context)


_buffers = {}
_slots = {}    # kind -> its words' slot, the same on every device
_words = {}


def _faults(device):
    """``(host view or None, device array)`` of ``device``'s fault words, made on first use."""
    if device not in _words:
        if device == "cuda":
            _words[device] = mapped_pair(WORDS * MAX_KINDS, np.int64)
        else:
            words = np.zeros(WORDS * MAX_KINDS, np.int64)
            _words[device] = (words, words)
    return _words[device]


def fault_words(device):
    """The array of every op's fault words on ``device``, for kernels that gate on it."""
    return _faults(device)[1]


def flag_buffer(kind, device, message, error):
    """The one ``FlagBuffer`` of ``kind`` (an op's name) on ``device``."""
    key = (kind, device)
    if key not in _buffers:
        slot = _slots.setdefault(kind, len(_slots))
        if slot >= MAX_KINDS:
            raise RuntimeError(f"flag_buffer: more than {MAX_KINDS} kinds of input check; "
                               "raise ops.flag_buffer.MAX_KINDS")
        _buffers[key] = FlagBuffer(device, slot, message, error)
    return _buffers[key]


def raise_pending(device, context=None):
    """Raise the error of any fault flagged on ``device`` (each op's words in turn), with
    ``context`` (else what ``note_launcher`` last said) after its message."""
    if device not in _words:
        return
    for (_, where), buffer in list(_buffers.items()):
        if where == device:
            buffer.raise_if_flagged(_launchers.get(device, "") if context is None else context)


_launchers = {}


def note_launcher(device, context):
    """Say what launched the kernels now queued on ``device`` (a captured step's call), for a
    fault found later: it is named in the error."""
    _launchers[device] = context
