"""Learning-rate schedules: they write ``"lr"`` into the optimizer's ``param_groups``.

As in ``torch.optim.lr_scheduler``: building a scheduler records each group's
``"initial_lr"`` and sets epoch 0; every ``step()`` moves one epoch on and writes the new
rates. The rates are closed-form functions of the epoch (torch's chainable forms give the
same values up to rounding), so a scheduler's whole state is ``last_epoch`` and
``base_lrs``. The optimizer's kernels take ``lr`` as an argument: a new rate never
recompiles anything. A plain callable works too: ``LambdaLR(opt, lambda epoch: ...)``,
or write ``group["lr"]`` yourself.
"""
import math

from optim.optimizer import Optimizer


class LRScheduler:
    def __init__(self, optimizer, last_epoch=-1):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(self).__name__}: {type(optimizer).__name__} is not an optim.Optimizer")
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
        self.step()

    def lr_at(self, group_index, base_lr, epoch):
        """The learning rate of group ``group_index`` (initial rate ``base_lr``) at ``epoch``."""
        raise NotImplementedError

    def step(self):
        """Move one epoch on and write every group's ``"lr"``."""
        self.last_epoch += 1
        self._write_rates()

    def _write_rates(self):
        for index, (group, base_lr) in enumerate(zip(self.optimizer.param_groups, self.base_lrs)):
            group["lr"] = self.lr_at(index, base_lr, self.last_epoch)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def get_last_lr(self):
        """The rates written by the last ``step()``."""
        return list(self._last_lr)

    def state_dict(self):
        """Everything but the optimizer (and, for LambdaLR, the function)."""
        return {key: value for key, value in self.__dict__.items()
                if key not in ("optimizer", "lr_lambdas")}

    def load_state_dict(self, state_dict):
        """Restore the epoch and rewrite the optimizer's rates for it (closed forms need no
        history), so the order of loading optimizer and scheduler states does not matter."""
        self.__dict__.update(state_dict)
        self._write_rates()


class StepLR(LRScheduler):
    """``lr = initial_lr * gamma ** (epoch // step_size)``: decay by ``gamma`` every
    ``step_size`` epochs."""

    def __init__(self, optimizer, step_size, gamma=0.1, last_epoch=-1):
        if not isinstance(step_size, int) or isinstance(step_size, bool) or step_size < 1:
            raise ValueError(f"StepLR: invalid step_size: {step_size!r} (must be an integer >= 1)")
        if not gamma >= 0:
            raise ValueError(f"StepLR: invalid gamma: {gamma} (must be >= 0)")
        self.step_size, self.gamma = step_size, float(gamma)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, group_index, base_lr, epoch):
        return base_lr * self.gamma ** (epoch // self.step_size)


class CosineAnnealingLR(LRScheduler):
    """``lr = eta_min + (initial_lr - eta_min) * (1 + cos(pi * epoch / T_max)) / 2``: half a
    cosine from ``initial_lr`` down to ``eta_min`` over ``T_max`` epochs (it rises again
    after ``T_max``, as torch's does; no restarts)."""

    def __init__(self, optimizer, T_max, eta_min=0.0, last_epoch=-1):
        if not isinstance(T_max, int) or isinstance(T_max, bool) or T_max < 1:
            raise ValueError(f"CosineAnnealingLR: invalid T_max: {T_max!r} (must be an integer >= 1)")
        if not eta_min >= 0:
            raise ValueError(f"CosineAnnealingLR: invalid eta_min: {eta_min} (must be >= 0)")
        self.T_max, self.eta_min = T_max, float(eta_min)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, group_index, base_lr, epoch):
        return self.eta_min + (base_lr - self.eta_min) * (1 + math.cos(math.pi * epoch / self.T_max)) / 2


class LambdaLR(LRScheduler):
    """``lr = initial_lr * lr_lambda(epoch)``; ``lr_lambda`` is one callable or one per group."""

    def __init__(self, optimizer, lr_lambda, last_epoch=-1):
        groups = optimizer.param_groups if isinstance(optimizer, Optimizer) else []
        lambdas = list(lr_lambda) if isinstance(lr_lambda, (list, tuple)) else [lr_lambda] * len(groups)
        if len(lambdas) != len(groups):
            raise ValueError(f"LambdaLR: got {len(lambdas)} lr_lambda(s) for {len(groups)} param groups")
        for fn in lambdas:
            if not callable(fn):
                raise TypeError(f"LambdaLR: lr_lambda must be callable, got {fn!r}")
        self.lr_lambdas = lambdas
        super().__init__(optimizer, last_epoch)

    def lr_at(self, group_index, base_lr, epoch):
        return base_lr * self.lr_lambdas[group_index](epoch)
