"""CUDA graphs of recorded launches (cuda.core's ``GraphDefinition``): a chain of a step's
kernels, and a loop of them whose count is read from device memory."""
import functools
import os

from ops.cuda.direct_launch import default_stream, kernel_params, launch_config
from ops.cuda.runtime import cuda


def build_graph(launches):
    """An executable CUDA graph of ``launches`` (``(function, grid, block, args)`` with
    ``function`` from ``direct_function``) in one chain, each after the one before. Its
    nodes never change: what changes between replays is device memory the kernels read."""
    from cuda.core.graph import GraphDefinition
    definition = GraphDefinition()
    node = definition
    for function, grid, block, args in launches:
        node = node.launch(launch_config(grid, block, function), function,
                           *kernel_params(args))
    return definition.instantiate()


def build_loop_graph(launches, remaining, unroll, tail):
    """An executable CUDA graph that runs ``launches`` (a step, as ``build_graph`` chains
    them) ``unroll * remaining[0] + tail`` times: a one-thread kernel sets a condition from
    the one-element int64 device array ``remaining``, a WHILE conditional node runs ``unroll``
    chained copies of the step and a kernel that counts ``remaining`` down and sets the
    condition again (``cudaGraphSetConditional``, from the CUDA device runtime library), then
    ``tail`` more copies follow. Set ``remaining`` before a launch: n steps in one launch.
    A WHILE pass costs ~3-5 us of its own on the H200 (two tiny kernels looped: 5.0 us a
    pass), so the body holds several steps. None where the device runtime library cannot
    be found or linked (the caller then chains n copies)."""
    kernels = _condition_kernels()
    if kernels is None:
        return None
    start, count_down = kernels
    from cuda.core.graph import GraphDefinition
    definition = GraphDefinition()
    condition = definition.create_condition(default_value=0)
    counter = kernel_params((remaining,))
    node = definition.launch(launch_config(1, 1), start, *counter, condition)
    loop = node.while_loop(condition)
    body = loop.body
    for function, grid, block, args in launches * unroll:
        body = body.launch(launch_config(grid, block, function), function,
                           *kernel_params(args))
    body.launch(launch_config(1, 1), count_down, *counter, condition)
    node = loop
    for function, grid, block, args in launches * tail:
        node = node.launch(launch_config(grid, block, function), function,
                           *kernel_params(args))
    return definition.instantiate()


def launch_graph(graph):
    """Launch ``graph`` on the engine's stream, after the kernels launched before it."""
    graph.launch(default_stream())


@functools.cache
def _condition_kernels():
    """``(start, count_down)``: cuda.core kernels that set a graph condition to
    ``remaining[0] > 0``, the second after counting it down; None without the library."""
    library = _device_runtime_library()
    if library is None:
        return None
    set_conditional = cuda.declare_device("cudaGraphSetConditional", "void(uint64, uint32)",
                                          link=[library], abi="c")

    @cuda.jit("void(int64[::1], uint64)")
    def start(remaining, condition):
        if cuda.grid(1) == 0:
            more = 0
            if remaining[0] > 0:
                more = 1
            set_conditional(condition, more)

    @cuda.jit("void(int64[::1], uint64)")
    def count_down(remaining, condition):
        if cuda.grid(1) == 0:
            remaining[0] -= 1
            more = 0
            if remaining[0] > 0:
                more = 1
            set_conditional(condition, more)

    try:
        return tuple(next(iter(kernel.overloads.values()))._codelibrary.get_cufunc().kernel
                     for kernel in (start, count_down))
    except Exception:   # a toolkit whose linker cannot take the library: chain copies instead
        return None


def _device_runtime_library():
    """``libcudadevrt.a``: from CUDA_HOME, the system toolkit or NVIDIA's runtime wheels."""
    import glob
    import site
    roots = [os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    patterns = [f"{root}/lib64/libcudadevrt.a" for root in roots if root]
    patterns += [f"{path}/nvidia/*/lib/libcudadevrt.a" for path in site.getsitepackages()]
    found = [match for pattern in patterns for match in sorted(glob.glob(pattern))]
    return found[0] if found else None
