"""The optimizer base class: parameter groups, per-parameter state, the flat fast path.

Like ``torch.optim.Optimizer``: ``param_groups`` is a list of dicts (``"params"`` plus the
hyper-parameters; schedulers write ``"lr"`` there), ``state[p]`` holds a parameter's step
count and buffers, ``state_dict()`` / ``load_state_dict()`` save and restore both.

How a group is updated (``step``):

- **flat path**: when a group's parameters are exactly the parameters of one
  ``engine.parameter.FlatBuffer`` (any order), every gradient slot is valid and the
  parameters' steps are counted together, the update rule runs as ONE kernel over
  ``flat.data``, ``flat.grad`` and the group's flat state buffers (same size, device and
  dtype). Each parameter's ``state[p]`` buffers are views into those flat buffers, so both
  paths read and write the same state.
- **slots path**: when a group holds some of one FlatBuffer's parameters (AdamW's decay and
  no-decay groups), with the same conditions, the rule runs as ONE kernel over the group's
  slots of ``flat.data`` and ``flat.grad`` (``optim.flat_slots.FlatSlots``: runs of the
  buffer) and the buffer's flat state buffers, which the groups share.
- **per-parameter path**, otherwise: one kernel per parameter that has a gradient
  (parameters whose ``grad`` is None are skipped, as in torch), each with step counts of its
  own from then on. This covers plain tensors with ``requires_grad=True``, groups that mix
  buffers, and a flat group with a stale slot (a frozen parameter). It is correct but costs
  one launch per parameter.

What an update reads from device memory and what the host decides (the capture contract):
``Optimizer``'s class doc, written once for every optimizer.

State buffers start at zero, as torch's; a rule reads from the step counts whether a buffer
is new where that matters (SGD's momentum starts from the first gradient). A rule whose
buffers may start at any step (``lazy_state``: SGD's momentum buffer, made when momentum
turns non-zero after earlier steps, as in torch) also loads a saved state that lacks them.

An optimizer is a declaration (``Optimizer``'s class doc) and its hyper-parameters' checks.
"""
import functools
import warnings
import weakref

import numpy as np

from engine.autograd import enable_grad
from engine.parameter import Parameter, zero_grads
from engine.tensor import Tensor
from ops.check import count_nonfinite
from ops.device import copy_into, device_of, to_device, to_host
from ops.fill import fill
from ops.flag_buffer import fault_words
from ops.launch import note_participant, unrecorded
from ops.layout import flat
from ops.memory import empty
from ops.step_counter import (BUFFER_UPDATES, T, HostMirror, advance_steps, new_step_counts,
                              store_values)
from optim.flat_slots import FlatSlots, shared_flat_buffer
from optim.rule import RuleKernels


