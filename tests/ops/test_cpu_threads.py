"""engine.set_num_threads / get_num_threads: one count for the engine's GEMM split and
Numba's prange loops, BLAS kept at one thread; the default that follows the machine's load."""
import collections
import os
import subprocess
import sys

import numba
import numpy as np
import pytest
from threadpoolctl import threadpool_info

import engine
from ops import cpu_threads
from ops.conv import CONV2D_FORWARD
from ops.matmul import gemm


@pytest.fixture
def follow_the_load_after():
    yield
    cpu_threads.set_threads(None)


def _blas_thread_counts():
    return [library["num_threads"] for library in threadpool_info()
            if library["user_api"] == "blas"]


def _fresh_interpreter(code, **variables):
    environment = {name: value for name, value in os.environ.items()
                   if name not in cpu_threads.USER_VARIABLES}
    environment.update(variables)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=environment)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_import_engine_starts_no_thread_and_the_first_gemm_sets_blas_to_one_thread():
    code = ("import sys, threading\nimport numpy as np\nimport engine\n"
            "print('numba' in sys.modules, 'scipy.linalg' in sys.modules, "
            "threading.active_count())\n"
            "from ops.matmul import gemm\n"
            "gemm(np.ones((64, 64), np.float32), np.ones((64, 64), np.float32))\n"
            "print(sorted({l['num_threads'] for l in __import__('threadpoolctl')"
            ".threadpool_info() if l['user_api'] == 'blas'}), threading.active_count())")
    assert _fresh_interpreter(code).split("\n") == ["False False 1", "[1] 1"]


def test_the_first_gemm_through_numpy_sets_its_blas_to_one_thread_before_numba_compiles():
    # before any compile: Numba's first compile loads SciPy's BLAS, which also sets every
    # BLAS library's threads (engine.blas_threads). NumPy's BLAS, as without the mkl extra
    # (whose products are described and run in compiled code)
    code = ("import sys\nimport numpy as np\nimport engine\n"
            "from ops.gemm import cblas\ncblas._mkl_runtime = lambda: None\n"
            "from threadpoolctl import threadpool_info\nfrom ops.gemm.cpu import blas_product\n"
            "blas_product(np.ones((64, 64), np.float32), np.ones((64, 64), np.float32), "
            "np.empty((64, 64), np.float32))\n"
            "print(sorted({l['num_threads'] for l in threadpool_info() "
            "if l['user_api'] == 'blas'}), 'scipy.linalg.cython_blas' in sys.modules)")
    assert _fresh_interpreter(code) == "[1] False"


@pytest.mark.parametrize("cpus, others, threads", [(2, 0, 2), (2, 0.49, 2), (2, 0.5, 1),
                                                   (2, 1, 1), (2, 10, 1), (16, 0, 16),
                                                   (16, 3.5, 12), (1, 0, 1)])
def test_the_default_is_the_usable_cpus_less_those_other_processes_keep_busy(cpus, others,
                                                                             threads):
    assert cpu_threads.threads_for_load(cpus, others) == threads


def test_the_load_is_read_again_after_the_interval_and_not_before(monkeypatch,
                                                                   follow_the_load_after):
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat: the count is the usable CPUs")
    cpus = cpu_threads.usable_cpus()
    cpu_threads.set_threads(None)
    busy = [float(cpus)]
    monkeypatch.setattr(cpu_threads._LoadReader, "others_now", lambda self: busy[0])
    monkeypatch.setattr(cpu_threads._LoadReader, "others_busy", lambda self: busy[0])
    now = [1000.0]
    monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: now[0])
    assert engine.get_num_threads() == 1   # every CPU busy: one thread
    busy[0] = 0.0
    now[0] += cpu_threads.LOAD_INTERVAL_S / 2
    assert engine.get_num_threads() == 1   # not read again yet
    now[0] += cpu_threads.LOAD_INTERVAL_S
    assert engine.get_num_threads() == cpus   # quiet again: all of them


