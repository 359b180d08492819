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
allocator fills, the optimizer makes its state. The second runs eagerly too, inside an
``ops.launch.LaunchRecorder``. Later calls replay that recording: on CUDA every kernel of
the step in one CUDA graph launch, on the CPU the recorded kernel calls with their
arguments bound, without the tape, the dispatcher or any op's Python. A call of another
signature (a last partial batch) gets a recording of its own (``MAX_RECORDINGS`` kept).

One source of truth: everything a replay reads that changes between calls is device memory
that the eager step reads too, so eager and replayed steps run the same kernels on the same
arrays and a recording's kernel arguments never change (``ops.step_counter``): the
optimizer's step counts and hyper-parameters (synced from ``param_groups`` before each
step, by the eager step and by each replay alike), Dropout's mask seeds, the loader's batch
cursor (``data.loader.EpochCursor``). So ``repeat(n, *args)`` replays n steps at once, on
CUDA as one launch of one graph whose WHILE node loops over the step while a device counter
counts the n passes down (chained copies of the step where the CUDA device runtime library
is missing): ``fit`` runs an epoch that way, its step fetching its own batch at the cursor.

What the host decides is part of what a recording was made for: the objects that took part
in the recorded call (the optimizers that stepped, the models and layers that ran:
``ops.launch.note_participant``) give a ``capture_key()`` (which parameters require grad,
each layer's train/eval mode, the parameter set, the optimizer's groups and state layout),
and a call replays only a recording whose participants' keys are what they were. A call
where they differ (a frozen layer, ``model.eval()``) warms up and records again, and
switching back finds the first recording.

What a replay freezes: the step's Python. So a step may not branch on values that change
(Python counters, data), and must return the same kinds of results every call. A step that
reads device values on the host (``.item()``, ``float(loss)``, ``bool(...)``, ``.numpy()``,
``np.asarray(t)``, ``.tolist()``), copies between host and device, or does work no kernel
holds (an MPI all-reduce) is not replayed, on the CPU as on CUDA: it runs eagerly from then
on and ``train_step.eager_reason`` says why. A call that raises while warming up or
recording leaves no recording behind: the next call starts the warm-up again.

A bad input in a replayed call (a label outside the classes) changes nothing: the checking
kernel records it in its device's fault words (``ops.flag_buffer``), the optimizers' step
advance reads them and their update kernels skip, and the host raises: on the CPU at that
call, on CUDA at the next call or the next host read of device data (naming the call).

