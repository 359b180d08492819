"""RMSprop, as ``torch.optim.RMSprop``: a rule (``optim.rule``) and its declaration."""
import math

from optim.optimizer import Optimizer, check_non_negative


def _rmsprop_rule(param, grad, square_avg, momentum_buffer, grad_avg, lr, alpha,
                  one_minus_alpha, eps, weight_decay, momentum, centered, tiny):
    # in the parameter's dtype, as torch; the state starts at zero, as torch's. A buffer the
    # group does not keep (momentum_buffer without momentum, grad_avg uncentered) reads 0 and
    # is not stored
    g = grad + weight_decay * param
    v = alpha * square_avg + one_minus_alpha * g * g
    if v < tiny:   # a gradient stuck at 0 decays v into subnormals: see optim.adam
        v = tiny - tiny
    mean = grad_avg
    centered_v = v
    if centered != 0:   # subtract the squared mean gradient
        mean = grad_avg + one_minus_alpha * (g - grad_avg)   # torch's lerp
        if abs(mean) < tiny:
            mean = tiny - tiny
        centered_v = v - mean * mean
    avg = math.sqrt(centered_v) + eps
    buf = momentum_buffer
    if momentum > 0:
        buf = momentum * momentum_buffer + g / avg
        if abs(buf) < tiny:
            buf = tiny - tiny
        return param - lr * buf, v, buf, mean
    return param - lr * (g / avg), v, buf, mean


def one_minus_alpha(alpha):
    return 1.0 - alpha


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
    turned on through ``param_groups``) starts at zero. Arithmetic is in the parameter's
    dtype, as torch's; a state value below the dtype's smallest normal
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

    rule = _rmsprop_rule
    hyper = ("lr", "alpha", "eps", "weight_decay", "momentum", "centered")
    buffers = ("square_avg", "momentum_buffer", "grad_avg")
    derived = (one_minus_alpha,)
    flush_subnormals = True
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
