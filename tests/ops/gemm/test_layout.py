"""The GEMM's room, ops/gemm/: its tiling catalogue and pickers read without Numba, the GPU
facts they ask for replaced by the dry device of ``engine.cli.build_kernels`` per target, and the
files of the GEMM, the convolution and batch norm within the size the guide allows."""
import subprocess
import sys
import textwrap

from tests.support.paths import REPO_ROOT


# ``ops/__init__.py`` installs the CUDA allocator (Numba) as the package loads: a stand-in
# package object with the same path lets the child import ops.gemm's modules alone, so what
# is proven is that they and everything they import need no Numba.
_WITHOUT_NUMBA = textwrap.dedent("""
    import sys, types
    sys.modules["numba"] = None   # any import of numba or numba.* now raises ImportError
    ops = types.ModuleType("ops")
    ops.__path__ = [{ops_path!r}]
    sys.modules["ops"] = ops
    import ops.gemm.tilings as tilings
    import ops.gemm.choices as choices
    loaded = sorted(name for name, module in sys.modules.items()
                    if module is not None and name.split(".")[0] in ("numba", "llvmlite"))
    assert not loaded, loaded
    assert "LARGE" in tilings.TILINGS and "TF32_PIPELINED" in tilings.TILINGS
    for tiling in tilings.TILINGS.values():
        tilings.check_tiling(tiling)
    # a shape of the measured table needs no GPU facts; the rule's would import gpu_facts
    print(choices.pick_config(128, 256, 784, False, False).split,
          choices.k_slices(784, 13, 32), len(tilings.TILINGS))
""")


def test_the_tilings_and_their_pickers_import_without_numba():
    code = _WITHOUT_NUMBA.format(ops_path=str(REPO_ROOT / "ops"))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    from ops.gemm import choices, tilings
    entry = choices.GEMM_CHOICES[(128, 256, 784, False, False)]
    assert result.stdout.split() == [str(entry.split), str(choices.k_slices(784, 13, 32)),
                                     str(len(tilings.TILINGS))]


def test_the_dry_device_gives_the_pickers_each_targets_multiprocessors():
    """``ops.gemm.choices`` reads the multiprocessor count through ``ops.gemm.gpu_facts``'
    cache, which the dry device replaces: each target's count, not the first one cached.
    The build imports engine.train, and with it the GEMM, before it installs a dry device."""
    import ops.matmul  # noqa: F401
    from ops.cuda.dry_device import DryDevice
    from ops.gemm import choices
    for multiprocessors in (132, 108):
        with DryDevice(multiprocessors).installed():
            assert choices._multiprocessors() == multiprocessors


def test_a_long_product_splits_k_into_medium_128_tiles():
    """K many times the output's sides (a weight gradient over a large batch): MEDIUM_128
    tiles, K split until the multiprocessors have LONG_BLOCKS_PER_SM blocks each, slices of
    at least LONG_SLICE_K; the GPT's measured shapes keep their table entries, and a square
    product is not long."""
    import ops.matmul  # noqa: F401
    from ops.cuda.dry_device import DryDevice
    from ops.gemm import choices, tilings
    with DryDevice(132).installed():
        unlisted = choices.pick_config(384, 1152, 32768, True, False, extra_rows=1)
        assert unlisted == choices.GemmConfig(tilings.MEDIUM_128, -(-24 * 132 // (7 * 18)))
        assert choices.pick_config(384, 1152, 16384, True, False, extra_rows=1) == \
            choices.GEMM_CHOICES[(384, 1152, 16384, True, False)]
        short = choices.pick_config(64, 64, 2048, True, False, extra_rows=1)   # 4 slices of 512
        assert short == choices.GemmConfig(tilings.MEDIUM_128, 4)
        assert choices.pick_config(4096, 4096, 4096, False, False).tiling == tilings.LARGE
        assert choices.pick_config(384, 1152, 3000, True, False, extra_rows=1).tiling != \
            tilings.MEDIUM_128


def test_a_measured_tensor_core_choice_stands_where_its_pipeline_can_copy_the_operands():
    """MMA_CHOICES gives the GPT's TF32 forwards K steps of 16 in 3 stages where the plan
    found the operands fit for a pipeline; where not (pipelined None), the rule's register
    tiling; bf16 and the FMA path do not read the TF32 entries."""
    import ops.matmul  # noqa: F401
    from ops.cuda.dry_device import DryDevice
    from ops.gemm import choices, tilings
    shape = (16384, 1152, 384, False, False)
    with DryDevice(132).installed():
        chosen = choices.pick_config(*shape, mma="tf32", pipelined=tilings.TF32_PIPELINED)
        assert chosen == choices.MMA_CHOICES[("tf32",) + shape]
        assert chosen.tiling == tilings.TF32_PIPELINED_PROLOGUE
        assert choices.pick_config(*shape, mma="tf32").tiling == tilings.TF32_LARGE
        assert choices.pick_config(*shape, mma="bf16",
                                   pipelined=tilings.BF16_PIPELINED).tiling == \
            tilings.BF16_PIPELINED
        assert choices.pick_config(*shape).tiling == choices.GEMM_CHOICES[shape].tiling


def _lines(path):
    return len(path.read_text().splitlines())


def test_the_gemm_conv_and_batch_norm_files_stay_small():
    files = sorted((REPO_ROOT / "ops" / "gemm").glob("*.py")) + [
        REPO_ROOT / "ops" / name for name in ("conv.py", "conv_cpu.py", "batch_norm.py",
                                         "batch_norm_cpu.py", "batch_norm_cuda.py")]
    too_long = {str(path.relative_to(REPO_ROOT)): _lines(path) for path in files
                if _lines(path) > 400}
    assert not too_long, too_long
    assert _lines(REPO_ROOT / "ops" / "matmul.py") <= 120
