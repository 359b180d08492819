"""Adam (L2 weight decay added to the gradient) and AdamW (decoupled weight decay), each
with or without AMSGrad."""
import math

from optim.optimizer import Optimizer, check_non_negative


def _adam_rule(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, one_minus_beta1, beta2,
               one_minus_beta2, eps, l2, param_decay, step_size, bias_correction2_sqrt, amsgrad,
               tiny, m_floor):
    # arithmetic in the parameters' dtype, as torch.optim does: float32 math vectorises twice
    # as wide and its sqrt and division are ~3x cheaper. The state starts at zero (as
    # torch's): m + (1 - beta1) * (g - m) of m = 0 is exactly (1 - beta1) * g, so the first
    # step needs no flag of its own.
    p = param * param_decay                   # AdamW: p * (1 - lr * weight_decay)
    g = grad + l2 * p                         # Adam: L2 penalty in the gradient
    m = exp_avg + one_minus_beta1 * (g - exp_avg)
    v = beta2 * exp_avg_sq + one_minus_beta2 * g * g
    # A weight whose gradient stays 0 (an MNIST border pixel's) has m decay by beta1 a step
    # into subnormal numbers, which x86 computes ~20x slower: after ~800 MNIST steps 134k of
    # the MLP's 235k m values were subnormal and the CPU update took 2581 us instead of 125.
    # Flushed to 0 on both devices alike (the update they would make is below 1e-30). m's
    # floor is tiny / (1 - beta1): below it the decrement (1 - beta1) * m is subnormal, which
    # the CPU kernel's flush-to-zero mode (ops.subnormals) drops, and m would stop decaying.
    if abs(m) < m_floor:
        m = m_floor - m_floor
    if v < tiny:
        v = tiny - tiny
    v_max = max_exp_avg_sq
    denominator = v
    if amsgrad != 0:   # the largest v so far (torch.maximum: a NaN v is kept)
        v_max = max_exp_avg_sq if max_exp_avg_sq >= v else v
        denominator = v_max
    return p - step_size * m / (math.sqrt(denominator) / bias_correction2_sqrt + eps), m, v, v_max


# the per-launch scalars, in float64 from the device arrays: t from the step counts (a
# replayed step computes its own bias corrections: the power of a float t, so both devices
# call pow, not an integer power loop) and the hyper-parameters the host synced
def one_minus_beta1(beta1):
    return 1.0 - beta1


def one_minus_beta2(beta2):
    return 1.0 - beta2


def l2(weight_decay, decoupled):
    return 0.0 if decoupled != 0 else weight_decay


def param_decay(lr, weight_decay, decoupled):
    return 1.0 - lr * weight_decay if decoupled != 0 else 1.0


def step_size(lr, beta1, t):
    return lr / (1.0 - beta1 ** t)


def bias_correction2_sqrt(beta2, t):
    return math.sqrt(1.0 - beta2 ** t)


def m_floor(tiny, beta1):
    return tiny / (1.0 - beta1)


def check_betas(optimizer, group):
    """Raise naming ``optimizer`` unless ``group["betas"]`` is a pair in [0, 1); store it as a
    tuple."""
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{optimizer}: betas must be a pair (beta1, beta2), got {betas!r}")
    group["betas"] = tuple(betas)
    for index, beta in enumerate(betas):
        check_non_negative(optimizer, f"beta parameter at index {index}", beta)
        if not beta < 1:
            raise ValueError(f"{optimizer}: invalid beta parameter at index {index}: {beta} "
                             "(must be in [0, 1))")


def check_lr_eps_weight_decay(optimizer, group):
    """Raise naming ``optimizer`` unless lr, eps and weight_decay are >= 0 and lr finite."""
    for name in ("lr", "eps", "weight_decay"):
        check_non_negative(optimizer, name, group[name])
    if not math.isfinite(group["lr"]):
        raise ValueError(f"{optimizer}: invalid lr: {group['lr']} (must be finite)")


