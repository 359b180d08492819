"""Whether the machine can hold the model ``python -m engine.train --hidden`` asks for: the
MLP's float32 parameters, and on the CPU their gradients, counted from the widths before
anything is allocated, against the memory the system says is available. A model that
cannot fit is a ``BadInput`` before training, not a ``MemoryError`` traceback part way
through building it. (The optimizer's state and the activations come on top: a run that
passes may still run out, which the command reports in one line.)"""
import math
import os

from engine.cli.failures import BadInput

FLOAT32_BYTES = 4


def mlp_parameters(features, hidden, classes):
    """The parameters of ``engine.models.build_mlp``: a weight matrix and a bias per layer."""
    widths = (features,) + tuple(hidden) + (classes,)
    return sum((inputs + 1) * outputs for inputs, outputs in zip(widths, widths[1:]))


def available_memory():
    """Bytes of host memory the system says a new allocation can have (Linux's
    MemAvailable), else the physical memory; None where neither is known."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _gib(size):
    return f"{size / 2**30:,.1f} GiB"


def check_model_fits(args, input_shape, classes, available=None):
    """Raise ``BadInput`` when the ``--model mlp`` of ``args.hidden`` cannot fit in the host
    memory: it is built there (then moved to ``args.device``) and, on the CPU, trained there
    with a gradient per parameter. ``available``: bytes, by default ``available_memory()``."""
    if args.model != "mlp":
        return   # the cnn's size does not depend on the arguments
    available = available_memory() if available is None else available
    parameters = mlp_parameters(math.prod(input_shape), args.hidden, classes)
    copies = 2 if args.device == "cpu" else 1   # the gradients live on the device
    needed = parameters * FLOAT32_BYTES * copies
    if available is not None and needed > available:
        held = "the parameters and their gradients" if copies == 2 else "the parameters"
        widths = ",".join(map(str, args.hidden))
        raise BadInput(f"--hidden {widths}: the network has {parameters:,} parameters; "
                       f"{held} alone need {_gib(needed)} of memory, and this machine has "
                       f"{_gib(available)} available; give smaller widths")