def test_after_an_idle_gap_the_count_is_guessed_afresh_not_from_the_gap_s_average(
        monkeypatch, follow_the_load_after):
    """A process that ran no kernel while another ran its epoch (bench.cnn's rows in their
    processes) takes the threads runnable now, not the CPUs the other used meanwhile."""
    cpu_threads.set_threads(None)
    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(cpu_threads._LoadReader, "_reading",
                        lambda self: (cpu_threads.time.monotonic(), 0, 0))
    monkeypatch.setattr(cpu_threads._LoadReader, "others_now", lambda self: 0)
    monkeypatch.setattr(cpu_threads._LoadReader, "others_busy", lambda self: 2.0)
    now = [1000.0]
    monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: now[0])
    assert engine.get_num_threads() == 2   # the first guess: nothing runnable
    for _ in range(15):   # working: kernels ask every 0.1 s, past the next reading
        now[0] += 0.1
        engine.get_num_threads()
    assert engine.get_num_threads() == 1   # others busy on average since: a reading
    now[0] += cpu_threads.IDLE_S * 1.5
    assert engine.get_num_threads() == 2   # after an idle gap: guessed again


def test_the_fresh_guess_is_the_fewest_runnable_others_of_its_looks(monkeypatch):
    looks = iter([2, 1, 3])   # a process whose threads spin a moment, then sleep
    monkeypatch.setattr(cpu_threads._LoadReader, "_runnable_others",
                        staticmethod(lambda: next(looks)))
    assert cpu_threads._LoadReader().others_now() == 1
    monkeypatch.setattr(cpu_threads._LoadReader, "_runnable_others", staticmethod(lambda: None))
    assert cpu_threads._LoadReader().others_now() is None


def test_others_busy_is_the_usable_cpus_busy_ticks_less_this_process_s_per_second(
        monkeypatch):
    readings = iter([(10.0, 1000, 300), (12.0, 1000 + 3 * 100, 300 + 100),
                     (13.0, 1300 + 50, 400 + 100)])   # (wall s, busy ticks, own ticks)
    monkeypatch.setattr(cpu_threads._LoadReader, "_reading", lambda self: next(readings))
    reader = cpu_threads._LoadReader()
    reader.tick = 100
    # 300 busy ticks in 2 s, 100 of them this process's: others kept 1 CPU busy
    assert reader.others_busy() == pytest.approx(1.0)
    assert reader.others_busy() == 0.0   # more own ticks than busy ones: never negative


def test_a_reading_of_this_machine_is_a_plausible_count():
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat")
    reader = cpu_threads._LoadReader()
    __import__("time").sleep(0.2)
    others = reader.others_busy()
    assert 0.0 <= others <= cpu_threads.usable_cpus() + 0.5


@pytest.mark.parametrize("variable", cpu_threads.USER_VARIABLES)
def test_a_blas_count_chosen_in_the_environment_is_left_alone(variable):
    code = ("import scipy.linalg.cython_blas\nfrom threadpoolctl import threadpool_info\n"
            "print(max(l['num_threads'] for l in threadpool_info() if l['user_api'] == 'blas'))\n"
            "import engine\nprint(max(engine.blas_threads.blas_thread_counts()), "
            "engine.get_num_threads())")
    before, after, own = _fresh_interpreter(code, **{variable: "2"}).split()
    assert after == before and own == "1"   # BLAS threads the GEMMs, the engine does not
    if variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        assert after == "2"   # OpenBLAS reads these itself


def test_set_num_threads_sets_the_engine_s_threads_and_blas_to_one(follow_the_load_after):
    """One count for every CPU kernel: the convolutions, pools and BatchNorm run in blocks on
    the engine's threads too, so Numba's own thread pool never starts."""
    x, w = engine.ones(2, 1, 4, 4), engine.ones(1, 1, 3, 3)
    for threads in (1, 2):
        engine.set_num_threads(threads)
        assert engine.get_num_threads() == threads and set(_blas_thread_counts()) == {1}
        engine.max_pool2d(engine.conv2d(x, w), 2)
    assert numba.np.ufunc.parallel._is_initialized is False
    assert CONV2D_FORWARD.cpu.__name__ == "conv2d_forward_cpu"


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_set_num_threads_rejects_what_is_not_a_positive_integer(bad):
    with pytest.raises(ValueError, match=rf"engine.set_num_threads: n must be a positive "
                                         rf"integer, got {bad!r}"):
        engine.set_num_threads(bad)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_gemm_repeats_bit_for_bit_at_a_fixed_thread_count(threads, follow_the_load_after):
    rng = np.random.default_rng(0)
    a, b = rng.random((128, 784), np.float32), rng.random((784, 256), np.float32)
    engine.set_num_threads(threads)
    first = gemm(a, b)
    assert all(np.array_equal(gemm(a, b), first) for _ in range(5))
    np.testing.assert_allclose(first, a.astype(np.float64) @ b, rtol=1e-5)


