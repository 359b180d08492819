"""engine.fit and the command (engine.cli.train): the fit loop, evaluate, checkpoints, and the command's
behaviour on good and bad input (in process through ``main``: any exception other than
SystemExit would have been a traceback; one real subprocess checks the module entry point)."""
import errno
import functools
import importlib.util
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import data
import engine
import optim
from data.datasets import pixel_statistics
from engine import nn
from engine.losses import cross_entropy
from engine import archive
from engine.archive import decode, encode
from engine.fit import (CHECKPOINT_KEY, RECORD_KEYS, evaluate, fit, progress_bar,
                        read_checkpoint, save_checkpoint, show_progress)
from engine.models import build_mlp, preprocessing
from engine.train import main
from engine.cli.training_curves import plot_history
from ops.cuda import SIMULATOR
from ops.device import cuda_available
from tests.support.damaged_files import each_flipped_byte
from tests.support.paths import REPO_ROOT
from tests.support.training_command import TINY, run_main


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


def _gradient_norms_at_each_step(optimizer, parameters):
    """Wrap ``optimizer.step`` to record the global gradient norm it is about to apply."""
    norms, step = [], optimizer.step

    def recording_step(*args, **kwargs):
        norms.append(float(np.sqrt(sum(np.sum(p.grad.numpy().astype(np.float64) ** 2)
                                       for p in parameters))))
        return step(*args, **kwargs)

    optimizer.step = recording_step
    return norms


def _clipped_run(clip_norm):
    engine.manual_seed(0)
    model, loader, _, _ = _blobs_model_and_loader("cpu")
    optimizer = optim.Adam(model.parameters(), lr=0.01)
    norms = _gradient_norms_at_each_step(optimizer, model.parameters())
    scheduler = optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    # eager steps: the norms are read in Python inside each step, which a replay skips
    clip = functools.partial(optim.clip_grad_norm_, max_norm=clip_norm) if clip_norm else None
    fit(model, loader, optimizer, cross_entropy, 2, scheduler=scheduler, clip=clip,
        progress=True, verbose=False, capture=False)
    return model, optimizer, norms


def test_fit_clips_and_steps_a_scheduler():
    """Clipping happened: every step applied a gradient of norm <= clip_norm, where the same
    run without clipping applies larger ones, and the weights differ."""
    model, optimizer, norms = _clipped_run(0.5)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0025)
    assert len(norms) == 12 and max(norms) <= 0.5 * (1 + 1e-5)
    unclipped, _, free_norms = _clipped_run(0.0)
    assert sum(norm > 0.5 for norm in free_norms) >= 3, free_norms
    assert any(not np.array_equal(a, b) for a, b in zip(model.state_dict().values(),
                                                         unclipped.state_dict().values()))


@pytest.mark.parametrize("arguments, error, message", [
    ({"epochs": 0}, ValueError, "epochs"),
    ({"epochs": 2, "start_epoch": 3}, ValueError, "start_epoch"),
    ({"epochs": 1, "clip": 0.5}, TypeError, "clip must be a function of the parameters")])
def test_fit_rejects_bad_arguments(arguments, error, message):
    model, loader, _, _ = _blobs_model_and_loader("cpu")
    with pytest.raises(error, match=message):
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
    restored = decode(json.loads(json.dumps(encode(state, arrays))), arrays)
    assert restored["state"][0]["step"] == 3 and restored["betas"] == (0.9, 0.999)
    np.testing.assert_array_equal(restored["state"][0]["exp_avg"], np.arange(4.0))
    assert restored["groups"] == state["groups"] and restored["none"] is None
    with pytest.raises(TypeError, match="cannot store"):
        encode({"f": object()}, {})


def test_pixel_statistics_are_exact():
    images = np.random.default_rng(0).integers(0, 256, (50, 28, 28), dtype=np.uint8)
    mean, std = pixel_statistics(images)
    scaled = images.astype(np.float64) / 255
    assert mean == pytest.approx(scaled.mean(), rel=1e-12)
    assert std == pytest.approx(scaled.std(), rel=1e-12)


# ------------------------------------------------------------------ the command

@pytest.fixture(autouse=True)
def _in_a_fresh_folder(tmp_path, monkeypatch):
    """Runs save to ``DATASET-MODEL.npz`` in the current folder by default: a test's own."""
    monkeypatch.chdir(tmp_path)


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