class Optimizer:
    r"""The base of every optimizer; a subclass is a declaration::

        class SGD(Optimizer):
            rule = _sgd_rule          # the update of one element, by name (optim.rule)
            hyper = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
            buffers = ("momentum_buffer",)   # its per-element state, torch's names
            derived = (one_minus_dampening,) # per-launch float64 scalars, by function name

            def _check_group(self, group): ...   # each hyper-parameter, named in the error

    and one line in ``optim.OPTIMIZERS``. The rule's kernels, their arguments and the order
    of the hyper-parameters on the device all follow from the declaration.

    **The capture contract** (as torch's ``capturable``; ``engine.capture`` records a step
    and replays its kernels with the arguments they were recorded with):

    - *device state*, read by the kernels and changed only by kernels: the parameters, the
      gradients, the state buffers, each update unit's step counts ``[t, updates of its
      buffers, skipped]`` (moved on by a one-thread kernel each step, and held while an input
      fault is pending: then the update changes nothing), and each group's hyper-parameters
      (a ``HostMirror`` of ``_hyper_values``, synced from ``param_groups`` before each
      eager step and each replay: a scheduler's new lr needs no new recording);
    - *host decisions*, fixed in a recording and named by ``capture_key()``: which
      parameters each group has and whether they require grad, which buffers the rule keeps
      for each group (SGD with or without momentum: another kernel), which step counts each
      parameter's update uses, and the state arrays' layout. A replay runs only while the
      key is unchanged; a changed key records anew.

    So an eager step and a replayed one run the same kernels on the same arrays and give the
    same bits; a rule never reads a Python number that changes between steps.
    """

    def __init__(self, params, defaults, skip_nonfinite=False):
        self.defaults = dict(defaults)
        self.state = {}
        self.param_groups = []
        self.skip_nonfinite = bool(skip_nonfinite)
        self.skipped_steps = 0
        # FlatBuffer -> {state name: (its flat array, ids of the parameters whose state views it)}
        self._flat_state = weakref.WeakKeyDictionary()
        # the update unit (a FlatBuffer, or the parameter itself) whose step counts hold a
        # parameter's steps, and each unit's counts (ops.step_counter.new_step_counts)
        self._unit_of = {}
        # a plain dict: weak keys would compare Tensors by their elementwise ==
        self._counts = {}
        self._hypers = {}   # (group index, device) -> HostMirror of _hyper_values(group)
        self._slots = {}    # group index -> its FlatSlots, while it holds part of a FlatBuffer
        self._plans = {}    # group index -> its _FlatPlan, while its flat update stays valid
        self._layout = 0    # bumped whenever state arrays are made or replaced (capture_key)
        if isinstance(params, Tensor):
            raise TypeError(f"{self._name}: params must be an iterable of tensors or of dicts, "
                            "got a single Tensor (wrap it in a list)")
        if callable(getattr(params, "parameters", None)):
            raise TypeError(f"{self._name}: got a {type(params).__name__}, not its parameters; "
                            f"pass model.parameters(): {self._name}(model.parameters(), ...)")
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
            # a frozen Parameter may join (torch's rule): it is skipped while frozen
            if not (p.requires_grad or isinstance(p, Parameter)) or not p.is_leaf:
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

    # ----------------------------------------------------------- the declaration
    # A subclass declares its rule (optim.rule): ``rule`` (the element function), ``hyper``
    # (the names of the numbers it reads from its group), ``buffers`` (its per-element state,
    # torch's names), ``derived`` (per-launch scalars, functions named as their value) and
    # ``flush_subnormals``; the kernels, their arguments and the hyper-parameters' device
    # order all follow from it.
    rule = None
    hyper = ()
    buffers = ()
    derived = ()
    flush_subnormals = False
    lazy_state = False   # True: a state buffer may be made at any step (see the module doc)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "rule" in cls.__dict__:
            rule = cls.__dict__["rule"]
            cls.kernels = RuleKernels(cls.__name__.lower(), getattr(rule, "__func__", rule),
                                      cls.hyper, cls.buffers, cls.derived, cls.flush_subnormals)

    def _state_names(self, group):
        """The buffers the rule keeps for ``group`` now: all of ``buffers`` unless a subclass
        keeps some only for some settings (SGD's momentum buffer)."""
        return self.buffers

    def _hyper_source(self, group):
        """Where ``hyper``'s names are looked up: the group, unless a subclass unpacks a value
        (Adam's ``betas``) or adds one the class decides (AdamW's decoupled decay)."""
        return group

    def _hyper_values(self, group):
        """The numbers of ``group`` the kernel reads from its device array, in ``hyper``'s
        order."""
        source = self._hyper_source(group)
        return tuple(source[name] for name in self.hyper)

    # ----------------------------------------------------------- stepping
    def zero_grad(self, set_to_none=True):
        """Forget every gradient without a kernel: flat slots are marked stale (the next
        backward overwrites them), plain tensors get ``grad = None``. ``set_to_none=False``
        (torch's) writes zeros into the gradients that exist instead: a parameter the next
        backward does not reach is then still updated, as in torch
        (``engine.parameter.zero_grads``)."""
        for group in self.param_groups:
            zero_grads(group["params"], set_to_none)

    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns ``closure()``'s loss."""
        note_participant(self)
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
        for index, group in enumerate(self.param_groups):
            self._step_group(index, group)
        return loss

    def _step_group(self, index, group):
        plan = self._plans.get(index)
        if plan is not None and plan.fits(self, group):
            self._update(index, group, *plan.update)
            return
        params = group["params"]
        names = self._state_names(group)
        unit = self._flat_unit(index, params)
        if (unit is not None and unit.grads_valid() and all(p.requires_grad for p in params)
                and all(self._unit_of.get(p, unit) is unit for p in params)):
            with unrecorded():   # state set-up runs once: a replay must not repeat it
                storage = self._flat_storage(group, unit, names)
            if storage is not None:
                buffer = getattr(unit, "buffer", unit)
                runs = unit.runs(buffer.device) if isinstance(unit, FlatSlots) else None
                update = (unit, buffer.data, buffer.grad, storage, names, runs)
                self._plans[index] = _FlatPlan(self, group, buffer, update)
                self._update(index, group, *update)
                return
        self._plans.pop(index, None)
        for p in params:
            grad = p.grad
            if grad is None or not p.requires_grad:   # frozen: never moved, decay or not
                continue
            if grad.dtype != p.dtype or grad.device != p.device:
                raise TypeError(f"{self._name}: the gradient of a {p.dtype} {p.device} parameter "
                                f"of shape {p.shape} is {grad.dtype} on {grad.device}")
            with unrecorded():
                state = self._own_state(group, p)
            self._update(index, group, p, flat(p.data), flat(grad.data),
                         [flat(state[name]) for name in names], names)

    def _flat_unit(self, index, params):
        """The flat update unit of group ``index`` holding ``params``: their FlatBuffer when
        they are all of it, the group's ``FlatSlots`` when they are some of one, else None."""
        buffer = whole_flat_buffer(params)
        if buffer is not None:
            return buffer
        buffer = shared_flat_buffer(params)
        if buffer is None:
            return None
        slots = self._slots.get(index)
        if slots is None or not slots.holds(buffer, params):
            slots = self._slots[index] = FlatSlots(buffer, params)
        return slots

    def _update(self, index, group, unit, param, grad, buffers, names, runs=None):
        """Advance ``unit``'s step counts and run the rule's kernel on the 1-D arrays (the
        ``buffers`` the group keeps, ``names`` in order; on their elements in ``runs`` when
        given)."""
        device = device_of(param)
        counts = self._counts[unit]
        hyper = self._hyper(index, group, device)
        advance_steps(counts, fault_words(device))
        named = dict(zip(names, buffers))
        kept = [named[name] for name in self.buffers if name in named]   # declared order
        extra = () if runs is None else (runs,)
        self.kernels.kernel(names, runs is not None).run_on(
            device, (param, grad, *kept, counts, hyper, _smallest_normal(param.dtype), *extra))
        mark_written(getattr(unit, "params", (unit,)))

    def _hyper(self, index, group, device):
        """The group's hyper-parameters on ``device``, synced from ``param_groups``."""
        mirror = self._hypers.get((index, device))
        values = self._hyper_values(group)
        if mirror is None:
            mirror = self._hypers[(index, device)] = HostMirror(device, values)
            self._layout += 1
            return mirror.array
        return mirror.sync(values)

    def sync_device(self):
        """Write every hyper-parameter changed in ``param_groups`` since the last step to the
        device arrays the kernels read (a replay of a captured step runs this first)."""
        for (index, _), mirror in self._hypers.items():
            if index < len(self.param_groups):
                mirror.sync(self._hyper_values(self.param_groups[index]))
        for group in self.param_groups:   # the replayed update writes them, as step() does
            mark_written(group["params"])

    def capture_key(self):
        """What the host decides about the update kernels: the parameters of each group,
        whether they require grad, the rule's state buffers and which step counts each
        parameter's update uses (``engine.capture`` replays only while this is unchanged)."""
        return (self.skip_nonfinite, self._layout) + tuple(
            (tuple(id(p) for p in group["params"]),
             tuple(p.requires_grad for p in group["params"]),
             self._state_names(group),
             tuple(id(self._unit_of.get(p)) for p in group["params"]))
            for group in self.param_groups)

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
    def _flat_storage(self, group, unit, names):
        """The group's flat state buffers (like the unit's FlatBuffer in size, device and
        dtype, in ``_state_names`` order; the groups of one buffer share them, each its own
        slots), with ``unit``'s step counts; made zeroed once. Made again, with the
        parameters' state moved in, when the model was moved to another device, or when the
        rule names a buffer it did not before (then new: its update count restarts). None
        when only some of the unit's parameters hold a buffer the rule now names: the
        per-parameter path then keeps each one's history."""
        buffer = getattr(unit, "buffer", unit)
        device = buffer.device
        storage = self._flat_state.setdefault(buffer, {})   # name -> (array, ids bound to it)
        counts = self._counts.get(unit)
        if counts is None or device_of(counts) != device:   # new, or the model moved since
            counts = self._counts[unit] = (new_step_counts(device) if counts is None
                                           else to_device(counts, device))
            self._layout += 1
        for name in names:
            array, bound = storage.get(name, (None, None))
            if array is None or device_of(array) != device:
                array, bound = fill(empty(buffer.size, buffer.dtype, device), 0), set()
                storage[name] = (array, bound)
                self._layout += 1
            unbound = [p for p in unit.params if id(p) not in bound]
            if not unbound:
                continue
            holders = [p for p in unbound
                       if p in self.state and dict.__contains__(self.state[p], name)]
            if holders and len(holders) != len(unbound):
                return None
            for p in unbound:
                offset = buffer.offsets[p._slot]
                view = array[offset:offset + p.size].reshape(p.shape)
                state = self._state_of(p, unit)
                if dict.__contains__(state, name):
                    copy_into(view, dict.__getitem__(state, name))
                state[name] = view
                bound.add(id(p))
            if not holders:
                store_values(counts[BUFFER_UPDATES:BUFFER_UPDATES + 1], (0,))
        for p in unit.params:
            self._state_of(p, unit)
        return tuple(storage[name][0] for name in names)

    def _own_state(self, group, p):
        """``state[p]`` with the rule's buffers on ``p``'s device and step counts of its own
        (a copy of its unit's, when it shared a FlatBuffer's)."""
        unit = self._unit_of.get(p)
        if unit is not p:
            shared = self._counts.get(unit) if unit is not None else None
            self._counts[p] = (new_step_counts(p.device) if shared is None
                               else to_device(shared, p.device))
            self._layout += 1
        state = self._state_of(p, p)
        counts = self._counts[p]
        if device_of(counts) != p.device:   # the parameter moved since
            counts = self._counts[p] = to_device(counts, p.device)
            self._layout += 1
        for name in self._state_names(group):
            if not dict.__contains__(state, name):   # named only now (lazy_state): new
                state[name] = fill(empty(p.shape, p.dtype, p.device), 0)
                store_values(counts[BUFFER_UPDATES:BUFFER_UPDATES + 1], (0,))
                self._layout += 1
            elif device_of(dict.__getitem__(state, name)) != p.device:
                state[name] = to_device(dict.__getitem__(state, name), p.device)
                self._layout += 1
        return state

    def _state_of(self, p, unit):
        """``state[p]``, made empty when missing, with its steps counted by ``unit``."""
        state = self.state.get(p)
        if state is None:
            state = self.state[p] = ParameterState(self, p)
        self._unit_of[p] = unit
        return state

    def _step_of(self, p):
        counts = self._counts.get(self._unit_of.get(p))
        return 0 if counts is None else int(to_host(counts)[T])

    def state_dict(self):
        """``{"state": {index: {"step", buffers as NumPy copies}}, "param_groups": [...],
        "skipped_steps"}``; parameters are numbered in group order, as in torch. A lazily made
        buffer that has had no update yet is left out (it holds no history)."""
        index = {}
        groups = []
        for group in self.param_groups:
            numbers = []
            for p in group["params"]:
                index[id(p)] = len(index)
                numbers.append(index[id(p)])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": numbers})
        state = {}
        counts = {}   # id of a unit -> its counts on the host: one read per unit
        for group in self.param_groups:
            for p in group["params"]:
                if p not in self.state:
                    continue
                unit = self._unit_of[p]
                if id(unit) not in counts:
                    counts[id(unit)] = to_host(self._counts[unit])
                step, updates = (int(v) for v in counts[id(unit)][:BUFFER_UPDATES + 1])
                saved = {"step": step}
                if updates or not self.lazy_state:
                    saved.update((name, np.array(to_host(value), copy=True))
                                 for name, value in dict.items(self.state[p]))
                state[index[id(p)]] = saved
        return {"state": state, "param_groups": groups, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict):
        """Restore hyper-parameters and state saved by ``state_dict`` of an optimizer built on
        parameters of the same shapes in the same order (buffers are copied to each
        parameter's device and dtype). The saved hyper-parameters replace the current ones,
        as in torch. A saved buffer the rule does not name for the loaded group (SGD's
        momentum buffer saved after momentum was set to 0) is kept, and used again if the
        rule names it later; one the rule names but the state lacks is made new when the
        rule is ``lazy_state`` (SGD), else the load is refused."""
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
        entries = []
        for saved, group in zip(saved_groups, new_groups):
            rows = [(p, state_dict["state"][number])
                    for number, p in zip(saved["params"], group["params"])
                    if number in state_dict["state"]]
            for p, entry in rows:
                self._check_saved(group, p, entry)
            entries.append(rows)
        self.param_groups = new_groups
        self.state = {}
        self._unit_of = {}
        self._counts = {}
        self._flat_state = weakref.WeakKeyDictionary()
        self._layout += 1
        with unrecorded():
            for index, (group, rows) in enumerate(zip(self.param_groups, entries)):
                unit = self._flat_unit(index, group["params"])
                names = self._state_names(group)
                # one unit when every parameter was saved at one step with the same buffers
                together = (unit is not None and len(rows) == len(group["params"])
                            and len({int(entry["step"]) for _, entry in rows}) == 1
                            and len({tuple(name in entry for name in names)
                                     for _, entry in rows}) == 1)
                for p, entry in rows:
                    self._load_param_state(group, p, entry, unit if together else p)
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))

    def _check_saved(self, group, p, saved):
        names = self._state_names(group)
        missing = [name for name in names if name not in saved]
        if "step" not in saved or (missing and not self.lazy_state):
            raise ValueError(f"{self._name}.load_state_dict: a parameter's saved state has "
                             f"{sorted(saved)}, expected {sorted(set(names) | {'step'})}")
        for name in sorted(set(saved) - {"step"}):
            shape = tuple(np.shape(to_host(saved[name])))
            if shape != p.shape:
                raise ValueError(f"{self._name}.load_state_dict: saved {name} has shape "
                                 f"{shape}, the parameter {p.shape}")

    def _load_param_state(self, group, p, saved, unit):
        state = self._state_of(p, unit)
        step = int(saved["step"])
        has_buffers = all(name in saved for name in self._state_names(group))
        if unit not in self._counts:
            self._counts[unit] = new_step_counts(p.device, step, step if has_buffers else 0)
        for name in sorted(set(saved) - {"step"}):
            values = np.ascontiguousarray(np.asarray(to_host(saved[name])), dtype=p.dtype)
            state[name] = to_device(values, p.device)


