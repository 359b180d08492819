"""``python -m engine.train`` on outputs it cannot write as asked, a model too large for the
machine, a full disk under ``--tensorboard`` and SIGTERM: each is refused before training or
ends with one line on stderr, never a traceback (issue 47)."""
import os
import signal
import subprocess
import sys

import pytest

from engine.checkpoint import read_checkpoint
from engine.cli import memory_estimate
from engine.train import main
from tests.support.paths import REPO_ROOT
from tests.support.training_command import TINY, run_main


@pytest.fixture(autouse=True)
def _in_a_fresh_folder(tmp_path, monkeypatch):
    """Runs save to ``DATASET-MODEL.npz`` in the current folder by default: a test's own."""
    monkeypatch.chdir(tmp_path)


def _refused(argv, capsys):
    """The one line of a run refused before training (status 2, no epoch trained)."""
    code, captured = run_main(argv, capsys)
    assert code == 2 and "epoch 1/" not in captured.out, (code, captured)
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


# ------------------------------------------------------------------ two outputs, one file

@pytest.mark.parametrize("flags, named", [
    (["--save", "run.npz"], "--save run.npz"),
    (["--resume", "run.npz"], "--resume run.npz (a resumed run saves its checkpoint there)"),
    ([], "the checkpoint run.npz (the default of --save)")])
def test_export_onnx_onto_the_checkpoint_is_refused_before_training(capsys, tmp_path, flags,
                                                                     named):
    (tmp_path / "run.npz").write_bytes(b"left alone")
    arguments = TINY + flags + ["--export-onnx", "run.npz"]
    if not flags:   # the default checkpoint name, DATASET-MODEL.npz
        arguments = TINY + ["--export-onnx", "mnist-mlp.npz"]
        named = named.replace("run.npz", "mnist-mlp.npz")
    line = _refused(arguments, capsys)
    assert line == (f"engine-train: error: --export-onnx {arguments[-1]}: is the file of "
                    f"{named} too; give each output a file of its own")
    assert (tmp_path / "run.npz").read_bytes() == b"left alone"


def test_two_outputs_through_different_spellings_are_one_file(capsys, tmp_path):
    (tmp_path / "logs").mkdir()
    line = _refused(TINY + ["--log-json", "logs/../run.jsonl", "--export-onnx",
                            str(tmp_path / "run.jsonl")], capsys)
    assert line == (f"engine-train: error: --export-onnx {tmp_path / 'run.jsonl'}: is the file "
                    "of --log-json logs/../run.jsonl too; give each output a file of its own")


# ------------------------------------------------------------------ the checkpoint's name

@pytest.mark.parametrize("suffix", [".safetensors", ".onnx", ".SafeTensors"])
def test_a_checkpoint_name_of_a_model_only_format_is_refused_before_training(capsys,
                                                                             suffix):
    line = _refused(TINY + ["--save", f"x{suffix}"], capsys)
    assert line.startswith(
        f"engine-train: error: --save x{suffix}: a training checkpoint (the model, the "
        f"optimizer's state, the history) is an .npz file, not {suffix.lower()}; give a name "
        "ending in .npz")
    assert not os.path.exists(f"x{suffix}")


def test_resuming_a_file_of_a_model_only_name_is_refused_before_training(capsys, tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"whatever it holds")
    line = _refused(TINY + ["--epochs", "2", "--resume", "x.safetensors"], capsys)
    assert line == (
        "engine-train: error: --resume x.safetensors: a resumed run saves its checkpoint "
        "there, and a training checkpoint (the model, the optimizer's state, the history) is "
        "an .npz file, not .safetensors; give --save a name ending in .npz")


# ------------------------------------------------------------------ names too long

@pytest.mark.parametrize("flag, name", [
    ("--save", "a" * 300 + ".npz"), ("--log-json", "b" * 300 + ".jsonl"),
    ("--export-onnx", "d" * 300 + ".onnx"),
    ("--tensorboard", "e" * 300)])