@pytest.mark.parametrize("optimizer", ["adam", "rmsprop", "sgd"])
def test_save_and_resume_continue_the_run_exactly(tmp_path, capsys, optimizer):
    """Bit for bit, as the README promises: the same records, weights and optimizer state as
    the run that was never interrupted."""
    straight, first, resumed = (tmp_path / name for name in ("straight", "first", "resumed"))
    run = TINY + ["--optimizer", optimizer]
    main(run + ["--epochs", "2", "--save", str(straight) + ".npz",
                "--log-json", str(straight) + ".jsonl"])
    main(run + ["--epochs", "1", "--save", str(first) + ".npz"])
    main(run + ["--epochs", "2", "--resume", str(first) + ".npz",
                "--save", str(resumed) + ".npz", "--log-json", str(resumed) + ".jsonl"])
    assert "resuming after epoch 1" in capsys.readouterr().out
    reference = [json.loads(line) for line in open(str(straight) + ".jsonl")]
    continued = [json.loads(line) for line in open(str(resumed) + ".jsonl")]
    assert [record["epoch"] for record in continued] == [2]
    for key in ("loss", "train_acc", "test_acc"):
        assert continued[0][key] == reference[1][key]
    a, b = read_checkpoint(str(straight) + ".npz"), read_checkpoint(str(resumed) + ".npz")
    assert a["epoch"] == b["epoch"] == 2 and len(b["history"]) == 2
    assert a["model"].keys() == b["model"].keys()
    for name, value in a["model"].items():
        np.testing.assert_array_equal(b["model"][name], value)
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for index, state in a["optimizer"]["state"].items():
        for name, value in state.items():
            np.testing.assert_array_equal(b["optimizer"]["state"][index][name], value)
    assert a["rng"] == b["rng"]
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]   # no temporary files


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
    assert [layer["config"].get("units") for layer in config["layers"]] == [None, None, None,
                                                                             16, 10]


def _not_a_checkpoint(tmp_path):
    path = tmp_path / "model.npz"
    nn.Sequential([nn.Dense(2, input_shape=(3,))]).save(str(path))
    return str(path)


def _garbage(tmp_path):
    path = tmp_path / "garbage.npz"
    path.write_text("not a zip file\n")
    return str(path)


RUN_CONFIG = {"dataset": "mnist", "hidden": [16], "optimizer": "adam", "schedule": "cosine"}
A_RECORD = {"epoch": 1, "loss": 2.5, "train_acc": 0.1, "test_acc": 0.2, "seconds": 0.1,
            "samples_per_s": 1900.0}


def _checkpoint(tmp_path, name="run.npz"):
    """A checkpoint of the TINY run's architecture after one (pretend) epoch."""
    model = build_mlp((28, 28), (16,), 10)
    optimizer = optim.Adam(model.parameters(), lr=2e-3)
    path = tmp_path / name
    save_checkpoint(str(path), model, optimizer, 1, [A_RECORD], RUN_CONFIG)
    return path


def _rewritten(path, skeleton_text):
    """The checkpoint at ``path`` with its training state's JSON replaced."""
    with np.load(path, allow_pickle=False) as stored:
        entries = {name: stored[name] for name in stored.files}
    entries[CHECKPOINT_KEY] = np.array(skeleton_text)
    np.savez(path, **entries)
    return str(path)


def _with_state(key, value):
    """A fixture: a checkpoint whose training state has ``key`` set to ``value``."""
    def make(tmp_path):
        path = _checkpoint(tmp_path)
        with np.load(path, allow_pickle=False) as stored:
            skeleton = json.loads(str(stored[CHECKPOINT_KEY]))
        for pair in skeleton["dict"]:
            if pair[0] == key:
                pair[1] = encode(value, {})
        return _rewritten(path, json.dumps(skeleton))
    make.__name__ = f"checkpoint with {key}={value!r:.30}"
    return make


def _deeply_nested_state(tmp_path):
    return _rewritten(_checkpoint(tmp_path), '{"list": [' * 100_000 + "]}" * 100_000)


def _flipped(locate):
    """A fixture: a checkpoint with the byte at ``locate(content)`` flipped."""
    def make(tmp_path):
        path = _checkpoint(tmp_path)
        content = bytearray(path.read_bytes())
        content[locate(bytes(content))] ^= 0x20
        path.write_bytes(bytes(content))
        return str(path)
    make.__name__ = f"checkpoint with a flipped byte {locate.__name__}"
    return make


def in_the_weights(content):
    return len(content) // 3


def in_the_training_state(content):
    return content.index('"epoch"'.encode("utf-32-le")) + 4   # np.array(str) is UTF-32


def in_the_zip_directory(content):
    return content.rindex(b"PK\x01\x02") + 16   # the CRC-32 of the last entry


def _empty_data_dir(tmp_path):
    folder = tmp_path / "empty-mnist"
    folder.mkdir()
    for prefix in ("train", "t10k"):
        data.write_idx(folder / f"{prefix}-images-idx3-ubyte.gz", np.zeros((0, 28, 28), np.uint8))
        data.write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", np.zeros(0, np.uint8))
    return str(folder)


def _a_directory(tmp_path):
    (tmp_path / "taken").mkdir()
    return str(tmp_path / "taken")


def _under_a_file(tmp_path):
    (tmp_path / "plain-file").write_text("")
    return str(tmp_path / "plain-file" / "model.npz")


