"""Smoke tests of the benchmark scripts on tiny data (they measure nothing here) and of the
launch recorder bench.mlp counts with."""
import collections
import functools
import importlib.util
import json
import math

import numpy as np
import pytest

import engine
from bench import cnn, harness, mlp, ops as bench_ops
from ops.launch import LaunchRecorder

HAS_TORCH = importlib.util.find_spec("torch") is not None


@pytest.mark.cuda
def test_launch_recorder_counts_launches_and_stops_at_exit():
    a = engine.tensor(np.ones((3, 5), np.float32), device="cuda")
    with engine.debug.poison(False), LaunchRecorder() as recorder:
        (a + a).relu()
        a.sum()
    a.sum()
    assert recorder.cuda_launches() == 3
    assert [run.kernel.name for run in recorder.runs] == ["add", "relu", "sum"]


@pytest.fixture
def neighbours(monkeypatch):
    """The busy processes bench.harness.busy_neighbour starts (for bench.mlp and bench.cnn),
    as started."""
    started = []
    real_neighbour = harness.busy_neighbour

    def recorded_neighbour():
        started.append(real_neighbour())
        return started[-1]

    monkeypatch.setattr(harness, "busy_neighbour", recorded_neighbour)
    return started


def assert_busy_neighbour_timed_the_epochs_again_and_stopped(row, epochs, neighbours, output):
    assert len(row["loaded_epoch_s"]) == epochs and row["loaded_s_per_epoch"] > 0
    assert row["loaded_over_quiet"] == row["loaded_s_per_epoch"] / row["s_per_epoch"]
    assert len(neighbours) == 1 and neighbours[0].poll() is not None   # stopped at the end
    assert "beside a busy process (started and stopped by this run" in output


# Each smoke test runs its benchmark once with --busy-neighbour (the loaded epochs follow the
# quiet ones): a second run for the loaded epochs alone took 3-39 s more on the 2-core machine.
def test_bench_mlp_smoke_and_busy_neighbour(tmp_path, capsys, neighbours):
    path = tmp_path / "mlp.json"
    mlp.main(["--device", "cpu", "--epochs", "2", "--limit", "256", "--hidden", "16",
              "--no-compile-time", "--busy-neighbour", "--json", str(path)])
    result = json.loads(path.read_text())
    engine_row = result["results"]["engine"]
    assert len(engine_row["epoch_s"]) == 2 and engine_row["s_per_epoch"] > 0
    assert 0 <= engine_row["test_acc"] <= 1
    assert engine_row["tape_nodes_between_steps_max"] == 0
    assert ("torch" in result["results"]) == HAS_TORCH
    output = capsys.readouterr().out
    assert "| engine, fit (captured step) |" in output
    assert "| engine, fit(capture=False) |" in output
    assert result["separate_processes"] and "each row in a process of its own" in output
    assert_busy_neighbour_timed_the_epochs_again_and_stopped(engine_row, 2, neighbours, output)


def test_bench_cnn_smoke_and_busy_neighbour(tmp_path, capsys, neighbours):
    path = tmp_path / "cnn.json"
    cnn.main(["--device", "cpu", "--epochs", "1", "--limit", "128", "--no-compile-time",
              "--busy-neighbour", "--json", str(path)])
    result = json.loads(path.read_text())
    rows = result["results"]
    assert len(rows["engine"]["epoch_s"]) == 1 and rows["engine"]["s_per_epoch"] > 0
    assert rows["engine"]["test_acc"] == rows["engine eager"]["test_acc"]   # one computation
    assert ("torch" in rows) == HAS_TORCH
    if HAS_TORCH:   # same network, initial weights and batches: the same predictions, nearly
        assert abs(rows["torch"]["test_acc"] - rows["engine"]["test_acc"]) <= 2 / 128
    assert result["engine_threads_loaded"] >= 1
    assert result["epochs_trained"] == 3   # the warm-up, the timed epoch, the loaded one
    output = capsys.readouterr().out
    assert "| engine, fit (captured step) |" in output and "after all 3 epochs" in output
    assert result["separate_processes"] and "each row in a process of its own" in output
    assert "| framework | s/epoch |" in output
    assert_busy_neighbour_timed_the_epochs_again_and_stopped(rows["engine"], 1, neighbours,
                                                             output)


def counting_side(start):
    """A side for bench.framework_process: counts from ``start``; its info its process."""
    import os
    count = [int(start)]

    def step(by):
        count[0] += by
        return count[0]

    def fail():
        raise ValueError("the side's own error")

    return {"step": step, "pid": os.getpid, "fail": fail}, {"built_in": os.getpid()}