class Adam(Optimizer):
    r"""Adam, as ``torch.optim.Adam``.

    For each parameter :math:`p` with gradient :math:`g` at step :math:`t` (from 1), with
    :math:`m_0 = v_0 = 0`::

        g = g + weight_decay * p                        # L2 penalty, when weight_decay != 0
        m = beta1 * m + (1 - beta1) * g                 # computed as m + (1 - beta1) * (g - m)
        v = beta2 * v + (1 - beta2) * g * g
        u = max(v_max, v) if amsgrad else v             # AMSGrad: v_max = u, from v_max_0 = 0
        p = p - lr / (1 - beta1**t) * m / (sqrt(u) / sqrt(1 - beta2**t) + eps)

    State: ``exp_avg`` (m), ``exp_avg_sq`` (v) and, with ``amsgrad``, ``max_exp_avg_sq``
    (v_max), torch's names. v below the dtype's smallest normal number, and m below that over
    ``1 - beta1``, are stored as 0 (subnormal arithmetic is ~20x slower on x86; torch keeps
    them), and the CPU kernel runs with subnormal results flushed to zero (``ops.subnormals``).
    The kernel reads t from the device step counts that one small kernel advances each step, and
    lr, the betas, eps and weight_decay from a device array the step syncs from ``param_groups``
    (so a captured step replays with its own t and the current lr), and computes the bias
    corrections in float64; the update's arithmetic is in the parameter's dtype, as in torch.

    Args:
        params: tensors with ``requires_grad=True``, or a list of param-group dicts.
        lr: learning rate (>= 0).
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator (>= 0).
        weight_decay: L2 penalty added to the gradient (>= 0).
        amsgrad: divide by the largest second moment so far (AMSGrad), as torch.
        skip_nonfinite: skip (and count in ``skipped_steps``, with a warning) a step whose
            gradients hold a NaN or Inf. Costs a check kernel and a device sync per step.
    """

    rule = _adam_rule
    hyper = ("lr", "beta1", "beta2", "eps", "weight_decay", "decoupled", "amsgrad")
    buffers = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    derived = (one_minus_beta1, one_minus_beta2, l2, param_decay, step_size,
               bias_correction2_sqrt, m_floor)
    flush_subnormals = True
    decoupled_weight_decay = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, skip_nonfinite=False):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad)
        super().__init__(params, defaults, skip_nonfinite)

    def _check_group(self, group):
        check_lr_eps_weight_decay(self._name, group)
        check_betas(self._name, group)
        if not isinstance(group["amsgrad"], bool):
            raise TypeError(f"{self._name}: amsgrad must be True or False, got "
                            f"{group['amsgrad']!r}")

    def _state_names(self, group):
        return self.buffers if group["amsgrad"] else self.buffers[:2]

    def _hyper_source(self, group):
        beta1, beta2 = group["betas"]
        return {**group, "beta1": beta1, "beta2": beta2,
                "decoupled": self.decoupled_weight_decay}


class AdamW(Adam):
    r"""Adam with decoupled weight decay, as ``torch.optim.AdamW``.

    For each parameter :math:`p` with gradient :math:`g` at step :math:`t` (from 1), with
    :math:`m_0 = v_0 = 0`::

        p = p * (1 - lr * weight_decay)                 # decoupled: not part of the gradient
        m = beta1 * m + (1 - beta1) * g                 # computed as m + (1 - beta1) * (g - m)
        v = beta2 * v + (1 - beta2) * g * g
        u = max(v_max, v) if amsgrad else v             # AMSGrad: v_max = u, from v_max_0 = 0
        p = p - lr / (1 - beta1**t) * m / (sqrt(u) / sqrt(1 - beta2**t) + eps)

    Same kernel and arguments as ``Adam``; ``weight_decay`` defaults to 1e-2 as in torch.
    """

    decoupled_weight_decay = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, skip_nonfinite=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, skip_nonfinite)