class _FlatPlan:
    """A group's flat update as ``_step_group`` decided it (the unit, its buffers and state
    arrays, the rule's buffer names), kept while nothing that decision read has changed: the
    group and its parameters (the same objects, all requiring grad, all still in the
    buffer), the buffer's arrays (a model moved to another device gets new ones), the names
    the rule keeps, the optimizer's state layout (``Optimizer._layout``), and every gradient
    slot valid. A step then skips the walk that decided it: SGD's step over 1000 parameters in
    four (its Python, nearly all of it) took 8.2-13.5 us against 10.7-22.0 (the 2-core Xeon
    under load, four pairs of runs alternating)."""
    __slots__ = ("group", "params", "ids", "layout", "unit", "names", "buffer", "data",
                 "grad", "update")

    def __init__(self, optimizer, group, buffer, update):
        """``update``: ``_update``'s arguments after the group, ``(unit, data, grad, state
        arrays, names, runs)``."""
        self.group, self.params = group, group["params"]
        self.ids = tuple(map(id, self.params))
        self.layout, self.unit, self.names = optimizer._layout, update[0], update[4]
        self.buffer, self.data, self.grad = buffer, buffer.data, buffer.grad
        self.update = update

    def fits(self, optimizer, group):
        """Whether the kept update is the one ``_step_group`` would decide now."""
        buffer = self.buffer
        if (group is not self.group or group["params"] is not self.params
                or len(self.params) != len(self.ids) or optimizer._layout != self.layout
                or buffer.data is not self.data or buffer.grad is not self.grad
                or optimizer._state_names(group) != self.names
                or not self.unit.grads_valid()):
            return False
        for p, kept in zip(self.params, self.ids):
            if id(p) != kept or not p._requires_grad or getattr(p, "flat", None) is not buffer:
                return False
        return True


