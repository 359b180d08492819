"""engine.train: the fit loop, evaluate, checkpoints, and the command's behaviour on good and
bad input (in process through ``main``: any exception other than SystemExit would have been
a traceback; one real subprocess checks the module entry point)."""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import data
import engine
import optim
from engine import nn
from engine.losses import cross_entropy
from engine.train import (RECORD_KEYS, _pack, _unpack, evaluate, fit, main, pixel_statistics,
                          read_checkpoint)
from ops.device import cuda_available

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--limit", "192", "--epochs", "1", "--batch-size", "64", "--hidden", "16",
        "--no-progress"]


def _blobs_model_and_loader(device, batch_size=8):
    x, y = data.blobs(48, centers=3, seed=0)
    loader = data.DataLoader(x, y, batch_size=batch_size, shuffle=True, seed=0, device=device)
    model = nn.Sequential([nn.Dense(8, activation="relu", input_shape=(2,)), nn.Dense(3)])
    model.to(device)
    return model, loader, x, y


def test_fit_reduces_loss_and_returns_records(device):
    model, loader, _, _ = _blobs_model_and_loader(device)
    optimizer = optim.Adam(model.parameters(), lr=0.05)
    history = fit(model, loader, optimizer, cross_entropy, 6, test_loader=loader,
                  progress=False, verbose=False)
    assert [record["epoch"] for record in history] == [1, 2, 3, 4, 5, 6]
    assert all(tuple(record) == RECORD_KEYS for record in history)
    assert history[-1]["loss"] < 0.7 * history[0]["loss"]
    assert 0 <= history[-1]["train_acc"] <= 1 and 0 <= history[-1]["test_acc"] <= 1
    assert len(engine.autograd.current_tape()) == 0


def test_fit_epoch_loss_is_the_sample_mean_of_batch_losses():
    model, loader, x, y = _blobs_model_and_loader("cpu", batch_size=20)   # batches 20, 20, 8
    optimizer = optim.SGD(model.parameters(), lr=0.0)   # lr 0: the model does not move
    record = fit(model, loader, optimizer, cross_entropy, 1, progress=False, verbose=False)[0]
    with engine.no_grad():
        full_batch = cross_entropy(model(engine.tensor(x)), y).item()
        predicted = model(engine.tensor(x)).numpy().argmax(axis=1)
    assert record["loss"] == pytest.approx(full_batch, rel=1e-5)
    assert record["train_acc"] == pytest.approx(np.mean(predicted == y))
    assert record["test_acc"] is None


def test_fit_with_a_plain_iterable_grows_its_buffers_and_calls_callbacks():
    model, loader, _, _ = _blobs_model_and_loader("cpu")

    class Batches:   # no __len__: the loop cannot size its buffers in advance
        def __iter__(self):
            return iter(loader)

    seen = []
    history = fit(model, Batches(), optim.Adam(model.parameters()), cross_entropy, 2,
                  on_epoch_end=seen.append, progress=False, verbose=False)
    assert seen == history and history[-1]["train_acc"] is not None


def test_fit_clips_and_steps_a_scheduler():
    model, loader, _, _ = _blobs_model_and_loader("cpu")
    optimizer = optim.Adam(model.parameters(), lr=0.01)
    scheduler = optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    fit(model, loader, optimizer, cross_entropy, 2, scheduler=scheduler, clip_norm=0.5,
        progress=True, verbose=False)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0025)


@pytest.mark.parametrize("arguments, message", [
    ({"epochs": 0}, "epochs"), ({"epochs": 2, "start_epoch": 3}, "start_epoch"),
    ({"epochs": 1, "clip_norm": -1}, "clip_norm")])
def test_fit_rejects_bad_arguments(arguments, message):
    model, loader, _, _ = _blobs_model_and_loader("cpu")
    with pytest.raises(ValueError, match=message):
        fit(model, loader, optim.Adam(model.parameters()), cross_entropy, progress=False,
            **arguments)


def test_evaluate_matches_numpy_and_restores_train_mode(device):
    model, loader, x, y = _blobs_model_and_loader(device)
    model.train()
    accuracy = evaluate(model, loader)
    with engine.no_grad():
        predicted = model(engine.tensor(x, device=device)).numpy().argmax(axis=1)
    assert accuracy == pytest.approx(np.mean(predicted == y))
    assert model.training and len(engine.autograd.current_tape()) == 0


