"""Compile the CUDA kernels the CLI's models launch ahead of time, into ops/kernels/.

    python -m engine.cli.build_kernels          # rebuild ops/kernels/ (whenever kernels change)
    python -m engine.cli.build_kernels --check  # exit 1 when ops/kernels/ is not what a build makes

Which kernels: the (kernel, argument types) pairs that ``python -m engine.train`` launches
for the MLP and the CNN (Adam, SGD, AdamW) and the GPT (both presets) on an H200 and on an
A100, found by running the CLI on ``ops.cuda.DryDevice``: real numba-cuda without a GPU, whose device arrays hold no memory
(reads give zeros) and whose launches are recorded instead of run. Each pair is compiled as
Numba compiles it at a first launch (``ops.cuda.compile_artifact``) for sm_80 and sm_90, and
written as ``<key>.sm_XY.cubin`` beside a ``manifest.json``; the key is the content hash of
``ops.cuda.artifact_key``, which the launch path looks up (ops/cuda/README.md, "Shipped
kernels").

Needs NVVM, libdevice and nvJitLink, which a CPU install of the engine lacks: install NVIDIA's
wheels into a folder of their own and point CUDA_HOME at it (ops/cuda/README.md says how).
"""
import argparse
import contextlib
import json
import os
import sys
import time

from ops import cuda as cuda_runtime

# The GPUs the artifacts are built for: (compute capability, multiprocessors) of each; the
# multiprocessor count decides split-K and tile choices of the launch plans.
TARGETS = {"H200": ((9, 0), 132), "A100": ((8, 0), 108)}
COMPUTE_CAPABILITIES = ((8, 0), (9, 0))
MANIFEST_FILE = cuda_runtime.MANIFEST_NAME
# The CLI runs whose kernels are shipped: the models of engine.train with each optimizer
# (one epoch, or the GPT's two steps in each of its configurations: its first CUDA step then
# compiles nothing either)
_GPT = ["--model", "gpt", "--dataset", "shakespeare", "--steps", "2", "--eval-every", "2"]
RUNS = (["--model", "mlp", "--optimizer", "adam", "--epochs", "1"],
        ["--model", "cnn", "--optimizer", "adam", "--epochs", "1"],
        ["--model", "mlp", "--optimizer", "sgd", "--epochs", "1"],
        ["--model", "mlp", "--optimizer", "adamw", "--epochs", "1"],
        _GPT, _GPT + ["--preset", "shakespeare-char"])
CLI_OPTIONS = ["--device", "cuda", "--no-capture", "--no-save", "--no-progress"]
COMMAND = "engine.cli.build_kernels"


def enumerate_launches(multiprocessors, runs=RUNS):
    """``{(id, argtypes): (dispatcher, argtypes)}`` of every kernel the CLI ``runs`` launch
    on a GPU of ``multiprocessors`` (on the dry device). Runs in this process: call it from a process of its own (the build's)."""
    import io
    from engine import train
    device = cuda_runtime.DryDevice(multiprocessors)
    with device.installed():
        for run in runs:
            with contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()) as errors:
                code = train.main(run + CLI_OPTIONS)
            if code:
                raise RuntimeError(f"{COMMAND}: the dry run of engine.train "
                                   f"{' '.join(run)} failed: {errors.getvalue().strip()}")
    if device.unpassable:
        print(f"{COMMAND}: not shipped (arguments only Numba's launch passes): "
              f"{', '.join(sorted(device.unpassable))}")
    return device.launches


def expected_entries():
    """``{key: (dispatcher, argtypes)}`` over every target GPU."""
    entries = {}
    for _, multiprocessors in TARGETS.values():
        for kernel, argtypes in enumerate_launches(multiprocessors).values():
            entries.setdefault(cuda_runtime.artifact_key(kernel, argtypes), (kernel, argtypes))
    return entries


def build(directory=cuda_runtime.SHIPPED_KERNELS_DIR, log=print):
    """Compile every expected entry for every compute capability into ``directory`` and
    write its manifest; files of earlier builds that no entry names are removed."""
    started = time.perf_counter()
    entries = expected_entries()
    log(f"{COMMAND}: {len(entries)} kernel variants "
        f"({time.perf_counter() - started:.1f} s to find them)")
    os.makedirs(directory, exist_ok=True)
    manifest = {"kernels": {}}
    for number, (key, (kernel, argtypes)) in enumerate(sorted(entries.items()), 1):
        name = f"{kernel.py_func.__module__}.{kernel.py_func.__qualname__}"
        cubins = {}
        for capability in COMPUTE_CAPABILITIES:
            compiled = cuda_runtime.compile_artifact(kernel, argtypes, capability)
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
    log(f"{COMMAND}: wrote {len(manifest['kernels'])} kernels, "
        f"{len(kept) - 1} cubins, {size / 1e6:.1f} MB, in {time.perf_counter() - started:.0f} s")
    return manifest


def stale_entries(manifest=None):
    """``(stale, missing)``: keys the shipped manifest holds that no kernel of today's code
    has (built from other code, or for a variant no model launches now), and names of the
    variants today's models launch that it lacks."""
    manifest = cuda_runtime.shipped_manifest() if manifest is None else manifest
    shipped = set((manifest or {"kernels": {}})["kernels"])
    expected = expected_entries()
    stale = sorted(f"{manifest['kernels'][key]['name']} {key}" for key in shipped - set(expected))
    missing = sorted(f"{kernel.py_func.__module__}.{kernel.py_func.__qualname__} "
                     f"{tuple(str(t) for t in argtypes)}"
                     for key, (kernel, argtypes) in expected.items() if key not in shipped)
    return stale, missing


def main(argv=None):
    parser = argparse.ArgumentParser(prog=f"python -m {COMMAND}",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="compare ops/kernels/ with today's kernels, build nothing")
    args = parser.parse_args(argv)
    if cuda_runtime.SIMULATOR:
        parser.error("the build needs real numba-cuda: unset NUMBA_ENABLE_CUDASIM")
    os.environ["ENGINE_SHIPPED_KERNELS"] = "0"   # the dry run looks nothing up
    if args.check:
        stale, missing = stale_entries()
        for line in stale:
            print(f"stale: {line}")
        for line in missing:
            print(f"missing: {line}")
        if stale or missing:
            print(f"ops/kernels/ is out of date: run python -m {COMMAND}")
            return 1
        print("ops/kernels/ matches the kernels")
        return 0
    try:
        build()
    except RuntimeError as error:   # the dry run failed, or no compiler libraries: one line
        print(f"python -m {COMMAND}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
