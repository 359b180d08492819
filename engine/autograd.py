"""Autograd: the graph that ops record, the reverse walk that differentiates it, grad mode.

``apply`` runs an op and, when grad mode is on and an input requires grad, gives the output a
``Node``: the op instance (holding what its backward needs), its inputs, and a sequence
number from one process-wide counter. An input's node was always recorded before the nodes
that consume it, so decreasing sequence numbers are a topological order: ``backward`` walks
from the root's node through the inputs' nodes and needs no other record of the graph. The
graph belongs to its tensors, not to a thread: any thread may run the backward of a graph
another thread built (the torch bridge runs ours from torch's threads). Grad mode
(``no_grad``) and anomaly detection are per thread, as in torch.

The rules of a backward:

- it accumulates into the ``.grad`` of the leaves that require grad, under a lock: backwards
  running on several threads at once over shared leaves lose nothing (see "leaves under
  threads" below);
- without ``retain_graph=True`` it releases every node it walked: their saved values and
  inputs are freed, and a later backward that reaches one raises before touching any
  gradient, naming ``retain_graph=True`` as the remedy (never a silent partial gradient);
- a value an op saved for its backward and that was written in place since (see version
  counters below) makes the backward raise torch's error before any gradient is touched:
  nothing is ever computed from a changed value.

Version counters, as torch's: the storage a tensor shares with its views (``x[2:5]``,
``x.view(...)``, ``x.detach()``) carries one ``VersionCounter``, which every in-place write
through any of them bumps. A node remembers the versions of its inputs and its output when
it was recorded; a backward compares them (one int compare each). Only when one differs does
it look at what the op saved (the arrays on the op instance): a changed input that the op
did not keep (an add's operands) is no error, as in torch. An optimizer's update counts as a
write of every parameter it updates (``optim.optimizer.mark_written``: one increment per
parameter, not per element), in ``step()`` and before each replay of a captured step (its
``sync_device``; the replay itself runs no Python): a graph retained across the step that
saved a parameter refuses its next backward, as torch's does, instead of using the updated
values. Kernels writing into other buffers they own (BatchNorm's running statistics, a
loader's batch buffer) bump nothing.

What autograd needs of a tensor is ``Value``, a base class; ``engine.tensor.Tensor`` is its
one user-facing subclass. Autograd knows nothing else of it, so ``engine.tensor`` and
``engine.functional`` build on this module and nothing here imports them.

Each thread records onto a ``Tape``: a weak registry of its live nodes, used only to see a
graph pile up. A dropped graph frees itself; one kept alive from step to step (say
``total += loss`` where ``total += loss.item()`` was meant, or results of an evaluation run
without ``no_grad()`` kept in a list) is reported once per tape with a ``RuntimeWarning``.
"""
import contextlib
import functools
import itertools
import operator
import threading
import warnings
import weakref

import numpy as np

from ops.check import count_nonfinite
from ops.cuda import is_device_array
from ops.device import device_of, to_device
from ops.elementwise import add_arrays
from ops.fill import fill
from ops.memory import empty, shares_memory
from ops.registry import FLOAT_DTYPES

# A training step's graph is consumed by the backward of that step (the reference MLP's step
# records 4 nodes, all released by its backward), so a node that STALE_BACKWARDS later
# backwards of its tape have not reached belongs to no step: more than STALE_NODE_LIMIT such
# nodes, or nodes holding more than STALE_BYTES_LIMIT of outputs, warn. `total += loss` over
# the reference MLP leaves one node per step and warns after ~100 steps (the old bound of
# 10,000 live nodes warned at step 9,996, with 6 GB resident). A tape holding more than
# LIVE_NODE_LIMIT unreleased nodes warns too, with or without backwards (250 steps' graphs of
# that MLP; a longer unrolled loop that is meant to be one graph may silence the warning).
STALE_BACKWARDS = 3
STALE_NODE_LIMIT = 100
STALE_BYTES_LIMIT = 256 * 2**20
LIVE_NODE_LIMIT = 1000