BAD_INPUTS = [
    (["--dataset", "cifar"], "unknown dataset"),
    (["--model", "resnet"], "unknown model 'resnet': expected one of mlp, cnn"),
    (["--epochs", "0"], "--epochs"),
    (["--batch-size", "-3"], "--batch-size"),
    (["--limit", "0"], "--limit"),
    (["--epochs", "abc"], "--epochs"),
    (["--hidden", "256,x"], "--hidden"),
    (["--hidden", ""], "--hidden"),
    (["--hidden", "256,0"], "--hidden"),
    (["--lr", "0"], "--lr"),
    (["--weight-decay", "-1"], "--weight-decay"),
    (["--optimizer", "lbfgs"], "unknown optimizer"),
    (["--device", "tpu"], "device"),
    (["--dataset", "fashion-mnist", "--data-dir", "/nonexistent/fashion"], "fashion-mnist"),
    (["--dataset", "mnist", "--data-dir", "/nonexistent/mnist"], "mnist"),
    (["--resume", "/nonexistent/checkpoint.npz"], "--resume"),
    (["--resume", _garbage], "not an .npz archive"),
    (["--resume", _not_a_checkpoint], "not a training checkpoint"),
    (["--save", "/nonexistent/dir/model.npz"], "--save"),
    (["--log-json", "/nonexistent/dir/log.jsonl"], "--log-json"),
    (["--lr", "inf"], "--lr must be a positive finite number, got inf"),
    (["--lr", "nan"], "--lr must be a positive finite number, got nan"),
    (["--clip-norm", "inf"], "--clip-norm must be a finite number >= 0, got inf"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number >= 0"),
    (["--momentum", "inf"], "--momentum must be a finite number >= 0"),
    (["--threads", "0"], "--threads must be a positive integer"),
    (["--save", _a_directory], "is a directory"),
    (["--log-json", _a_directory], "is a directory"),
    (["--save", _under_a_file], "plain-file is not a directory"),
    (["--data-dir", _empty_data_dir], "the training images (0, 28, 28) hold no samples"),
    (["--resume", _flipped(in_the_weights)], "cannot read the checkpoint"),
    (["--resume", _flipped(in_the_training_state)], "cannot read the checkpoint"),
    (["--resume", _flipped(in_the_zip_directory)], "cannot read the checkpoint"),
    (["--resume", _with_state("epoch", -1)], "epoch must be a non-negative integer, got -1"),
    (["--resume", _with_state("epoch", "3")], "epoch must be a non-negative integer, got '3'"),
    (["--resume", _with_state("epoch", True)], "epoch must be a non-negative integer"),
    (["--resume", _with_state("history", {"epoch": 1})], "history must be a list"),
    (["--resume", _with_state("history", [{**A_RECORD, "loss": "low"}])],
     "loss is 'low', not a number"),
    (["--resume", _with_state("history", [{**A_RECORD, "epoch": 7}])], "epoch must be 1..1"),
    (["--resume", _with_state("rng", {"bit_generator": "PCG64"})], "rng is not a PCG64 state"),
    (["--resume", _with_state("optimizer", [1, 2])], "optimizer must be a dict"),
    (["--resume", _deeply_nested_state], "nested too deeply"),
    (["--early-stopping", "0"], "--early-stopping must be a positive integer, got 0"),
    (["--export-onnx", "/nonexistent/dir/m.onnx"], "--export-onnx /nonexistent/dir/m.onnx"),
    (["--export-onnx", _a_directory], "is a directory"),
]


@pytest.mark.parametrize("arguments, message", BAD_INPUTS,
                         ids=[" ".join(a if isinstance(a, str) else a.__name__ for a in args)
                              for args, _ in BAD_INPUTS])
def test_bad_input_exits_with_one_line(arguments, message, tmp_path, capsys):
    arguments = [a(tmp_path) if callable(a) else a for a in arguments]
    code, captured = run_main(TINY + arguments, capsys)
    assert code != 0
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], captured.err
    assert "Traceback" not in captured.err
    assert "epoch 1/" not in captured.out   # found before any training


@pytest.mark.skipif(cuda_available(), reason="CUDA is usable here")
def test_unusable_cuda_device_exits_with_one_line(capsys):
    code, captured = run_main(TINY + ["--device", "cuda"], capsys)
    lines = captured.err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and "cuda" in lines[0]


def test_resume_rejects_another_architecture_and_a_finished_run(tmp_path, capsys):
    checkpoint = str(tmp_path / "run.npz")
    main(TINY + ["--save", checkpoint])
    capsys.readouterr()
    code, captured = run_main(TINY + ["--hidden", "8", "--resume", checkpoint], capsys)
    assert code != 0 and "trained with" in captured.err and len(captured.err.splitlines()) == 1
    code, captured = run_main(TINY + ["--resume", checkpoint], capsys)
    assert code != 0 and "already trained for 1 epochs" in captured.err


def test_plot_without_matplotlib_is_one_line(monkeypatch, tmp_path, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *rest: None if name == "matplotlib" else find_spec(name, *rest))
    code, captured = run_main(TINY + ["--plot", str(tmp_path / "curves.png")], capsys)
    assert code != 0 and "matplotlib" in captured.err and len(captured.err.splitlines()) == 1


def test_module_entry_point_runs_and_fails_cleanly():
    command = [sys.executable, "-m", "engine.train"]
    environment = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    good = subprocess.run(command + TINY + ["--no-save"], cwd=REPO_ROOT, capture_output=True,
                          text=True, env=environment)
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


# ------------------------------------------------------------------ saving and outputs

def test_resume_keeps_saving_to_the_checkpoint_it_resumed(tmp_path, capsys):
    """--resume PATH without --save used to stop checkpointing."""
    path = str(tmp_path / "run.npz")
    main(TINY + ["--save", path])
    main(TINY + ["--epochs", "2", "--resume", path])
    state = read_checkpoint(path)
    assert state["epoch"] == 2 and [r["epoch"] for r in state["history"]] == [1, 2]
    other = str(tmp_path / "other.npz")
    main(TINY + ["--epochs", "3", "--resume", path, "--save", other])
    assert read_checkpoint(path)["epoch"] == 2 and read_checkpoint(other)["epoch"] == 3


