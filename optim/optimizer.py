"""The optimizer base class: parameter groups, per-parameter state, the flat fast path.

Like ``torch.optim.Optimizer``: ``param_groups`` is a list of dicts (``"params"`` plus the
hyper-parameters; schedulers write ``"lr"`` there), ``state[p]`` holds a parameter's step
count and buffers, ``state_dict()`` / ``load_state_dict()`` save and restore both.

How a group is updated (``step``):

- **flat path**: when a group's parameters are exactly the parameters of one
  ``engine.parameter.FlatBuffer`` (any order), every gradient slot is valid and every
  parameter has taken the same number of steps, the update rule runs as ONE kernel over
  ``flat.data``, ``flat.grad`` and the group's flat state buffers (same size, device and
  dtype). Each parameter's ``state[p]`` buffers are views into those flat buffers, so both
  paths read and write the same state.
- **per-parameter path**, otherwise: one kernel per parameter that has a gradient
  (parameters whose ``grad`` is None are skipped, as in torch). This covers plain tensors with
  ``requires_grad=True``, groups that mix buffers, and a flat group with a stale slot. It is
  correct but costs one launch per parameter.

Subclasses name their state buffers (``_state_names``), validate their hyper-parameters
(``_check_group``) and give their kernel (``update_kernel``) and its arguments
(``_update_args``).

State buffers are allocated uninitialised. ``_update_args`` gets them as ``StateBuffers``,
whose ``fresh`` flags say which hold no history yet (made since the parameter's last update), so
the rule writes those before reading them. Adam's buffers are made with the state, so they
are fresh exactly at step 1. A rule whose buffers may start at any step (``lazy_state``:
SGD's momentum buffer, made when momentum turns non-zero after earlier steps, as in torch)
also loads a saved state that lacks them.
"""
import warnings
import weakref

import numpy as np

from engine.autograd import enable_grad
from engine.tensor import Tensor
from ops.check import count_nonfinite
from ops.device import copy_into, device_of, to_device, to_host
from ops.launch import StaleRecording, claim_last_run, recording
from ops.layout import flat
from ops.memory import empty
from ops.step_counter import advance, new_counter, set_counter


