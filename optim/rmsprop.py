"""RMSprop, as ``torch.optim.RMSprop``: one element function, made a kernel by
``ops.element_kernel``."""
import math

import numpy as np

from ops.element_kernel import element_kernel
from ops.step_counter import SKIPPED
from optim.optimizer import Optimizer, check_non_negative


def _rmsprop_element(i, param, grad, square_avg, momentum_buffer, grad_avg, counts, hyper,
                     tiny):
    # hyper: [lr, alpha, eps, weight_decay, momentum, centered]; float64 arithmetic whatever
    # the storage dtype (as optim.sgd), one rounding per stored value. The state starts at
    # zero, as torch's; momentum_buffer and grad_avg are placeholders (param) that are never
    # touched unless momentum > 0 and centered ask for them.
    lr, alpha, eps, weight_decay, momentum = hyper[0], hyper[1], hyper[2], hyper[3], hyper[4]
    g = float(grad[i]) + weight_decay * float(param[i])
    v = alpha * float(square_avg[i]) + (1.0 - alpha) * g * g
    if v < tiny:   # a gradient stuck at 0 decays v into subnormals: see optim.adam
        v = 0.0
    square_avg[i] = v
    v = float(square_avg[i])   # continue from the stored (rounded) value, as torch
    if hyper[5] != 0.0:   # centered: subtract the squared mean gradient
        mean = float(grad_avg[i]) + (1.0 - alpha) * (g - float(grad_avg[i]))   # torch's lerp
        if abs(mean) < tiny:
            mean = 0.0
        grad_avg[i] = mean
        mean = float(grad_avg[i])
        v = v - mean * mean
    avg = math.sqrt(v) + eps
    if momentum > 0.0:
        buf = momentum * float(momentum_buffer[i]) + g / avg
        if abs(buf) < tiny:
            buf = 0.0
        momentum_buffer[i] = buf
        param[i] = float(param[i]) - lr * float(momentum_buffer[i])
    else:
        param[i] = float(param[i]) - lr * (g / avg)


RMSPROP_UPDATE = element_kernel("rmsprop", _rmsprop_element, skip_if=("counts", SKIPPED),
                                flush_subnormals=True)


class RMSprop(Optimizer):
    r"""RMSprop, as ``torch.optim.RMSprop``.

    For each parameter :math:`p` with gradient :math:`g`, with :math:`v_0 = 0` (and
    :math:`\bar g_0 = b_0 = 0`)::

        g = g + weight_decay * p                        # L2 penalty, when weight_decay != 0
        v = alpha * v + (1 - alpha) * g * g
        if centered:
            gbar = gbar + (1 - alpha) * (g - gbar)      # torch's lerp
            avg = sqrt(v - gbar * gbar) + eps
        else:
            avg = sqrt(v) + eps
        if momentum > 0:
            b = momentum * b + g / avg
            p = p - lr * b
        else:
            p = p - lr * g / avg

    State: ``square_avg`` (v), ``momentum_buffer`` (b, when momentum > 0) and ``grad_avg``
    (gbar, when centered), torch's names; a buffer named only after earlier steps (momentum
    turned on through ``param_groups``) starts at zero. Arithmetic is float64 inside the
    kernel, stored in the parameter's dtype; a state value below the dtype's smallest normal
    number is stored as 0 (see ``optim.adam``). The kernel reads lr and the other
    hyper-parameters from a device array the step syncs from ``param_groups``, so a captured
    step replays with the current ones.

    Args:
        params: tensors with ``requires_grad=True``, or a list of param-group dicts.
        lr: learning rate (>= 0, finite).
        alpha: smoothing constant of the squared-gradient average, in [0, 1].
        eps: added to the denominator (>= 0).
        weight_decay: L2 penalty added to the gradient (>= 0).
        momentum: momentum factor (>= 0).
        centered: divide by the estimated variance of the gradient, not its second moment.
        skip_nonfinite: skip (and count in ``skipped_steps``, with a warning) a step whose
            gradients hold a NaN or Inf. Costs a check kernel and a device sync per step.
    """

    lazy_state = True   # momentum_buffer and grad_avg may start at any step

    def __init__(self, params, lr=0.01, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0,
                 centered=False, skip_nonfinite=False):
        defaults = dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                        momentum=momentum, centered=centered)
        super().__init__(params, defaults, skip_nonfinite)

    def _check_group(self, group):
        for name in ("lr", "alpha", "eps", "weight_decay", "momentum"):
            check_non_negative(self._name, name, group[name])
        if not math.isfinite(group["lr"]):
            raise ValueError(f"{self._name}: invalid lr: {group['lr']} (must be finite)")
        if not group["alpha"] <= 1:
            raise ValueError(f"{self._name}: invalid alpha: {group['alpha']} (must be in [0, 1])")
        if not isinstance(group["centered"], bool):
            raise TypeError(f"{self._name}: centered must be True or False, got "
                            f"{group['centered']!r}")

    def _state_names(self, group):
        return (("square_avg",) + (("momentum_buffer",) if group["momentum"] > 0 else ())
                + (("grad_avg",) if group["centered"] else ()))

    update_kernel = RMSPROP_UPDATE

    def _hyper_values(self, group):
        return (group["lr"], group["alpha"], group["eps"], group["weight_decay"],
                group["momentum"], group["centered"])

    def _update_args(self, param, grad, buffers, counts, hyper):
        return (param, grad, buffers["square_avg"], buffers.get("momentum_buffer", param),
                buffers.get("grad_avg", param), counts, hyper, float(np.finfo(param.dtype).tiny))
