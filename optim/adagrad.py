"""Adagrad, as ``torch.optim.Adagrad``: a rule (``optim.rule``) and its declaration."""
import math

from optim.optimizer import Optimizer, check_non_negative


def _adagrad_rule(param, grad, sum, clr, weight_decay, initial_accumulator_value, eps,
                  first_step):
    # in the parameter's dtype, as torch. The flat state starts at zero, torch's sum at
    # initial_accumulator_value: the sum's first update starts from that value instead of the
    # stored one. The sum never decreases, so no subnormal decay (optim.adam) to flush.
    g = grad + weight_decay * param
    start = initial_accumulator_value if first_step != 0 else sum
    s = start + g * g
    return param - clr * g / (math.sqrt(s) + eps), s   # torch's addcdiv: (value * g) / std


def clr(lr, lr_decay, t):
    return lr / (1.0 + (t - 1.0) * lr_decay)


class Adagrad(Optimizer):
    r"""Adagrad, as ``torch.optim.Adagrad`` (``maximize`` is not supported).

    For each parameter :math:`p` with gradient :math:`g` at step :math:`t` (from 1), with
    :math:`s_0` = ``initial_accumulator_value``::

        g = g + weight_decay * p                        # L2 penalty, when weight_decay != 0
        clr = lr / (1 + (t - 1) * lr_decay)
        s = s + g * g
        p = p - clr * g / (sqrt(s) + eps)

    State: ``sum`` (s), torch's name. Arithmetic is in the parameter's dtype, as torch's
    (``clr`` in float64, then cast). The kernel reads t from the device step counts, and lr and
    the other hyper-parameters from a device array the step syncs from ``param_groups``, so a
    captured step replays with its own t and the current lr. ``initial_accumulator_value`` is
    read at the first step (torch fills the sum with it when the optimizer is made).

    Args:
        params: tensors with ``requires_grad=True``, or a list of param-group dicts.
        lr: learning rate (>= 0, finite).
        lr_decay: learning-rate decay per step (>= 0).
        weight_decay: L2 penalty added to the gradient (>= 0).
        initial_accumulator_value: the sum's start (>= 0).
        eps: added to the denominator (>= 0).
        skip_nonfinite: skip (and count in ``skipped_steps``, with a warning) a step whose
            gradients hold a NaN or Inf. Costs a check kernel and a device sync per step.
    """

    rule = _adagrad_rule
    hyper = ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")
    buffers = ("sum",)
    derived = (clr,)

    def __init__(self, params, lr=0.01, lr_decay=0, weight_decay=0, initial_accumulator_value=0,
                 eps=1e-10, skip_nonfinite=False):
        defaults = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, eps=eps)
        super().__init__(params, defaults, skip_nonfinite)

    def _check_group(self, group):
        for name in ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"):
            check_non_negative(self._name, name, group[name])
            if not math.isfinite(group[name]):
                raise ValueError(f"{self._name}: invalid {name}: {group[name]} (must be finite)")