_sequence = itertools.count()
_by_sequence = operator.attrgetter("seq")


class AnomalyError(FloatingPointError):
    """A NaN or Inf appeared while ``engine.detect_anomaly()`` was active."""


class VersionCounter:
    """The number of in-place writes into one storage, shared by a tensor and its views."""
    __slots__ = ("value",)

    def __init__(self):
        self.value = 0


OUTPUT = -1   # the position of a node's output among the versions it remembers


class Node:
    """One recorded op: ``op`` (None once released), its ``inputs``, ``seq`` (the recording
    order), the ``tape`` it is registered on, that tape's ``backwards`` count when it was
    recorded or a backward last reached it (``touched``), its output's ``nbytes``, and
    ``versions``: ``(counter, version seen, position)`` of each tensor input and of the
    output (position ``OUTPUT``) when the op ran."""
    __slots__ = ("op", "inputs", "seq", "tape", "touched", "nbytes", "versions", "__weakref__")

    def __init__(self, op, inputs, nbytes, tape):
        self.op, self.inputs, self.nbytes, self.tape = op, inputs, nbytes, tape
        self.seq = next(_sequence)
        self.touched = tape.backwards
        self.versions = []


class Tape:
    """The live nodes recorded while this tape was a thread's current one, held weakly.

    ``len(tape)`` counts those neither released by a backward nor freed with their graph.
    It warns once (see the limits above) when they pile up. A backward on another thread
    may release nodes while this one records: each is one operation on a dict."""

    def __init__(self):
        # the live nodes as the keys of a dict of weak references, each removing itself when
        # its node is freed (a WeakSet under a lock: 0.77 us a record against 0.36); each
        # change is one dict operation, atomic under the GIL
        self._refs = {}
        self.backwards = 0      # backwards whose root was recorded here
        self.warned = False
        tape = weakref.ref(self)   # (the callback holding the tape itself: a reference cycle)

        def forget(ref):
            alive = tape()
            if alive is not None:
                alive._refs.pop(ref, None)
        self._forget = forget

    def __len__(self):
        return len(self._refs)

    @property
    def nodes(self):
        """The live nodes."""
        return [node for node in (ref() for ref in list(self._refs)) if node is not None]

    def record(self, op, inputs, output):
        node = Node(op, inputs, output.nbytes, self)
        self._refs[weakref.ref(node, self._forget)] = None
        live = len(self._refs)
        if live > LIVE_NODE_LIMIT and not self.warned:
            self._warn(f"{live} nodes that no backward has released", stacklevel=4)
        return node

    def release(self, nodes):
        for node in nodes:
            self._refs.pop(weakref.ref(node), None)

    def warn_if_stale(self):
        """After a backward whose root was recorded here: warn once about stale nodes."""
        if self.warned or not self._refs:
            return
        stale = [n for n in self.nodes if self.backwards - n.touched >= STALE_BACKWARDS]
        held = sum(n.nbytes for n in stale)
        if len(stale) > STALE_NODE_LIMIT or held > STALE_BYTES_LIMIT:
            self._warn(f"{len(stale)} nodes ({held / 2**20:.1f} MB of outputs) that the last "
                       f"{STALE_BACKWARDS} backward calls did not reach", stacklevel=5)

    def _warn(self, what, stacklevel):
        self.warned = True
        warnings.warn(
            f"the autograd tape holds {what}: a tensor kept from step to step keeps its whole "
            "graph alive. Accumulate losses with `total += loss.item()`, not `total += loss`, "
            "and evaluate inside `with engine.no_grad():`, or memory keeps growing "
            "(this warning is given once per tape)", RuntimeWarning, stacklevel=stacklevel)


class _State(threading.local):
    def __init__(self):
        self.grad_enabled = True
        self.anomaly = False
        self.tape = Tape()
        self.tracer = None   # engine.onnx's export: called with every op applied


_state = _State()