def test_checkpoint_skeleton_round_trips_nested_state():
    state = {"state": {0: {"step": 3, "exp_avg": np.arange(4.0)}}, "betas": (0.9, 0.999),
             "groups": [{"lr": 1e-3, "params": [0, 1]}], "none": None, "flag": True}
    arrays = {}
    restored = _unpack(json.loads(json.dumps(_pack(state, arrays))), arrays)
    assert restored["state"][0]["step"] == 3 and restored["betas"] == (0.9, 0.999)
    np.testing.assert_array_equal(restored["state"][0]["exp_avg"], np.arange(4.0))
    assert restored["groups"] == state["groups"] and restored["none"] is None
    with pytest.raises(TypeError, match="cannot store"):
        _pack({"f": object()}, {})


def test_pixel_statistics_are_exact():
    images = np.random.default_rng(0).integers(0, 256, (50, 28, 28), dtype=np.uint8)
    mean, std = pixel_statistics(images)
    scaled = images.astype(np.float64) / 255
    assert mean == pytest.approx(scaled.mean(), rel=1e-12)
    assert std == pytest.approx(scaled.std(), rel=1e-12)


# ------------------------------------------------------------------ the command

def _run_main(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code, capsys.readouterr()


def test_command_logs_json_records_and_plots(tmp_path, capsys):
    log = tmp_path / "metrics.jsonl"
    arguments = TINY + ["--epochs", "2", "--log-json", str(log)]
    if importlib.util.find_spec("matplotlib") is not None:
        arguments += ["--plot", str(tmp_path / "curves.png")]
    main(arguments)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [record["epoch"] for record in records] == [1, 2]
    assert all(set(record) == set(RECORD_KEYS) for record in records)
    output = capsys.readouterr().out
    assert "epoch 2/2" in output and "samples/s" in output
    if "--plot" in arguments:
        assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_save_and_resume_continue_the_run_exactly(tmp_path, capsys):
    straight, first, resumed = (tmp_path / name for name in ("straight", "first", "resumed"))
    main(TINY + ["--epochs", "2", "--save", str(straight) + ".npz",
                 "--log-json", str(straight) + ".jsonl"])
    main(TINY + ["--epochs", "1", "--save", str(first) + ".npz"])
    main(TINY + ["--epochs", "2", "--resume", str(first) + ".npz",
                 "--save", str(resumed) + ".npz", "--log-json", str(resumed) + ".jsonl"])
    assert "resuming after epoch 1" in capsys.readouterr().out
    reference = [json.loads(line) for line in open(str(straight) + ".jsonl")]
    continued = [json.loads(line) for line in open(str(resumed) + ".jsonl")]
    assert [record["epoch"] for record in continued] == [2]
    for key in ("loss", "train_acc", "test_acc"):
        assert continued[0][key] == pytest.approx(reference[1][key], rel=1e-5)
    a, b = read_checkpoint(str(straight) + ".npz"), read_checkpoint(str(resumed) + ".npz")
    assert a["epoch"] == b["epoch"] == 2 and len(b["history"]) == 2
    for name, value in a["model"].items():
        np.testing.assert_allclose(b["model"][name], value, rtol=1e-5, atol=1e-7)
    assert a["optimizer"]["state"][0]["step"] == b["optimizer"]["state"][0]["step"]
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".checkpoint-")]


def test_checkpoint_holds_a_model_file(tmp_path, capsys):
    """The architecture and weights sit under model.save's names (train/ holds the rest), so
    the model rebuilds from the checkpoint alone."""
    path = str(tmp_path / "run.npz")
    main(TINY + ["--save", path])
    with np.load(path, allow_pickle=False) as stored:
        config = json.loads(str(stored[nn.CONFIG_KEY]))
        names = set(stored.files)
    model = nn.Sequential.from_config(config)
    state = read_checkpoint(path)["model"]
    model.load_state_dict(state)
    assert names - set(state) - {nn.CONFIG_KEY} == {n for n in names if n.startswith("train/")}
    assert [layer["config"].get("units") for layer in config["layers"]] == [None, 16, 10]


def _not_a_checkpoint(tmp_path):
    path = tmp_path / "model.npz"
    nn.Sequential([nn.Dense(2, input_shape=(3,))]).save(str(path))
    return str(path)


