"""The machine code (SASS) of the GPT's Dense GEMM kernels, compiled for the H100/H200 (sm_90)
without a GPU: what a tiling's main loop issues, for a session whose device is not lent.

    python -m bench.gemm_sass fc forward --precision high          # the plan's own kernel
    python -m bench.gemm_sass fc dX --precision high --tiling 128,256,16,8,16,3
    python -m bench.gemm_sass qkv dW --out DIR                     # also keep .cubin and .sass

The kernel is the one ``ops.gemm.plans.gemm_plan`` launches for the product (or the tiling
forced, as ``bench.tiling_sweep`` forces it: ``bench.gemm_plan``), compiled as
``engine.cli.build_kernels`` compiles the shipped ones: on the dry device
(``ops.cuda.DryDevice``), by ``ops.cuda.compile_artifact`` (NVVM and nvJitLink: CUDA_HOME as
ops/cuda/README.md says). It is disassembled by ``nvdisasm`` (CUDA_HOME/bin, PATH, or
``--nvdisasm``: NVIDIA's ``nvidia-cuda-nvdisasm`` wheel holds one), and ``cuobjdump`` beside
it, where found, gives its registers and stack. Printed: those, and the instruction mix of the
loop holding the most multiply instructions (HMMA, FFMA), the main loop. Session 27 read here
that the TF32 kernel's K loop stayed a loop of one step a pass and that rounding a fragment
register (``cvt.rna``) takes two instructions, before timing either on a GPU.
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np

from bench.gemm_plan import GPT_DENSE, GPT_ROWS, dense_gemm, planned

_LAYERS = {name: (features, outputs) for name, features, outputs in GPT_DENSE}
_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z0-9_]+)[.\s;]")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"BRA\s+`?\(?(\.L_x_\d+)")


def _tool(name, given):
    """The path of CUDA tool ``name``: ``given``, CUDA_HOME/bin, or PATH; None if none."""
    for path in (given, os.path.join(os.environ.get("CUDA_HOME", ""), "bin", name),
                 shutil.which(name)):
        if path and os.path.isfile(path):
            return path
    return None


def compiled_gemm(layer, mode_name, precision, tiling=None, capability=(9, 0),
                  multiprocessors=132):
    """``(config, entry name, cubin bytes)`` of the first kernel the plan launches for
    ``layer``'s ``mode_name`` product ("forward", "dX", "dW") at ``precision``."""
    from numba import typeof

    import engine  # noqa: F401  every module loaded before the dry device replaces names
    from ops import cuda as cuda_runtime
    from ops.gemm import gpu_facts, mma, plans, template  # noqa: F401
    from ops.gemm.tilings import FORWARD, GRAD_A, GRAD_B
    mode = {"forward": FORWARD, "dX": GRAD_A, "dW": GRAD_B}[mode_name]
    with cuda_runtime.DryDevice(multiprocessors).installed():
        def empty(*shape):
            return cuda_runtime.device_empty(shape, np.float32)
        *shape, args = dense_gemm(mode, GPT_ROWS, *_LAYERS[layer], empty, empty)
        launches, config = planned(mode, *shape, args, precision, tiling)
        kernel, _, _, kernel_args = launches[0]
        entry, cubin = cuda_runtime.compile_artifact(
            kernel, [typeof(a) for a in kernel_args], capability)
    return config, entry, cubin


def main_loop_mix(sass):
    """The instruction counts of the loop (a label and a later branch back to it) holding
    the most HMMA and FFMA instructions, and its length."""
    lines = sass.splitlines()
    labels, best = {}, (None, 0)
    for number, line in enumerate(lines):
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = number
        branch = _BRANCH.search(line)
        if branch and branch.group(1) in labels:
            body = lines[labels[branch.group(1)]:number + 1]
            names = [m.group(1) for m in map(_INSTRUCTION.match, body) if m]
            products = sum(n in ("HMMA", "FFMA", "DFMA") for n in names)
            if products > best[1]:
                best = (collections.Counter(names), products)
    return best[0]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.gemm_sass",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("layer", choices=sorted(_LAYERS))
    parser.add_argument("mode", choices=("forward", "dX", "dW"))
    parser.add_argument("--precision", default="highest", choices=("highest", "high", "medium"))
    parser.add_argument("--tiling", help="BM,BN,BK,TM,TN[,stages]: forced, as the sweeps force "
                                         "one (a tensor-core format's at high or medium)")
    parser.add_argument("--out", help="keep the .cubin and .sass in this folder")
    parser.add_argument("--nvdisasm", help="nvdisasm's path (else CUDA_HOME/bin, PATH)")
    options = parser.parse_args(argv)
    nvdisasm = _tool("nvdisasm", options.nvdisasm)
    if nvdisasm is None:
        parser.error("nvdisasm not found: give --nvdisasm PATH (pip's nvidia-cuda-nvdisasm "
                     "holds one) or put it in CUDA_HOME/bin")
    tiling = None
    if options.tiling:
        from ops.gemm.tilings import Tiling
        from ops.matmul_precision import TENSOR_CORE_FORMATS
        numbers = [int(v) for v in options.tiling.split(",")]
        if len(numbers) not in (5, 6):
            parser.error(f"--tiling takes BM,BN,BK,TM,TN[,stages], got {options.tiling!r}")
        tiling = Tiling(*numbers[:5], mma=TENSOR_CORE_FORMATS.get(options.precision),
                        stages=numbers[5] if len(numbers) == 6 else None)
    config, entry, cubin = compiled_gemm(options.layer, options.mode, options.precision, tiling)
    folder = options.out or tempfile.mkdtemp(prefix="gemm_sass_")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{options.layer}_{options.mode}_{options.precision}.cubin")
    with open(path, "wb") as file:
        file.write(cubin)
    sass = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True,
                          check=True).stdout
    with open(path + ".sass", "w") as file:
        file.write(sass)
    print(f"{options.layer} {options.mode} at {options.precision}: tiling "
          f"{tuple(config.tiling[:5])}, stages {config.tiling.stages}, split {config.split}")
    cuobjdump = _tool("cuobjdump", os.path.join(os.path.dirname(nvdisasm), "cuobjdump"))
    if cuobjdump:
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True,
                               text=True).stdout
        found = re.search(r"REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+", usage)
        print(found.group(0) if found else usage.strip())
    mix = main_loop_mix(sass)
    if mix:
        print(f"main loop, {sum(mix.values())} instructions: "
              + ", ".join(f"{name} {count}" for name, count in mix.most_common(12)))
    print(f"{len(sass.splitlines())} lines of SASS: {path}.sass")


if __name__ == "__main__":
    main()
