"""Learning-rate schedules: they write ``"lr"`` into the optimizer's ``param_groups``.

As in ``torch.optim.lr_scheduler`` (checked against torch 2.13): building a scheduler
records each group's ``"initial_lr"`` (``base_lrs``; kept when a group already has one),
moves ``last_epoch`` from -1 to 0 and writes that epoch's rates; every ``step()`` moves one
epoch on and writes the next rates. ``StepLR`` and ``CosineAnnealingLR`` are chainable: each
rate is computed from the group's *current* ``"lr"``, so a rate set by hand or by a second
scheduler on the same optimizer carries on (set lr to 0.01, take two ``StepLR(step_size=2,
gamma=0.5)`` steps: 0.005). ``LambdaLR`` is a closed form of ``base_lrs``, as torch's.

Resuming: the optimizer's state holds the rates, and the schedule goes on from them, bit
for bit like a run never interrupted. Load the optimizer's state, then either build the
scheduler fresh and ``load_state_dict`` its saved state (which writes no rate, as in torch),
or rebuild it with ``last_epoch=k`` (it needs the ``"initial_lr"`` the optimizer's state
carries; its first epoch is k + 1). As in torch, the constructor's step keeps the loaded
rates for ``CosineAnnealingLR``, while ``StepLR`` decays them when k + 1 is a multiple of
``step_size`` (torch's advice: build the scheduler before loading the optimizer's state).
A recursive cosine resumed with another ``T_max`` goes on from the loaded rate; a schedule
that must be a function of the epoch alone is a ``LambdaLR`` (``engine.train`` does that).

Two schedules are not functions of the epoch count alone, as in torch: ``OneCycleLR`` is
stepped once per *batch* (and cycles the momentum, or Adam's beta1, the other way), and
``ReduceLROnPlateau`` is stepped with the monitored value (``scheduler.step(val_loss)``).

The optimizer's kernels take ``lr`` as an argument: a new rate never recompiles anything. A
plain callable works too (``LambdaLR(opt, lambda epoch: ...)``), or write ``group["lr"]``.
"""
import math
import numbers

from optim.optimizer import Optimizer


class LRScheduler:
    def __init__(self, optimizer, last_epoch=-1):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(self).__name__}: {type(optimizer).__name__} is not an "
                            "optim.Optimizer")
        self.optimizer = optimizer
        if last_epoch == -1:
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
        else:
            for i, group in enumerate(optimizer.param_groups):
                if "initial_lr" not in group:
                    raise KeyError(f"{type(self).__name__}: param group {i} has no 'initial_lr'; "
                                   "resuming with last_epoch != -1 needs the optimizer state "
                                   "that a scheduler wrote")
        self.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._step_count = 0
        self._advance(initial=True)

    def rates(self, initial):
        """The rates of epoch ``last_epoch`` (just advanced), one per group, from the groups'
        current ``"lr"``; ``initial`` is True for the step the constructor takes."""
        raise NotImplementedError

    def step(self):
        """Move one epoch on and write every group's ``"lr"``."""
        self._advance(initial=False)

    def _advance(self, initial):
        self._step_count += 1
        self.last_epoch += 1
        for group, lr in zip(self.optimizer.param_groups, self.rates(initial)):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def get_last_lr(self):
        """The rates written by the last step (the constructor's included)."""
        return list(self._last_lr)

    def state_dict(self):
        """Everything but the optimizer (and, for LambdaLR, the function)."""
        return {key: value for key, value in self.__dict__.items()
                if key not in ("optimizer", "lr_lambdas")}

    def load_state_dict(self, state_dict):
        """Restore the epoch and the rest of ``state_dict``; the optimizer's rates are left as
        they are (they come with the optimizer's own state)."""
        self.__dict__.update(state_dict)

    def _current_rates(self):
        return [group["lr"] for group in self.optimizer.param_groups]