The graphs are built explicitly (``cuda.core``'s ``GraphDefinition``), not by stream
capture, and launched on the stream the engine's kernels use, after them in order.
"""
import functools
from collections import OrderedDict

import numpy as np

from engine.tensor import Tensor
from ops import cuda as cuda_runtime
from ops.array_copy import copy_array
from ops.matmul_precision import get_float32_matmul_precision
from ops.device import device_of, to_device
from ops.flag_buffer import note_launcher, raise_pending
from ops.launch import LaunchRecorder, unrecorded
from ops.memory import empty
from ops.step_counter import store_values

MAX_RECORDINGS = 8
WARM_KEYS_KEPT = 4 * MAX_RECORDINGS   # warm-up counts kept (the least recently used go)
LOOP_UNROLL = 8   # steps per pass of a replay's device loop: a pass costs ~3-5 us of its own


class _Recording:
    """The kernel runs of one recorded call, its input buffers, its outputs, and the
    participants whose host decisions (their ``capture_key()``) the runs were made for."""

    def __init__(self, recorder, inputs, outputs, output_kind):
        self.runs = list(recorder.runs)   # holds every buffer the kernels touch
        self.participants = tuple(recorder.participants)
        self.inputs = inputs
        self.outputs = outputs
        self.output_kind = output_kind
        self.device = next((run.device for run in self.runs), "cpu")
        self.syncs = [p.sync_device for p in self.participants if hasattr(p, "sync_device")]
        self.graphs = {}   # steps -> executable graph of that many chained copies of the runs
        self.loops = {}    # steps % LOOP_UNROLL -> graph looping over the runs (None: none)
        self.remaining = None   # the loop's count of passes, on the device
        self.functions = None
        if self.device == "cuda" and not cuda_runtime.SIMULATOR:   # the simulator has no graphs:
            self.functions = self._direct_functions()              # its replay relaunches runs
            self.graphs[1] = self._graph(1)

    def _direct_functions(self):
        functions = []
        for run in self.runs:
            function = cuda_runtime.direct_function(run.function, run.args)
            if not function:
                raise _NotReady(f"kernel {run.kernel.name} ran through Numba's own launch "
                                "path (its first launch, or arguments only Numba passes)")
            functions.append(function)
        return functions

    def _graph(self, copies):
        """One executable CUDA graph: ``copies`` chained copies of the runs, each run after
        the one before."""
        return cuda_runtime.build_graph(self._launches() * copies)

    def _launches(self):
        return [(function, run.grid, run.block, run.args)
                for function, run in zip(self.functions, self.runs)]

    def _graph_of(self, steps):
        """The graph that runs ``steps`` steps in one launch. For several: a WHILE node loops
        over ``LOOP_UNROLL`` copies of the step while the device counts the passes down,
        then the remaining copies follow (one graph per remainder, whatever ``steps``);
        chained copies where the loop cannot be built (no CUDA device runtime library)."""
        if steps >= LOOP_UNROLL and self.loops is not None:
            if self.remaining is None:
                self.remaining = empty(1, np.int64, "cuda")
            tail = steps % LOOP_UNROLL
            if tail not in self.loops:
                self.loops[tail] = cuda_runtime.build_loop_graph(
                    self._launches(), self.remaining, LOOP_UNROLL, tail)
            if self.loops[tail] is None:
                self.loops = None
            else:
                with unrecorded():
                    store_values(self.remaining, (steps // LOOP_UNROLL,))
                return self.loops[tail]
        graph = self.graphs.get(steps)
        if graph is None:
            graph = self.graphs[steps] = self._graph(steps)
        return graph

    def replay(self, arrays, steps, call):
        """Run the recorded step ``steps`` times on ``arrays`` (one graph launch on CUDA)."""
        for sync in self.syncs:   # host-written values (param_groups) to the device arrays
            sync()
        for destination, source in zip(self.inputs, arrays):
            # a copy kernel: numba's copy_to_device costs ~200 us of Python per call on the H200
            copy_array(destination, source)
        if self.functions is not None:
            note_launcher("cuda", _at_call(call, steps))
            cuda_runtime.launch_graph(self._graph_of(steps))
        elif self.device == "cuda":
            for _ in range(steps):
                for run in self.runs:
                    cuda_runtime.launch(run.function, run.grid, run.block, run.args)
        else:
            for _ in range(steps):
                for run in self.runs:
                    run.function(*run.args)
        if self.functions is None:   # kernels ran synchronously: a fault is known now
            raise_pending(self.device, _at_call(call, steps))
        return self.results()

    def results(self):
        """Copies of the recorded outputs: later replays overwrite the recording's own."""
        copies = tuple(Tensor(to_device(output, device_of(output))) for output in self.outputs)
        if self.output_kind == "none":
            return None
        return copies[0] if self.output_kind == "tensor" else copies


def _at_call(call, steps):
    calls = f"call {call}" if steps == 1 else f"one of calls {call}..{call + steps - 1}"
    return (f" [engine.capture: in {calls} of the captured step or before; from that call "
            "on no update ran: the weights are as before it]")


class _NotReady(Exception):
    """A recording that cannot be replayed yet (a kernel's first launch went through Numba's
    own path): the next call records again."""


class _NotCapturable(Exception):
    pass


class CapturedStep:
    """The callable ``engine.capture`` makes of a step function (see the module docstring)."""

    RECORD_ATTEMPTS = 3   # recordings that were not ready before the step runs eagerly

    def __init__(self, fn, warmup=1):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.warmup = warmup
        self.eager_reason = None
        self.calls = 0
        self.replayed = 0   # calls that ran as a replay (of ``calls``)
        # (signature, host key or None) -> calls run since it was first seen
        self._warm = OrderedDict()
        self._new_in_a_row = 0   # calls in a row with a signature never seen, none replayed
        self._previous = None    # the last call's signature
        self._attempts = 0
        self._recordings = OrderedDict()   # (signature, host key) -> _Recording

    def __call__(self, *args):
        return self.repeat(1, *args)

    def repeat(self, steps, *args):
        """Call the step ``steps`` times on the same arguments, as that many calls would, and
        return the last call's result. Once recorded, the calls replay together: on CUDA one
        launch of one graph that loops over the step on the device. Worth it for a step that
        moves its own state on the device (the loader's batch cursor, the optimizer's step
        count), so Python is out of the loop between those steps."""
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"engine.capture: repeat needs a step count >= 1, got {steps!r}")
        result = None
        while steps:
            if self.eager_reason is not None:
                result = self._eager(args)
                steps -= 1
                continue
            signature = _signature(args)
            key, recording = self._find(signature)
            if recording is None:
                self._note_new_signature(signature)
                if self.eager_reason is not None:
                    continue
                result = self._eager_or_record(key, args)
                steps -= 1
                continue
            self._recordings.move_to_end(key)
            self._new_in_a_row, self._previous = 0, signature
            if recording.device == "cuda":   # a fault of an earlier call, read without a sync
                raise_pending("cuda", _at_call(self.calls, 1))
            self.calls += steps
            self.replayed += steps
            return recording.replay([a.data for a in args if isinstance(a, Tensor)], steps,
                                    self.calls - steps + 1)
        return result

    def _find(self, signature):
        """``(key, recording)``: the recording of ``signature`` made for the participants'
        host decisions as they are now, or None with the key a new recording would have
        before the call (None for the host part when no recording says who takes part)."""
        newest = None
        for (recorded, _), recording in reversed(self._recordings.items()):
            if recorded == signature:
                key = (signature, _host_key(recording.participants))
                found = self._recordings.get(key)
                if found is not None:
                    return key, found
                newest = newest or key
        return newest or (signature, None), None

    def _note_new_signature(self, signature):
        """Count the calls in a row whose signature was never seen; past ``MAX_RECORDINGS``
        of them a Python argument changes on every call (a step counter, a float learning
        rate): each value would need a recording of its own and none would replay, so the
        step runs eagerly from then on and ``eager_reason`` names the argument."""
        previous, self._previous = self._previous, signature
        if any(known == signature for known, _ in self._warm):
            self._new_in_a_row = 0
            return
        self._new_in_a_row += 1
        if self._new_in_a_row <= MAX_RECORDINGS or previous is None:
            return
        changed = [f"argument {index - 1}: {before[1]!r:.40} then {after[1]!r:.40}"
                   for index, (before, after) in enumerate(zip(previous, signature))
                   if before != after and before[0] == after[0] == "value"]
        self.eager_reason = (
            f"a Python argument changes on every call ({'; '.join(changed) or 'the signature'}"
            f", {self._new_in_a_row} calls in a row of new values): each value needs a "
            "recording of its own and none replays; pass a changing number as a Tensor, or "
            "keep the argument fixed")
        self._warm.clear()
        self._recordings.clear()

    def _eager(self, args):
        self.calls += 1
        note_launcher("cuda", "")   # its kernels are the eager step's: they say no call
        return self.fn(*args)

    def _eager_or_record(self, key, args):
        calls = self._warm.get(key, 0)
        if calls < self.warmup:
            self._warm[key] = 0   # a call that raises leaves the warm-up where it was
            result = self._eager(args)
            # the call may have changed what the host decides (an optimizer making its
            # state): the warm-up counts for the decisions it left
            after = self._find(key[0])[0]
            self._warm[key] = calls + 1
            self._warm[after] = max(self._warm.get(after, 0), calls + 1)
            self._warm.move_to_end(key)
            self._warm.move_to_end(after)
            while len(self._warm) > WARM_KEYS_KEPT:
                self._warm.popitem(last=False)
            return result
        return self._record(key, args)

    def _record(self, warm_key, args):
        # the recording reads its inputs from buffers of its own: a replay copies each call's
        # arguments there, and must never write into a caller's tensor
        args = tuple(Tensor(to_device(a.data, a.device), a.requires_grad)
                     if isinstance(a, Tensor) else a for a in args)
        self.calls += 1
        note_launcher("cuda", "")
        try:
            with LaunchRecorder() as recorder:
                result = self.fn(*args)
        except BaseException:
            self._warm[warm_key] = 0   # nothing kept: the next call warms up again
            raise
        key = (warm_key[0], _host_key(recorder.participants))
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
        except _NotReady as reason:
            self._attempts += 1
            if self._attempts >= self.RECORD_ATTEMPTS:
                self.eager_reason = str(reason)
            return result
        self._recordings[key] = recording
        if len(self._recordings) > MAX_RECORDINGS:
            self._recordings.popitem(last=False)
        return recording.results()

    @property
    def recordings(self):
        """How many recordings are kept (argument signatures and host decisions)."""
        return len(self._recordings)


def _host_key(participants):
    return tuple(participant.capture_key() for participant in participants)


def _signature(args):
    # the float32 matmul precision picks the GEMM kernels a step launches: a step recorded
    # under one precision is not replayed under another
    parts = [("matmul precision", get_float32_matmul_precision())]
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
