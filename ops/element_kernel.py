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

``skip_if=(argument, word)`` names an argument holding an optimizer's device step counts
and the word of it (``ops.step_counter.SKIPPED``) that, while set (a bad input this step),
makes the kernel change nothing. ``flush_subnormals`` runs the CPU loop with subnormal
results flushed to zero (``ops.subnormals``; on CUDA, flushing is the compiler's default for
float32).

``size`` names the array whose size is the loop's (the first one's by default).
``positional=True`` says the element reads its position ``i`` as a place in a shape (a row
and a column, a window and an offset): the CPU loop then runs whole, never in blocks, whose
positions would restart at 0. ``pairs`` are twins (``ops.twin``) of the helpers the element
calls, which differ by device: ``element`` is then a factory ``element(*helpers)`` of the
element function, as ``twin(make, *pairs)`` takes.

``scalars=(function, count)`` computes per launch what every element reads (Adam's bias
corrections): ``function(..., out)`` writes ``count`` float64 values into ``out``, once
before the CPU loop and once per CUDA block, by thread 0 into shared memory (every thread
computing Adam's float64 powers and divisions made the update of the MLP's 235k parameters
take 9.2 us of H200 time). ``element`` then takes them as its last ``count`` arguments, cast
to the dtype of its first array; the kernel's arguments are ``element``'s others, then
``function``'s (but ``out``) that ``element`` does not take. Such a kernel's grid stops at
``SCALAR_BLOCKS_PER_SM`` blocks a multiprocessor, each thread striding over the elements
past it: Adam over the wide MLP's 20M parameters launched 78k blocks, each waiting for its
thread 0's float64 powers, and took 282 us of H200 time (2.0 TB/s).

On the CPU a kernel over many elements (an optimizer's update of the MLP's 235k parameters)
runs in blocks of them on the engine's threads (``split_over_threads``); the compiled loop
releases the GIL (``nogil``) for that.
"""
import hashlib
import inspect

import numpy as np
from numba import float64, njit

from ops import cuda as cuda_runtime
from ops.compiled_call import KeptBlocks
from ops.cpu_threads import SPLIT_MIN_ELEMENTS, element_blocks, run_blocks
from ops.cuda import SIMULATOR, cuda
from ops.kernel_pace import Pace
from ops.launch import CPU_KERNEL, THREADS_PER_BLOCK, Kernel, elements
from ops.subnormals import flush_begin, flush_end
from ops.twin import twin


_SOURCE = """
def {name}_cpu({arguments}):
    if {skipped}:
        return
    mode = {flush_begin}
    {cpu_scalars}
    for i in range({size}.size):
        element_cpu(i, {element_arguments})
    {flush_end}


def {name}_cuda({arguments}):
    {cuda_scalars}
    if {skipped}:
        return
    for i in range(cuda.grid(1), {size}.size, cuda.gridsize(1)):
        element_cuda(i, {element_arguments})
