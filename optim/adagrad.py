"""Adagrad, as ``torch.optim.Adagrad``: one element function, made a kernel by
``ops.element_kernel``."""
import math

from ops.element_kernel import element_kernel
from ops.step_counter import BUFFER_UPDATES, SKIPPED, T
from optim.optimizer import Optimizer, check_non_negative


def _adagrad_element(i, param, grad, state_sum, counts, hyper):
    # hyper: [lr, lr_decay, weight_decay, initial_accumulator_value, eps]; float64 arithmetic
    # whatever the storage dtype (as optim.sgd), one rounding per stored value. The flat
    # state starts at zero, torch's sum at initial_accumulator_value: the sum's first update
    # starts from that value instead of the stored one. The sum never decreases, so no
    # subnormal decay (optim.adam) to flush.
    lr, lr_decay, weight_decay, eps = hyper[0], hyper[1], hyper[2], hyper[4]
    g = float(grad[i]) + weight_decay * float(param[i])
    start = hyper[3] if counts[BUFFER_UPDATES] == 1 else float(state_sum[i])
    state_sum[i] = start + g * g
    std = math.sqrt(float(state_sum[i])) + eps   # from the stored (rounded) sum, as torch
    clr = lr / (1.0 + (float(counts[T]) - 1.0) * lr_decay)
    param[i] = float(param[i]) - clr * g / std   # torch's addcdiv: (value * g) / std


ADAGRAD_UPDATE = element_kernel("adagrad", _adagrad_element, skip_if=("counts", SKIPPED))


class Adagrad(Optimizer):
    r"""Adagrad, as ``torch.optim.Adagrad`` (``maximize`` is not supported).

    For each parameter :math:`p` with gradient :math:`g` at step :math:`t` (from 1), with
    :math:`s_0` = ``initial_accumulator_value``::

        g = g + weight_decay * p                        # L2 penalty, when weight_decay != 0
        clr = lr / (1 + (t - 1) * lr_decay)
        s = s + g * g
        p = p - clr * g / (sqrt(s) + eps)

    State: ``sum`` (s), torch's name. Arithmetic is float64 inside the kernel, stored in the
    parameter's dtype. The kernel reads t from the device step counts, and lr and the other
    hyper-parameters from a device array the step syncs from ``param_groups``, so a captured
    step replays with its own t and the current lr. ``initial_accumulator_value`` is read
    at the first step (torch fills the sum with it when the optimizer is made).

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

    def _state_names(self, group):
        return ("sum",)

    update_kernel = ADAGRAD_UPDATE

    def _hyper_values(self, group):
        return (group["lr"], group["lr_decay"], group["weight_decay"],
                group["initial_accumulator_value"], group["eps"])

    def _update_args(self, param, grad, buffers, counts, hyper):
        return (param, grad, buffers["sum"], counts, hyper)
