"""Compile the CUDA kernels the CLI's models launch ahead of time, into ops/kernels/.

    python -m ops.build_kernels            # rebuild ops/kernels/ (rerun whenever kernels change)
    python -m ops.build_kernels --check    # exit 1 when ops/kernels/ is not what a build makes

Which kernels: the (kernel, argument types) pairs that ``python -m engine.train`` launches
for the MLP and the CNN (Adam, SGD, AdamW) on an H200 and on an A100, found by running the CLI
on a *dry device*: real numba-cuda without a GPU, whose device arrays hold no memory (reads
give zeros) and whose launches are recorded instead of run. The launch plans see the target's
multiprocessor count, so the GEMM tilings and split-K choices are the ones that GPU makes.
Each pair is compiled as Numba compiles it at a first launch (``ops.cuda_backend
.compile_artifact``) for sm_80 and sm_90, and written as ``<key>.sm_XY.cubin`` beside a
``manifest.json``; the key is the content hash of ``ops.cuda_backend.artifact_key``, which
the launch path looks up (ops/README.md, "Shipped kernels").

Needs NVVM, libdevice and nvJitLink, which a CPU install of the engine lacks: install NVIDIA's
wheels into a folder of their own and point CUDA_HOME at it (ops/README.md says how).

This is a build tool at the top of the stack: it runs the CLI (``engine.train``), which no
other module of ``ops`` may import.
"""
import argparse
import contextlib
import ctypes
import functools
import itertools
import json
import os
import sys
import time

import numpy as np

from ops import cuda_backend

# The GPUs the artifacts are built for: (compute capability, multiprocessors) of each; the
# multiprocessor count decides split-K and tile choices of the launch plans.
TARGETS = {"H200": ((9, 0), 132), "A100": ((8, 0), 108)}
COMPUTE_CAPABILITIES = ((8, 0), (9, 0))
MANIFEST_FILE = cuda_backend.MANIFEST_NAME
# The CLI runs whose kernels are shipped: the models of engine.train with each optimizer
RUNS = (["--model", "mlp", "--optimizer", "adam"],
        ["--model", "cnn", "--optimizer", "adam"],
        ["--model", "mlp", "--optimizer", "sgd"],
        ["--model", "mlp", "--optimizer", "adamw"])
CLI_OPTIONS = ["--device", "cuda", "--epochs", "1", "--no-capture", "--no-save",
               "--no-progress"]


# ------------------------------------------------------------------ the dry device

class _DryMemory:
    """Device memory that is not there: an address range, for views and overlap checks."""
    __cuda_memory__ = True
    _addresses = itertools.count(1 << 40, 1 << 32)

    def __init__(self, size, address=None):
        self.size = self._cuda_memsize_ = size
        self.address = next(self._addresses) if address is None else address

    @property
    def device_ctypes_pointer(self):
        return ctypes.c_void_p(self.address)

    @property
    def device_pointer(self):
        return self.address

    def view(self, start, stop=None):
        stop = self.size if stop is None else stop
        return _DryMemory(stop - start, self.address + start)


