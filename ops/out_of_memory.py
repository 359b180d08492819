"""The answer to GPU memory exhaustion: one ``MemoryError`` subclass that says what was asked
for, what the device has and what this process holds.

The caching pool (``ops.cuda.pool``) raises it when the driver refuses a block even after
the pool gave every cached block back and asked once more. Nothing is left half-done by the
failed request, so the process can go on (free tensors, or use a smaller batch) and the next
allocation that fits succeeds.
"""


class OutOfMemoryError(MemoryError):
    """A device allocation failed after the pool freed its cache and retried once (torch's
    ``torch.cuda.OutOfMemoryError``). ``requested``, ``device_free``, ``device_total``,
    ``pool_in_use`` and ``pool_cached`` are in bytes (``device_free``/``device_total`` None
    when the driver could not say)."""

    def __init__(self, requested, device_free, device_total, pool_in_use, pool_cached):
        self.requested, self.device_free, self.device_total = requested, device_free, device_total
        self.pool_in_use, self.pool_cached = pool_in_use, pool_cached
        device = ("the device's free and total memory are unknown" if device_total is None else
                  f"the GPU has {_size(device_free)} free of {_size(device_total)}")
        super().__init__(
            f"CUDA out of memory: tried to allocate {_size(requested)}; {device}, of which "
            f"this process's memory pool holds {_size(pool_in_use)} in tensors and "
            f"{_size(pool_cached)} cached (its cache was freed and the request retried "
            "once). Free tensors that are no longer needed, or use a smaller batch")


def _size(nbytes):
    """Bytes in the largest binary unit that keeps a number >= 1 (``1.50 GiB``)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.2f} {unit}"
    return f"{nbytes} bytes"