class StepLR(LRScheduler):
    """Decay each group's current rate by ``gamma`` at every epoch that is a non-zero
    multiple of ``step_size`` (from a constant start: ``initial_lr * gamma ** (epoch //
    step_size)``)."""

    def __init__(self, optimizer, step_size, gamma=0.1, last_epoch=-1):
        if not isinstance(step_size, int) or isinstance(step_size, bool) or step_size < 1:
            raise ValueError(f"StepLR: invalid step_size: {step_size!r} (must be an integer >= 1)")
        if not gamma >= 0:
            raise ValueError(f"StepLR: invalid gamma: {gamma} (must be >= 0)")
        self.step_size, self.gamma = step_size, float(gamma)
        super().__init__(optimizer, last_epoch)

    def rates(self, initial):
        if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:
            return self._current_rates()
        return [lr * self.gamma for lr in self._current_rates()]


class CosineAnnealingLR(LRScheduler):
    """Half a cosine from ``initial_lr`` down to ``eta_min`` over ``T_max`` epochs (it rises
    again after ``T_max``, as torch's does; no restarts), in torch's recursive form::

        lr_e = eta_min + (lr_{e-1} - eta_min) * (1 + cos(pi e / T)) / (1 + cos(pi (e-1) / T))
        lr_e = lr_{e-1} + (initial_lr - eta_min) * (1 - cos(pi / T)) / 2
                                               when (e - 1 - T) % (2 T) == 0

    with ``T = T_max``. From a constant start this is ``eta_min + (initial_lr - eta_min) *
    (1 + cos(pi e / T)) / 2``. The constructor's step keeps the current rates."""

    def __init__(self, optimizer, T_max, eta_min=0.0, last_epoch=-1):
        if not isinstance(T_max, int) or isinstance(T_max, bool) or T_max < 1:
            raise ValueError(f"CosineAnnealingLR: invalid T_max: {T_max!r} "
                             "(must be an integer >= 1)")
        if not eta_min >= 0:
            raise ValueError(f"CosineAnnealingLR: invalid eta_min: {eta_min} (must be >= 0)")
        self.T_max, self.eta_min = T_max, float(eta_min)
        super().__init__(optimizer, last_epoch)

    def rates(self, initial):
        epoch, period, eta_min = self.last_epoch, self.T_max, self.eta_min
        if initial:
            return self._current_rates()
        if (epoch - 1 - period) % (2 * period) == 0:   # the ratio below would divide by 0
            return [lr + (base_lr - eta_min) * (1 - math.cos(math.pi / period)) / 2
                    for lr, base_lr in zip(self._current_rates(), self.base_lrs)]
        ratio = ((1 + math.cos(math.pi * epoch / period))
                 / (1 + math.cos(math.pi * (epoch - 1) / period)))
        return [ratio * (lr - eta_min) + eta_min for lr in self._current_rates()]


class LambdaLR(LRScheduler):
    """``lr = initial_lr * lr_lambda(epoch)``; ``lr_lambda`` is one callable or one per group.
    A closed form (not chainable), as torch's."""

    def __init__(self, optimizer, lr_lambda, last_epoch=-1):
        groups = optimizer.param_groups if isinstance(optimizer, Optimizer) else []
        lambdas = (list(lr_lambda) if isinstance(lr_lambda, (list, tuple))
                   else [lr_lambda] * len(groups))
        if len(lambdas) != len(groups):
            raise ValueError(f"LambdaLR: got {len(lambdas)} lr_lambda(s) for {len(groups)} "
                             "param groups")
        for fn in lambdas:
            if not callable(fn):
                raise TypeError(f"LambdaLR: lr_lambda must be callable, got {fn!r}")
        self.lr_lambdas = lambdas
        super().__init__(optimizer, last_epoch)

    def rates(self, initial):
        return [base_lr * fn(self.last_epoch)
                for fn, base_lr in zip(self.lr_lambdas, self.base_lrs)]


def _per_group(name, optimizer, value):
    """``value`` as one number per parameter group (a list or tuple gives them one each)."""
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"{name} has {len(value)} values for {groups} param groups")
        return [float(v) for v in value]
    return [float(value)] * groups


