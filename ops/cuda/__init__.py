"""The GPU runtime: the one package that imports numba-cuda, and its one interface.

Everything the rest of the engine asks of CUDA comes from here: the ``cuda`` API the kernel
modules are written against (``@cuda.jit``, ``cuda.grid``, shared and local arrays; a
stand-in until the first CUDA use, ``ops.cuda.runtime``), device arrays, launches, CUDA
graphs, the shipped kernels and the caching allocator. The modules behind it are described
in ops/cuda/README.md; ``ops.cuda.ptx`` (inline-PTX tensor-core instructions) is imported by
the kernels that use them, since importing it imports numba.cuda.
"""
from ops.cuda.runtime import (SIMULATOR, LazyKernel, cuda, is_cuda_kernel, is_device_array,
                              when_numba_cuda_imported)
from ops.cuda.gpu import (compute_capability, current_device_id, current_memory_manager,
                          driver_library_loads, gpu_usable, install_memory_manager,
                          multiprocessor_count)
from ops.cuda.arrays import (as_device_array, device_address, device_array_from_dlpack,
                             device_arrays_overlap, device_empty, device_reshape, device_view,
                             dlpack_capsule, host_to_device, mapped_pair)
from ops.cuda.shipped import (MANIFEST_NAME, SHIPPED_KERNELS_DIR, artifact_key,
                              compile_artifact, shipped_manifest)
from ops.cuda.direct_launch import direct_function, engine_stream, launch, set_dynamic_shared_bytes
from ops.cuda.graphs import build_graph, build_loop_graph, launch_graph
from ops.cuda.dry_device import DryDevice

# The caching allocator and the driver's names it subclasses and raises, from ops.cuda.pool
# when first asked for (module ``__getattr__``, PEP 562): it imports numba-cuda's driver.
_POOL_NAMES = ("CachingMemoryManager", "MemoryManagerBase", "MemoryPointer", "CudaAPIError",
               "OUT_OF_MEMORY")


def __getattr__(name):
    if SIMULATOR or name not in _POOL_NAMES:   # the simulator has no memory manager
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from ops.cuda import pool
    return getattr(pool, name)