def test_a_framework_process_builds_and_runs_its_side_in_another_process_and_stops():
    import os
    from bench.framework_process import FrameworkProcess, LocalSide, open_side
    side = open_side(True, "counter", counting_side, 10)
    try:
        assert isinstance(side, FrameworkProcess)
        assert side.info["built_in"] == side.call("pid") != os.getpid()
        assert [side.call("step", 1), side.call("step", 5)] == [11, 16]   # state kept
        with pytest.raises(RuntimeError, match="the counter process failed while fail:"
                                               "(.|\n)*the side's own error"):
            side.call("fail")
        assert side.call("step", 1) == 17   # a failed call leaves the side usable
    finally:
        side.close()
    assert not side._process.is_alive()
    local = open_side(False, "counter", counting_side, 0)
    assert isinstance(local, LocalSide) and local.info["built_in"] == os.getpid()
    assert local.call("step", 2) == 2


def test_a_framework_process_that_fails_to_build_raises_with_its_traceback():
    from bench.framework_process import FrameworkProcess
    side = FrameworkProcess("counter", counting_side, "not a number")
    try:
        with pytest.raises(RuntimeError, match="the counter process failed while building:"
                                               "(.|\n)*invalid literal for int"):
            side.call("step", 1)
    finally:
        side.close()


@pytest.mark.parametrize("model", ["mlp:16", "cnn", "gpt:cpu"])
def test_first_step_times_of_each_model(model):
    """What each fresh process of ``compile_times`` runs and reports (here in this process:
    the fresh processes are the benchmark's, not a test's)."""
    import time
    timing = harness.time_first_steps("cpu", model, time.perf_counter())
    compiles = timing.pop("first_step_compiles")
    assert set(timing) == {"import_and_setup_s", "first_step_s", "second_step_s",
                           "first_step_cpu_s"}
    assert all(seconds > 0 for seconds in timing.values())
    line, = harness.format_first_steps({"warm": {**timing, "process_s": 1.5,
                                             "first_step_compiles": []}})
    assert line.startswith("first step, warm cache: ") and "whole process 1.5 s" in line
    # this process's cache may hold every kernel already: what was compiled is a list of
    # (name, seconds), the costliest first
    assert all(isinstance(name, str) and seconds > 0 for name, seconds in compiles)
    assert [seconds for _, seconds in compiles] == sorted(
        (seconds for _, seconds in compiles), reverse=True)


def test_the_first_step_lists_each_function_numba_compiled_in_it_once():
    from numba import njit
    values = np.zeros(3)

    @njit
    def fresh(a):
        a[0] = 1.0

    with harness.Compiles() as compiles:
        fresh(values)
        fresh(values)   # compiled once
    (name, seconds), = compiles
    assert name.endswith("fresh") and seconds > 0
    line = harness.format_first_steps({"cold": {
        "first_step_s": 2.0, "first_step_cpu_s": 1.9, "second_step_s": 0.004,
        "import_and_setup_s": 1.0, "process_s": 3.5, "first_step_compiles": compiles}})[1]
    assert line.startswith("  functions Numba compiled in that first step: 1, ")


@pytest.mark.torch
def test_bench_hybrid_mnist_engine_row_trains_as_the_hybrid(tmp_path):
    from bench import hybrid_mnist
    path = tmp_path / "hybrid.json"
    hybrid_mnist.main(["--limit", "128", "--epochs", "1", "--json", str(path)])
    result = json.loads(path.read_text())
    hybrid, alone = result["epochs"][0], result["engine_cnn_epochs"][0]
    # the same network, initial weights and batches: only who convolves differs
    assert alone["loss"] == pytest.approx(hybrid["loss"], rel=1e-4)
    assert alone["test_acc"] == pytest.approx(hybrid["test_acc"], abs=0.002)


def test_bench_ops_quick_smoke(tmp_path, capsys):
    path = tmp_path / "ops.json"
    bench_ops.main(["--quick", "--json", str(path)])
    rows = json.loads(path.read_text())["rows"]
    assert [row["op"] for row in rows] == list(bench_ops.MLP_SIZE)
    assert all(row["us_per_call"]["engine"] > 0 and row["throughput"]["numpy"] > 0 for row in rows)
    assert all(row["gpu_us_per_call"] is None for row in rows)   # GPU time: on CUDA only
    assert "| dense relu | 128x784 @ 784x256 |" in capsys.readouterr().out


