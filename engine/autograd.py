"""The tape: a Wengert list of the ops that ran while grad mode was on.

``apply`` runs an op and, when an input requires grad, appends one ``Node`` (the op instance,
holding what its backward needs, its inputs and a weak reference to its output). The tape is
in recording order, which is a topological order by construction, so ``backward`` walks it
in reverse from the root's node and needs no graph search. It accumulates into leaves'
``.grad`` and drops the nodes it consumed unless ``retain_graph=True``.

A node whose output tensor has been garbage-collected can never receive a gradient, so it is
pruned; a tape that still keeps growing means live outputs pile up without a backward (say a
``total += loss`` that should have been ``total += loss.item()``), and it is reported.
"""
import bisect
import contextlib
import functools
import itertools
import threading
import warnings
import weakref

import numpy as np

from ops.check import count_nonfinite
from ops.device import device_of, to_device
from ops.elementwise import add
from ops.fill import fill
from ops.memory import empty

TAPE_WARNING_SIZE = 10_000


class AnomalyError(FloatingPointError):
    """A NaN or Inf appeared while ``engine.detect_anomaly()`` was active."""


class _State(threading.local):
    def __init__(self):
        self.grad_enabled = True
        self.anomaly = False
        self.tape = Tape()


class Node:
    __slots__ = ("op", "inputs", "output_ref", "seq")

    def __init__(self, op, inputs, output, seq):
        self.op, self.inputs, self.seq = op, inputs, seq
        self.output_ref = weakref.ref(output)


class Tape:
    def __init__(self):
        self.nodes = []
        self._counter = itertools.count()
        self._warn_at = TAPE_WARNING_SIZE

    def record(self, op, inputs, output):
        node = Node(op, inputs, output, next(self._counter))
        self.nodes.append(node)
        if len(self.nodes) >= self._warn_at:
            self.nodes = [n for n in self.nodes if n.output_ref() is not None]
            if len(self.nodes) >= self._warn_at:
                warnings.warn(
                    f"the autograd tape holds {len(self.nodes)} live nodes and no backward has "
                    "consumed them: wrap inference in `with engine.no_grad():` and accumulate "
                    "losses with `.item()`, or memory keeps growing", RuntimeWarning, stacklevel=3)
                self._warn_at *= 2
        return node

    def __len__(self):
        return len(self.nodes)

    def discard(self, consumed):
        gone = {id(n) for n in consumed}
        self.nodes = [n for n in self.nodes if id(n) not in gone]


_state = _State()


def current_tape():
    return _state.tape


# ------------------------------------------------------------------ grad mode

def is_grad_enabled():
    return _state.grad_enabled


class set_grad_enabled(contextlib.ContextDecorator):
    def __init__(self, mode):
        self.prev = _state.grad_enabled
        _state.grad_enabled = bool(mode)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _state.grad_enabled = self.prev


class no_grad(contextlib.ContextDecorator):
    """Record nothing on the tape inside this block (inference, evaluation)."""

    def __enter__(self):
        self.prev = _state.grad_enabled
        _state.grad_enabled = False

    def __exit__(self, *exc):
        _state.grad_enabled = self.prev


class enable_grad(no_grad):
    def __enter__(self):
        self.prev = _state.grad_enabled
        _state.grad_enabled = True


class detect_anomaly(contextlib.ContextDecorator):
    """Check every forward output and every backward gradient; the first NaN/Inf raises
    ``AnomalyError`` naming the op, the phase and the shapes."""

    def __enter__(self):
        self.prev = _state.anomaly
        _state.anomaly = True

    def __exit__(self, *exc):
        _state.anomaly = self.prev


def _check_finite(array, op, phase, inputs):
    bad = count_nonfinite(array)
    if bad:
        shapes = ", ".join(str(tuple(x.shape)) for x in inputs if hasattr(x, "shape"))
        raise AnomalyError(
            f"{op.name}: {bad} non-finite value(s) in the {phase} "
            f"(output shape {tuple(array.shape)}, input shapes {shapes})")