def current_tape():
    """The tape this thread records onto."""
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
    """Record nothing inside this block (inference, evaluation); for this thread only."""

    def __enter__(self):
        self.prev = _state.grad_enabled
        _state.grad_enabled = False

    def __exit__(self, *exc):
        _state.grad_enabled = self.prev


class enable_grad(no_grad):
    def __enter__(self):
        self.prev = _state.grad_enabled
        _state.grad_enabled = True


@contextlib.contextmanager
def trace_ops(record):
    """Call ``record(op, inputs, result)`` after every op this thread applies inside the
    block, recorded for backward or not (``engine.onnx`` exports what a forward ran)."""
    previous, _state.tracer = _state.tracer, record
    try:
        yield
    finally:
        _state.tracer = previous


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


# ------------------------------------------------------------------ what autograd needs of a tensor

class Value:
    """A tensor as autograd sees it; ``engine.tensor.Tensor`` is the class users get.

    A subclass sets ``data`` (its array) before calling ``Value.__init__`` and implements
    ``_wrap(array, requires_grad=False)``, a new user-facing tensor over ``array`` (an op's
    output, a gradient), and ``_operand(value)``, a number, list or array as a tensor of its
    own device and dtype (the other side of a binary op).

    ``_node`` is the Node of the op that computed the value, None for a leaf. A leaf's
    gradient lives in ``_grad``; ``engine.parameter.Parameter`` keeps it in a slot of its
    flat buffer instead, overriding the four slot methods ``_grad_array``, ``_store_grad``,
    ``_accumulate_grad`` and ``_grad_destination``.
    """

    def __init__(self, requires_grad=False):
        self._node = None
        self._grad = None
        self._version_counter = VersionCounter()
        self.requires_grad = requires_grad

    @property
    def _version(self):
        """How many in-place writes this tensor's storage has had (torch's ``t._version``)."""
        return self._version_counter.value

    def _bump_version(self):
        """Record an in-place write into this tensor's storage (every view of it sees it)."""
        self._version_counter.value += 1

    def _share_version(self, base):
        """Make this tensor, a view of ``base``'s storage, count ``base``'s writes."""
        self._version_counter = base._version_counter
        return self

    @property
    def requires_grad(self):
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, value):
        if value and np.dtype(self.data.dtype) not in FLOAT_DTYPES:
            raise TypeError(f"requires_grad: only float32/float64 tensors can require grad, "
                            f"this one is {np.dtype(self.data.dtype)}")
        if not value and self._node is not None:
            raise RuntimeError("requires_grad: a tensor computed from others cannot stop "
                               "requiring grad; use .detach()")
        self._requires_grad = bool(value)

    @property
    def is_leaf(self):
        return self._node is None

    @property
    def grad(self):
        """The accumulated gradient (a tensor), or None before any backward reached it."""
        data = self._grad_array()
        return None if data is None else self._wrap(data)

    @grad.setter
    def grad(self, value):
        if value is None:
            self._store_grad(None)
            return
        data = value.data if isinstance(value, Value) else value
        if tuple(data.shape) != tuple(self.data.shape):
            raise ValueError(f"grad: shape {tuple(data.shape)} does not match the tensor's "
                             f"{tuple(self.data.shape)}")
        self._store_grad(data)

    # the gradient slot of a plain leaf: an array of its own
    def _grad_array(self):
        return self._grad

    def _store_grad(self, data):
        """Set the gradient to a copy of ``data`` (None forgets it)."""
        self._grad = None if data is None else to_device(data, device_of(self.data))

    def _accumulate_grad(self, g):
        """Add ``g`` to the gradient (a copy of it when there is none: ``g`` may be shared),
        in place as torch's: the gradient array is the tensor's own (every way in copies), and
        a new one each backward cost its allocation (98k float32: 21 -> 16 us)."""
        if self._grad is None:
            self._grad = to_device(g, device_of(self.data))
        else:
            add_arrays(self._grad, g, out=self._grad)

    def _grad_destination(self):
        """A preallocated buffer a backward rule may write this leaf's gradient into, or None."""
        return None

    def backward(self, grad=None, retain_graph=False):
        """Accumulate d self / d leaf into every leaf's ``.grad``; ``grad`` is d loss / d self
        (default: ones, for a one-element root only)."""
        backward(self, grad, retain_graph)