def test_bench_ops_table_on_cuda_puts_gpu_times_beside_the_wall_times():
    row = {"op": "sum", "shapes": [[1024, 1024]], "unit": "GB/s",
           "us_per_call": {"engine": 30.0, "numpy": 200.0, "torch": 10.0},
           "gpu_us_per_call": {"engine": 8.5, "torch": 4.3},
           "throughput": {"engine": 140.0, "numpy": 21.0, "torch": 419.0}}
    lines = bench_ops.format_table({"device": "cuda", "rows": [row]}).splitlines()
    header, rule, sum_row = lines[-3:]
    assert header == ("| op | shape | engine us | numpy us | torch us | engine gpu us | "
                      "torch gpu us | unit | engine | numpy | torch |")
    assert sum_row == ("| sum | 1024x1024 | 30.0 | 200.0 | 10.0 | 8.5 | 4.3 | GB/s | 140.00 | "
                       "21.00 | 419.00 |")
    assert rule.count("|") == header.count("|")


@pytest.mark.cuda
def test_a_training_step_launches_at_most_16_kernels_and_leaves_the_tape_empty():
    """The GPU target of the reference MLP (3 Dense layers, fused cross-entropy, Adam): at
    most 16 launches per eager step, the loader's batch gather, gradient clipping and the
    advance of Adam's device step count included; a captured fit replays several steps per
    graph launch, so fewer than one kernel per step runs from Python (the copy of the loss
    out of each replay)."""
    import data
    import optim
    from engine.losses import cross_entropy
    from engine.fit import fit
    from engine.models import build_mlp

    images = np.random.default_rng(0).integers(0, 256, (32, 8), dtype=np.uint8)
    model = build_mlp((8,), (4, 4), 10).to("cuda")
    optimizer = optim.Adam(model.parameters())
    loader = data.DataLoader(images, np.arange(32) % 10, batch_size=16, shuffle=True, seed=0,
                             device="cuda", normalize=(0.5, 0.3))
    clip = functools.partial(optim.clip_grad_norm_, max_norm=1.0)
    for capture, most in ((False, 16), (True, 1)):
        # the first fit warms up (and, captured, records); the second is counted
        fit(model, loader, optimizer, cross_entropy, 1, clip=clip, progress=False,
            verbose=False, capture=capture)
        with engine.debug.poison(False), LaunchRecorder() as recorder:
            fit(model, loader, optimizer, cross_entropy, 2, start_epoch=1, clip=clip,
                progress=False, verbose=False, capture=capture)
        # the metrics' zeroing fills run once a pass, outside the steps
        fills = sum(1 for run in recorder.runs if run.kernel.name == "fill")
        assert (recorder.cuda_launches() - fills) / len(loader) <= most, capture
        assert len(engine.autograd.current_tape()) == 0


def test_bench_cpu_split_times_each_layer_at_1_and_2_threads_and_restores_the_default(capsys):
    from bench import cpu_split
    from ops import cpu_threads
    result = cpu_split.main(["--rounds", "2"])
    assert [(row["layer"], row["part"]) for row in result["rows"]] == [
        (name, part) for name, *_ in cpu_split.LAYERS for part in ("forward", "backward")]
    assert all(row["median_us_1"] > 0 and row["median_us_2"] > 0 for row in result["rows"])
    assert cpu_threads.following_load()
    assert "| dense 784->256 | forward | 25.7M |" in capsys.readouterr().out


def test_bench_cpu_split_busy_neighbour_times_each_call_again_and_stops_its_process(
        capsys, neighbours):
    from bench import cpu_split
    result = cpu_split.main(["--rounds", "2", "--busy-neighbour"])
    assert all(row["loaded_median_us_1"] > 0 and row["loaded_median_us_2"] > 0
               for row in result["rows"])
    assert len(neighbours) == len(result["rows"])
    assert all(neighbour.poll() is not None for neighbour in neighbours)   # each stopped
    assert "beside a busy process: 1 thread | 2 threads | 2 / 1 |" in capsys.readouterr().out


