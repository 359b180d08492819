"""safetensors model files: ``model.save("m.safetensors")`` and ``nn.load`` round-trip a model
bit for bit (weights, BatchNorm statistics, Dropout's seed state, the architecture in the
metadata); the file is a plain safetensors file that ``safetensors.numpy`` (and torch's
reader) read, whose weights load into a model the user builds; a write is atomic; every
damaged byte is a ValueError naming the file.

Needs the safetensors package (the formats and test extras); skipped without it."""
import json
import os
import sys

import numpy as np
import pytest

import engine
import optim
from engine import archive, nn

safetensors_numpy = pytest.importorskip(
    "safetensors.numpy", reason="needs safetensors: pip install -e '.[formats]'")


def _cnn(dtype=np.float32):
    return nn.Sequential([
        nn.Reshape((1, 5, 5), input_shape=(25,)),
        nn.Conv2D(3, 3, padding="same", activation="relu", dtype=dtype),
        nn.BatchNorm(dtype=dtype), nn.MaxPool2D(2), nn.Flatten(),
        nn.Dense(6, activation="leaky_relu", alpha=0.2, dtype=dtype), nn.Dropout(0.3),
        nn.Dense(3, activation="softmax", dtype=dtype)])


def _inputs(dtype=np.float32, batch=4):
    return np.random.default_rng(1).normal(size=(batch, 25)).astype(dtype)


def _trained_statistics(model, dtype=np.float32):
    """Run one training forward so BatchNorm's running statistics and Dropout's mask count
    are no longer their initial values."""
    model.train()
    model(_inputs(dtype, batch=7))
    return model


def _outputs(model, x):
    model.eval()
    with engine.no_grad():
        return model(x).numpy()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_model_round_trips_bit_for_bit(tmp_path, dtype):
    model = _trained_statistics(_cnn(dtype), dtype)
    path = tmp_path / "m.safetensors"
    model.save(path)
    loaded = nn.load(path)
    assert loaded.get_config() == model.get_config()
    saved, read = model.state_dict(), loaded.state_dict()
    assert list(read) == list(saved)
    for name in saved:
        assert read[name].dtype == saved[name].dtype, name
        np.testing.assert_array_equal(read[name], saved[name], err_msg=name)
    assert not np.array_equal(saved["batchnorm.running_mean"], np.zeros(3))
    x = _inputs(dtype)
    np.testing.assert_array_equal(_outputs(loaded, x), _outputs(model, x))


def test_the_file_is_plain_safetensors_that_loads_into_a_model_the_user_builds(tmp_path):
    model = _trained_statistics(_cnn())
    path = tmp_path / "m.safetensors"
    model.save(str(path))
    arrays = safetensors_numpy.load_file(path)
    assert sorted(arrays) == sorted(model.state_dict())
    built = _cnn()
    built.load_state_dict(arrays)
    x = _inputs()
    np.testing.assert_array_equal(_outputs(built, x), _outputs(model, x))
    from safetensors import safe_open
    with safe_open(path, framework="numpy") as file:
        metadata = file.metadata()
    assert set(metadata) == {nn.CONFIG_KEY, archive.CHECKSUM_KEY}
    assert archive.loads_json(metadata[nn.CONFIG_KEY], "test") == model.get_config()


@pytest.mark.torch
def test_torch_reads_the_weights(tmp_path):
    import safetensors.torch
    model = _cnn()
    path = tmp_path / "m.safetensors"
    model.save(path)
    tensors = safetensors.torch.load_file(path)
    np.testing.assert_array_equal(tensors["dense.weight"].numpy(),
                                  model.state_dict()["dense.weight"])


def test_a_file_without_the_architecture_names_the_fix(tmp_path):
    model = _cnn()
    path = tmp_path / "weights.safetensors"
    safetensors_numpy.save_file(model.state_dict(), path)   # no metadata: another writer's
    with pytest.raises(ValueError, match=r"weights.safetensors.*no architecture.*"
                                         r"load_state_dict\(safetensors.numpy.load_file"):
        nn.load(path)
    built = _cnn()
    built.load_state_dict(safetensors_numpy.load_file(path))   # no checksum: loads as it is
    x = _inputs()
    np.testing.assert_array_equal(_outputs(built, x), _outputs(model, x))


def test_weights_of_another_architecture_are_named(tmp_path):
    path = tmp_path / "m.safetensors"
    _cnn().save(path)
    other = nn.Sequential([nn.Dense(4, input_shape=(25,))])
    with pytest.raises(KeyError, match="missing key"):
        other.load_state_dict(safetensors_numpy.load_file(path))