def test_a_name_longer_than_the_file_system_allows_is_refused_before_training(
        capsys, tmp_path, flag, name):
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    line = _refused(TINY + [flag, name], capsys)
    assert line == (f"engine-train: error: {flag} {name}: the name {name[:20]}... is "
                    f"{len(name)} bytes long, longer than the {limit} the file system "
                    "allows; give a shorter one")


def test_a_name_of_a_folder_to_be_made_is_checked_too(capsys):
    folder = "f" * 300
    line = _refused(TINY + ["--tensorboard", os.path.join("runs", folder, "today")], capsys)
    assert f"the name {folder[:20]}... is 300 bytes long" in line


def test_a_path_longer_than_the_file_system_allows_is_refused_before_training(capsys,
                                                                             tmp_path):
    limit = os.pathconf(tmp_path, "PC_PATH_MAX")
    deep = "/".join(["folder"] * (limit // 7 + 1)) + "/run.npz"
    line = _refused(TINY + ["--save", deep], capsys)
    length = len(os.path.abspath(deep))
    assert line == (f"engine-train: error: --save {deep}: the path is {length} bytes long, "
                    f"too long for the file system ({limit} bytes with the 40 of the file's "
                    "temporary name); give a shorter one")


def test_a_name_just_within_the_limit_trains_and_saves(capsys, tmp_path):
    name = "n" * (os.pathconf(tmp_path, "PC_NAME_MAX") - 4) + ".npz"
    main(TINY + ["--save", name])
    assert read_checkpoint(name)["epoch"] == 1


# ------------------------------------------------------------------ memory

def test_a_network_too_large_for_the_memory_is_refused_before_it_is_built(capsys):
    line = _refused(TINY + ["--hidden", "1000000,1000000"], capsys)
    assert line.startswith("engine-train: error: --hidden 1000000,1000000: the network has "
                           "1,000,796,000,010 parameters; the parameters and their "
                           "gradients alone need 7,456.5 GiB of memory, and this machine "
                           "has ")
    assert line.endswith(" GiB available; give smaller widths")


def test_the_estimate_counts_the_mlp_s_parameters():
    from engine.models import build_mlp
    model = build_mlp((6, 5), (7, 3), 4)
    assert memory_estimate.mlp_parameters(30, (7, 3), 4) == sum(
        p.size for p in model.parameters()) == 31 * 7 + 8 * 3 + 4 * 4


@pytest.mark.parametrize("device, available, refused", [
    ("cpu", 2 * 4 * 1990, False), ("cpu", 2 * 4 * 1990 - 1, True),
    ("cuda", 4 * 1990, False), ("cuda", 4 * 1990 - 1, True)])
def test_the_estimate_counts_the_gradients_where_they_live(device, available, refused):
    import types
    from engine.cli.failures import BadInput
    args = types.SimpleNamespace(model="mlp", hidden=(99,), device=device)   # 10*99 + 100*10
    if refused:
        with pytest.raises(BadInput, match="the network has 1,990 parameters"):
            memory_estimate.check_model_fits(args, (9,), 10, available=available)
    else:
        memory_estimate.check_model_fits(args, (9,), 10, available=available)


def test_running_out_of_host_memory_in_training_is_one_line(monkeypatch, capsys):
    from engine.cli import train as cli

    def fit_out_of_memory(*args, **options):
        raise MemoryError("Unable to allocate 3.64 TiB for an array with shape "
                          "(1000000, 1000000) and data type float32")

    monkeypatch.setattr(cli, "fit", fit_out_of_memory)
    code, captured = run_main(TINY, capsys)
    assert code == 1 and captured.err.strip().splitlines() == [
        "engine-train: error: out of memory: Unable to allocate 3.64 TiB for an array with "
        "shape (1000000, 1000000) and data type float32 (a smaller --hidden or --batch-size)"]


# ------------------------------------------------------------------ SIGTERM

def _terminated_after_epoch(epoch):
    from engine.cli import train as cli
    real_fit = cli.fit

    def fit(*args, on_epoch_end=(), **kwargs):
        def terminate(record):
            if record["epoch"] == epoch:
                os.kill(os.getpid(), signal.SIGTERM)   # as `kill PID` would
        return real_fit(*args, on_epoch_end=list(on_epoch_end) + [terminate], **kwargs)
    return fit


def test_sigterm_says_which_epoch_the_checkpoint_holds(monkeypatch, capsys):
    from engine.cli import train as cli
    monkeypatch.setattr(cli, "fit", _terminated_after_epoch(1))
    before = signal.getsignal(signal.SIGTERM)
    code, captured = run_main(TINY + ["--epochs", "3"], capsys)
    assert code == 143 and captured.err.strip().splitlines() == [
        "engine-train: terminated (SIGTERM); mnist-mlp.npz holds epoch 1 (resume with "
        "--resume mnist-mlp.npz)"]
    assert "epoch 2/3" not in captured.out
    assert read_checkpoint("mnist-mlp.npz")["epoch"] == 1
    assert signal.getsignal(signal.SIGTERM) == before   # the command's handler is gone


_TERMINATED_PROCESS = """
import os, signal, sys
from engine.cli import train as cli
real_fit = cli.fit
def fit(*args, on_epoch_end=(), **kwargs):
    def terminate(record):
        os.kill(os.getpid(), signal.SIGTERM)
    return real_fit(*args, on_epoch_end=list(on_epoch_end) + [terminate], **kwargs)
cli.fit = fit
cli.main(sys.argv[1:])
"""


def test_a_terminated_process_exits_143_with_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-c", _TERMINATED_PROCESS, *TINY, "--epochs",
                             "2", "--save", str(tmp_path / "run.npz")], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 143, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"engine-train: terminated (SIGTERM); {tmp_path / 'run.npz'} holds epoch 1 (resume "
        f"with --resume {tmp_path / 'run.npz'})"]