def test_bench_cpu_step_times_every_run_of_the_mlp_step_in_order_and_restores_blas(capsys):
    from bench import cpu_step
    from ops import cpu_threads
    from ops.gemm import cpu as gemm_cpu
    product, stalled = gemm_cpu.blas_product, cpu_threads.split_stalled
    result = cpu_step.main(["--steps", "3", "--threads", "2"])
    runs = [row["run"] for row in result["rows"]]
    assert runs[0] == "gather_rows" and runs[-1] == "adam"
    assert [run for run in runs if run.startswith("dense_forward")] == [
        "dense_forward_relu 784->256", "dense_forward_relu 256->128",
        "dense_forward_linear 128->10"]
    first = result["rows"][runs.index("dense_backward_relu 784->256")]
    assert 0 < first["blas_median_us"] <= first["run_median_us"]
    assert sum(row["run_median_us"] for row in result["rows"]) <= 1.5 * result["step_median_us"]
    assert gemm_cpu.blas_product is product and cpu_threads.split_stalled is stalled
    assert cpu_threads.following_load()
    assert "| the whole step |" in capsys.readouterr().out


def test_bench_cpu_step_of_the_gpt_times_its_attention_and_layer_norms(capsys):
    from bench import cpu_step
    result = cpu_step.main(["--model", "gpt", "--steps", "2", "--threads", "1"])
    runs = [row["run"] for row in result["rows"]]
    assert runs.count("attention") == runs.count("attention_grad") == 4   # one a layer
    assert runs.count("layer_norm") == 9 and runs[-1] == "adam"
    assert "the GPT's CPU step replayed 2 times" in capsys.readouterr().out


def test_bench_cpu_step_of_the_cnn_names_each_convolution_by_its_channels(capsys):
    from bench import cpu_step
    from ops import cpu_threads
    result = cpu_step.main(["--model", "cnn", "--steps", "2", "--threads", "1"])
    runs = [row["run"] for row in result["rows"]]
    assert [run for run in runs if run.startswith("conv2d")] == [
        "conv2d_forward 1->32 28x28", "conv2d_forward 32->64 14x14",
        "conv2d_backward 32->64 14x14", "conv2d_backward 1->32 28x28"]
    assert runs[0] == "gather_rows" and runs[-1] == "adam" and "max_pool2d_grad" in runs
    assert cpu_threads.following_load()
    assert "the CNN's CPU step replayed 2 times on 1 engine threads" in capsys.readouterr().out


def test_bench_tiling_sweep_candidates_are_valid_tilings_and_it_needs_a_gpu():
    from bench import tiling_sweep
    from ops.gemm import tilings
    for candidates in (tiling_sweep.tensor_core_candidates(), tiling_sweep.pipelined_candidates(),
                       tiling_sweep.fp32_candidates(), tiling_sweep.gpt_candidates(),
                       tiling_sweep.gpt_candidates("tf32"), tiling_sweep.gpt_candidates("bf16")):
        for tiling in candidates.values():
            tilings.check_tiling(tiling)
    for _, tiling, split in tiling_sweep.wide_mlp_candidates():
        tilings.check_tiling(tiling)
        assert split >= 1
    with pytest.raises(SystemExit, match="bench.tiling_sweep: needs a CUDA GPU"):
        tiling_sweep.main(["fp32"])


# nvdisasm's listing of a loop (sm_90 SASS): a label, its body, and the branch back to it
_SASS_LOOP = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_7:
        /*0010*/                   LDS R136, [R154] ;
        /*0020*/                   FSETP.GEU.AND P0, PT, |R136|, +INF , PT ;
        /*0030*/                   HMMA.1688.F32.TF32 R8, R136, R152, R8 ;
        /*0040*/                   HMMA.1688.F32.TF32 R40, R140, R152, R40 ;
        /*0050*/              @!P0 BRA `(.L_x_7) ;
.L_x_8:
        /*0060*/                   FADD R2, R2, R3 ;
        /*0070*/               @P1 BRA `(.L_x_8) ;
        /*0080*/                   EXIT ;