# ------------------------------------------------------------------ running ops

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def apply(op_class, *inputs, **params):
    """Run ``op_class`` on Tensors (or raw arrays that need no grad); record it when needed."""
    from engine.tensor import Tensor
    op = op_class(**params)
    arrays = []
    for position, x in enumerate(inputs):
        data = x.data if isinstance(x, Tensor) else x
        if (position not in getattr(op_class, "integer_inputs", ())
                and np.dtype(data.dtype) not in FLOAT_DTYPES):
            raise TypeError(f"{op_class.name}: input {position} has dtype {np.dtype(data.dtype)}; "
                            "expected float32 or float64")
        arrays.append(data)
    needs = tuple(isinstance(x, Tensor) and x.requires_grad for x in inputs)
    record = _state.grad_enabled and any(needs)
    op.needs_input_grad = needs if record else (False,) * len(inputs)
    out = op.forward(*arrays)
    if _state.anomaly:
        _check_finite(out, op, "forward", arrays)
    result = Tensor._wrap(out, requires_grad=record)
    if record:
        result._node = _state.tape.record(op, inputs, result)
    return result


def _root_gradient(root, grad):
    from engine.tensor import Tensor
    if grad is None:
        if root.size != 1:
            raise RuntimeError(
                f"backward: the root has shape {root.shape}; only a one-element tensor gets an "
                "implicit gradient of ones: pass one of that shape, loss.backward(grad)")
        return _ones_like(root.data)
    data = grad.data if isinstance(grad, Tensor) else np.asarray(grad)
    if tuple(data.shape) != root.shape:
        raise ValueError(f"backward: gradient shape {tuple(data.shape)} does not match "
                         f"the root's shape {root.shape}")
    if np.dtype(data.dtype) != root.dtype:
        data = np.asarray(to_device(data, "cpu"), dtype=root.dtype)
    return to_device(data, root.device) if device_of(data) != root.device else data


@functools.lru_cache(maxsize=64)
def _cached_ones(shape, dtype, device):
    return fill(empty(shape, dtype, device), 1)


def _ones_like(array):
    # the root gradient is only read by backward rules, never written, so one cached buffer
    # per shape spares a fill launch per step
    return _cached_ones(tuple(array.shape), np.dtype(array.dtype), device_of(array))


def backward(root, grad=None, retain_graph=False):
    if not root.requires_grad:
        raise RuntimeError("backward: the tensor does not require grad (no input of the "
                           "computation had requires_grad=True, or it ran under no_grad)")
    root_grad = _root_gradient(root, grad)
    if root._node is None:   # a leaf: d root / d root
        root._accumulate_grad(root_grad)
        return
    if root._node.op is None:
        raise RuntimeError("backward: this graph was already consumed by a backward; "
                           "call the first backward with retain_graph=True to go through it twice")
    tape = _state.tape
    nodes = tape.nodes
    end = bisect.bisect_right([n.seq for n in nodes], root._node.seq)
    grads = {id(root): root_grad}
    consumed = []
    for node in reversed(nodes[:end]):
        output = node.output_ref()
        grad_out = grads.pop(id(output), None) if output is not None else None
        if grad_out is None:
            continue
        if node.op is None:
            raise RuntimeError("backward: part of this graph was already consumed by a backward; "
                               "use retain_graph=True on the first one to go through it twice")
        consumed.append(node)
        if _state.anomaly:
            _check_finite(grad_out, node.op, "backward (gradient reaching it)", node.inputs)
        input_grads = node.op.backward(grad_out, _grad_destinations(node.inputs))
        for x, needed, g in zip(node.inputs, node.op.needs_input_grad, input_grads):
            if not needed or g is None:
                continue
            if _state.anomaly:
                _check_finite(g, node.op, "backward", node.inputs)
            if x._node is None:
                x._accumulate_grad(g)
            elif id(x) in grads:
                grads[id(x)] = add(grads[id(x)], g)
            else:
                grads[id(x)] = g
    if not retain_graph:
        for node in consumed:
            node.op = None   # frees the saved values; the node's output may still be alive
        tape.discard(consumed)


def _grad_destinations(inputs):
    """Per input, the preallocated gradient buffer a backward may write into, or None."""
    seen = set()
    destinations = []
    for x in inputs:
        buffer = getattr(x, "_grad_buffer", None)
        writable = (buffer is not None and x._node is None and not x._grad_valid
                    and id(x) not in seen)
        seen.add(id(x))
        destinations.append(buffer if writable else None)
    return tuple(destinations)
