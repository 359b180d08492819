"""``engine.capture``: run a training step, record its kernel runs, then replay them.

    @engine.capture
    def train_step(xb, yb):
        opt.zero_grad()
        loss = criterion(model(xb), yb)
        loss.backward()
        opt.step()
        return loss

The first call of each argument signature (the shapes, dtypes and devices of its tensor
arguments, and the values of the others) runs eagerly: kernels compile, the caching
allocator fills. The second runs eagerly too, inside an ``ops.launch.LaunchRecorder``. Later
calls replay that recording: on CUDA every kernel of the step in one CUDA graph launch, on
the CPU the recorded kernel calls with their arguments bound, without the tape, the
dispatcher or any op's Python. A call of another signature (a last partial batch) gets a
recording of its own (``MAX_RECORDINGS`` kept).

What a replay does each call: it copies the tensor arguments into the recorded input
buffers, asks the code that claimed a run (``ops.launch.claim_last_run``: the optimizers,
whose step count and learning rate change every step) for that run's arguments of this step,
runs the kernels, and returns copies of the recorded outputs (so a returned tensor stays
valid after later calls; they are detached from the tape). The recording keeps every buffer
its kernels use alive, so the caching allocator never hands them to other tensors.

What a replay freezes: everything the step's Python decided while it was recorded. So a step
may not branch on values that change (Python counters, data), must return the same kinds of
results every call, and must not read device values on the host (``.item()``,
``.numpy()``): a recording that reads the device, runs Dropout (its mask seed is drawn on the
host per call), or launches a kernel through Numba's slow path is not replayed; the step runs
eagerly from then on and ``train_step.eager_reason`` says why. Eager and replayed steps run
the same kernels on the same arguments, so their losses and weights are bit for bit equal.
"""
import functools
from collections import OrderedDict

from engine.tensor import Tensor
from ops import cuda_backend
from ops.array_copy import copy_array
from ops.device import device_of, to_device
from ops.launch import LaunchRecorder, StaleRecording

MAX_RECORDINGS = 8


class _Recording:
    """The kernel runs of one recorded call, its input buffers and its outputs."""

    def __init__(self, recorder, inputs, outputs, output_kind):
        self.runs = list(recorder.runs)   # holds every buffer the kernels touch
        self.refreshers = dict(recorder.refreshers)
        self.checks = list(recorder.replay_checks)
        self.inputs = inputs
        self.outputs = outputs
        self.output_kind = output_kind
        self.device = next((run.device for run in self.runs), "cpu")
        self.graph = self.nodes = None
        if self.device == "cuda" and not cuda_backend.SIMULATOR:   # the simulator has no graphs:
            self._build_graph()                                    # its replay relaunches each run

    def _build_graph(self):
        launches = []
        for run in self.runs:
            function = cuda_backend.direct_function(run.function, run.args)
            if not function:
                raise _NotCapturable(f"kernel {run.kernel.name} ran through Numba's own launch "
                                     "path (its first launch, or arguments only Numba passes)")
            launches.append((function, run.grid, run.block, run.args))
        self.functions = [launch[0] for launch in launches]
        self.graph, self.nodes = cuda_backend.build_graph(launches)

    def replay(self, arrays):
        for check in self.checks:
            check()
        for destination, source in zip(self.inputs, arrays):
            # a copy kernel: numba's copy_to_device costs ~200 us of Python per call on the H200
            copy_array(destination, source)
        refreshed = {index: refresh() for index, refresh in self.refreshers.items()}
        if self.graph is not None:
            for index, args in refreshed.items():
                _, grid, block, cuda_args = self.runs[index].kernel._launch(args)
                cuda_backend.update_graph_node(self.graph, self.nodes[index],
                                               self.functions[index], grid, block, cuda_args)
            cuda_backend.launch_graph(self.graph)
        elif self.device == "cuda":
            for index, run in enumerate(self.runs):
                if index in refreshed:
                    function, grid, block, args = run.kernel._launch(refreshed[index])
                else:
                    function, grid, block, args = run.function, run.grid, run.block, run.args
                cuda_backend.launch(function, grid, block, args)
        else:
            for index, run in enumerate(self.runs):
                run.function(*refreshed.get(index, run.args))
        return self.results()

    def results(self):
        """Copies of the recorded outputs: later replays overwrite the recording's own."""
        copies = tuple(Tensor(to_device(output, device_of(output))) for output in self.outputs)
        if self.output_kind == "none":
            return None
        return copies[0] if self.output_kind == "tensor" else copies


class _NotCapturable(Exception):
    pass


class CapturedStep:
    """The callable ``engine.capture`` makes of a step function (see the module docstring)."""

    def __init__(self, fn, warmup=1):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.warmup = warmup
        self.eager_reason = None
        self._calls = {}
        self._recordings = OrderedDict()

    def __call__(self, *args):
        if self.eager_reason is not None:
            return self.fn(*args)
        key = _signature(args)
        recording = self._recordings.get(key)
        if recording is not None:
            self._recordings.move_to_end(key)
            try:
                return recording.replay([a.data for a in args if isinstance(a, Tensor)])
            except StaleRecording:   # raised before the replay ran anything: record anew
                del self._recordings[key]
                self._calls[key] = self.warmup
                return self._record(key, args)
        calls = self._calls.get(key, 0)
        self._calls[key] = calls + 1
        if calls < self.warmup:
            return self.fn(*args)
        return self._record(key, args)

    def _record(self, key, args):
        # the recording reads its inputs from buffers of its own: a replay copies each call's
        # arguments there, and must never write into a caller's tensor
        args = tuple(Tensor(to_device(a.data, a.device), a.requires_grad)
                     if isinstance(a, Tensor) else a for a in args)
        with LaunchRecorder() as recorder:
            result = self.fn(*args)
        try:
            if recorder.unrecordable:
                raise _NotCapturable(f"the step does work no kernel holds: "
                                     f"{recorder.unrecordable[0]}")
            outputs, kind = _outputs(result)
            inputs = [a.data for a in args if isinstance(a, Tensor)]
            recording = _Recording(recorder, inputs, outputs, kind)
        except _NotCapturable as reason:
            self.eager_reason = str(reason)
            return result
        self._recordings[key] = recording
        if len(self._recordings) > MAX_RECORDINGS:
            self._recordings.popitem(last=False)
        return recording.results()

    @property
    def recordings(self):
        """How many argument signatures have a recording."""
        return len(self._recordings)


def _signature(args):
    parts = []
    for arg in args:
        if isinstance(arg, Tensor):
            parts.append((arg.shape, arg.dtype.str, arg.device))
        else:
            try:
                hash(arg)
            except TypeError:
                raise TypeError(f"engine.capture: argument {arg!r:.60} is neither a Tensor nor "
                                "hashable; pass arrays as Tensors") from None
            parts.append(("value", arg))
    return tuple(parts)


def _outputs(result):
    if result is None:
        return (), "none"
    if isinstance(result, Tensor):
        return (result.data,), "tensor"
    if isinstance(result, tuple) and all(isinstance(r, Tensor) for r in result):
        return tuple(r.data for r in result), "tuple"
    raise _NotCapturable(f"the step returns a {type(result).__name__}; a captured step "
                         "returns a Tensor, a tuple of Tensors or None")


def capture(fn=None, *, warmup=1):
    """Capture a training step: ``@engine.capture`` or ``engine.capture(fn, warmup=1)``."""
    if fn is None:
        return functools.partial(capture, warmup=warmup)
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"engine.capture: warmup must be an integer >= 0, got {warmup!r}")
    return CapturedStep(fn, warmup)