def test_a_longer_resumed_run_stretches_the_cosine(tmp_path, capsys):
    """A finished 1-epoch run (its rate ends at 0) resumed up to 3 epochs trains epochs 2 and
    3 at the rates of a 3-epoch run; epoch 1's rate is the peak in both, so the result is the
    3-epoch run's, bit for bit. (A cosine continuing from the saved rate stays at 0.)"""
    path, straight = str(tmp_path / "run.npz"), str(tmp_path / "straight.npz")
    main(TINY + ["--save", path])
    assert read_checkpoint(path)["optimizer"]["param_groups"][0]["lr"] == 0
    main(TINY + ["--epochs", "3", "--resume", path])
    main(TINY + ["--epochs", "3", "--save", straight])
    resumed, reference = read_checkpoint(path), read_checkpoint(straight)
    assert resumed["epoch"] == 3
    for name, value in reference["model"].items():
        np.testing.assert_array_equal(resumed["model"][name], value)
    assert [r["loss"] for r in resumed["history"]] == [r["loss"] for r in reference["history"]]


def test_checkpoints_get_the_mode_open_would(tmp_path, capsys):
    path = tmp_path / "run.npz"
    previous = os.umask(0o022)
    try:
        main(TINY + ["--save", str(path)])
    finally:
        os.umask(previous)
    assert os.stat(path).st_mode & 0o777 == 0o644   # mkstemp's 0600 before


def test_an_unwritable_output_folder_is_found_before_training(tmp_path, monkeypatch, capsys):
    checkpoint = _checkpoint(tmp_path, "old.npz")

    def read_only_folder(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(archive.tempfile, "mkstemp", read_only_folder)
    code, captured = run_main(TINY + ["--save", str(tmp_path / "run.npz")], capsys)
    assert code == 2 and captured.err.strip().splitlines() == [
        f"engine-train: error: --save {tmp_path / 'run.npz'}: cannot be written "
        "(Permission denied)"]
    assert "epoch 1/" not in captured.out and os.listdir(tmp_path) == ["old.npz"]
    code, captured = run_main(TINY + ["--epochs", "2", "--resume", str(checkpoint)], capsys)
    assert code == 2 and captured.err.strip().splitlines() == [
        f"engine-train: error: --resume {checkpoint}: cannot be written (Permission denied); "
        "a resumed run saves there unless --save names another file"]


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="root writes into read-only folders")
def test_a_read_only_folder_is_found_before_training(tmp_path, capsys):
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        code, captured = run_main(TINY + ["--log-json", str(folder / "log.jsonl")], capsys)
    finally:
        folder.chmod(0o755)
    assert code == 2 and "cannot be written (Permission denied)" in captured.err
    assert "epoch 1/" not in captured.out


def _failing_on_call(function, failing_call):
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(args)
        if len(calls) == failing_call:
            raise OSError(errno.ENOSPC, "No space left on device", "/x/.run.npz.1.abc.partial")
        return function(*args, **kwargs)

    return wrapper


def test_a_save_failing_during_training_is_one_line_and_keeps_the_last_checkpoint(
        tmp_path, monkeypatch, capsys):
    path = tmp_path / "run.npz"
    monkeypatch.setattr(archive, "write_npz", _failing_on_call(archive.write_npz, 2))
    code, captured = run_main(TINY + ["--epochs", "3", "--save", str(path)], capsys)
    assert code == 1 and captured.err.strip().splitlines() == [
        f"engine-train: error: --save {path}: cannot write the checkpoint of epoch 2 (No space "
        f"left on device); the checkpoint of epoch 1 in {path} is intact"]
    assert read_checkpoint(str(path))["epoch"] == 1 and "epoch 3/3" not in captured.out


def test_a_failing_first_save_of_a_resumed_run_names_the_resumed_checkpoint(
        tmp_path, monkeypatch, capsys):
    path = tmp_path / "run.npz"
    main(TINY + ["--save", str(path)])
    capsys.readouterr()
    monkeypatch.setattr(archive, "write_npz", _failing_on_call(archive.write_npz, 1))
    code, captured = run_main(TINY + ["--epochs", "2", "--resume", str(path)], capsys)
    assert code == 1 and captured.err.strip().endswith(
        f"the checkpoint of epoch 1 in {path} is intact")
    assert read_checkpoint(str(path))["epoch"] == 1


def test_a_log_failing_during_training_is_one_line(tmp_path, monkeypatch, capsys):
    import engine.cli.train
    log, path = tmp_path / "log.jsonl", tmp_path / "run.npz"
    monkeypatch.setattr(engine.cli.train, "append_record",
                        _failing_on_call(engine.cli.train.append_record, 2))
    code, captured = run_main(TINY + ["--epochs", "2", "--save", str(path), "--log-json",
                                       str(log)], capsys)
    assert code == 1 and captured.err.strip().splitlines() == [
        f"engine-train: error: --log-json {log}: cannot append the record of epoch 2 (No "
        f"space left on device); the checkpoint of epoch 2 in {path} is intact"]
    assert len(log.read_text().splitlines()) == 1


