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

The optimizer's kernels take ``lr`` as an argument: a new rate never recompiles anything. A
plain callable works too (``LambdaLR(opt, lambda epoch: ...)``), or write ``group["lr"]``.
"""
import math

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
