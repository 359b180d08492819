"""Stochastic gradient descent with momentum, dampening, Nesterov and L2 weight decay."""
import math

from optim.optimizer import Optimizer, check_non_negative


def _sgd_rule(param, grad, momentum_buffer, lr, momentum, one_minus_dampening, weight_decay,
              nesterov, first_step, tiny):
    # in the parameter's dtype, as torch; the momentum buffer starts from the first gradient
    # it sees (torch's clone), and is returned unchanged while momentum is 0
    d_p = grad + weight_decay * param
    buf = momentum_buffer
    if momentum != 0:
        if first_step != 0:
            buf = d_p
        else:
            buf = momentum * momentum_buffer + one_minus_dampening * d_p
        if abs(buf) < tiny:   # a subnormal buffer (a gradient stuck at 0): see optim.adam
            buf = tiny - tiny
        if nesterov != 0:
            d_p = d_p + momentum * buf
        else:
            d_p = buf
    return param - lr * d_p, buf


def one_minus_dampening(dampening):
    return 1.0 - dampening


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
    way. Arithmetic is in the parameter's dtype, as torch's (``1 - dampening`` in float64,
    then cast); a buffer value below the dtype's smallest normal number is stored as 0 (see
    ``optim.adam``). The kernel reads lr and the other hyper-parameters from a device array
    the step syncs from ``param_groups``, and whether the buffer is new from the device step
    counts.

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

    rule = _sgd_rule
    hyper = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
    buffers = ("momentum_buffer",)
    derived = (one_minus_dampening,)
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
        return self.buffers if group["momentum"] != 0 else ()