def test_threads_flag_sets_the_engine_s_threads(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(engine, "set_num_threads", calls.append, raising=False)
    main(TINY + ["--threads", "1"])
    assert calls == [1]
    main(TINY)
    assert calls == [1]   # no flag, no call: the engine's default stays


def test_every_flipped_byte_of_a_checkpoint_is_a_value_error_or_harmless(tmp_path):
    engine.manual_seed(0)
    model = nn.Sequential([nn.Dense(2, input_shape=(3,))])
    optimizer = optim.Adam(model.parameters())
    model(engine.randn(4, 3)).sum().backward()
    optimizer.step()
    path = tmp_path / "good.npz"
    save_checkpoint(str(path), model, optimizer, 1, [A_RECORD], RUN_CONFIG)
    good, content = read_checkpoint(str(path)), path.read_bytes()
    damaged = tmp_path / "damaged.npz"
    errors = 0
    for position in each_flipped_byte(content, damaged):
        try:
            state = read_checkpoint(str(damaged))
        except ValueError:
            errors += 1
            continue
        assert (state["epoch"], state["history"], state["config"], state["rng"]) == (
            good["epoch"], good["history"], good["config"], good["rng"]), position
        for name in state["model"]:
            np.testing.assert_array_equal(state["model"][name], good["model"][name])
    assert errors > len(content) // 2


# ------------------------------------------------------------------ progress and curves

def test_fit_reads_the_per_step_losses_once_per_epoch(device):
    model, loader, _, _ = _blobs_model_and_loader(device)   # 6 batches of 8
    seen = []

    def loss_fn(logits, labels):
        loss = cross_entropy(logits, labels)
        seen.append(loss)
        return loss

    step_losses = []   # eager steps: loss_fn keeps each step's loss, which a replay skips
    history = fit(model, loader, optim.SGD(model.parameters(), lr=0.1), loss_fn, 2,
                  progress=False, verbose=False, step_losses=step_losses, capture=False)
    assert [len(losses) for losses in step_losses] == [6, 6]
    np.testing.assert_array_equal(np.concatenate(step_losses), [l.item() for l in seen])
    for record, losses in zip(history, step_losses):
        assert record["loss"] == pytest.approx(losses.mean(), rel=1e-6)   # equal batches


def test_fit_captures_its_step_and_equals_eager_fit_bit_for_bit(device):
    """The default captured fit and ``capture=False`` give the same records and weights."""
    results = []
    for capture in (True, False):
        engine.manual_seed(0)
        model, loader, _, _ = _blobs_model_and_loader(device, batch_size=16)
        optimizer = optim.Adam(model.parameters(), lr=0.01)
        scheduler = optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        step_losses = []
        history = fit(model, loader, optimizer, cross_entropy, 3, scheduler=scheduler,
                      clip=functools.partial(optim.clip_grad_norm_, max_norm=0.5),
                      progress=False, verbose=False, step_losses=step_losses,
                      capture=capture)
        results.append((history, step_losses, model.state_dict(), fit.last_eager_reason))
    captured, captured_losses, captured_weights, reason = results[0]
    eager, eager_losses, weights, _ = results[1]
    assert reason is None
    assert [(r["loss"], r["train_acc"]) for r in captured] == \
        [(r["loss"], r["train_acc"]) for r in eager]
    np.testing.assert_array_equal(np.concatenate(captured_losses), np.concatenate(eager_losses))
    for name in weights:
        np.testing.assert_array_equal(captured_weights[name], weights[name], err_msg=name)


class _EveryThirdStep(engine.callbacks.Callback):
    """Watches steps three at a time, as the progress bar watches them twenty at a time."""
    step_interval = 3

    def __init__(self):
        self.calls = []

    def on_step_end(self, logs):
        self.calls.append((logs["epoch"], logs["step"], logs["steps_run"], logs["rows"],
                           logs["loss"].item()))


@pytest.mark.parametrize("watch", ["none", "every third step"])
def test_fit_replays_several_steps_at_once_and_equals_eager_fit(device, watch):
    """Without per-step losses the captured fit replays several steps per launch (the step
    fetching its own batches at the loader's device cursor): the records and weights are
    still the eager ones, bit for bit, with a partial last batch, a schedule and a manual lr
    change between epochs."""
    if device == "cuda" and SIMULATOR and watch == "none":
        pytest.skip("the simulator's 23 s go to the variant that also replays in groups")
    results = []
    for capture in (True, False):
        engine.manual_seed(0)
        x, y = data.blobs(45, centers=3, seed=0)   # 5 batches of 8, then one of 5
        loader = data.DataLoader(x, y, batch_size=8, shuffle=True, seed=0, device=device)
        model = nn.Sequential([nn.Dense(8, activation="relu", input_shape=(2,)),
                               nn.Dense(3)]).to(device)
        optimizer = optim.Adam(model.parameters(), lr=0.01)
        scheduler = optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        watcher = _EveryThirdStep()

        def triple_the_lr_once(record):
            if record["epoch"] == 1:
                optimizer.param_groups[0]["lr"] *= 3

        history = fit(model, loader, optimizer, cross_entropy, 3, scheduler=scheduler,
                      progress=False, verbose=False, capture=capture,
                      callbacks=[watcher] if watch != "none" else [],
                      on_epoch_end=triple_the_lr_once)
        results.append((history, model.state_dict(), optimizer.state_dict(), watcher.calls,
                        fit.last_eager_reason))
    (captured, weights, state, calls, reason), (eager, eager_weights, eager_state,
                                                eager_calls, _) = results
    assert reason is None
    assert [(r["loss"], r["train_acc"]) for r in captured] == \
        [(r["loss"], r["train_acc"]) for r in eager]
    for name in eager_weights:
        np.testing.assert_array_equal(weights[name], eager_weights[name], err_msg=name)
    assert [s["step"] for s in state["state"].values()] == [18] * 4
    assert [s["step"] for s in eager_state["state"].values()] == [18] * 4
    if watch != "none":
        # eagerly every step is seen; captured, groups of up to three, never past a
        # multiple of three, the partial batch alone, and the same last losses
        assert [c[1] for c in eager_calls] == list(range(6)) * 3
        assert [(c[1], c[2], c[3]) for c in calls] == [(2, 3, 24), (4, 2, 16), (5, 1, 5)] * 3
        eager_at = {(c[0], c[1]): c[4] for c in eager_calls}
        assert [c[4] for c in calls] == [eager_at[(c[0], c[1])] for c in calls]


def test_the_progress_bar_keeps_samples_per_second_at_80_columns():
    screen = io.StringIO()
    bar = progress_bar(469, 10, 10, file=screen, ncols=80, mininterval=0)
    bar.update(400)
    show_progress(bar, 0.1234, 102602.4)
    bar.refresh()
    line = screen.getvalue().split("\r")[-1]
    bar.close()
    assert len(line) <= 80 and line.endswith("loss 0.1234, 102602 samples/s"), line
    assert line.rindex("|") - line.index("|") > 10, line   # a bar, not one character
    assert line.startswith("epoch 10/10  85%|") and "400/469" in line


def test_plot_shows_every_step_and_integer_epochs(tmp_path):
    pytest.importorskip("matplotlib")
    history = [{**A_RECORD, "epoch": epoch, "loss": 2.0 / epoch, "test_acc": 0.1 * epoch}
               for epoch in (1, 2, 3)]
    step_losses = [np.linspace(3, 2, 5), np.linspace(2, 1, 5), np.linspace(1, 0.5, 5)]
    path = tmp_path / "curves.png"
    figure = plot_history(history, str(path), step_losses)
    loss_axes, accuracy_axes = figure.axes
    per_step, per_epoch = loss_axes.lines
    np.testing.assert_allclose(per_step.get_xdata()[:5], [0.2, 0.4, 0.6, 0.8, 1.0])
    assert len(per_step.get_ydata()) == 15 and list(per_epoch.get_xdata()) == [1, 2, 3]
    for axes in (loss_axes, accuracy_axes):
        assert axes.get_xlabel() == "epoch" and axes.get_ylabel()
        ticks = [t for t in axes.get_xticks() if axes.get_xlim()[0] <= t <= axes.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert accuracy_axes.get_ylabel() == "accuracy (%)"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.listdir(tmp_path) == ["curves.png"]


def test_plot_of_a_resumed_run_has_steps_only_for_its_epochs(tmp_path):
    pytest.importorskip("matplotlib")
    history = [{**A_RECORD, "epoch": epoch} for epoch in (1, 2, 3)]
    figure = plot_history(history, str(tmp_path / "c.svg"), [np.ones(4)])
    np.testing.assert_allclose(figure.axes[0].lines[0].get_xdata(), [2.25, 2.5, 2.75, 3.0])
    assert (tmp_path / "c.svg").read_text().lstrip().startswith("<?xml")


@pytest.mark.parametrize("target, message", [
    (lambda tmp_path: _a_directory(tmp_path), "is a directory"),
    (lambda tmp_path: str(tmp_path / "curves.nope"), "matplotlib writes no 'nope' files")])
def test_a_bad_plot_path_is_found_before_training(tmp_path, capsys, target, message):
    pytest.importorskip("matplotlib")
    code, captured = run_main(TINY + ["--plot", target(tmp_path)], capsys)
    assert code == 2 and message in captured.err and len(captured.err.splitlines()) == 1
    assert "epoch 1/" not in captured.out


# ------------------------------------------------------------------ early stopping and ONNX

def _onnx_logits(path, images):
    onnxruntime = pytest.importorskip("onnxruntime")
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"input": images})[0]