class Optimizer:
    def __init__(self, params, defaults, skip_nonfinite=False):
        self.defaults = dict(defaults)
        self.state = {}
        self.param_groups = []
        self.skip_nonfinite = bool(skip_nonfinite)
        self.skipped_steps = 0
        self._flat_state = weakref.WeakKeyDictionary()   # FlatBuffer -> {state name: flat array}
        self._unwritten = {}   # parameter -> names of its state buffers that hold no history
        # id of a FlatBuffer or parameter -> (weak reference to it, its device step counter,
        # the step the host knows the counter holds); by id: a Tensor's == is elementwise
        self._counters = {}
        if isinstance(params, Tensor):
            raise TypeError(f"{self._name}: params must be an iterable of tensors or of dicts, "
                            "got a single Tensor (wrap it in a list)")
        groups = list(params)
        if not groups:
            raise ValueError(f"{self._name}: got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for group in groups:
            self.add_param_group(group)

    @property
    def _name(self):
        return type(self).__name__

    def __repr__(self):
        lines = [f"{self._name} ("]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines += [f"    {key}: {value}" for key, value in sorted(group.items())
                      if key != "params"]
        return "\n".join(lines + [")"])

    # ----------------------------------------------------------- groups
    def add_param_group(self, group):
        """Add a group (a dict with ``"params"``; missing hyper-parameters take the defaults)."""
        if not isinstance(group, dict):
            raise TypeError(f"{self._name}: a param group must be a dict, "
                            f"got {type(group).__name__}")
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        for position, p in enumerate(params):
            if not isinstance(p, Tensor):
                raise TypeError(f"{self._name}: parameter {position} is a {type(p).__name__}, "
                                "not an engine Tensor")
            if not p.requires_grad or not p.is_leaf:
                raise ValueError(f"{self._name}: parameter {position} (shape {p.shape}) must be a "
                                 "leaf tensor with requires_grad=True")
        if len({id(p) for p in params}) != len(params):
            raise ValueError(f"{self._name}: a parameter appears twice in one group")
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) in seen for p in params):
            raise ValueError(f"{self._name}: some parameters appear in more than one "
                             "parameter group")
        group = {**self.defaults, **group, "params": params}
        self._check_group(group)
        self.param_groups.append(group)

    def _check_group(self, group):
        """Raise ValueError naming any invalid hyper-parameter of ``group`` (subclasses)."""
        raise NotImplementedError

    def _state_names(self, group):
        """Names of the per-element state buffers the rule keeps for ``group`` (subclasses)."""
        raise NotImplementedError

    lazy_state = False   # True: a state buffer may be made at any step (see the module doc)

    update_kernel = None   # the rule's ops.launch.Kernel (subclasses)

    def _update_args(self, group, param, grad, buffers, step_counter):
        """The arguments of ``update_kernel`` for 1-D arrays; ``buffers`` are ``StateBuffers``
        in ``_state_names`` order; ``step_counter`` is the one-element device array holding
        the step t (from 1) when ``counts_steps_on_device``, else None (subclasses)."""
        raise NotImplementedError

    # ----------------------------------------------------------- stepping
    def zero_grad(self):
        """Forget every gradient without a kernel: flat slots are marked stale (the next
        backward overwrites them), plain tensors get ``grad = None``."""
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with enable_grad():
                loss = closure()
        if self.skip_nonfinite:
            bad = self._count_nonfinite_grads()
            if bad:
                self.skipped_steps += 1
                warnings.warn(f"{self._name}: skipped a step: {bad} gradient value(s) are NaN or "
                              f"Inf ({self.skipped_steps} step(s) skipped so far)",
                              RuntimeWarning, stacklevel=2)
                return loss
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group):
        params = group["params"]
        names = self._state_names(group)
        buffer = whole_flat_buffer(params)
        if buffer is not None:
            flat_state = self._flat_buffers(group, buffer)
            if buffer.grads_valid() and self._steps_aligned(params):
                for p in params:
                    if p not in self.state:
                        self._init_state(group, p)
                fresh = {self._fresh(p, names) for p in params}
                if len(fresh) == 1:   # one kernel: every parameter's buffers alike
                    for p in params:
                        self.state[p]["step"] += 1
                        self._unwritten[p].difference_update(names)
                    self._run_update(group, buffer.data, buffer.grad,
                                     StateBuffers(flat_state, fresh.pop()), params, buffer)
                    return
        for p in params:
            grad = p.grad
            if grad is None:
                continue
            if grad.dtype != p.dtype or grad.device != p.device:
                raise TypeError(f"{self._name}: the gradient of a {p.dtype} {p.device} parameter "
                                f"of shape {p.shape} is {grad.dtype} on {grad.device}")
            if p not in self.state:
                self._init_state(group, p)
            state = self.state[p]
            for name in names:
                if name not in state:   # named only now (lazy_state): made, no history
                    state[name] = empty(p.shape, p.dtype, p.device)
                    self._unwritten[p].add(name)
                elif device_of(state[name]) != p.device:   # the parameter moved since
                    state[name] = to_device(state[name], p.device)
            state["step"] += 1
            buffers = StateBuffers((flat(state[name]) for name in names), self._fresh(p, names))
            self._unwritten[p].difference_update(names)
            self._run_update(group, flat(p.data), flat(grad.data), buffers, [p], p)

    counts_steps_on_device = False   # True: the rule's kernel reads its step t (Adam)

    def _run_update(self, group, param, grad, buffers, params, unit):
        """Launch the rule's kernel on the 1-D arrays of ``params`` (their steps just
        advanced; ``unit`` is their FlatBuffer, or the one parameter). A rule that reads its
        step t gets it as a device counter (``_step_counter``), advanced by a kernel, so a
        replayed step (``engine.capture``) reads its own t. Inside a recorded step the update
        run is claimed: each replay moves the host's step counts on as this call did and
        gives the kernel new scalars when the learning rate in the group changed."""
        step = self.state[params[0]]["step"]
        counter = (self._step_counter(unit, param, step) if self.counts_steps_on_device
                   else None)
        args = self._update_args(group, param, grad, buffers, counter)
        self.update_kernel(*args)
        if recording():
            claim_last_run(self._replay_refresher(group, params, unit, param, grad, buffers,
                                                  counter, args))

    def _replay_refresher(self, group, params, unit, param, grad, buffers, counter, args):
        """``refresh(steps)`` for a recorded update: advance the host's step counts by
        ``steps`` (the device counter advances itself), and return the kernel's arguments
        when a scalar changed since the last replay (a scheduler's lr), else None. A
        recording whose buffers or counter the optimizer no longer uses (a loaded state, a
        re-packed model, momentum switched on) is stale: it must be recorded again."""
        names = self._state_names(group)
        states = [self.state[p] for p in params]
        arrays = [[state[name] for name in names] for state in states]
        last = [args]

        def refresh(steps):
            if (self._state_names(group) != names
                    or any(self.state.get(p) is not state for p, state in zip(params, states))
                    or any(state[name] is not array for state, row in zip(states, arrays)
                           for name, array in zip(names, row))
                    or (counter is not None
                        and not self._counter_holds(unit, counter, states[0]["step"]))):
                raise StaleRecording(f"{self._name}: the state changed since the step was "
                                     "recorded")
            for state in states:
                state["step"] += steps
            if counter is not None:
                self._keep_counter(unit, counter, states[0]["step"])
            fresh = StateBuffers(buffers, self._fresh(params[0], names))
            new = self._update_args(group, param, grad, fresh, counter)
            if _same_arguments(new, last[0]):
                return None
            last[0] = new
            return new
        return refresh

    def _step_counter(self, unit, param, step):
        """The one-element device counter of ``unit`` holding ``step`` (t, from 1) after the
        advance kernel this launches. A counter whose value the host does not know (a new
        one, a loaded state, a parameter moved to another device) is written first."""
        device = device_of(param)
        kept = self._counter_of(unit)
        if kept is None or device_of(kept[0]) != device:
            kept = (new_counter(device, step - 1), step - 1)
        counter, value = kept
        if value != step - 1:
            set_counter(counter, step - 1)
        advance(counter)
        self._keep_counter(unit, counter, step)
        return counter

    def _counter_of(self, unit):
        """``(counter, step it holds)`` of ``unit``, or None."""
        kept = self._counters.get(id(unit))
        if kept is None or kept[0]() is not unit:
            return None
        return kept[1], kept[2]

    def _counter_holds(self, unit, counter, step):
        kept = self._counter_of(unit)
        return kept is not None and kept[0] is counter and kept[1] == step

    def _keep_counter(self, unit, counter, step):
        self._counters[id(unit)] = (weakref.ref(unit), counter, step)

    def _fresh(self, p, names):
        return tuple(name in self._unwritten[p] for name in names)

    def _steps_aligned(self, params):
        """True when no parameter has state yet or all have taken the same number of steps
        (one kernel has one step count, for Adam's bias correction)."""
        steps = {self.state[p]["step"] if p in self.state else None for p in params}
        return len(steps) == 1

    def _count_nonfinite_grads(self):
        bad = 0
        for group in self.param_groups:
            buffer = whole_flat_buffer(group["params"])
            if buffer is not None and buffer.grads_valid():
                bad += count_nonfinite(buffer.grad)
                continue
            for p in group["params"]:
                grad = p.grad
                if grad is not None:
                    bad += count_nonfinite(grad.data)
        return bad

    # ----------------------------------------------------------- state
    def _init_state(self, group, p):
        """``state[p]`` with step 0 and its buffers: views into the group's flat state when the
        group is one FlatBuffer, else arrays of its own. Uninitialised, so all unwritten."""
        state = {"step": 0}
        buffer = whole_flat_buffer(group["params"])
        if buffer is not None:
            flat_buffers = self._flat_buffers(group, buffer)
            offset = buffer.offsets[[id(q) for q in buffer.params].index(id(p))]
            for name, storage in zip(self._state_names(group), flat_buffers):
                state[name] = storage[offset:offset + p.size].reshape(p.shape)
        else:
            for name in self._state_names(group):
                state[name] = empty(p.shape, p.dtype, p.device)
        self.state[p] = state
        self._unwritten[p] = set(self._state_names(group))

    def _flat_buffers(self, group, buffer):
        """The group's flat state arrays, like ``buffer`` in size, device and dtype. Made once;
        made again (and the parameters' state moved into them) when the model was re-packed
        into a new FlatBuffer or moved to another device after the state was created, or when
        the rule names a buffer it did not before (a parameter's state lacking it gets an
        unwritten view)."""
        names = self._state_names(group)
        storage = self._flat_state.get(buffer)
        if storage is None or any(name not in storage or device_of(storage[name]) != buffer.device
                                  or storage[name].size != buffer.size for name in names):
            storage = {name: empty(buffer.size, buffer.dtype, buffer.device) for name in names}
            self._flat_state[buffer] = storage
            for p, offset in zip(buffer.params, buffer.offsets):
                state = self.state.get(p)
                for name in names if state is not None else ():
                    view = storage[name][offset:offset + p.size].reshape(p.shape)
                    if name in state:
                        copy_into(view, state[name])
                    else:
                        self._unwritten[p].add(name)
                    state[name] = view
        return tuple(storage[name] for name in names)

    def state_dict(self):
        """``{"state": {index: {"step", buffers as NumPy copies}}, "param_groups": [...],
        "skipped_steps"}``; parameters are numbered in group order, as in torch."""
        index = {}
        groups = []
        for group in self.param_groups:
            numbers = []
            for p in group["params"]:
                index[id(p)] = len(index)
                numbers.append(index[id(p)])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": numbers})
        state = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p in self.state:
                    state[index[id(p)]] = {
                        name: value if name == "step" else np.array(to_host(value), copy=True)
                        for name, value in self.state[p].items()
                        if name not in self._unwritten[p]}
        return {"state": state, "param_groups": groups, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict):
        """Restore hyper-parameters and state saved by ``state_dict`` of an optimizer built on
        parameters of the same shapes in the same order (buffers are copied to each
        parameter's device and dtype). The saved hyper-parameters replace the current ones,
        as in torch. A saved buffer the rule does not name for the loaded group (SGD's
        momentum buffer saved after momentum was set to 0) is kept, and used again if the
        rule names it later; one the rule names but the state lacks is made unwritten when
        the rule is ``lazy_state`` (SGD), else the load is refused."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"{self._name}.load_state_dict: the saved state has "
                             f"{len(saved_groups)} parameter group(s), this optimizer "
                             f"{len(self.param_groups)}")
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            missing = sorted(set(self.defaults) - set(saved))
            if missing:
                raise ValueError(f"{self._name}.load_state_dict: saved group {i} lacks {missing}; "
                                 f"expected the hyper-parameters of {self._name} (was it saved "
                                 "by another optimizer?)")
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"{self._name}.load_state_dict: group {i} has "
                                 f"{len(saved['params'])} saved parameter(s), "
                                 f"this optimizer {len(group['params'])}")
        new_groups = []
        for saved, group in zip(saved_groups, self.param_groups):
            new_group = {**{k: v for k, v in saved.items() if k != "params"},
                         "params": group["params"]}
            self._check_group(new_group)
            new_groups.append(new_group)
        self.param_groups = new_groups
        self.state = {}
        self._unwritten = {}
        self._flat_state = weakref.WeakKeyDictionary()
        for saved, group in zip(saved_groups, self.param_groups):
            for number, p in zip(saved["params"], group["params"]):
                if number in state_dict["state"]:
                    self._load_param_state(group, p, state_dict["state"][number])
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))

    def _load_param_state(self, group, p, saved):
        self._init_state(group, p)
        state = self.state[p]
        names = self._state_names(group)
        missing = [name for name in names if name not in saved]
        if "step" not in saved or (missing and not self.lazy_state):
            raise ValueError(f"{self._name}.load_state_dict: a parameter's saved state has "
                             f"{sorted(saved)}, expected {sorted(set(names) | {'step'})}")
        state["step"] = int(saved["step"])
        for name in sorted(set(saved) - {"step"}):
            values = np.asarray(to_host(saved[name]))
            if values.shape != p.shape:
                raise ValueError(f"{self._name}.load_state_dict: saved {name} has shape "
                                 f"{values.shape}, the parameter {p.shape}")
            values = np.ascontiguousarray(values, dtype=p.dtype)
            if name in names:
                copy_into(state[name], values)
                self._unwritten[p].discard(name)
            else:
                state[name] = to_device(values, p.device)


def _same_arguments(new, old):
    """True when two argument tuples of one kernel name the same arrays and equal scalars."""
    return all(a is b if hasattr(a, "shape") else (type(a) is type(b) and a == b)
               for a, b in zip(new, old))


class StateBuffers(tuple):
    """A parameter's (or a flat group's) state buffers for one update, in ``_state_names``
    order; ``fresh[i]`` is True when buffer ``i`` holds no history yet: the rule must write
    it before reading it."""

    def __new__(cls, buffers, fresh):
        self = super().__new__(cls, buffers)
        self.fresh = tuple(fresh)
        return self


def whole_flat_buffer(params):
    """The FlatBuffer whose parameters are exactly ``params`` (any order), else None."""
    buffer = getattr(params[0], "flat", None) if params else None
    if buffer is None or len(buffer.params) != len(params):
        return None
    if any(getattr(p, "flat", None) is not buffer for p in params):
        return None
    return buffer   # same length, all in it, no duplicates (add_param_group): the same set


def check_non_negative(optimizer, name, value):
    """Raise ValueError naming ``name`` unless ``value`` is a real number >= 0."""
    if not isinstance(value, (int, float, np.floating, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{optimizer}: {name} must be a number, got {value!r}")
    if not value >= 0:   # also catches NaN
        raise ValueError(f"{optimizer}: invalid {name}: {value} (must be >= 0)")