# ------------------------------------------------------------------ running ops

def apply(op_class, *inputs, **params):
    """Run ``op_class`` on Tensors (or raw arrays that need no grad); record it when grad mode
    is on and an input requires grad. The result is made by the first Tensor input."""
    op = op_class(**params)
    # one pass over the inputs (three generator passes took 1.5 us of a 12 us relu)
    maker, arrays, needs = None, [], []
    for x in inputs:
        if isinstance(x, Value):
            if maker is None:
                maker = x
            arrays.append(x.data)
            needs.append(x._requires_grad)
        else:
            arrays.append(x)
            needs.append(False)
    if maker is None:
        raise TypeError(f"{op_class.name}: no input is an engine Tensor; wrap one with "
                        "engine.tensor(...)")
    record = _state.grad_enabled and True in needs
    op.needs_input_grad = tuple(needs) if record else (False,) * len(inputs)
    try:
        out = op(*arrays)   # the declared checks (ops.registry.Op), then forward
    except TypeError as error:
        raise _with_cast_remedy(error, op, arrays) from None
    if _state.anomaly:
        _check_finite(out, op, "forward", arrays)
    result = maker._wrap(out, requires_grad=record)
    if op.is_view:   # the same memory as the input: one storage, one version counter
        result._share_version(inputs[0])
    if record:
        node = result._node = _state.tape.record(op, inputs, out)
        versions = node.versions
        for position, x in enumerate(inputs):
            if isinstance(x, Value):
                counter = x._version_counter
                versions.append((counter, counter.value, position))
        counter = result._version_counter
        versions.append((counter, counter.value, OUTPUT))
    if _state.tracer is not None:
        _state.tracer(op, inputs, result)
    return result


def _with_cast_remedy(error, op, arrays):
    """``error``, with the remedy added when it refused a bool or integer input (a comparison
    result, labels) that the op does not take: arithmetic needs a cast first."""
    refused = [np.dtype(a.dtype) for position, a in enumerate(arrays)
               if hasattr(a, "dtype") and np.dtype(a.dtype).kind in "biu"
               and position not in op.integer_inputs]
    if not refused:
        return error
    return TypeError(f"{error} ({refused[0]} tensors take part in arithmetic only once cast, "
                     "e.g. x.astype(np.float32))")


# ------------------------------------------------------------------ backward

def _root_gradient(root, grad):
    shape, dtype, device = tuple(root.data.shape), np.dtype(root.data.dtype), device_of(root.data)
    if grad is None:
        if root.data.size != 1:
            raise RuntimeError(
                f"backward: the root has shape {shape}; only a one-element tensor gets an "
                "implicit gradient of ones: pass one of that shape, loss.backward(grad)")
        return _cached_ones(shape, dtype, device)
    data = grad.data if isinstance(grad, Value) else np.asarray(grad)
    if tuple(data.shape) != shape:
        raise ValueError(f"backward: gradient shape {tuple(data.shape)} does not match "
                         f"the root's shape {shape}")
    if np.dtype(data.dtype) != dtype:
        data = np.asarray(to_device(data, "cpu"), dtype=dtype)
    return to_device(data, device) if device_of(data) != device else data


@functools.lru_cache(maxsize=64)
def _cached_ones(shape, dtype, device):
    # the root gradient is only read by backward rules, never written, so one cached buffer
    # per shape spares a fill launch per step
    return fill(empty(shape, dtype, device), 1)


_SECOND_BACKWARD = (
    "backward: trying to backward through the graph a second time: the first backward "
    "released the values it saved{where}. Specify retain_graph=True on the first backward "
    "to go through the graph again")