def test_early_stopping_exports_the_best_epoch(tmp_path, capsys):
    """Adam at 0.05 overshoots after epoch 1: the run stops after epoch 2 and exports epoch
    1's weights, which a run of 1 epoch saves; both take the raw uint8 images."""
    pytest.importorskip("onnx")
    run = TINY + ["--schedule", "constant", "--lr", "0.05"]
    exported, last = tmp_path / "best.onnx", tmp_path / "last.npz"
    main(run + ["--epochs", "6", "--early-stopping", "1", "--export-onnx", str(exported),
                "--save", str(last), "--log-json", str(tmp_path / "log.jsonl")])
    out = capsys.readouterr().out
    assert "early stopping after epoch 2: test_loss has not improved for 1 epoch(s)" in out
    assert f"ONNX model written to {exported} (the weights of epoch 1, the best test loss)" in out
    assert read_checkpoint(str(last))["epoch"] == 2   # --save keeps the last epoch, to resume
    first = tmp_path / "first.npz"
    main(run + ["--epochs", "1", "--save", str(first)])
    model = nn.load(str(first))
    images = data.mnist.load()[1][0][:64]
    np.testing.assert_allclose(_onnx_logits(exported, images), model.predict(images), rtol=0,
                               atol=1e-5)


def test_export_onnx_without_the_onnx_package_is_one_line(monkeypatch, tmp_path, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "onnx" else find_spec(name, *rest))
    code, captured = run_main(TINY + ["--export-onnx", str(tmp_path / "m.onnx")], capsys)
    assert code == 2 and captured.err.strip().splitlines() == [
        "engine-train: error: --export-onnx needs the onnx package, an optional extra: "
        "pip install -e '.[onnx]'"]


