"""Adamax (Adam with the infinity norm), as ``torch.optim.Adamax``: a rule and its
declaration."""
from optim.adam import check_betas, check_lr_eps_weight_decay, m_floor, one_minus_beta1
from optim.optimizer import Optimizer


def _adamax_rule(param, grad, exp_avg, exp_inf, one_minus_beta1, beta2, eps, weight_decay,
                 clr, tiny, m_floor):
    # in the parameter's dtype, as torch
    g = grad + weight_decay * param
    m = exp_avg + one_minus_beta1 * (g - exp_avg)   # torch's lerp
    decayed = beta2 * exp_inf
    bound = abs(g) + eps
    u = decayed if decayed >= bound else bound      # torch.maximum: a NaN gradient is kept
    if abs(m) < m_floor:   # subnormal state: see optim.adam
        m = m_floor - m_floor
    if u < tiny:
        u = tiny - tiny
    return param - clr * m / u, m, u               # torch's addcdiv: (value * m) / u


def clr(lr, beta1, t):
    return lr / (1.0 - beta1 ** t)


class Adamax(Optimizer):
    r"""Adamax, as ``torch.optim.Adamax``.

    For each parameter :math:`p` with gradient :math:`g` at step :math:`t` (from 1), with
    :math:`m_0 = u_0 = 0`::

        g = g + weight_decay * p                        # L2 penalty, when weight_decay != 0
        m = beta1 * m + (1 - beta1) * g                 # computed as m + (1 - beta1) * (g - m)
        u = max(beta2 * u, abs(g) + eps)
        p = p - lr / (1 - beta1**t) * m / u

    State: ``exp_avg`` (m) and ``exp_inf`` (u), torch's names. The arithmetic is in the
    parameter's dtype, ``lr / (1 - beta1**t)`` in float64, as torch's. m below the dtype's
    smallest normal number over ``1 - beta1``, and u below that number (``eps = 0`` and a
    gradient stuck at 0), are stored as 0 (see ``optim.adam``). The kernel reads t from the
    device step counts and the hyper-parameters from a device array the step syncs from
    ``param_groups``.

    Args:
        params: tensors with ``requires_grad=True``, or a list of param-group dicts.
        lr: learning rate (>= 0, finite).
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to ``abs(g)`` (>= 0).
        weight_decay: L2 penalty added to the gradient (>= 0).
        skip_nonfinite: skip (and count in ``skipped_steps``, with a warning) a step whose
            gradients hold a NaN or Inf. Costs a check kernel and a device sync per step.
    """

    rule = _adamax_rule
    hyper = ("lr", "beta1", "beta2", "eps", "weight_decay")
    buffers = ("exp_avg", "exp_inf")
    derived = (one_minus_beta1, clr, m_floor)
    flush_subnormals = True

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 skip_nonfinite=False):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, skip_nonfinite)

    def _check_group(self, group):
        check_lr_eps_weight_decay(self._name, group)
        check_betas(self._name, group)

    def _hyper_source(self, group):
        beta1, beta2 = group["betas"]
        return {**group, "beta1": beta1, "beta2": beta2}