def _graph(root):
    """Every node ``root`` (a tensor) reaches through inputs that need grad, latest first;
    raises before any gradient is touched when one of them was released or saved a value
    written in place since."""
    seen = {root._node}
    stack = [(root._node, root)]
    while stack:
        node, output = stack.pop()
        if node.op is None:
            raise RuntimeError(_SECOND_BACKWARD.format(
                where="" if output is root else " (part of this graph was consumed by it)"))
        for counter, version, position in node.versions:
            if counter.value != version:
                _refuse_if_saved(node, output, position, version, counter.value)
        for x, needed in zip(node.inputs, node.op.needs_input_grad):
            parent = x._node if needed else None
            if parent is not None and parent not in seen:
                seen.add(parent)
                stack.append((parent, x))
    return sorted(seen, key=_by_sequence, reverse=True)


def _refuse_if_saved(node, output, position, version, now):
    """Raise torch's in-place error when ``node``'s op kept (on itself) memory of the tensor
    at ``position`` (its output for ``OUTPUT``), written in place since version ``version``."""
    tensor = output if position == OUTPUT else node.inputs[position]
    op = node.op
    if not any(shares_memory(kept, tensor.data) for kept in _kept_arrays(op)):
        return   # the op's backward never reads it (an add's operand, a reshape's input)
    role = "the output" if position == OUTPUT else f"input {position}"
    shapes = ", ".join(str(tuple(x.shape)) for x in node.inputs if hasattr(x, "shape"))
    raise RuntimeError(
        f"backward: one of the variables needed for gradient computation has been modified "
        f"by an inplace operation: {role} of {op.name} (input shapes {shapes}), a "
        f"{np.dtype(tensor.data.dtype)} tensor of shape {tuple(tensor.data.shape)}, is at "
        f"version {now}; expected version {version} instead ({op.name} saved it for its "
        "backward, and an in-place write changed it since: an indexing assignment into it "
        "or a view of it, through detach(), or load_state_dict). Nothing was computed; make "
        "the write before the forward, or write into a copy (engine.tensor(x)) or build the "
        "new values with engine.where or engine.cat")


def _kept_arrays(op):
    """The arrays an op instance holds for its backward (attributes, and inside tuples)."""
    for value in vars(op).values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, np.ndarray) or is_device_array(item):
                yield item


def backward(root, grad=None, retain_graph=False):
    """Accumulate d ``root`` / d leaf into every leaf's ``.grad`` (see the module docstring)."""
    if not root.requires_grad:
        raise RuntimeError("backward: the tensor does not require grad (no input of the "
                           "computation had requires_grad=True, or it ran under no_grad)")
    root_grad = _root_gradient(root, grad)
    walk = object()   # this backward, as the owner of the gradient slots it is handed
    if root._node is None:   # a leaf: d root / d root
        _accumulate_leaves([(root, root_grad)], (), walk)
        return
    nodes = _graph(root)
    anomaly = _state.anomaly
    grads = {root._node: root_grad}
    for node in nodes:
        grad_out = grads.pop(node, None)
        if grad_out is None:
            continue
        if anomaly:
            _check_finite(grad_out, node.op, "backward (gradient reaching it)", node.inputs)
        destinations, claimed = _grad_destinations(node.inputs, walk)
        try:
            input_grads = node.op.backward(grad_out, destinations)
            leaves = []
            for x, needed, g in zip(node.inputs, node.op.needs_input_grad, input_grads):
                if not needed or g is None:
                    continue
                if anomaly:
                    _check_finite(g, node.op, "backward", node.inputs)
                parent = x._node
                if parent is None:
                    leaves.append((x, g))
                elif parent in grads:
                    grads[parent] = add_arrays(grads[parent], g)
                else:
                    grads[parent] = g
            if leaves:
                _accumulate_leaves(leaves, claimed, walk)
        finally:
            if claimed:
                _release_claims(claimed, walk)
    tape = root._node.tape
    tape.backwards += 1
    _after_backward(nodes, retain_graph)
    tape.warn_if_stale()