def test_a_checkpoint_from_before_the_test_loss_resumes(tmp_path, capsys):
    path = str(tmp_path / "old.npz")
    main(TINY + ["--save", path])
    state = read_checkpoint(path)
    model = build_mlp((28, 28), (16,), 10, preprocessing(data.mnist.load()[0][0][:192],
                                                         (0.1, 0.3)))
    optimizer = optim.Adam(model.parameters())
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    old_records = [{key: value for key, value in record.items() if key != "test_loss"}
                   for record in state["history"]]
    save_checkpoint(path, model, optimizer, 1, old_records, state["config"])
    assert read_checkpoint(path)["history"][0]["test_loss"] is None
    main(TINY + ["--epochs", "2", "--resume", path])
    history = read_checkpoint(path)["history"]
    assert history[0]["test_loss"] is None and history[1]["test_loss"] > 0


def test_no_capture_trains_as_the_captured_default(tmp_path, capsys):
    logs = [tmp_path / "captured.jsonl", tmp_path / "eager.jsonl"]
    main(TINY + ["--epochs", "2", "--log-json", str(logs[0])])
    main(TINY + ["--epochs", "2", "--no-capture", "--log-json", str(logs[1])])
    captured, eager = ([json.loads(line) for line in log.read_text().splitlines()]
                       for log in logs)
    assert [(r["loss"], r["test_loss"]) for r in captured] == \
        [(r["loss"], r["test_loss"]) for r in eager]


# ------------------------------------------------------------------ --model cnn

CNN_TINY = ["--model", "cnn", "--limit", "256", "--epochs", "1", "--batch-size", "64",
            "--no-progress"]


def test_model_cnn_trains_and_saves_its_running_statistics(tmp_path, capsys):
    path = str(tmp_path / "cnn.npz")
    main(CNN_TINY + ["--save", path, "--log-json", str(tmp_path / "log.jsonl")])
    output = capsys.readouterr().out
    assert "CNN 1x28x28-conv32-maxpool-conv64-batchnorm-avgpool-128-10 (421770 parameters)" \
        in output and "epoch 1/1" in output
    record = json.loads((tmp_path / "log.jsonl").read_text())
    assert record["test_acc"] > 0.3   # 256 images once: far above chance, far from trained
    state = read_checkpoint(path)
    assert state["config"]["model"] == "cnn" and "hidden" not in state["config"]
    assert state["model"]["batchnorm.running_var"].shape == (64,)
    assert not np.all(state["model"]["batchnorm.running_var"] == 1)   # it was trained
    model = nn.load(path)
    assert [type(layer).__name__ for layer in model.layers][:4] == [
        "Rescaling", "Normalization", "Reshape", "Conv2D"]
    main(CNN_TINY + ["--epochs", "2", "--resume", path])
    assert "resuming after epoch 1" in capsys.readouterr().out


def test_a_checkpoint_of_one_model_is_refused_for_the_other(tmp_path, capsys):
    cnn, mlp = str(tmp_path / "cnn.npz"), str(tmp_path / "mlp.npz")
    main(CNN_TINY + ["--save", cnn])
    main(TINY + ["--save", mlp])
    capsys.readouterr()
    for arguments, message in (
            (TINY + ["--epochs", "2", "--resume", cnn],
             "the checkpoint holds a --model cnn network, this run asks for --model mlp"),
            (CNN_TINY + ["--epochs", "2", "--resume", mlp],
             "the checkpoint holds a --model mlp network, this run asks for --model cnn")):
        code, captured = run_main(arguments, capsys)
        lines = captured.err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and message in lines[0], captured.err


