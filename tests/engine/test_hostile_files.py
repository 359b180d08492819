"""Hostile files are refused within about their size in memory and in linear time
(``engine.file_safety.SizeBudget``): each file here is small and declares far more than it
holds; each test checks the peak of Python's allocations (tracemalloc, which sees NumPy's
too) stays near the file's size, never near what it declares. The declared sizes are tens
of megabytes, so a reader that believed them would fail the test without exhausting the
machine."""
import contextlib
import json
import signal
import struct
import time
import tracemalloc
import zipfile
import zlib

import numpy as np
import pytest

import engine
from engine import archive, nn
from engine.nn.serialization import CONFIG_KEY

DECLARED = 48 << 20   # what each hostile file declares
PEAK_LIMIT = 6 << 20  # what reading it may allocate (its size, a 1 MiB slack, chunks)


@contextlib.contextmanager
def _peak_below(limit):
    """Fail unless the allocations traced inside the block peak below ``limit`` bytes."""
    tracemalloc.start()
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < limit, f"peak {peak / 2**20:.1f} MiB (limit {limit / 2**20:.1f} MiB)"


@contextlib.contextmanager
def _seconds_at_most(seconds):
    """Interrupt the block after ``seconds`` (an endless loop fails instead of hanging)."""
    def expire(*_):
        raise TimeoutError(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ------------------------------------------------------------------ .npz

def _npz_declaring(path, declared):
    """An .npz whose one entry's .npy header and zip directory declare ``declared`` bytes
    of uint8 while the file holds only the header (as a truncated or crafted file does)."""
    header = _npy_header((declared,))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive_file:
        archive_file.writestr("a.npy", header)
    content = bytearray(path.read_bytes())
    directory = content.rindex(b"PK\x01\x02")   # the entry's central directory record
    total = len(header) + declared
    struct.pack_into("<II", content, directory + 20, total, total)   # compressed, size
    path.write_bytes(bytes(content))


def _npy_header(shape, dtype="|u1"):
    buffer = __import__("io").BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": dtype, "fortran_order": False,
                                                  "shape": shape})
    return buffer.getvalue()


def test_an_npz_entry_larger_than_the_file_is_refused_before_it_is_allocated(tmp_path):
    path = tmp_path / "declared.npz"
    _npz_declaring(path, DECLARED)
    assert path.stat().st_size < 1000
    with _peak_below(PEAK_LIMIT), pytest.raises(ValueError, match=r"declared.npz' is not a "
                                                r"test file .*entry 'a.npy' needs 50,331,7"):
        archive.read_npz(path, "a test file")


def test_an_npz_entry_whose_stored_size_differs_from_its_size_is_refused(tmp_path):
    path = tmp_path / "mismatch.npz"
    np.savez(path, a=np.arange(4))
    content = bytearray(path.read_bytes())
    struct.pack_into("<I", content, content.rindex(b"PK\x01\x02") + 24, DECLARED)
    path.write_bytes(bytes(content))
    with _peak_below(PEAK_LIMIT), pytest.raises(ValueError, match="declares 50,331,648 bytes "
                                                                  "but stores"):
        archive.read_npz(path, "a test file")


# ------------------------------------------------------------------ model files

def _config(layers, dtype=None):
    entries = [{"class_name": "Dense", "config": {"units": 4, "input_shape": [3]}}] + layers
    if dtype is not None:
        entries[0]["config"]["dtype"] = dtype
    return json.dumps({"format": "engine.nn.Sequential", "version": 1, "name": "m",
                       "layers": entries})


def _small_weights():
    model = nn.Sequential([nn.Dense(4, input_shape=(3,))])
    return model.state_dict()