class OneCycleLR(LRScheduler):
    """The 1cycle policy (Smith and Topin), stepped once per batch, as torch's::

        warm-up:  initial_lr = max_lr / div_factor  ->  max_lr      over pct_start of the steps
        anneal:   max_lr  ->  min_lr = initial_lr / final_div_factor  over the rest

    each phase a half cosine (``anneal_strategy="cos"``) or a line (``"linear"``) in the phase's
    fraction ``(step - start) / (end - start)``. ``three_phase=True`` comes back down to
    ``initial_lr`` in a second phase as long as the first, then anneals to ``min_lr``. With
    ``cycle_momentum`` the momentum (SGD, RMSprop) or Adam's beta1 moves the opposite way,
    ``max_momentum -> base_momentum -> max_momentum``. ``total_steps``, or ``epochs`` and
    ``steps_per_epoch``, is the number of ``step()`` calls the schedule has; one more is an
    error. The construction writes step 0's rate (``initial_lr``)."""

    per_batch = True   # callbacks.LearningRateScheduler steps it after every batch

    def __init__(self, optimizer, max_lr, total_steps=None, epochs=None, steps_per_epoch=None,
                 pct_start=0.3, anneal_strategy="cos", cycle_momentum=True, base_momentum=0.85,
                 max_momentum=0.95, div_factor=25.0, final_div_factor=1e4, three_phase=False,
                 last_epoch=-1):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"OneCycleLR: {type(optimizer).__name__} is not an optim.Optimizer")
        self.total_steps = self._checked_total(total_steps, epochs, steps_per_epoch)
        if not (isinstance(pct_start, numbers.Real) and 0 <= pct_start <= 1):
            raise ValueError(f"OneCycleLR: pct_start must be a number in [0, 1], got {pct_start!r}")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"OneCycleLR: anneal_strategy must be 'cos' or 'linear', "
                             f"got {anneal_strategy!r}")
        if not (div_factor > 0 and final_div_factor > 0):
            raise ValueError(f"OneCycleLR: div_factor and final_div_factor must be > 0, got "
                             f"{div_factor} and {final_div_factor}")
        self.anneal_strategy, self.three_phase = anneal_strategy, bool(three_phase)
        warm_end = float(pct_start * self.total_steps) - 1
        # (last step of the phase, its start and end rate, its start and end momentum)
        self.phases = ([(warm_end, "initial_lr", "max_lr", "max_momentum", "base_momentum"),
                        (float(2 * pct_start * self.total_steps) - 2, "max_lr", "initial_lr",
                         "base_momentum", "max_momentum"),
                        (self.total_steps - 1, "initial_lr", "min_lr", "max_momentum",
                         "max_momentum")] if three_phase else
                       [(warm_end, "initial_lr", "max_lr", "max_momentum", "base_momentum"),
                        (self.total_steps - 1, "max_lr", "min_lr", "base_momentum",
                         "max_momentum")])
        if last_epoch == -1:
            for group, top in zip(optimizer.param_groups, _per_group("max_lr", optimizer, max_lr)):
                group["initial_lr"] = top / div_factor
                group["max_lr"] = top
                group["min_lr"] = group["initial_lr"] / final_div_factor
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum:
            defaults = optimizer.defaults
            if "momentum" not in defaults and "betas" not in defaults:
                raise ValueError(f"OneCycleLR: {type(optimizer).__name__} has no momentum or "
                                 "beta1 to cycle; pass cycle_momentum=False")
            self.use_beta1 = "betas" in defaults
            if last_epoch == -1:
                for group, top, base in zip(optimizer.param_groups,
                                            _per_group("max_momentum", optimizer, max_momentum),
                                            _per_group("base_momentum", optimizer, base_momentum)):
                    self._set_momentum(group, top)
                    group["max_momentum"], group["base_momentum"] = top, base
        super().__init__(optimizer, last_epoch)

    @staticmethod
    def _checked_total(total_steps, epochs, steps_per_epoch):
        def positive_int(value):
            return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0
        if total_steps is not None:
            if not positive_int(total_steps):
                raise ValueError(f"OneCycleLR: total_steps must be an integer > 0, got {total_steps!r}")
            return int(total_steps)
        if epochs is None or steps_per_epoch is None:
            raise ValueError("OneCycleLR: give total_steps, or epochs and steps_per_epoch")
        if not (positive_int(epochs) and positive_int(steps_per_epoch)):
            raise ValueError(f"OneCycleLR: epochs and steps_per_epoch must be integers > 0, "
                             f"got {epochs!r} and {steps_per_epoch!r}")
        return int(epochs) * int(steps_per_epoch)

    def _set_momentum(self, group, momentum):
        if self.use_beta1:
            group["betas"] = (momentum,) + tuple(group["betas"][1:])
        else:
            group["momentum"] = momentum

    def _anneal(self, start, end, fraction):
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (math.cos(math.pi * fraction) + 1)
        return (end - start) * fraction + start

    def rates(self, initial):
        step = self.last_epoch
        if step > self.total_steps:
            raise ValueError(f"OneCycleLR: stepped {step} times, but the schedule has "
                             f"total_steps={self.total_steps}")
        rates = []
        for group in self.optimizer.param_groups:
            start = 0.0
            for index, (end, lr_from, lr_to, m_from, m_to) in enumerate(self.phases):
                if step <= end or index == len(self.phases) - 1:
                    fraction = (step - start) / (end - start)
                    rates.append(self._anneal(group[lr_from], group[lr_to], fraction))
                    if self.cycle_momentum:
                        self._set_momentum(group, self._anneal(group[m_from], group[m_to], fraction))
                    break
                start = end
        return rates