"""
_CPU_SCALARS = "s = np.empty({count}, np.float64); scalars_cpu({scalar_arguments}, s)"
_CUDA_SCALARS = """s = cuda.shared.array({count}, float64)
    if cuda.threadIdx.x == 0:
        scalars_cuda({scalar_arguments}, s)
    cuda.syncthreads()"""
SCALAR_BLOCKS_PER_SM = 8   # 8 x 256 threads: a multiprocessor's 2048, where registers allow
# Numba's cache keys a kernel on its signature and source, not its compile flags: the CPU
# kernel's name carries them too, so one compiled without nogil is never reloaded for it.
_CPU_FLAGS = dict(CPU_KERNEL, nogil=True, error_model="numpy")
_TEMPLATE = _SOURCE + _CPU_SCALARS + _CUDA_SCALARS
_TEMPLATE_DIGEST = {side: hashlib.sha1(text.encode()).hexdigest()[:12] for side, text in (
    ("cuda", _TEMPLATE), ("cpu", _TEMPLATE + repr(sorted(_CPU_FLAGS.items()))))}


def element_kernel(name, element, skip_if=None, flush_subnormals=False, scalars=None,
                   size=None, positional=False, pairs=()):
    """The ``Kernel`` ``name`` that runs ``element(i, ...)`` for every ``i`` (module doc)."""
    made = element(*(cpu for cpu, _ in pairs)) if pairs else element   # twin's factory form
    parameters = list(inspect.signature(made).parameters)
    scalar_function, count = scalars or (None, 0)
    if len(parameters) < 2 + count or parameters[0] != "i":
        raise TypeError(f"element_kernel {name}: the element function takes (i, array, ...)"
                        + (f" and {count} scalars" if count else "")
                        + f", got ({', '.join(parameters)})")
    arrays = parameters[1:len(parameters) - count]
    scalar_parameters = (list(inspect.signature(scalar_function).parameters)[:-1]
                         if scalar_function else [])
    arguments = arrays + [p for p in scalar_parameters if p not in arrays]
    if skip_if is not None and skip_if[0] not in arguments:
        raise TypeError(f"element_kernel {name}: skip_if={skip_if[0]!r} is not an argument "
                        f"of the kernel ({', '.join(arguments)})")
    if size is not None and size not in arrays:
        raise TypeError(f"element_kernel {name}: size={size!r} is not an array of the "
                        f"element ({', '.join(arrays)})")
    size = size or arrays[0]
    first_dtype = f"{arrays[0]}.dtype.type"
    element_arguments = arrays + [f"{first_dtype}(s[{k}])" for k in range(count)]
    fields = dict(count=count, scalar_arguments=", ".join(scalar_parameters))
    source = _SOURCE.format(
        name=name, arguments=", ".join(arguments), size=size,
        element_arguments=", ".join(element_arguments),
        skipped=f"{skip_if[0]}[{skip_if[1]}] != 0" if skip_if else "False",
        flush_begin="flush_begin()" if flush_subnormals else "0",
        flush_end="flush_end(mode)" if flush_subnormals else "",
        cpu_scalars=_CPU_SCALARS.format(**fields) if count else "",
        cuda_scalars=_CUDA_SCALARS.format(**fields) if count else "")
    element_cpu, element_cuda = twin(element, *pairs)
    namespace = {"element_cpu": element_cpu, "element_cuda": element_cuda, "cuda": cuda,
                 "np": np, "float64": float64, "flush_begin": flush_begin,
                 "flush_end": flush_end,
                 "__name__": made.__module__}   # a cached kernel reloads from that module
    if scalar_function is not None:
        namespace["scalars_cpu"], namespace["scalars_cuda"] = twin(scalar_function)
    # line numbers as in element's file, so a traceback and the cache point at its module
    line = made.__code__.co_firstlineno
    exec(compile("\n" * (line - 1) + source, inspect.getfile(made), "exec"), namespace)
    for side in ("cpu", "cuda"):
        namespace[f"{name}_{side}"].__qualname__ = f"{name}_{side}_{_TEMPLATE_DIGEST[side]}"
    cpu = njit(**_CPU_FLAGS)(namespace[f"{name}_cpu"])
    gpu = cuda.jit(cache=True)(namespace[f"{name}_cuda"])
    at = arguments.index(size)
    return Kernel(name, cpu if positional else split_over_threads(cpu, len(arrays)), gpu,
                  strided_blocks(at) if count else elements(at))


def split_over_threads(cpu, array_count):
    """``cpu`` (the loop over every element) in blocks of the elements across the engine's
    threads when they are many (``ops.cpu_threads.element_blocks``): each block the same
    kernel on slices of the per-element arrays (those among the first ``array_count``
    arguments that are 1-D and as long as the first), so every element is computed as in one
    call, on any thread count. Each block reads the skip flag and computes the per-launch
    scalars itself.

    Whether a block is worth a thread depends on the kernel's pace (plain SGD's update is 5x
    cheaper an element than Adam's): the kernel runs whole, timed, until ``TIMED_CALLS``
    whole calls after its first (which compiles) give its fastest seconds per element, and
    from then on splits only into blocks of ``MIN_BLOCK_SECONDS`` or more at that pace
    (``MIN_KEPT_BLOCK_SECONDS`` on the last call's arrays, whose blocks' records are kept:
    ``ops.compiled_call.KeptBlocks``)."""
    pace = Pace(cpu, SPLIT_MIN_ELEMENTS)
    kept = KeptBlocks()

    def split(*args):
        first = args[0]
        if getattr(first, "ndim", 0) != 1:
            return cpu(*args)

        def block_arguments(blocks):
            per_element = [k for k in range(array_count) if isinstance(args[k], np.ndarray)
                           and args[k].ndim == 1 and args[k].size == first.size]
            return [tuple(arg[start:stop] if k in per_element else arg
                          for k, arg in enumerate(args)) for start, stop in blocks], ()
        return _run_in_blocks(pace, kept, first.size, args, block_arguments)
    return _named_after(split, cpu)


def split_runs_over_threads(cpu):
    """``cpu``, a loop over the elements in the rows ``[start, stop)`` of its last argument
    (``runs``, an (R, 2) int64 array), in blocks of those elements across the engine's
    threads as ``split_over_threads``: each block the same kernel on the whole arrays with
    the runs cut to its own elements."""
    pace = Pace(cpu, SPLIT_MIN_ELEMENTS)
    kept = KeptBlocks()

    def split(*args):
        runs = args[-1]
        lengths = runs[:, 1] - runs[:, 0]

        def block_arguments(blocks):
            cuts = [_runs_between(runs, lengths, start, stop) for start, stop in blocks]
            return [args[:-1] + (cut,) for cut in cuts], cuts
        return _run_in_blocks(pace, kept, int(lengths.sum()), args, block_arguments)
    return _named_after(split, cpu)


def _runs_between(runs, lengths, start, stop):
    """The rows of ``runs`` cut to the elements ``start`` to ``stop`` of their concatenation."""
    ends = np.cumsum(lengths)
    begins = ends - lengths
    kept = (ends > start) & (begins < stop)
    cut = runs[kept].copy()
    cut[:, 0] += np.maximum(start - begins[kept], 0)
    cut[:, 1] -= np.maximum(ends[kept] - stop, 0)
    return cut


def _run_in_blocks(pace, kept, size, args, block_arguments):
    """``pace.cpu(*args)`` over ``size`` elements: whole (timed while its pace is unknown),
    or in the blocks its pace gives (shorter where the arguments are the last call's: their
    hand-off is kept in ``kept``), ``block_arguments(blocks)`` making each block's
    arguments."""
    if size < pace.smallest:
        return pace.cpu(*args)

    def blocks_of(repeated):
        seconds = pace.per_unit(size)
        return None if seconds is None else element_blocks(size, seconds, repeated)
    calls = kept.calls(pace.cpu, args, blocks_of, block_arguments)
    if calls is None:
        return pace.whole(size, args)
    run_blocks(calls)


def _named_after(split, cpu):
    split.__wrapped__ = cpu   # the @njit kernel, for whoever inspects the compiled side
    split.__name__ = split.__qualname__ = cpu.__name__
    return split


def strided_blocks(position):
    """The grid rule of a kernel that strides over the elements of argument ``position``:
    a thread per element up to ``SCALAR_BLOCKS_PER_SM`` blocks a multiprocessor (the
    simulator, one OS thread per CUDA thread, keeps a thread per element)."""
    def grid(*args):
        size = args[position].size
        if SIMULATOR:
            return size
        blocks = min(-(-size // THREADS_PER_BLOCK),
                     SCALAR_BLOCKS_PER_SM * cuda_runtime.multiprocessor_count())
        return (blocks, THREADS_PER_BLOCK)
    return grid


def run_blocks_grid():
    """The grid rule of a kernel over runs of its elements (its last argument, an (R, 2) int64
    array: ``split_runs_over_threads``): a row of blocks per run, ``SCALAR_BLOCKS_PER_SM``
    blocks a multiprocessor shared among the rows (the simulator, one OS thread per CUDA
    thread: one block of a few threads per run). A run's blocks stride over its elements."""
    def grid(*args):
        count = args[-1].shape[0]
        if SIMULATOR:
            return ((1, count), 4)
        blocks = SCALAR_BLOCKS_PER_SM * cuda_runtime.multiprocessor_count()
        return ((max(1, blocks // count), count), THREADS_PER_BLOCK)
    return grid