def test_help_names_the_model_and_its_default(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--model MODEL mlp (Flatten" in text and "(default mlp)" in text


def test_model_cnn_exports_onnx(tmp_path, capsys):
    pytest.importorskip("onnx", reason="needs onnx: pip install -e '.[onnx]'")
    onnxruntime = pytest.importorskip("onnxruntime", reason="needs onnxruntime")
    path = tmp_path / "cnn.onnx"
    main(CNN_TINY + ["--export-onnx", str(path)])
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    images = data.mnist.load()[1][0][:2]
    (logits,) = session.run(None, {"input": images})
    np.testing.assert_allclose(logits, nn.load("mnist-cnn.npz").predict(images), rtol=0,
                               atol=1e-4)


# ------------------------------------------------------------------ a first run keeps its model

def test_a_run_saves_its_model_in_the_current_folder_by_default(tmp_path, capsys):
    main(TINY)
    out = capsys.readouterr().out
    assert (tmp_path / "mnist-mlp.npz").is_file()
    assert "model saved to mnist-mlp.npz (epoch 1): engine.nn.load('mnist-mlp.npz')" in out
    raw = data.mnist.load()[1][0][:5]   # uint8, as the data set ships them
    assert nn.load("mnist-mlp.npz").predict(raw).shape == (5, 10)
    main(TINY + ["--no-save", "--model", "cnn"])
    assert not (tmp_path / "mnist-cnn.npz").exists()
    assert "model saved" not in capsys.readouterr().out
    code, captured = run_main(TINY + ["--no-save", "--save", "m.npz"], capsys)
    assert code == 2 and "--no-save and --save m.npz contradict each other" in captured.err


def _interrupted_after(epochs):
    """``fit`` that Ctrl-C stops after ``epochs`` epochs (their checkpoints written)."""
    from engine.cli import train as cli
    real_fit = cli.fit

    def fit(*args, on_epoch_end=(), **kwargs):
        def stop(record):
            if record["epoch"] >= epochs:
                raise KeyboardInterrupt
        if epochs == 0:
            raise KeyboardInterrupt
        return real_fit(*args, on_epoch_end=list(on_epoch_end) + [stop], **kwargs)
    return fit


@pytest.mark.parametrize("epochs, extra, message", [
    (1, [], "engine-train: interrupted; mnist-mlp.npz holds epoch 1 (resume with --resume "
            "mnist-mlp.npz)"),
    (0, [], "engine-train: interrupted; no epoch finished, so mnist-mlp.npz was not written"),
    (0, ["--no-save"], "engine-train: interrupted; nothing was saved (--no-save)")])
def test_an_interrupt_says_which_epoch_the_file_holds(monkeypatch, capsys, epochs, extra,
                                                       message):
    from engine.cli import train as cli
    monkeypatch.setattr(cli, "fit", _interrupted_after(epochs))
    code, captured = run_main(TINY + ["--epochs", "3"] + extra, capsys)
    assert code == 130 and captured.err.strip().splitlines() == [message]


def test_resume_says_that_it_keeps_the_checkpoint_s_lr(capsys):
    main(TINY + ["--lr", "0.01"])
    capsys.readouterr()
    main(TINY + ["--epochs", "2", "--resume", "mnist-mlp.npz", "--lr", "0.5"])
    header = capsys.readouterr().out.splitlines()[0]
    assert ("adam lr 0.01 (the checkpoint's: a resumed run keeps its optimizer settings, so "
            "--lr 0.5 is not used)") in header


def test_the_first_run_is_told_that_it_compiles(monkeypatch, tmp_path, capsys):
    from numba import config

    from engine.cli import run_header as cli
    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    assert not cli.kernels_cached()
    main(TINY + ["--no-save"])
    assert "compiling the engine's kernels (Numba JIT, the first run only)" in \
        capsys.readouterr().out
    (tmp_path / "site" / "ops").mkdir(parents=True)
    (tmp_path / "site" / "ops" / "dense._dense_kernels.dense_forward_cpu-35.py311.nbi").touch()
    assert cli.kernels_cached()
    main(TINY + ["--no-save"])
    assert "compiling" not in capsys.readouterr().out


# ------------------------------------------------------------------ a fast start

_NUMBA_AFTER = """
import runpy, sys
sys.argv = ["engine.train", *sys.argv[1:]]
try:
    runpy.run_module("engine.train", run_name="__main__", alter_sys=True)
except SystemExit as exit:
    print("exit", exit.code, "numba" in sys.modules, "numba.cuda" in sys.modules)
"""


@pytest.mark.parametrize("arguments, status", [(["--help"], 0), (["--epochz", "3"], 2)])
def test_help_and_a_typo_answer_before_numba_is_imported(arguments, status):
    result = subprocess.run([sys.executable, "-c", _NUMBA_AFTER, *arguments], cwd=REPO_ROOT,
                            capture_output=True, text=True)
    assert result.stdout.splitlines()[-1] == f"exit {status} False False", result.stderr
    if status:
        assert result.stderr.strip().splitlines() == [
            "engine-train: error: unrecognized arguments: --epochz 3 (see --help)"]


def test_the_early_answer_knows_the_launchers_of_engine_distributed():
    from engine import distributed
    from engine.cli import arguments as cli
    assert cli.LAUNCHERS == distributed.LAUNCHER_VARIABLES


def test_import_engine_imports_no_numba():
    result = subprocess.run([sys.executable, "-c", "import sys, engine; "
                             "print('numba' in sys.modules, 'numba.cuda' in sys.modules)"],
                            cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.stdout.split() == ["False", "False"], result.stderr


def test_the_header_names_the_simulator():
    from engine.cli import run_header as cli
    assert cli.describe_device("cuda", simulator=False) == "cuda"
    assert cli.describe_device("cpu", simulator=True) == "cpu"
    assert cli.describe_device("cuda", simulator=True).startswith(
        "cuda (Numba's CUDA simulator, as NUMBA_ENABLE_CUDASIM=1 asks")
