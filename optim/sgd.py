"""Stochastic gradient descent with momentum, dampening, Nesterov and L2 weight decay."""
import math

import numpy as np

from ops.element_kernel import element_kernel
from ops.step_counter import BUFFER_UPDATES, SKIPPED
from optim.optimizer import Optimizer, check_non_negative


def _sgd_element(i, param, grad, momentum_buffer, counts, hyper, tiny):
    # hyper: [lr, momentum, dampening, weight_decay, nesterov]; the momentum buffer starts
    # from the first gradient it sees (torch's clone), so the element reads whether this is
    # that step. float64 arithmetic whatever the storage dtype; one rounding per stored value
    lr, momentum, dampening, weight_decay = hyper[0], hyper[1], hyper[2], hyper[3]
    nesterov, first_step = hyper[4] != 0.0, counts[BUFFER_UPDATES] == 1
    d_p = float(grad[i]) + weight_decay * float(param[i])
    if momentum != 0.0:
        if first_step:
            buf = d_p
        else:
            buf = momentum * float(momentum_buffer[i]) + (1.0 - dampening) * d_p
        if abs(buf) < tiny:   # a subnormal buffer (a gradient stuck at 0): see optim.adam
            buf = 0.0
        momentum_buffer[i] = buf
        buf = float(momentum_buffer[i])   # continue from the stored (rounded) buffer, as torch
        if nesterov:
            d_p = d_p + momentum * buf
        else:
            d_p = buf
    param[i] = float(param[i]) - lr * d_p


SGD_UPDATE = element_kernel("sgd", _sgd_element, skip_if=("counts", SKIPPED))
sgd_cpu, sgd_cuda = SGD_UPDATE.cpu.__wrapped__, SGD_UPDATE.cuda   # the compiled kernels, by name


class SGD(Optimizer):
    r"""Stochastic gradient descent, as ``torch.optim.SGD``.

    For each parameter :math:`p` with gradient :math:`g`::

        g = g + weight_decay * p                        # L2 penalty, when weight_decay != 0
        if momentum != 0:
            b = g                               the first time momentum is used (no b yet)
            b = momentum * b + (1 - dampening) * g   otherwise
            g = g + momentum * b                if nesterov
            g = b                               otherwise
        p = p - lr * g

    The momentum buffer ``b`` is made when a step first runs with ``momentum != 0`` (also
    when momentum is turned on through ``param_groups`` after earlier steps) and kept when
    momentum is set back to 0, as in torch; a saved state with or without it loads either
    way. Arithmetic is float64 inside the kernel, stored in the parameter's dtype; a buffer
    value below the dtype's smallest normal number is stored as 0 (see ``optim.adam``). The
    kernel reads lr and the other hyper-parameters from a device array the step syncs from
    ``param_groups``, and whether the buffer is new from the device step counts.

    Args:
        params: tensors with ``requires_grad=True``, or a list of param-group dicts.
        lr: learning rate (>= 0).
        momentum: momentum factor (>= 0).
        dampening: dampening of the momentum (>= 0); must be 0 with ``nesterov``.
        weight_decay: L2 penalty added to the gradient (>= 0).
        nesterov: Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
        skip_nonfinite: skip (and count in ``skipped_steps``, with a warning) a step whose
            gradients hold a NaN or Inf. Costs a check kernel and a device sync per step.
    """

    lazy_state = True   # the momentum buffer may start at any step

    def __init__(self, params, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, skip_nonfinite=False):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults, skip_nonfinite)

    def _check_group(self, group):
        for name in ("lr", "momentum", "dampening", "weight_decay"):
            check_non_negative("SGD", name, group[name])
        if not isinstance(group["nesterov"], bool):
            raise TypeError(f"SGD: nesterov must be True or False, got {group['nesterov']!r}")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(f"SGD: nesterov=True requires momentum > 0 and dampening = 0, got "
                             f"momentum={group['momentum']}, dampening={group['dampening']}")
        if not math.isfinite(group["lr"]):
            raise ValueError(f"SGD: invalid lr: {group['lr']} (must be finite)")

    def _state_names(self, group):
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    update_kernel = SGD_UPDATE

    def _hyper_values(self, group):
        return (group["lr"], group["momentum"], group["dampening"], group["weight_decay"],
                group["nesterov"])

    def _update_args(self, param, grad, buffers, counts, hyper):
        momentum_buffer = buffers.get("momentum_buffer", param)   # untouched without momentum
        return (param, grad, momentum_buffer, counts, hyper,
                float(np.finfo(momentum_buffer.dtype).tiny))
