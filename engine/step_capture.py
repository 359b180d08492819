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
buffers, asks the code that claimed a run (``ops.launch.claim_last_run``: the optimizers)
whether that run's arguments changed (a learning rate written by a scheduler or by hand),
runs the kernels, and returns copies of the recorded outputs (so a returned tensor stays
valid after later calls; they are detached from the tape). The recording keeps every buffer
its kernels use alive, so the caching allocator never hands them to other tensors.

State that changes every step lives on the device (``ops.step_counter``) and is moved on by
kernels of the step itself: Adam's step count (its bias corrections are computed in the
kernel), Dropout's mask seeds, the loader's batch cursor (``data.loader.EpochCursor``). So
``repeat(n, *args)`` replays n steps at once, on CUDA as one graph of n chained copies of
the step: ``fit`` runs an epoch that way, its step fetching its own batch at the cursor.

What a replay freezes: everything the step's Python decided while it was recorded. So a step
may not branch on values that change (Python counters, data), must return the same kinds of
results every call, and must not read device values on the host (``.item()``,
``.numpy()``): a recording that reads the device, copies between host and device, or
launches a kernel through Numba's slow path is not replayed; the step runs eagerly from then
on and ``train_step.eager_reason`` says why. Eager and replayed steps run the same kernels
on the same arguments, so their losses and weights are bit for bit equal.

The graphs are built explicitly (``cuda.core``'s ``GraphDefinition``), not by stream
capture, and launched on the stream the engine's kernels use, after them in order.
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
        self.graphs = {}   # steps -> _Graph of that many chained copies of the runs
        self.functions = None
        if self.device == "cuda" and not cuda_backend.SIMULATOR:   # the simulator has no graphs:
            self.functions = self._direct_functions()              # its replay relaunches runs
            self.graphs[1] = _Graph(self, 1)

    def _direct_functions(self):
        functions = []
        for run in self.runs:
            function = cuda_backend.direct_function(run.function, run.args)
            if not function:
                raise _NotCapturable(f"kernel {run.kernel.name} ran through Numba's own launch "
                                     "path (its first launch, or arguments only Numba passes)")
            functions.append(function)
        return functions

    def replay(self, arrays, steps=1):
        """Run the recorded step ``steps`` times on ``arrays`` (one graph launch on CUDA)."""
        for check in self.checks:
            check()
        for destination, source in zip(self.inputs, arrays):
            # a copy kernel: numba's copy_to_device costs ~200 us of Python per call on the H200
            copy_array(destination, source)
        for index, refresh in self.refreshers.items():
            args = refresh(steps)   # None: the run's arguments are those of the last replay
            if args is not None:
                run = self.runs[index]
                function, grid, block, cuda_args = (run.kernel._launch(args)
                                                    if run.device == "cuda"
                                                    else (run.function, None, None, args))
                self.runs[index] = run._replace(function=function, grid=grid, block=block,
                                                args=cuda_args)
        if self.functions is not None:
            graph = self.graphs.get(steps)
            if graph is None:
                graph = self.graphs[steps] = _Graph(self, steps)
            graph.launch(self)
        elif self.device == "cuda":
            for _ in range(steps):
                for run in self.runs:
                    cuda_backend.launch(run.function, run.grid, run.block, run.args)
        else:
            for _ in range(steps):
                for run in self.runs:
                    run.function(*run.args)
        return self.results()

    def results(self):
        """Copies of the recorded outputs: later replays overwrite the recording's own."""
        copies = tuple(Tensor(to_device(output, device_of(output))) for output in self.outputs)
        if self.output_kind == "none":
            return None
        return copies[0] if self.output_kind == "tensor" else copies


class _Graph:
    """One executable CUDA graph: ``copies`` chained copies of a recording's runs, each run
    after the one before. A run whose arguments a refresher changed gets them in every copy
    before the next launch."""

    def __init__(self, recording, copies):
        runs = recording.runs
        launches = [(function, run.grid, run.block, run.args)
                    for function, run in zip(recording.functions, runs)] * copies
        self.graph, self.nodes = cuda_backend.build_graph(launches)
        self.copies = copies
        self.applied = [run.args for run in runs]   # the arguments in this graph's nodes

    def launch(self, recording):
        count = len(recording.runs)
        for index, run in enumerate(recording.runs):
            if run.args is not self.applied[index]:
                for copy in range(self.copies):
                    cuda_backend.update_graph_node(self.graph, self.nodes[copy * count + index],
                                                   recording.functions[index], run.grid,
                                                   run.block, run.args)
                self.applied[index] = run.args
        cuda_backend.launch_graph(self.graph)


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
        return self.repeat(1, *args)

    def repeat(self, steps, *args):
        """Call the step ``steps`` times on the same arguments, as that many calls would, and
        return the last call's result. Once recorded, the calls replay together: on CUDA one
        graph launch of ``steps`` chained copies of the step. Worth it for a step that moves
        its own state on the device (the loader's batch cursor, the optimizer's step count),
        so Python is out of the loop between those steps."""
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"engine.capture: repeat needs a step count >= 1, got {steps!r}")
        result = None
        while steps:
            if self.eager_reason is not None:
                result = self.fn(*args)
                steps -= 1
                continue
            key = _signature(args)
            recording = self._recordings.get(key)
            if recording is None:
                result = self._eager_or_record(key, args)
                steps -= 1
                continue
            self._recordings.move_to_end(key)
            try:
                return recording.replay([a.data for a in args if isinstance(a, Tensor)], steps)
            except StaleRecording:   # raised before the replay ran anything: record anew
                del self._recordings[key]
                self._calls[key] = self.warmup
        return result

    def _eager_or_record(self, key, args):
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