def _after_backward(nodes, retain_graph):
    """Release the walked nodes (their saved values and inputs), or mark them reached."""
    if retain_graph:
        for node in nodes:
            node.touched = node.tape.backwards
        return
    by_tape = {}
    for node in nodes:
        node.op, node.inputs = None, ()
        by_tape.setdefault(node.tape, []).append(node)
    for tape, released in by_tape.items():
        tape.release(released)


# ------------------------------------------------------------------ leaves under threads
#
# Backwards may run on several threads at once over shared leaves (a model's parameters, a
# shared tensor): every accumulation into a leaf's gradient takes ``_leaves``'s lock, so no
# read-add-write is lost. A leaf's stale gradient slot handed to an op as its destination
# (``_grad_destination``: the op writes the gradient there, outside the lock) is *claimed* by
# that backward until it has accumulated it: another backward is handed no destination for
# that leaf meanwhile, and its accumulation into the leaf waits for the claim to end (else
# its gradient would be overwritten by the op's write, or the slot added to itself). A node
# accumulates into the leaves it claimed first, so two backwards never wait on each other.
_leaves_lock = threading.RLock()
# (taken as the lock itself, a C with-statement; the Condition's own is Python code)
_leaves = threading.Condition(_leaves_lock)
_claims = {}   # id(leaf) -> (the backward holding its slot, that backward's thread)


def _grad_destinations(inputs, walk):
    """Per input, the preallocated gradient buffer a backward rule may write into, or None
    (a leaf offers it at its first occurrence only: later ones accumulate into it; never a
    slot another backward holds), and the ids of the leaves so claimed by ``walk``."""
    for x in inputs:   # a loop, not any(...) over a generator: 6-8 such nodes a step
        if isinstance(x, Value) and x._node is None:
            break
    else:
        return (None,) * len(inputs), ()
    seen = set()
    destinations = []
    claimed = []
    with _leaves_lock:
        for x in inputs:
            destination = None
            if isinstance(x, Value) and x._node is None and id(x) not in seen:
                seen.add(id(x))
                if id(x) not in _claims:
                    destination = x._grad_destination()
                    if destination is not None:
                        _claims[id(x)] = (walk, threading.get_ident())
                        claimed.append(id(x))
            destinations.append(destination)
    return tuple(destinations), claimed


def _accumulate_leaves(leaves, claimed, walk):
    """Add each ``(leaf, gradient)`` into the leaf's gradient under the lock: first those
    whose slot ``walk`` claimed (ending the claim), then the others, each once no other
    backward holds its slot."""
    mine = [(x, g) for x, g in leaves if id(x) in claimed]
    others = [(x, g) for x, g in leaves if id(x) not in claimed]
    with _leaves_lock:
        for x, g in mine:
            x._accumulate_grad(g)
            if _claims.get(id(x), (None,))[0] is walk:
                del _claims[id(x)]
        if mine:
            _leaves.notify_all()
        for x, g in others:
            holder = _claims.get(id(x))
            while holder is not None and holder[0] is not walk:
                if holder[1] == threading.get_ident():
                    raise RuntimeError(
                        "backward: a backward run inside another one's op (on the same "
                        "thread) reached a leaf whose gradient slot the outer backward is "
                        "writing; run it after the outer backward returns")
                _leaves.wait()
                holder = _claims.get(id(x))
            x._accumulate_grad(g)


def _release_claims(claimed, walk):
    """End whatever claims of ``walk`` a node still holds (a frozen leaf's slot, a failed
    backward): its slot stays stale."""
    with _leaves_lock:
        ended = False
        for key in claimed:
            if _claims.get(key, (None,))[0] is walk:
                del _claims[key]
                ended = True
        if ended:   # (after ``_accumulate_leaves``, which ended them and woke the waiters)
            _leaves.notify_all()