# a Dense of DECLARED / 4 / 5 units after the 4-unit one: ~48 MB of float32 parameters
HUGE = [{"class_name": "Dense", "config": {"units": DECLARED // 20}}]


def test_an_npz_architecture_larger_than_its_weights_is_refused_before_building(tmp_path):
    path = tmp_path / "huge.npz"
    archive.write_npz(path, {CONFIG_KEY: np.array(_config(HUGE)), **_small_weights()})
    with _peak_below(PEAK_LIMIT), pytest.raises(ValueError, match=r"nn.load: .*huge.npz.*"
                                                r"layer 1 \(Dense\) of the architecture, on "
                                                r"inputs \(4,\), needs 50,331,6"):
        nn.load(path)


def test_a_safetensors_architecture_larger_than_its_weights_is_refused_before_building(
        tmp_path):
    pytest.importorskip("safetensors")
    path = tmp_path / "huge.safetensors"
    archive.write_safetensors(path, _small_weights(), {CONFIG_KEY: _config(HUGE)})
    assert path.stat().st_size < 2000
    with _peak_below(PEAK_LIMIT), pytest.raises(ValueError, match="layer 1 .Dense. of the "
                                                                  "architecture"):
        nn.load(path)


def test_a_stack_of_layers_beyond_the_weights_is_refused_at_the_first_that_does_not_fit(
        tmp_path):
    """Twelve 1000-unit layers (48 MB) declared beside one small layer's weights: each fits
    the budget's slack alone, their sum does not."""
    path = tmp_path / "deep.npz"
    deep = [{"class_name": "Dense", "config": {"units": 1000}}] * 12
    archive.write_npz(path, {CONFIG_KEY: np.array(_config(deep)), **_small_weights()})
    with _peak_below(PEAK_LIMIT), pytest.raises(ValueError, match=r"layer 2 \(Dense\)"):
        nn.load(path)


@pytest.mark.parametrize("dtype", ["O", "float16", "int32", "no such type"])
def test_a_config_dtype_the_layers_do_not_compute_in_is_a_value_error(tmp_path, dtype):
    path = tmp_path / "dtype.npz"
    archive.write_npz(path, {CONFIG_KEY: np.array(_config([], dtype)), **_small_weights()})
    with pytest.raises(ValueError, match=rf"nn.load: .*layer 0 \(Dense\): dtype '{dtype}' is "
                                         r"not one the layers compute in \(float32, float64\)"):
        nn.load(path)


def _load_seconds(tmp_path, count):
    layers = [nn.Dense(2, input_shape=(2,))]
    layers += [nn.Activation("relu") if k % 2 else nn.Dense(2) for k in range(count - 1)]
    path = tmp_path / f"deep{count}.npz"
    nn.Sequential(layers).save(path)
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        model = nn.load(path)
        best = min(best, time.perf_counter() - start)
    assert len(model.layers) == count and model.layers[-1].name == f"dense_{count // 2}"
    return best


def test_loading_is_linear_in_the_layer_count(tmp_path):
    """4x the layers load in about 4x the time (it was the square: every layer repacked
    the model and rescanned its names). A ratio, not a time: 8 leaves room for noise."""
    with _seconds_at_most(120):
        small, large = _load_seconds(tmp_path, 500), _load_seconds(tmp_path, 2000)
    assert large / small < 8, f"500 layers {small:.3f} s, 2000 layers {large:.3f} s"


def test_a_model_of_many_layers_builds_as_before(tmp_path):
    """The one-pack build names, shapes and initialises layers as add() does."""
    engine.manual_seed(0)
    layers = [nn.Dense(3, input_shape=(2,)), nn.Dense(3), nn.Activation("relu"), nn.Dense(3)]
    model = nn.Sequential(layers)
    engine.manual_seed(0)
    added = nn.Sequential()
    for layer in [nn.Dense(3, input_shape=(2,)), nn.Dense(3), nn.Activation("relu"),
                  nn.Dense(3)]:
        added.add(layer)
    assert [layer.name for layer in model.layers] == ["dense", "dense_1", "activation",
                                                      "dense_2"]
    assert [layer.name for layer in model.layers] == [layer.name for layer in added.layers]
    for (name, value), (other, expected) in zip(model.state_dict().items(),
                                                added.state_dict().items()):
        assert name == other
        np.testing.assert_array_equal(value, expected)
    model.save(tmp_path / "m.npz")
    x = np.ones((2, 2), np.float32)
    np.testing.assert_array_equal(nn.load(tmp_path / "m.npz")(x).numpy(), model(x).numpy())


# ------------------------------------------------------------------ IDX

def test_a_gzip_idx_declaring_more_than_its_stream_holds_is_refused_before_inflating():
    """A 30 KB gzip whose header declares 48 MB and whose stream holds 16 MB of zeros: the
    stream is counted in dropped chunks before any array is made."""
    from data.idx import parse_idx
    header = b"\x00\x00\x08\x01" + struct.pack(">I", DECLARED)
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    content = compressor.compress(header) + b"".join(
        compressor.compress(bytes(1 << 20)) for _ in range(16)) + compressor.flush()
    assert len(content) < 40_000
    with _peak_below(PEAK_LIMIT), pytest.raises(ValueError, match=r"truncated: shape "
                                                r"\(50331648,\) .* the file has 16777216"):
        parse_idx(content, "declared.gz")


# ------------------------------------------------------------------ ONNX

def _onnx_file(tmp_path, nodes, initializers=(), output="y", name="hostile.onnx"):
    onnx = pytest.importorskip("onnx")
    helper = onnx.helper
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, ["N", 4])],
        list(initializers))
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / name
    path.write_bytes(proto.SerializeToString())
    return path