def _garbage(tmp_path):
    path = tmp_path / "garbage.npz"
    path.write_text("not a zip file\n")
    return str(path)


BAD_INPUTS = [
    (["--dataset", "cifar"], "unknown dataset"),
    (["--epochs", "0"], "--epochs"),
    (["--batch-size", "-3"], "--batch-size"),
    (["--limit", "0"], "--limit"),
    (["--epochs", "abc"], "--epochs"),
    (["--hidden", "256,x"], "--hidden"),
    (["--hidden", ""], "--hidden"),
    (["--hidden", "256,0"], "--hidden"),
    (["--lr", "0"], "--lr"),
    (["--weight-decay", "-1"], "--weight-decay"),
    (["--optimizer", "rmsprop"], "unknown optimizer"),
    (["--device", "tpu"], "device"),
    (["--dataset", "fashion-mnist", "--data-dir", "/nonexistent/fashion"], "fashion-mnist"),
    (["--dataset", "mnist", "--data-dir", "/nonexistent/mnist"], "mnist"),
    (["--resume", "/nonexistent/checkpoint.npz"], "--resume"),
    (["--resume", _garbage], "not an .npz archive"),
    (["--resume", _not_a_checkpoint], "not a training checkpoint"),
    (["--save", "/nonexistent/dir/model.npz"], "--save"),
    (["--log-json", "/nonexistent/dir/log.jsonl"], "--log-json"),
]


@pytest.mark.parametrize("arguments, message", BAD_INPUTS,
                         ids=[" ".join(a if isinstance(a, str) else a.__name__ for a in args)
                              for args, _ in BAD_INPUTS])
def test_bad_input_exits_with_one_line(arguments, message, tmp_path, capsys):
    arguments = [a(tmp_path) if callable(a) else a for a in arguments]
    code, captured = _run_main(TINY + arguments, capsys)
    assert code != 0
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], captured.err
    assert "Traceback" not in captured.err


@pytest.mark.skipif(cuda_available(), reason="CUDA is usable here")
def test_unusable_cuda_device_exits_with_one_line(capsys):
    code, captured = _run_main(TINY + ["--device", "cuda"], capsys)
    lines = captured.err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and "cuda" in lines[0]


def test_resume_rejects_another_architecture_and_a_finished_run(tmp_path, capsys):
    checkpoint = str(tmp_path / "run.npz")
    main(TINY + ["--save", checkpoint])
    capsys.readouterr()
    code, captured = _run_main(TINY + ["--hidden", "8", "--resume", checkpoint], capsys)
    assert code != 0 and "trained with" in captured.err and len(captured.err.splitlines()) == 1
    code, captured = _run_main(TINY + ["--resume", checkpoint], capsys)
    assert code != 0 and "already trained for 1 epochs" in captured.err


def test_plot_without_matplotlib_is_one_line(monkeypatch, tmp_path, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *rest: None if name == "matplotlib" else find_spec(name, *rest))
    code, captured = _run_main(TINY + ["--plot", str(tmp_path / "curves.png")], capsys)
    assert code != 0 and "matplotlib" in captured.err and len(captured.err.splitlines()) == 1


def test_module_entry_point_runs_and_fails_cleanly():
    command = [sys.executable, "-m", "engine.train"]
    environment = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    good = subprocess.run(command + TINY, cwd=REPO_ROOT, capture_output=True, text=True,
                          env=environment)
    assert good.returncode == 0, good.stderr
    assert "epoch 1/1" in good.stdout
    bad = subprocess.run(command + TINY + ["--hidden", "a,b"], cwd=REPO_ROOT,
                         capture_output=True, text=True, env=environment)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "engine-train: error: --hidden 'a,b': expected positive layer widths separated by "
        "commas, like 256,128"]


def test_a_training_checkpoint_loads_as_a_model(tmp_path):
    checkpoint = tmp_path / "run.npz"
    result = subprocess.run(
        [sys.executable, "-m", "engine.train", "--epochs", "1", "--limit", "256",
         "--hidden", "8", "--device", "cpu", "--no-progress", "--save", str(checkpoint)],
        capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    from engine import nn
    model = nn.load(str(checkpoint))
    assert model(engine.zeros(2, 28, 28)).shape == (2, 10)