class ReduceLROnPlateau:
    """Multiply every group's rate by ``factor`` once the monitored value has not improved
    for more than ``patience`` calls of ``step(value)``, as torch's: an improvement is
    ``value < best * (1 - threshold)`` (mode "min", threshold_mode "rel"), ``value < best -
    threshold`` ("abs"), and the mirror images for mode "max". After a reduction the next
    ``cooldown`` calls count no bad epoch. A rate never goes below ``min_lr`` (one value, or
    one per group), and a change smaller than ``eps`` is not made."""

    needs_metric = True   # callbacks.LearningRateScheduler steps it with a record's value

    def __init__(self, optimizer, mode="min", factor=0.1, patience=10, threshold=1e-4,
                 threshold_mode="rel", cooldown=0, min_lr=0.0, eps=1e-8):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"ReduceLROnPlateau: {type(optimizer).__name__} is not an "
                            "optim.Optimizer")
        if not 0 <= factor < 1:
            raise ValueError(f"ReduceLROnPlateau: factor must be in [0, 1), got {factor!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"ReduceLROnPlateau: mode must be 'min' or 'max', got {mode!r}")
        if threshold_mode not in ("rel", "abs"):
            raise ValueError(f"ReduceLROnPlateau: threshold_mode must be 'rel' or 'abs', "
                             f"got {threshold_mode!r}")
        for name, value in (("patience", patience), ("cooldown", cooldown)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ReduceLROnPlateau: {name} must be an integer >= 0, got {value!r}")
        self.optimizer = optimizer
        self.mode, self.factor, self.patience = mode, float(factor), int(patience)
        self.threshold, self.threshold_mode = float(threshold), threshold_mode
        self.cooldown, self.eps = int(cooldown), float(eps)
        self.min_lrs = _per_group("min_lr", optimizer, min_lr)
        self.last_epoch = 0
        self.best = math.inf if mode == "min" else -math.inf
        self.num_bad_epochs = self.cooldown_counter = 0
        self._last_lr = [group["lr"] for group in optimizer.param_groups]

    def is_better(self, value, best):
        if self.mode == "min":
            return value < (best * (1.0 - self.threshold) if self.threshold_mode == "rel"
                            else best - self.threshold)
        return value > (best * (self.threshold + 1.0) if self.threshold_mode == "rel"
                        else best + self.threshold)

    def step(self, metrics):
        """Count one epoch with the monitored value ``metrics`` (a number)."""
        value = float(metrics)
        self.last_epoch += 1
        if self.is_better(value, self.best):
            self.best, self.num_bad_epochs = value, 0
        else:
            self.num_bad_epochs += 1
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0   # bad epochs in the cooldown do not count
        if self.num_bad_epochs > self.patience:
            for group, floor in zip(self.optimizer.param_groups, self.min_lrs):
                new_lr = max(group["lr"] * self.factor, floor)
                if group["lr"] - new_lr > self.eps:
                    group["lr"] = new_lr
            self.cooldown_counter, self.num_bad_epochs = self.cooldown, 0
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def get_last_lr(self):
        return list(self._last_lr)

    def state_dict(self):
        return {key: value for key, value in self.__dict__.items() if key != "optimizer"}

    def load_state_dict(self, state_dict):
        self.__dict__.update(state_dict)
