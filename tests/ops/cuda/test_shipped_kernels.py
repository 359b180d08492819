"""Kernels compiled ahead of time (ops/kernels/, ``python -m engine.cli.build_kernels``): the
shipped ones match today's kernels, a change to what a kernel is made from changes its key (so a
stale artifact is never found), and on a GPU a step through them computes what Numba's own
compiles compute."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ops import cuda as cuda_runtime
from tests.support.paths import REPO_ROOT

needs_real_numba_cuda = pytest.mark.skipif(
    cuda_runtime.SIMULATOR, reason="the simulator has no dispatchers to hash (a CPU test)")


def _run(code, **environment):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_ROOT,
                          env={**os.environ, **environment}, capture_output=True, text=True,
                          timeout=600)


@needs_real_numba_cuda
def test_shipped_kernels_are_those_of_todays_code():
    """Every artifact in ops/kernels/ is keyed by the hash of a kernel variant the CLI's models
    launch today, and every such variant is shipped. On a failure: rerun the build."""
    child = subprocess.run([sys.executable, "-m", "engine.cli.build_kernels", "--check"],
                           cwd=REPO_ROOT, env={k: v for k, v in os.environ.items()
                                          if k != "NUMBA_ENABLE_CUDASIM"},
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, (
        f"ops/kernels/ is stale: run python -m engine.cli.build_kernels (ops/cuda/README.md, "
        f"'Shipped kernels', says what it needs)\n{child.stdout}{child.stderr[-3000:]}")


def test_the_manifest_names_files_that_are_shipped():
    manifest = cuda_runtime.shipped_manifest()
    assert manifest is not None and manifest["kernels"], "ops/kernels/manifest.json is missing"
    for key, entry in manifest["kernels"].items():
        assert set(entry["cubins"]) == {"sm_80", "sm_90"}, (key, entry)
        for cubin in entry["cubins"].values():   # the entry point get_kernel asks for is in it
            assert cubin["file"].startswith(key), cubin
            with open(os.path.join(cuda_runtime.SHIPPED_KERNELS_DIR, cubin["file"]), "rb") as file:
                assert cubin["entry"].encode() in file.read(), cubin


@needs_real_numba_cuda
def test_the_key_changes_with_anything_the_code_is_made_from(monkeypatch):
    """The key of a kernel follows its source, a constant it reads, the device function it
    calls (and that one's own callees), the argument types and its compile options; the same
    code gives the same key again. ops.loss's cross-entropy kernels: the rows' losses (calling
    ``_row_loss_cuda``) and their mean (reading ``REDUCE_THREADS``, calling the block
    reduction)."""
    from numba import types

    from ops import block_reduce, loss
    from ops.cuda import fingerprints
    rows_kernel, mean_kernel = loss.cross_entropy_rows_cuda, loss.mean_of_rows_cuda
    rows_types = (types.float32[::1], types.int64[::1], types.float32[::1], types.float64[::1],
                  types.int64[::1])
    mean_types = (types.float64[::1], types.float32[::1])

    def keys():
        fingerprints._fingerprints.clear()   # what a fresh process computes
        return (cuda_runtime.artifact_key(rows_kernel, rows_types),
                cuda_runtime.artifact_key(mean_kernel, mean_types))

    original = keys()
    assert keys() == original
    monkeypatch.setattr(loss, "REDUCE_THREADS", loss.REDUCE_THREADS * 2)
    assert keys()[1] != original[1]
    monkeypatch.undo()
    assert keys() == original
    monkeypatch.setattr(loss, "_row_loss_cuda", loss._cross_entropy_grad_cuda)
    assert keys()[0] != original[0]
    monkeypatch.undo()
    monkeypatch.setattr(block_reduce, "SUM", block_reduce.SUM + 100)   # a callee's constant
    assert keys()[1] != original[1]
    monkeypatch.undo()
    assert cuda_runtime.artifact_key(mean_kernel, (types.float64[::1], types.float64[::1])) \
        != original[1]
    monkeypatch.setitem(mean_kernel.targetoptions, "fastmath", True)
    assert keys()[1] != original[1]
    monkeypatch.undo()
    assert keys() == original


@needs_real_numba_cuda
def test_a_changed_source_gives_a_new_key(tmp_path):
    """Two processes importing a kernel module that differs in one line of a device function
    the kernel calls give different keys; an unchanged one gives the same key."""
    def module(scale):
        return textwrap.dedent(f"""
            from ops.cuda import cuda

            @cuda.jit(device=True)
            def scaled(x):
                return x * {scale}

            @cuda.jit
            def kernel(a):
                i = cuda.grid(1)
                if i < a.size:
                    a[i] = scaled(a[i])
            """)
    code = f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from numba import types
        from ops import cuda as cuda_runtime
        from ops.cuda import fingerprints
        fingerprints.PROJECT_PACKAGES += ("shipped_probe",)
        import shipped_probe
        print(cuda_runtime.artifact_key(shipped_probe.kernel, (types.float32[::1],)))
        """
    keys = []
    for scale in (2, 2, 3):
        (tmp_path / "shipped_probe.py").write_text(module(scale))
        child = _run(code)
        assert child.returncode == 0, child.stderr
        keys.append(child.stdout.strip())
    assert keys[0] == keys[1] != keys[2]


# ------------------------------------------------------------------ on a GPU

_STEP = """
    import json, os
    import numpy as np
    import engine, optim
    from engine.losses import cross_entropy
    from engine.models import build_mlp
    from ops.cuda import shipped as shipped_kernels
    engine.manual_seed(0)
    model = build_mlp((28, 28), (256, 128), 10).to("cuda")
    optimizer = optim.Adam(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    x = engine.tensor(rng.standard_normal((128, 28, 28)).astype(np.float32), device="cuda")
    y = engine.tensor(rng.integers(0, 10, 128), device="cuda")
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.item()))
    weights = [p.numpy().tolist() for p in model.parameters()]
    shipped = sum(1 for f in shipped_kernels._shipped.values() if f is not None)
    unshipped = sorted(kernel.py_func.__qualname__
                       for (kernel, _), f in shipped_kernels._shipped.items() if f is None)
    print(json.dumps({"losses": losses, "weights": weights, "shipped": shipped,
                      "unshipped": unshipped}))
    """


@pytest.mark.gpu
def test_a_step_through_shipped_kernels_equals_numbas_own_compiles(tmp_path):
    """Three MLP steps from an empty Numba cache, with the shipped kernels and without them:
    the same losses and weights, and the first run loaded every kernel it launched from
    ops/kernels/ (the second none). Not asked bit for bit: the GPU machine's NVVM, which
    compiles the second run, may contract a multiply-add into an FMA where the build's did
    not."""
    results = []
    for shipped in ("1", "0"):
        cache = tmp_path / f"cache{shipped}"
        child = _run(_STEP, ENGINE_SHIPPED_KERNELS=shipped, NUMBA_CACHE_DIR=str(cache))
        assert child.returncode == 0, child.stderr
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
    with_shipped, without = results
    assert with_shipped["shipped"] > 0 and without["shipped"] == 0
    assert with_shipped["unshipped"] == []   # the dry run found what this GPU launches
    np.testing.assert_allclose(with_shipped["losses"], without["losses"], rtol=1e-6)
    for a, b in zip(with_shipped["weights"], without["weights"]):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-7)