class DryDevice:
    """Replaces ``ops.cuda_backend``'s device functions, in every module that bound them, by
    ones that need no GPU: arrays without memory, launches recorded in ``launches``
    (``(dispatcher, argument types)``, first launch order) instead of run."""

    def __init__(self, multiprocessors):
        self.multiprocessors = multiprocessors
        self.launches = {}
        self.unpassable = set()   # kernels launched with arguments only Numba's path takes

    def device_empty(self, shape, dtype):
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(map(int, shape))
        dtype = np.dtype(dtype)
        layout = cuda_backend._c_layout(shape, dtype.itemsize)
        return cuda_backend._device_array(layout, dtype, _DryMemory(layout[2] * dtype.itemsize), 0)

    def device_reshape(self, array, shape):
        layout = cuda_backend._c_layout(tuple(shape), array.dtype.itemsize)
        return cuda_backend._device_array(layout, array.dtype, array.gpu_data, 0)

    def device_view(self, array, dtype):
        dtype = np.dtype(dtype)
        layout = cuda_backend._c_layout(array.shape, dtype.itemsize)
        return cuda_backend._device_array(layout, dtype, array.gpu_data, 0)

    def host_to_device(self, array):
        array = np.asarray(array)
        return self.device_empty(array.shape, array.dtype)

    def mapped_pair(self, size, dtype):
        return np.zeros(size, dtype), self.device_empty(size, dtype)

    def launch(self, kernel, grid, block, args):
        if cuda_backend._signature(args) is None:
            self.unpassable.add(kernel.py_func.__qualname__)
            return
        argtypes = tuple(kernel.typeof_pyval(arg) for arg in args)
        self.launches.setdefault((id(kernel), argtypes), (kernel, argtypes))

    def replacements(self):
        return {cuda_backend.device_empty: self.device_empty,
                cuda_backend.device_reshape: self.device_reshape,
                cuda_backend.device_view: self.device_view,
                cuda_backend.host_to_device: self.host_to_device,
                cuda_backend.mapped_pair: self.mapped_pair,
                cuda_backend.launch: self.launch,
                cuda_backend.direct_function: lambda kernel, args: None,
                cuda_backend.gpu_usable: lambda: True,
                cuda_backend.multiprocessor_count: lambda: self.multiprocessors,
                cuda_backend.compute_capability: lambda: (9, 0),
                cuda_backend.current_device_id: lambda: 0}

    @contextlib.contextmanager
    def installed(self):
        """The dry device in place of the real one in every loaded module of the project (a
        ``functools.cache`` of a replaced function is replaced by a cache of its
        replacement), and Numba's host/device copies made no-ops (reads give zeros)."""
        replacements = self.replacements()
        undo = []
        for module in list(sys.modules.values()):
            if module is None or module.__name__.split(".")[0] not in ("ops", "optim",
                                                                      "engine", "data"):
                continue
            for name, value in list(vars(module).items()):
                try:
                    replacement = replacements.get(value)
                except TypeError:   # an unhashable value: no function of ours
                    continue
                wrapped = getattr(value, "__wrapped__", None)
                if replacement is None and callable(value) and wrapped is not None:
                    try:
                        inner = replacements.get(wrapped)
                    except TypeError:
                        inner = None
                    replacement = functools.cache(inner) if inner is not None else None
                if replacement is not None:
                    undo.append((module, name, value))
                    setattr(module, name, replacement)
        driver = cuda_backend.cuda.cudadrv.driver
        copies = {"device_to_host": _zero_host_copy, "host_to_device": _no_copy,
                  "device_to_device": _no_copy, "device_memset": _no_copy}
        undo += [(driver, name, getattr(driver, name)) for name in copies]
        for name, replacement in copies.items():
            setattr(driver, name, replacement)
        runtime = cuda_backend.cuda.cudadrv.devices._runtime   # methods that ask for a context
        undo.append((runtime, "ensure_context", runtime.ensure_context))
        runtime.ensure_context = contextlib.nullcontext
        try:
            yield self
        finally:
            for module, name, value in reversed(undo):
                setattr(module, name, value)


def _zero_host_copy(dst, src, size, stream=0):
    if isinstance(dst, np.ndarray):
        dst.fill(0)


def _no_copy(*args, **kwargs):
    pass


# ------------------------------------------------------------------ enumerating and building

def enumerate_launches(multiprocessors, runs=RUNS):
    """``{(id, argtypes): (dispatcher, argtypes)}`` of every kernel the CLI ``runs`` launch
    on a GPU of ``multiprocessors`` (one epoch each over the shipped MNIST, on the dry
    device). Runs in this process: call it from a process of its own (the build's)."""
    import io
    from engine import train
    device = DryDevice(multiprocessors)
    with device.installed():
        for run in runs:
            with contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()) as errors:
                code = train.main(run + CLI_OPTIONS)
            if code:
                raise RuntimeError(f"ops.build_kernels: the dry run of engine.train "
                                   f"{' '.join(run)} failed: {errors.getvalue().strip()}")
    if device.unpassable:
        print(f"ops.build_kernels: not shipped (arguments only Numba's launch passes): "
              f"{', '.join(sorted(device.unpassable))}")
    return device.launches