def test_an_unknown_layer_in_the_metadata_is_refused_not_imported(tmp_path):
    """The architecture names classes of ``nn.LAYERS`` only: a file cannot make ``nn.load``
    import or call anything else."""
    path = tmp_path / "crafted.safetensors"
    config = {"format": "engine.nn.Sequential", "version": nn.FORMAT_VERSION, "name": "x",
              "layers": [{"class_name": "os.system", "config": {"command": "true"}}]}
    archive.write_safetensors(path, {}, {nn.CONFIG_KEY: json.dumps(config)})
    with pytest.raises(ValueError, match=r"crafted.safetensors.*unknown layer type 'os.system'"):
        nn.load(path)


def test_every_flipped_byte_is_a_value_error_naming_the_file(tmp_path):
    """The checksum covers the weights and the metadata, safetensors's own checks the header:
    no single-byte corruption loads, and none raises anything but a ValueError."""
    model = nn.Sequential([nn.Dense(2, activation="tanh", input_shape=(3,)), nn.Dense(1)])
    good = tmp_path / "good.safetensors"
    model.save(good)
    content = good.read_bytes()
    damaged = tmp_path / "damaged.safetensors"
    for position in range(len(content)):
        flipped = bytearray(content)
        flipped[position] ^= 0xFF
        damaged.write_bytes(bytes(flipped))
        with pytest.raises(ValueError, match="damaged.safetensors") as caught:
            nn.load(damaged)
        assert "\n" not in str(caught.value), (position, str(caught.value))


def test_truncated_and_foreign_files_are_value_errors(tmp_path):
    good = tmp_path / "good.safetensors"
    _cnn().save(good)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-5])
    with pytest.raises(ValueError, match="truncated.safetensors.*not a safetensors file"):
        nn.load(truncated)
    npz = tmp_path / "model.safetensors"
    _cnn().save(tmp_path / "model.npz")
    os.replace(tmp_path / "model.npz", npz)
    with pytest.raises(ValueError, match="model.safetensors.*not a safetensors file but an "
                                         r"\.npz archive under a \.safetensors name"):
        nn.load(npz)
    with pytest.raises(FileNotFoundError):
        nn.load(tmp_path / "absent.safetensors")


def test_a_failed_write_leaves_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    first = _cnn()
    first.save(path)
    before = path.read_bytes()

    def full_disk(descriptor):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(archive.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        _trained_statistics(_cnn()).save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["m.safetensors"]   # no temporary file left behind


def test_without_the_package_the_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(ImportError, match=r"numba-engine\[formats\]"):
        _cnn().save(tmp_path / "m.safetensors")


@pytest.mark.gpu
def test_a_cuda_model_saves_and_loads_on_the_gpu(tmp_path):
    model = _trained_statistics(_cnn().to("cuda"))
    path = tmp_path / "m.safetensors"
    model.save(path)
    loaded = nn.load(path, device="cuda")
    assert loaded.device == "cuda"
    x = engine.tensor(_inputs(), device="cuda")
    np.testing.assert_array_equal(_outputs(loaded, x), _outputs(model, x))


@pytest.mark.cuda
def test_a_model_on_the_cuda_device_saves_its_device_weights(tmp_path):
    """The weights come from the device (Numba's simulator on a CPU machine): a tiny model."""
    model = nn.Sequential([nn.Dense(3, activation="tanh", input_shape=(2,)),
                           nn.Dense(2)]).to("cuda")
    path = tmp_path / "m.safetensors"
    model.save(path)
    loaded = nn.load(path, device="cuda")
    assert loaded.device == "cuda"
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[name], value, err_msg=name)
    x = engine.tensor(_inputs()[:, :2], device="cuda")
    np.testing.assert_array_equal(_outputs(loaded, x), _outputs(model, x))


@pytest.mark.parametrize("suffix", [".safetensors", ".onnx"])
def test_a_training_checkpoint_refuses_a_model_only_format(tmp_path, suffix):
    from engine.fit import save_checkpoint
    model = nn.Sequential([nn.Dense(2, input_shape=(3,))])
    opt = optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=rf"checkpoint .* is an \.npz file, not \{suffix}"):
        save_checkpoint(tmp_path / f"run{suffix}", model, opt)
    assert not (tmp_path / f"run{suffix}").exists()
