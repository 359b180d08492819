"""A small int64 buffer that kernels write a problem of their inputs into, for the host to raise.

A kernel cannot raise, so one that meets a bad input (a label outside the classes, an index
out of range) records ``[1, value, where, limit]`` in this buffer and writes NaN or a safe
value instead. On the CPU the caller reads the buffer right after the call and raises at
once. On CUDA a device-to-host copy per call would stall the pipeline, so the buffer is
mapped (host-visible) memory that the host reads without a synchronisation at the start of
later calls: the error comes at the latest one call after the bad batch (``deferred``). In
the simulator kernels are synchronous and the buffer is read right after the call.
"""
import numpy as np

from ops.cuda_backend import SIMULATOR, mapped_pair


class FlagBuffer:
    """``message(values)`` words the error of a flagged ``[1, value, where, limit]``;
    ``error`` is its exception type."""

    def __init__(self, device, message, error):
        self.deferred = device == "cuda" and not SIMULATOR
        self.message, self.error = message, error
        if device == "cuda":
            self.host, self.device = mapped_pair(4, np.int64)
        else:
            self.host = self.device = np.zeros(4, np.int64)

    def raise_if_flagged(self):
        # the simulator's buffer is read directly, not through ops.device.to_host: a check of
        # a step's inputs is not step data that a captured replay would lose
        values = self.device.copy_to_host() if self.host is None else self.host.copy()
        if values[0]:
            if self.host is None:
                self.device.copy_to_device(np.zeros(4, np.int64))
            else:
                self.host[:] = 0
            raise self.error(self.message(values, self.deferred))


_buffers = {}


def flag_buffer(kind, device, message, error):
    """The one ``FlagBuffer`` of ``kind`` (an op's name) on ``device``."""
    key = (kind, device)
    if key not in _buffers:
        _buffers[key] = FlagBuffer(device, message, error)
    return _buffers[key]