# ------------------------------------------------------------------ a full disk

_FULL_DISK = """
import sys
from tensorboardX import record_writer
record_writer.open_file = lambda path: open("/dev/full", "wb")   # every flush: ENOSPC
from engine.train import main
main(sys.argv[1:])
"""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_tensorboard_on_a_full_disk_is_one_line_and_nothing_at_exit(tmp_path):
    pytest.importorskip("tensorboardX")
    result = subprocess.run([sys.executable, "-c", _FULL_DISK, *TINY, "--epochs", "2",
                             "--save", str(tmp_path / "run.npz"), "--tensorboard",
                             str(tmp_path / "runs")], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"engine-train: error: --tensorboard {tmp_path / 'runs'}: cannot write the event "
        "files (No space left on device); no checkpoint was written"]


def test_the_callback_names_its_folder_and_lets_the_writer_go(tmp_path, monkeypatch):
    tensorboardX = pytest.importorskip("tensorboardX")
    import data
    import engine
    import optim
    from engine import callbacks, nn
    from engine.fit import fit
    from engine.losses import cross_entropy
    monkeypatch.setattr(tensorboardX.record_writer, "open_file",
                        lambda path: open("/dev/full", "wb"))
    engine.manual_seed(0)
    x, y = data.blobs(32, centers=2, seed=0)
    model = nn.Sequential([nn.Dense(2, input_shape=(2,))])
    board = callbacks.TensorBoard(tmp_path / "runs")
    with pytest.raises(OSError, match=f"TensorBoard: cannot write the event files in "
                                      f"{tmp_path / 'runs'} \\(No space left on device\\)"):
        fit(model, data.DataLoader(x, y, batch_size=8), optim.SGD(model.parameters(), lr=0.1),
            cross_entropy, 2, progress=False, verbose=False, callbacks=[board])
    assert board.writer is None and board.failure.errno == 28
