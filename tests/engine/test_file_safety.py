"""Every writer refuses a target that exists and is not a regular file (``engine.file_safety``):
a FIFO, or a symlink to a device, keeps what it is and nothing is written beside it. The
targets are a FIFO and a link to /dev/null made in tmp_path; the real /dev is never touched.
"""
import contextlib
import os
import stat

import numpy as np
import pytest

from engine import archive, nn
from engine.callbacks import JsonLog, TensorBoard, append_record
from engine.file_safety import SizeBudget, check_write_target, special_kind

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo (POSIX)")


@contextlib.contextmanager
def _fifo(path):
    """A FIFO at ``path`` with a reader holding it open (nonblocking), so a writer that
    opens it never blocks: a wrong one writes into the pipe instead of hanging the test."""
    os.mkfifo(path)
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        yield path
    finally:
        os.close(reader)


def _link_to_dev_null(tmp_path):
    link = tmp_path / "null.npz"
    os.symlink(os.devnull, link)
    return link


def _model():
    return nn.Sequential([nn.Dense(3, input_shape=(2,))])


def _assert_untouched(folder, target, kind):
    """``target`` is still a ``kind`` (S_ISFIFO, S_ISCHR) and no file was left beside it."""
    assert kind(os.stat(target).st_mode), f"{target} was replaced"
    left = sorted(name for name in os.listdir(folder) if name != os.path.basename(target))
    assert left == [], left


def _writers():
    """Each writer of a file, as ``write(path)``."""
    def onnx_export(path):
        pytest.importorskip("onnx")
        _model().export_onnx(path)

    def safetensors(path):
        pytest.importorskip("safetensors")
        _model().save(os.fspath(path) + ".safetensors")

    def plot(path):
        pytest.importorskip("matplotlib")
        from engine.cli.training_curves import plot_history
        plot_history([{"epoch": 1, "loss": 1.0, "train_acc": 0.5, "test_acc": 0.5}],
                     os.fspath(path) + ".png", [])

    def idx(path):
        from data.idx import write_idx
        write_idx(path, np.zeros((2, 2), np.uint8))

    return {"model.save": lambda path: _model().save(path),
            "atomic_write": lambda path: archive.write_npz(path, {"a": np.ones(2)}),
            "probe_writable": lambda path: archive.probe_writable(path),
            "append (JSON log)": lambda path: append_record(path, {"epoch": 1}),
            "JsonLog": lambda path: JsonLog(path).on_epoch_end({"epoch": 1}),
            "export_onnx": onnx_export, "safetensors": safetensors, "plot": plot,
            "write_idx": idx}


@pytest.mark.parametrize("writer", sorted(_writers()))
def test_a_fifo_is_never_replaced_nor_written(tmp_path, writer):
    write = _writers()[writer]
    name = {"safetensors": "model", "plot": "curves"}.get(writer, "target.npz")
    target = tmp_path / (name + {"safetensors": ".safetensors", "plot": ".png"}.get(writer, ""))
    with _fifo(target):
        with pytest.raises(OSError, match="is a FIFO .*not a regular file"):
            write(tmp_path / name if writer in ("safetensors", "plot") else target)
        _assert_untouched(tmp_path, target, stat.S_ISFIFO)


@pytest.mark.parametrize("writer", ["model.save", "atomic_write", "probe_writable",
                                    "append (JSON log)"])
def test_a_link_to_dev_null_is_refused_and_left_a_link(tmp_path, writer):
    link = _link_to_dev_null(tmp_path)
    with pytest.raises(OSError, match=r"a link to /dev/null\) is a character device"):
        _writers()[writer](link)
    assert os.path.islink(link) and os.readlink(link) == os.devnull
    _assert_untouched(tmp_path, link, stat.S_ISCHR)


def test_tensorboard_refuses_a_fifo_for_its_folder(tmp_path):
    pytest.importorskip("tensorboardX")
    with _fifo(tmp_path / "runs") as target:
        callback = TensorBoard(target)
        with pytest.raises(OSError, match="TensorBoard: .*runs cannot be made .*is a FIFO"):
            callback.on_train_begin({"steps": 1, "start_epoch": 0})
        _assert_untouched(tmp_path, target, stat.S_ISFIFO)


def test_the_cli_refuses_a_fifo_for_save_and_export(tmp_path):
    from engine.cli.failures import BadInput
    from engine.cli.output_paths import check_output
    for flag in ("--save", "--export-onnx", "--log-json"):
        with _fifo(tmp_path / f"out{flag}") as target:
            with pytest.raises(BadInput, match=f"{flag} .*cannot be written .*FIFO"):
                check_output(flag, os.fspath(target), appending=flag == "--log-json")


def test_regular_files_links_to_them_and_folders_still_pass(tmp_path):
    regular = tmp_path / "model.npz"
    regular.write_bytes(b"old")
    os.symlink(regular, tmp_path / "link.npz")
    for path in (regular, tmp_path / "link.npz", tmp_path / "new.npz"):
        check_write_target(path)
    check_write_target(tmp_path, directory=True)
    with pytest.raises(IsADirectoryError, match="is a directory, not a regular file"):
        check_write_target(tmp_path)
    assert special_kind(regular) is None and special_kind(tmp_path / "absent") is None
    _model().save(tmp_path / "link.npz")   # a link to a regular file is replaced, as before
    assert nn.load(tmp_path / "link.npz").layers[0].units == 3


def test_a_size_budget_refuses_what_the_file_cannot_hold():
    budget = SizeBudget("f.bin", 100, slack=10)
    budget.charge(60, "entry a")
    assert budget.remaining == 50
    with pytest.raises(ValueError, match=r"f.bin: entry b needs 51 bytes, but it holds 100 "
                                         r"bytes \(50 not yet spent\)"):
        budget.charge(51, "entry b")
    with pytest.raises(ValueError, match="needs -1 bytes"):
        budget.charge(-1, "a negative size")