"""


def test_bench_gemm_sass_counts_the_main_loop_and_names_a_missing_disassembler(monkeypatch,
                                                                              capsys):
    import shutil

    from bench import gemm_sass
    mix = gemm_sass.main_loop_mix(_SASS_LOOP)   # the loop with the products, not the other
    assert mix == {"LDS": 1, "FSETP": 1, "HMMA": 2, "BRA": 1}
    monkeypatch.setenv("CUDA_HOME", "/nonexistent")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(SystemExit):
        gemm_sass.main(["fc", "forward"])
    assert "nvdisasm not found" in capsys.readouterr().err


def test_bench_gpu_step_needs_a_gpu_and_its_table_gives_each_kernel_its_share(capsys):
    from bench import gpu_step
    from ops.device import cuda_available
    if not cuda_available():
        with pytest.raises(SystemExit):
            gpu_step.main(["--preset", "cpu"])
        assert "no CUDA GPU is usable here" in capsys.readouterr().err
    table = gpu_step.format_table({
        "preset": "gpu", "precision": "highest", "dropout": 0.2, "launches": 3,
        "eager_step_ms": 5.0, "kernels_ms": 4.0,
        "rows": [{"kernel": "attention_grad: attention_grad_q_cuda", "launches": 2, "ms": 3.0},
                 {"kernel": "adamw: adamw_cuda", "launches": 1, "ms": 1.0}]})
    assert "| attention_grad: attention_grad_q_cuda | 2 | 3.000 | 75.0% |" in table
    assert "add to 4.00 ms (the eager step's wall time 5.0 ms)" in table


@pytest.mark.gpu
def test_bench_gpu_step_times_every_launch_of_the_gpt_step():
    from bench import gpu_step
    result = gpu_step.main(["--preset", "cpu", "--repeats", "1"])
    kernels = collections.Counter()   # launches of each op, its rows (kernels) together
    for row in result["rows"]:
        kernels[row["kernel"].split(":")[0]] += row["launches"]
    assert kernels["attention"] == kernels["attention_grad"] / 2 == 4   # dQ, dK/dV a layer
    assert sum(row["launches"] for row in result["rows"]) == result["launches"]
    assert result["kernels_ms"] > 0


def test_settle_waits_for_a_quiet_machine_at_most_its_timeout(monkeypatch):
    import time
    monkeypatch.setattr(harness, "_runnable_threads", lambda: 3)   # others keep running
    start = time.monotonic()
    harness.settle(timeout_s=0.05)
    assert 0.05 <= time.monotonic() - start < 1.0
    looks = iter([3, 1, 1, 1])   # quiet from the second look on: three quiet looks end it
    monkeypatch.setattr(harness, "_runnable_threads", lambda: next(looks))
    harness.settle(timeout_s=10.0)
    monkeypatch.setattr(harness, "_runnable_threads", lambda: None)   # no /proc/stat
    start = time.monotonic()
    harness.settle(timeout_s=10.0)
    assert time.monotonic() - start < 0.5


@pytest.mark.torch
def test_bench_gpt_on_the_cpu_runs_each_framework_in_a_process_of_its_own():
    """Two steps of each side, one a block, the validation loss after them: both rows,
    from processes of their own."""
    import math

    from bench import gpt
    result = gpt.measure("cpu", "cpu", steps=2, warmup=1, block=1, eval_every=2,
                         eval_batches=1, compiled=False)
    assert result["separate_processes"]
    assert set(result["rows"]) == {"engine", "torch"}
    for row in result["rows"].values():
        assert row["ms_per_iter"] > 0
        [(step, loss)] = row["val_loss"]
        assert step == 2 and math.isfinite(loss) and 3.0 < loss < 5.0   # ln(65) = 4.17
    assert "| engine |" in gpt.format_table(result)


def test_gpu_timer_queues_busy_work_longer_than_the_timed_calls_launches():
    """One busy product was too short for calls slow to launch: the queue drained and the
    events timed the launches (bench/gpu_time.py's docstring). Host-clock events stand in
    for CUDA's here: a busy product of 1 ms, calls of 3 ms to launch."""
    import time

    from bench import gpu_time

    class HostEvent:
        def record(self):
            self.at = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, other):   # milliseconds, as CUDA events
            return (other.at - self.at) * 1e3

    busy_calls = []

    def busy():
        busy_calls.append(1)
        time.sleep(1e-3)

    timer = gpu_time.GpuTimer(busy, HostEvent(), HostEvent())
    busy_calls.clear()
    gpu_seconds, launch_seconds = timer.measure(lambda: time.sleep(3e-3), n=2)
    assert launch_seconds >= 3e-3
    # twice the two calls' launches, in products of the measured busy time
    assert len(busy_calls) == math.ceil(2 * 2 * launch_seconds / timer.busy_seconds)
    assert len(busy_calls) >= 6


def test_bench_attention_table_on_cuda_gives_the_launch_times_beside_the_gpu_times():
    from bench import attention
    table = attention.format_table({
        "device": "cuda", "shapes": attention.GPU_SHAPES, "rounds": 3, "engine_threads": 1,
        "torch_threads": 1,
        "rows": [{"op": "layer_norm", "engine_us": 196.0, "torch_us": 174.0, "ratio": 1.126,
                  "engine_launch_us": 545.0, "torch_launch_us": 331.0}]})
    assert "GPU time a call, then the host's time to launch one" in table
    assert table.splitlines()[-1].split() == ["layer_norm", "196.0", "174.0", "1.13", "545.0",
                                              "331.0"]
