"""Kernels written once, per element: ``element_kernel``.

``element_kernel(name, element)`` makes the whole twin kernel from one function
``element(i, a, b, ...)`` that updates position ``i`` of its arrays: the CPU loop over every
``i``, the CUDA kernel with one thread per ``i`` and its bounds guard, and the
``ops.launch.Kernel`` of both, the kernel's arguments being ``element``'s after ``i`` (the
first one an array whose size is the loop's). Numba's CUDA kernels take no ``*args``
(numba issue 6891), so the two kernels are generated as source with ``element``'s
argument names; they are compiled as if written in ``element``'s own file (its name and
line), so Numba's on-disk cache keys on, and goes stale with, the file that defines the
arithmetic. The template's own text is in their qualified names (a digest), which Numba's
cache files and the shipped kernels' keys are named by: a changed template compiles anew
instead of reloading a kernel built from the old one.

``skip_if`` names an argument holding an optimizer's device step counts
(``ops.step_counter``): while its ``SKIPPED`` word is set (a bad input this step) the kernel
changes nothing. ``flush_subnormals`` runs the CPU loop with subnormal results flushed to
zero (``ops.subnormals``; on CUDA, flushing is the compiler's default for float32).
"""
import hashlib
import inspect

from numba import njit

from ops.cuda_backend import cuda
from ops.launch import Kernel, elements
from ops.step_counter import SKIPPED
from ops.subnormals import flush_begin, flush_end
from ops.twin import twin


_SOURCE = """
def {name}_cpu({arguments}):
    if {skipped}:
        return
    mode = {flush_begin}
    for i in range({size}.size):
        element_cpu(i, {arguments})
    {flush_end}


def {name}_cuda({arguments}):
    i = cuda.grid(1)
    if i < {size}.size and not ({skipped}):
        element_cuda(i, {arguments})
"""
_TEMPLATE_DIGEST = hashlib.sha1(_SOURCE.encode()).hexdigest()[:12]


def element_kernel(name, element, skip_if=None, flush_subnormals=False):
    """The ``Kernel`` ``name`` that runs ``element(i, ...)`` for every ``i`` (module doc)."""
    parameters = list(inspect.signature(element).parameters)
    if len(parameters) < 2 or parameters[0] != "i":
        raise TypeError(f"element_kernel {name}: the element function takes (i, array, ...), "
                        f"got ({', '.join(parameters)})")
    arguments = parameters[1:]
    if skip_if is not None and skip_if not in arguments:
        raise TypeError(f"element_kernel {name}: skip_if={skip_if!r} is not an argument of "
                        f"{element.__name__} ({', '.join(arguments)})")
    source = _SOURCE.format(
        name=name, arguments=", ".join(arguments), size=arguments[0],
        skipped=f"{skip_if}[SKIPPED] != 0" if skip_if else "False",
        flush_begin="flush_begin()" if flush_subnormals else "0",
        flush_end="flush_end(mode)" if flush_subnormals else "")
    element_cpu, element_cuda = twin(element)
    namespace = {"element_cpu": element_cpu, "element_cuda": element_cuda, "cuda": cuda,
                 "SKIPPED": SKIPPED, "flush_begin": flush_begin, "flush_end": flush_end,
                 "__name__": element.__module__}   # a cached kernel reloads from that module
    # line numbers as in element's file, so a traceback and the cache point at its module
    line = element.__code__.co_firstlineno
    exec(compile("\n" * (line - 1) + source, inspect.getfile(element), "exec"), namespace)
    for side in ("cpu", "cuda"):
        namespace[f"{name}_{side}"].__qualname__ = f"{name}_{side}_{_TEMPLATE_DIGEST}"
    cpu = njit(cache=True, error_model="numpy")(namespace[f"{name}_cpu"])
    gpu = cuda.jit(cache=True)(namespace[f"{name}_cuda"])
    return Kernel(name, cpu, gpu, elements(0))