def expected_entries():
    """``{key: (dispatcher, argtypes)}`` over every target GPU."""
    entries = {}
    for _, multiprocessors in TARGETS.values():
        for kernel, argtypes in enumerate_launches(multiprocessors).values():
            entries.setdefault(cuda_backend.artifact_key(kernel, argtypes), (kernel, argtypes))
    return entries


def build(directory=cuda_backend.SHIPPED_KERNELS_DIR, log=print):
    """Compile every expected entry for every compute capability into ``directory`` and
    write its manifest; files of earlier builds that no entry names are removed."""
    started = time.perf_counter()
    entries = expected_entries()
    log(f"ops.build_kernels: {len(entries)} kernel variants "
        f"({time.perf_counter() - started:.1f} s to find them)")
    os.makedirs(directory, exist_ok=True)
    manifest = {"kernels": {}}
    for number, (key, (kernel, argtypes)) in enumerate(sorted(entries.items()), 1):
        name = f"{kernel.py_func.__module__}.{kernel.py_func.__qualname__}"
        cubins = {}
        for capability in COMPUTE_CAPABILITIES:
            compiled = cuda_backend.compile_artifact(kernel, argtypes, capability)
            if compiled is None:
                break
            entry_name, cubin = compiled   # each compile names its entry point anew
            arch = f"sm_{capability[0]}{capability[1]}"
            file_name = f"{key}.{arch}.cubin"
            with open(os.path.join(directory, file_name), "wb") as file:
                file.write(cubin)
            cubins[arch] = {"file": file_name, "entry": entry_name}
        if cubins:
            manifest["kernels"][key] = {"name": name, "argtypes": [str(t) for t in argtypes],
                                        "cubins": cubins}
        log(f"  {number}/{len(entries)} {name} {tuple(str(t) for t in argtypes)}"
            f"{'' if cubins else ': only Numba launches it, not shipped'} "
            f"({time.perf_counter() - started:.0f} s)")
    kept = {MANIFEST_FILE} | {cubin["file"] for entry in manifest["kernels"].values()
                              for cubin in entry["cubins"].values()}
    for file in os.listdir(directory):
        if file not in kept and file.endswith(".cubin"):
            os.remove(os.path.join(directory, file))
    with open(os.path.join(directory, MANIFEST_FILE), "w") as file:
        json.dump(manifest, file, indent=1, sort_keys=True)
        file.write("\n")
    size = sum(os.path.getsize(os.path.join(directory, file)) for file in kept)
    log(f"ops.build_kernels: wrote {len(manifest['kernels'])} kernels, "
        f"{len(kept) - 1} cubins, {size / 1e6:.1f} MB, in {time.perf_counter() - started:.0f} s")
    return manifest



def stale_entries(manifest=None):
    """``(stale, missing)``: keys the shipped manifest holds that no kernel of today's code
    has (built from other code, or for a variant no model launches now), and names of the
    variants today's models launch that it lacks."""
    manifest = cuda_backend.shipped_manifest() if manifest is None else manifest
    shipped = set((manifest or {"kernels": {}})["kernels"])
    expected = expected_entries()
    stale = sorted(f"{manifest['kernels'][key]['name']} {key}" for key in shipped - set(expected))
    missing = sorted(f"{kernel.py_func.__module__}.{kernel.py_func.__qualname__} "
                     f"{tuple(str(t) for t in argtypes)}"
                     for key, (kernel, argtypes) in expected.items() if key not in shipped)
    return stale, missing


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ops.build_kernels",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="compare ops/kernels/ with today's kernels, build nothing")
    args = parser.parse_args(argv)
    if cuda_backend.SIMULATOR:
        parser.error("the build needs real numba-cuda: unset NUMBA_ENABLE_CUDASIM")
    os.environ["ENGINE_SHIPPED_KERNELS"] = "0"   # the dry run looks nothing up
    if args.check:
        stale, missing = stale_entries()
        for line in stale:
            print(f"stale: {line}")
        for line in missing:
            print(f"missing: {line}")
        if stale or missing:
            print("ops/kernels/ is out of date: run python -m ops.build_kernels")
            return 1
        print("ops/kernels/ matches the kernels")
        return 0
    try:
        build()
    except RuntimeError as error:   # the dry run failed, or no compiler libraries: one line
        print(f"python -m ops.build_kernels: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