@pytest.mark.parametrize("own, waited, stalled", [(300e-6, 20e-6, False), (300e-6, 290e-6, False),
                                                  (300e-6, 4e-3, True), (50e-6, 150e-6, False),
                                                  (50e-6, 250e-6, True)])
def test_a_split_stalled_when_its_workers_ended_a_block_s_time_after_its_own(own, waited,
                                                                              stalled):
    assert cpu_threads.split_stalled(own, waited) == stalled


def _sleep(seconds):
    __import__("time").sleep(seconds)


@pytest.mark.parametrize("stalls, persist", [
    ([True, False, True], [False, False, True]),
    ([True, False, False, True], [False] * 4),   # one stall at a time: never
    ([True, True, True, True], [False, True, False, True]),   # the window starts again
])
def test_stalls_persist_when_two_of_the_last_three_splits_stalled(monkeypatch, stalls, persist):
    monkeypatch.setattr(cpu_threads, "_recent_splits",
                        collections.deque(maxlen=cpu_threads.STALL_WINDOW))
    assert [cpu_threads.stalls_persist(stalled) for stalled in stalls] == persist


def test_stalled_splits_drop_the_default_to_one_thread_until_a_reading_soon_after(
        monkeypatch, follow_the_load_after):
    cpu_threads.set_threads(None)
    monkeypatch.setattr(cpu_threads, "_recent_splits",
                        collections.deque(maxlen=cpu_threads.STALL_WINDOW))
    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(cpu_threads._LoadReader, "others_now", lambda self: 0.0)
    monkeypatch.setattr(cpu_threads._LoadReader, "others_busy", lambda self: 0.0)
    now = [1000.0]
    monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: now[0])
    assert engine.get_num_threads() == 2
    cpu_threads.run_blocks([(_sleep, (0.0,)), (_sleep, (0.05,))])   # a worker 50 ms late
    assert engine.get_num_threads() == 2   # one stall is not yet a busy neighbour
    cpu_threads.run_blocks([(_sleep, (0.0,)), (_sleep, (0.05,))])
    assert engine.get_num_threads() == 1
    now[0] += cpu_threads.FALL_BACK_S / 2
    assert engine.get_num_threads() == 1   # not read again yet
    now[0] += cpu_threads.FALL_BACK_S
    assert engine.get_num_threads() == 2   # the reading finds the machine quiet


def test_a_stalled_split_leaves_a_count_that_set_num_threads_fixed(follow_the_load_after):
    engine.set_num_threads(2)
    cpu_threads.run_blocks([(_sleep, (0.0,)), (_sleep, (0.05,))])
    assert engine.get_num_threads() == 2


def test_a_split_into_one_block_runs_it_without_a_pool(monkeypatch):
    """A first split of a single block used to ask for a pool of 0 workers (ValueError)."""
    from ops import cpu_pool, cpu_threads
    monkeypatch.setattr(cpu_pool, "_workers", [])   # as in a process that never split
    ran = []
    cpu_threads.run_blocks([(ran.append, (1,))])
    assert ran == [1] and cpu_pool._workers == []


@pytest.mark.parametrize("threads, macs, expected", [
    (1, [40 << 20, 40 << 20], None),   # one thread: one after another
    (2, [1 << 20, 1 << 20], None),   # together too little for a hand-off
    (2, [40 << 20, 40 << 20], [1, 1]),   # each whole, at once
    (4, [40 << 20, 40 << 20], [2, 2]),
    (3, [40 << 20, 40 << 20], [2, 1]),
    (2, [40 << 20], [2]),   # one GEMM: all the threads
])
def test_independent_gemms_share_the_threads_in_one_hand_off(threads, macs, expected,
                                                             follow_the_load_after):
    engine.set_num_threads(threads)
    assert cpu_threads.thread_shares(macs) == expected


@pytest.mark.parametrize("m, k, n, by_columns", [(64, 784, 512, True), (768, 128, 384, False)])
def test_a_product_splits_along_the_side_of_the_larger_operand_with_the_same_bits(
        m, k, n, by_columns, follow_the_load_after):
    from ops.gemm.cpu import blas_product, product_blocks, product_calls
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k)).astype(np.float32), \
        rng.standard_normal((k, n)).astype(np.float32)
    whole, split = np.empty((m, n), np.float32), np.empty((m, n), np.float32)
    blas_product(a, b, whole)
    engine.set_num_threads(2)
    columns, blocks = product_blocks(a, b, split)
    assert columns == by_columns and len(blocks) == 2
    cpu_threads.run_blocks(product_calls(a, b, split))
    assert np.array_equal(whole, split)
