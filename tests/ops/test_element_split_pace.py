"""An element kernel splits across threads only into blocks worth a thread at its own
measured pace (ops.element_kernel.split_over_threads, ops.cpu_threads.MIN_BLOCK_SECONDS, and
MIN_KEPT_BLOCK_SECONDS on the last call's arrays, whose hand-off is kept); the blocks, when
it splits, give the same bits."""
import numpy as np
from numba import njit

import engine
from ops import compiled_call, cpu_threads, element_kernel, kernel_pace


@njit(nogil=True, cache=False)
def _scaled_add(x, out, scale):
    for i in range(x.size):
        out[i] = out[i] + scale * x[i]


def _run(monkeypatch, min_block_seconds, calls=6, kept_seconds=None, kinds=False):
    monkeypatch.setattr(cpu_threads, "MIN_BLOCK_SECONDS", min_block_seconds)
    monkeypatch.setattr(cpu_threads, "MIN_KEPT_BLOCK_SECONDS", kept_seconds or min_block_seconds)
    splits = []
    run_blocks = element_kernel.run_blocks
    monkeypatch.setattr(element_kernel, "run_blocks",
                        lambda blocks: (splits.append(_kind(blocks) if kinds else len(blocks)),
                                        run_blocks(blocks)))
    kernel = element_kernel.split_over_threads(_scaled_add, 2)
    x = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)
    out = np.zeros_like(x)
    for _ in range(calls):
        kernel(x, out, np.float32(0.5))
    return splits, out


def _kind(blocks):
    assert len(blocks) == 2
    return "kept" if type(blocks[0][0]) is compiled_call.Kept else "plain"


def test_a_cheap_kernel_runs_whole_and_a_split_gives_the_same_bits(monkeypatch):
    previous = engine.get_num_threads()
    engine.set_num_threads(2)
    try:
        whole, expected = _run(monkeypatch, 1.0)   # no block is worth a second of work
        assert whole == []
        split, got = _run(monkeypatch, 1e-12)      # every block is
        timed = kernel_pace.TIMED_CALLS + 1
        assert split == [2] * (6 - timed)          # timed whole first, then split in two
        np.testing.assert_array_equal(got, expected)
        # every call on the same arrays: blocks of the kept floor, plain calls the first
        # time, then the records kept from the second split
        kept, got = _run(monkeypatch, 1.0, kept_seconds=1e-12, kinds=True)
        assert kept == ["plain"] + ["kept"] * (6 - timed - 1)
        np.testing.assert_array_equal(got, expected)
    finally:
        engine.set_num_threads(previous)


def test_the_pace_decides_the_block_count(monkeypatch):
    monkeypatch.setattr(cpu_threads, "threads", lambda: 2)
    size = 300_000
    assert cpu_threads.element_blocks(size, 0.1e-9) is None        # 30 us of work: whole
    assert len(cpu_threads.element_blocks(size, 1e-9)) == 2       # 300 us: two blocks
    assert len(cpu_threads.element_blocks(size)) == 2             # pace unknown: by size
    assert len(cpu_threads.element_blocks(size, 0.1e-9, kept=True)) == 2   # kept: 2 of 15 us
