"""NAdam (Adam with Nesterov momentum), as ``torch.optim.NAdam``: a rule and its declaration."""
import math

from optim.adam import (check_betas, check_lr_eps_weight_decay, l2, m_floor, one_minus_beta1,
                        one_minus_beta2, param_decay)
from optim.optimizer import Optimizer, check_non_negative


def _nadam_rule(param, grad, exp_avg, exp_avg_sq, mu_product, one_minus_beta1, beta2,
                one_minus_beta2, eps, l2, param_decay, mu, mu_next, lr_one_minus_mu,
                lr_mu_next, bias_correction2, first_step, one, tiny, m_floor):
    # in the parameter's dtype, as torch; mu_product, torch's one float scalar a parameter
    # (in the default dtype), is kept per element here: every element holds the same value
    p = param * param_decay                     # decoupled_weight_decay: p * (1 - lr * wd)
    g = grad + l2 * p                           # else: L2 penalty in the gradient
    product = mu if first_step != 0 else mu_product * mu   # torch's mu_product *= mu, from 1
    m = exp_avg + one_minus_beta1 * (g - exp_avg)          # torch's lerp
    v = beta2 * exp_avg_sq + one_minus_beta2 * g * g
    if abs(m) < m_floor:   # subnormal state: see optim.adam
        m = m_floor - m_floor
    if v < tiny:
        v = tiny - tiny
    denominator = math.sqrt(v / bias_correction2) + eps
    p = p - lr_one_minus_mu / (one - product) * g / denominator
    p = p - lr_mu_next / (one - product * mu_next) * m / denominator
    return p, m, v, product


def mu(beta1, momentum_decay, t):
    return beta1 * (1.0 - 0.5 * 0.96 ** (t * momentum_decay))


def mu_next(beta1, momentum_decay, t):
    return beta1 * (1.0 - 0.5 * 0.96 ** ((t + 1.0) * momentum_decay))


def lr_one_minus_mu(lr, mu):
    return lr * (1.0 - mu)


def lr_mu_next(lr, mu_next):
    return lr * mu_next


def bias_correction2(beta2, t):
    return 1.0 - beta2 ** t


class NAdam(Optimizer):
    r"""NAdam, as ``torch.optim.NAdam``.

    For each parameter :math:`p` with gradient :math:`g` at step :math:`t` (from 1), with
    :math:`m_0 = v_0 = 0` and the momentum product :math:`\Pi_0 = 1`::

        p = p * (1 - lr * weight_decay)                 # if decoupled_weight_decay, else:
        g = g + weight_decay * p                        # L2 penalty in the gradient
        mu      = beta1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))
        mu_next = beta1 * (1 - 0.5 * 0.96 ** ((t + 1) * momentum_decay))
        Pi = Pi * mu
        m = beta1 * m + (1 - beta1) * g                 # computed as m + (1 - beta1) * (g - m)
        v = beta2 * v + (1 - beta2) * g * g
        d = sqrt(v / (1 - beta2 ** t)) + eps
        p = p - lr * (1 - mu) / (1 - Pi) * g / d
        p = p - lr * mu_next / (1 - Pi * mu_next) * m / d

    State: ``exp_avg`` (m), ``exp_avg_sq`` (v) and ``mu_product`` (Pi), torch's names; torch
    keeps ``mu_product`` as one scalar in its default dtype, this one as a buffer like the
    parameter whose elements all hold that value (in the parameter's dtype: torch's values
    for parameters of its default dtype). The arithmetic is in the parameter's dtype, mu,
    mu_next and ``1 - beta2 ** t`` in float64, as torch's. m below the dtype's smallest normal
    number over ``1 - beta1``, and v below that number, are stored as 0 (see
    ``optim.adam``). The kernel reads t from the device step counts and the
    hyper-parameters from a device array the step syncs from ``param_groups``.

    Args:
        params: tensors with ``requires_grad=True``, or a list of param-group dicts.
        lr: learning rate (>= 0, finite).
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator (>= 0).
        weight_decay: weight decay (>= 0): an L2 penalty in the gradient, or decoupled.
        momentum_decay: how fast mu approaches beta1 (>= 0).
        decoupled_weight_decay: decay the weights as AdamW does (NAdamW), not through the
            gradient.
        skip_nonfinite: skip (and count in ``skipped_steps``, with a warning) a step whose
            gradients hold a NaN or Inf. Costs a check kernel and a device sync per step.
    """

    rule = _nadam_rule
    hyper = ("lr", "beta1", "beta2", "eps", "weight_decay", "momentum_decay", "decoupled")
    buffers = ("exp_avg", "exp_avg_sq", "mu_product")
    derived = (one_minus_beta1, one_minus_beta2, l2, param_decay, mu, mu_next,
               lr_one_minus_mu, lr_mu_next, bias_correction2, m_floor)
    flush_subnormals = True

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 momentum_decay=4e-3, decoupled_weight_decay=False, skip_nonfinite=False):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        momentum_decay=momentum_decay,
                        decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults, skip_nonfinite)

    def _check_group(self, group):
        check_lr_eps_weight_decay(self._name, group)
        check_betas(self._name, group)
        check_non_negative(self._name, "momentum_decay", group["momentum_decay"])
        if not math.isfinite(group["momentum_decay"]):
            raise ValueError(f"{self._name}: invalid momentum_decay: "
                             f"{group['momentum_decay']} (must be finite)")
        if not isinstance(group["decoupled_weight_decay"], bool):
            raise TypeError(f"{self._name}: decoupled_weight_decay must be True or False, got "
                            f"{group['decoupled_weight_decay']!r}")

    def _hyper_source(self, group):
        beta1, beta2 = group["betas"]
        return {**group, "beta1": beta1, "beta2": beta2,
                "decoupled": group["decoupled_weight_decay"]}
