"""Kernels compiled ahead of time: the first CUDA step without compiling.

A cold start compiles every kernel a step launches: 11.4-12.4 s for the first CUDA step of
the MLP or the CNN on the H200 with an empty Numba cache (issue 32), nearly all of it
Numba's typing and lowering. ``python -m engine.cli.build_kernels`` compiles the variants the
CLI's models launch ahead of time into ops/kernels/ (a cubin per compute capability, named by
a content hash); the first launch of a (kernel, argument types) pair looks for one there and
loads it through cuda.core, without asking Numba to compile. The hash covers everything
the kernel's code is made from (``ops.cuda.fingerprints``: its source and that of every
function it calls, the constants and closure values they read, its compile options) and the
numba and numba-cuda versions, so an artifact built from other code is never found: it
cannot run. A variant not shipped compiles just in time, as before. ENGINE_SHIPPED_KERNELS=0
turns the lookup off.
"""
import functools
import os

from ops.cuda.fingerprints import fingerprint
from ops.cuda.runtime import cuda

SHIPPED_KERNELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                   "kernels")
MANIFEST_NAME = "manifest.json"
_shipped = {}             # (kernel, signature) -> cuda.core kernel, or None: not shipped


def shipped_kernels_enabled():
    return os.environ.get("ENGINE_SHIPPED_KERNELS", "1") != "0"


@functools.cache
def shipped_manifest():
    """The manifest of ops/kernels/, or None without one: ``{"kernels": {key: {"name",
    "argtypes", "cubins": {"sm_90": {"file", "entry"}, ...}}}}``."""
    import json
    try:
        with open(os.path.join(SHIPPED_KERNELS_DIR, MANIFEST_NAME)) as file:
            return json.load(file)
    except FileNotFoundError:
        return None


def artifact_key(kernel, argtypes):
    """The content hash that names the artifact of ``kernel`` (a ``@cuda.jit`` dispatcher)
    compiled for ``argtypes`` (Numba types): the kernel's fingerprint, the argument types and
    the numba and numba-cuda release series it was compiled with."""
    import hashlib
    text = "\n".join((fingerprint(kernel), repr(tuple(str(t) for t in argtypes)),
                      _compiler_versions()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@functools.cache
def _compiler_versions():
    """The numba and numba-cuda release series (major.minor) the key holds. A cubin is
    machine code: what must match at run time is the argument layout of Numba's data model,
    which changes only between minor releases. Full versions matched nothing on the H200,
    whose image has numba 0.68.0 where the build had 0.68.1: every kernel compiled just in
    time again (0 of 16 lookups found)."""
    import importlib.metadata
    import numba

    def series(version):
        return ".".join(version.split(".")[:2])
    return (f"numba {series(numba.__version__)} "
            f"numba-cuda {series(importlib.metadata.version('numba-cuda'))}")


def shipped_function(kernel, args, signature):
    """The cuda.core kernel shipped for ``kernel`` and the types of ``args`` (``signature``,
    ``ops.cuda.direct_launch.launch_signature``'s key of them), loaded once; None when there
    is none (lookup off, no manifest, no artifact for this device's compute capability)."""
    if not shipped_kernels_enabled():
        return None
    try:
        return _shipped[(kernel, signature)]
    except KeyError:
        pass
    function = None
    manifest = shipped_manifest()
    if manifest is not None:
        entry = manifest["kernels"].get(artifact_key(kernel, tuple(kernel.typeof_pyval(a)
                                                                  for a in args)))
        if entry is not None:
            try:
                function = _load_artifact(entry)
            except Exception as error:   # a driver that refuses the cubin: compile instead
                import warnings
                warnings.warn(f"ops.cuda: the shipped kernel {entry['name']} did not "
                              f"load ({error}); Numba compiles it instead", stacklevel=2)
    _shipped[(kernel, signature)] = function
    return function


def _load_artifact(entry):
    """The cuda.core kernel of a manifest entry, from its cubin for this device's compute
    capability; None when it has none for this one."""
    from cuda.core import ObjectCode
    major, minor = cuda.get_current_device().compute_capability
    cubin = entry["cubins"].get(f"sm_{major}{minor}")
    if cubin is None:
        return None
    with open(os.path.join(SHIPPED_KERNELS_DIR, cubin["file"]), "rb") as file:
        code = ObjectCode.from_cubin(file.read())
    return code.get_kernel(cubin["entry"])


def compile_artifact(kernel, argtypes, compute_capability):
    """``(entry name, cubin bytes)`` of ``kernel`` compiled for ``argtypes`` and
    ``compute_capability`` (major, minor) as Numba compiles it at a first launch on such a
    GPU (its options, max_registers included; sm_90 and later as Numba's arch-specific
    ``sm_XYa``), without a GPU: for ``python -m engine.cli.build_kernels``. None for a kernel
    that only Numba's launch can run (cooperative, debug, extensions, launch-config
    sensitive)."""
    import types
    from numba.cuda import codegen as cuda_codegen
    from numba.cuda import dispatcher as cuda_dispatcher
    major, minor = compute_capability
    target = (major, minor, "a" if (major, minor) >= (9, 0) else "")   # Numba's _ensure_cc
    device = types.SimpleNamespace(compute_capability=(major, minor))
    found = cuda_dispatcher.get_current_device, cuda_codegen.CUDACodeLibrary._ensure_cc
    cuda_dispatcher.get_current_device = lambda: device
    cuda_codegen.CUDACodeLibrary._ensure_cc = lambda library, cc: target if cc is None else cc
    from cuda.pathfinder import DynamicLibNotFoundError
    try:
        compiled = cuda_dispatcher._Kernel(kernel.py_func, tuple(argtypes),
                                           **kernel.targetoptions)
        if (compiled.debug or compiled.cooperative or compiled.extensions
                or compiled.launch_config_sensitive):
            return None
        cubin = compiled._codelibrary.get_cubin(cc=target)   # a cuda.core ObjectCode
        return compiled.entry_name, bytes(getattr(cubin, "code", cubin))
    except DynamicLibNotFoundError as error:
        raise RuntimeError(f"compiling a kernel needs NVVM, NVRTC and nvJitLink, not found "
                           f"here ({str(error).splitlines()[0]}): install them and set "
                           f"CUDA_HOME as ops/cuda/README.md, 'Shipped kernels', says") from None
    finally:
        cuda_dispatcher.get_current_device, cuda_codegen.CUDACodeLibrary._ensure_cc = found
