"""Smoke test of ``bench.optimizers`` on a tiny size (it measures nothing here): a row per
optimizer and thread count, engine and torch both timed, the JSON written."""
import json

import pytest

from bench import optimizers


@pytest.mark.torch
def test_bench_optimizers_times_every_optimizer_beside_torch(tmp_path, capsys):
    pytest.importorskip("torch")
    path = tmp_path / "optimizers.json"
    optimizers.main(["--sizes", "1000", "--threads", "1", "--steps", "3", "--json", str(path)])
    rows = json.loads(path.read_text())["results"]
    assert [row["optimizer"] for row in rows] == list(optimizers.OPTIMIZERS)
    for row in rows:
        assert row["engine_us"] > 0 and row["torch_us"] > 0
        assert row["ratio"] == row["engine_us"] / row["torch_us"]
    assert "| NAdam | 1,000 | 1 |" in capsys.readouterr().out
