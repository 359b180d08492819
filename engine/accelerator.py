"""torch's ``torch.accelerator``: ``is_available()``, ``current_accelerator()``,
``device_count()``, so ``device = torch.accelerator.current_accelerator().type if
torch.accelerator.is_available() else "cpu"`` reads the same with ``import engine as torch``."""
from collections import namedtuple

device = namedtuple("device", ("type", "index"))   # torch.device's two fields


def is_available():
    """True when a CUDA GPU can run the engine's kernels."""
    from ops.device import cuda_available
    return cuda_available()


def current_accelerator(check_available=False):
    """``device(type="cuda", index=None)`` when a GPU is available, else None (torch's
    answer on a machine without one)."""
    return device("cuda", None) if is_available() else None


def device_count():
    """The number of CUDA GPUs (0 without one)."""
    if not is_available():
        return 0
    from ops.cuda import cuda
    return len(cuda.gpus)