def test_an_onnx_chain_with_a_cycle_is_refused_at_once(tmp_path):
    helper = pytest.importorskip("onnx").helper
    loop = _onnx_file(tmp_path, [helper.make_node("Relu", ["x"], ["x"], name="again")])
    assert loop.stat().st_size < 120
    two = _onnx_file(tmp_path, [helper.make_node("Relu", ["x"], ["a"], name="r"),
                                helper.make_node("Tanh", ["a"], ["x"], name="t")],
                     name="two.onnx")
    for path in (loop, two):
        with _seconds_at_most(10), _peak_below(PEAK_LIMIT), \
                pytest.raises(ValueError, match="the graph has a cycle"):
            engine.onnx.load(path)


def test_an_onnx_shape_computation_with_a_cycle_is_refused(tmp_path):
    helper = pytest.importorskip("onnx").helper
    nodes = [helper.make_node("Identity", ["b"], ["a"], name="i1"),
             helper.make_node("Identity", ["a"], ["b"], name="i2"),
             helper.make_node("Reshape", ["x", "a"], ["y"], name="reshape")]
    with _seconds_at_most(10), pytest.raises(ValueError, match="'a' is computed from itself: "
                                                               "the graph has a cycle"):
        engine.onnx.load(_onnx_file(tmp_path, nodes))


def test_an_onnx_shape_computation_is_bounded_by_the_file(tmp_path):
    """A 20 KB file whose Concat names one 1000-value constant 6000 times: 48 MB if run."""
    onnx = pytest.importorskip("onnx")
    constant = onnx.numpy_helper.from_array(np.zeros(1000, np.int64), "c")
    nodes = [onnx.helper.make_node("Concat", ["c"] * (DECLARED // 8000), ["target"],
                                   name="concat", axis=0),
             onnx.helper.make_node("Reshape", ["x", "target"], ["y"], name="reshape")]
    path = _onnx_file(tmp_path, nodes, [constant])
    assert path.stat().st_size < 60_000
    with _peak_below(PEAK_LIMIT), pytest.raises(ValueError, match=r"node 'concat' \(Concat\): "
                                                r"the model file: its result needs 50,3"):
        engine.onnx.load(path)


def test_an_onnx_broadcast_is_bounded_by_the_file(tmp_path):
    """Two 2 KB constants that broadcast to 48 MB."""
    onnx = pytest.importorskip("onnx")
    rows = onnx.numpy_helper.from_array(np.zeros((2508, 1), np.int64), "rows")
    columns = onnx.numpy_helper.from_array(np.zeros((1, 2508), np.int64), "columns")
    nodes = [onnx.helper.make_node("Mul", ["rows", "columns"], ["target"], name="mul"),
             onnx.helper.make_node("Reshape", ["x", "target"], ["y"], name="reshape")]
    with _peak_below(PEAK_LIMIT), pytest.raises(ValueError, match=r"node 'mul' \(Mul\): the "
                                                                  r"model file: its result"):
        engine.onnx.load(_onnx_file(tmp_path, nodes, [rows, columns]))


# ------------------------------------------------------------------ capture

def _captured_scaling():
    """A captured ``x * scale + 1`` of a Python float ``scale``, and an ``x`` for it."""
    weight = engine.tensor(np.ones(3, np.float32))

    @engine.capture
    def step(x, scale):
        return x * scale + weight

    return step, engine.tensor(np.arange(3, dtype=np.float32))

def test_a_captured_step_with_a_python_argument_changing_every_call_says_so():
    """Each value would need a recording of its own: after MAX_RECORDINGS new values in a
    row the step runs eagerly with a reason, and what it keeps stays bounded."""
    from engine import step_capture
    step, x = _captured_scaling()
    for call in range(200):
        np.testing.assert_array_equal(step(x, float(call)).numpy(), np.arange(3) * call + 1)
    assert step.eager_reason is not None
    assert "a Python argument changes on every call (argument 1: " in step.eager_reason
    assert len(step._warm) <= step_capture.WARM_KEYS_KEPT and step.recordings == 0
    assert step.replayed == 0


def test_a_captured_step_with_a_few_python_values_still_replays():
    step, x = _captured_scaling()
    for call in range(40):
        scale = float(call % 3)
        np.testing.assert_array_equal(step(x, scale).numpy(), np.arange(3) * scale + 1)
    assert step.eager_reason is None and step.replayed > 0 and step.recordings == 3
