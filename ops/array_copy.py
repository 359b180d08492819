"""Copying one array into another of the same device, as a kernel pair.

A copy made by ``memcpy`` (NumPy's ``copyto``, a device-to-device ``copy_to_device``) runs no
kernel, so a captured step (``engine.capture``) would not record it and its replays would
skip it. The engine's same-device copies (``to_device``, gradient slots) run this kernel
instead; copies between the host and the device are refused inside a recording.

The kernel converts as it copies (NumPy's ``astype``: floats to integers truncate toward
zero, integers wrap), so it is also ``ops.cast``'s kernel.
"""
from ops.element_kernel import element_kernel


def _copy_element(i, source, destination):
    destination[i] = source[i]


COPY = element_kernel("copy", _copy_element)


def copy_array(destination, source):
    """Copy ``source`` into ``destination``: C-contiguous, one device, one size and dtype."""
    COPY(source.reshape(source.size), destination.reshape(destination.size))
    return destination