class ParameterState(dict):
    """``optimizer.state[p]``: the rule's buffers by name, and ``"step"``, read from the
    device step counts of the unit that updates ``p`` (a host read, like torch's tensor
    step)."""

    def __init__(self, optimizer, p):
        super().__init__()
        self._optimizer = weakref.ref(optimizer)
        self._param = weakref.ref(p)

    def __getitem__(self, key):
        if key == "step":
            return self._optimizer()._step_of(self._param())
        return super().__getitem__(key)

    def __contains__(self, key):
        return key == "step" or super().__contains__(key)


@functools.lru_cache(maxsize=None)
def _smallest_normal(dtype):
    """The dtype's smallest normal number as a float (``np.finfo`` takes a microsecond a
    call, of a step's Python around its kernel)."""
    return float(np.finfo(dtype).tiny)


def mark_written(params):
    """Count the optimizer's write into each parameter (``engine.autograd``'s version
    counters, one increment per parameter): a graph retained across the step that saved one
    refuses its next backward with torch's error instead of using the updated values."""
    for p in params:
        if p._requires_grad:   # a frozen one is not written
            p._version_counter.value += 1


def whole_flat_buffer(params):
    """The FlatBuffer whose parameters are exactly ``params`` (any order), else None."""
    buffer = shared_flat_buffer(params)
    if buffer is None or len(buffer.params) != len(params):
        return None
    return buffer   # same length, all in it, no duplicates (add_param_group): the same set


def check_non_negative(optimizer, name, value):
    """Raise ValueError naming ``name`` unless ``value`` is a real number >= 0."""
    if not isinstance(value, (int, float, np.floating, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{optimizer}: {name} must be a number, got {value!r}")
    if not value >= 0:   # also catches NaN
        raise ValueError(f"{optimizer}: invalid {name}: {value} (must be >= 0)")
