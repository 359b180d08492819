"""Adam (L2 weight decay added to the gradient) and AdamW (decoupled weight decay)."""
import math

import numpy as np

from ops.element_kernel import element_kernel
from ops.step_counter import SKIPPED, T
from optim.optimizer import Optimizer, check_non_negative


def _adam_element(i, param, grad, exp_avg, exp_avg_sq, one_minus_beta1, beta2, one_minus_beta2,
                  eps, l2, param_decay, step_size, bias_correction2_sqrt, tiny, m_floor):
    # arithmetic in the parameters' dtype (every scalar arrives cast to it), as torch.optim
    # does: float32 math vectorises twice as wide and its sqrt and division are ~3x cheaper.
    # The state starts at zero (as torch's): m + (1 - beta1) * (g - m) of m = 0 is exactly
    # (1 - beta1) * g, so the first step needs no flag of its own.
    p = param[i] * param_decay                   # AdamW: p * (1 - lr * weight_decay)
    g = grad[i] + l2 * p                         # Adam: L2 penalty in the gradient
    m = exp_avg[i] + one_minus_beta1 * (g - exp_avg[i])
    v = beta2 * exp_avg_sq[i] + one_minus_beta2 * g * g
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
    exp_avg[i] = m
    exp_avg_sq[i] = v
    param[i] = p - step_size * m / (math.sqrt(v) / bias_correction2_sqrt + eps)


def _adam_scalars(counts, hyper, decoupled, tiny, scalars):
    """The update's scalars in float64 into ``scalars``, from the device arrays: t from the
    step counts (a replayed step computes its own bias corrections: the power of a float t,
    so both devices call pow, not an integer power loop) and the hyper-parameters
    ``[lr, beta1, beta2, eps, weight_decay]`` the host synced."""
    t = float(counts[T])
    lr, beta1, beta2, eps, weight_decay = hyper[0], hyper[1], hyper[2], hyper[3], hyper[4]
    scalars[0] = 1.0 - beta1
    scalars[1] = beta2
    scalars[2] = 1.0 - beta2
    scalars[3] = eps
    scalars[4] = 0.0 if decoupled else weight_decay            # l2
    scalars[5] = 1.0 - lr * weight_decay if decoupled else 1.0  # param_decay
    scalars[6] = lr / (1.0 - beta1 ** t)                        # step size
    scalars[7] = math.sqrt(1.0 - beta2 ** t)                    # bias correction 2, sqrt
    scalars[8] = tiny                                           # v's floor
    scalars[9] = tiny / (1.0 - beta1)                           # m's floor


# the kernel's arguments: (param, grad, exp_avg, exp_avg_sq, counts, hyper, decoupled, tiny)
ADAM_UPDATE = element_kernel("adam", _adam_element, skip_if=("counts", SKIPPED),
                             flush_subnormals=True, scalars=(_adam_scalars, 10))


class Adam(Optimizer):
    r"""Adam, as ``torch.optim.Adam`` (``amsgrad`` is not supported).

    For each parameter :math:`p` with gradient :math:`g` at step :math:`t` (from 1), with
    :math:`m_0 = v_0 = 0`::

        g = g + weight_decay * p                        # L2 penalty, when weight_decay != 0
        m = beta1 * m + (1 - beta1) * g                 # computed as m + (1 - beta1) * (g - m)
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    v below the dtype's smallest normal number, and m below that over ``1 - beta1``, are
    stored as 0 (subnormal arithmetic is ~20x slower on x86; torch keeps them), and the CPU
    kernel runs with subnormal results flushed to zero (``ops.subnormals``). The kernel reads
    t from the device step counts that one small kernel advances each step, and lr, the betas,
    eps and weight_decay from a device array the step syncs from ``param_groups`` (so a
    captured step replays with its own t and the current lr), and computes the bias
    corrections in float64; the update's arithmetic is in the parameter's dtype, as in torch.

    Args:
        params: tensors with ``requires_grad=True``, or a list of param-group dicts.
        lr: learning rate (>= 0).
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator (>= 0).
        weight_decay: L2 penalty added to the gradient (>= 0).
        skip_nonfinite: skip (and count in ``skipped_steps``, with a warning) a step whose
            gradients hold a NaN or Inf. Costs a check kernel and a device sync per step.
    """

    decoupled_weight_decay = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 skip_nonfinite=False):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, skip_nonfinite)

    def _check_group(self, group):
        for name in ("lr", "eps", "weight_decay"):
            check_non_negative(self._name, name, group[name])
        if not math.isfinite(group["lr"]):
            raise ValueError(f"{self._name}: invalid lr: {group['lr']} (must be finite)")
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{self._name}: betas must be a pair (beta1, beta2), got {betas!r}")
        group["betas"] = tuple(betas)
        for index, beta in enumerate(betas):
            check_non_negative(self._name, f"beta parameter at index {index}", beta)
            if not beta < 1:
                raise ValueError(f"{self._name}: invalid beta parameter at index {index}: {beta} "
                                 "(must be in [0, 1))")

    def _state_names(self, group):
        return ("exp_avg", "exp_avg_sq")

    update_kernel = ADAM_UPDATE

    def _hyper_values(self, group):
        beta1, beta2 = group["betas"]
        return (group["lr"], beta1, beta2, group["eps"], group["weight_decay"])

    def _update_args(self, param, grad, buffers, counts, hyper):
        exp_avg, exp_avg_sq = buffers["exp_avg"], buffers["exp_avg_sq"]
        return (param, grad, exp_avg, exp_avg_sq, counts, hyper, self.decoupled_weight_decay,
                float(np.finfo(param.dtype).tiny))


class AdamW(Adam):
    r"""Adam with decoupled weight decay, as ``torch.optim.AdamW``.

    For each parameter :math:`p` with gradient :math:`g` at step :math:`t` (from 1), with
    :math:`m_0 = v_0 = 0`::

        p = p * (1 - lr * weight_decay)                 # decoupled: not part of the gradient
        m = beta1 * m + (1 - beta1) * g                 # computed as m + (1 - beta1) * (g - m)
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    Same kernel and arguments as ``Adam``; ``weight_decay`` defaults to 1e-2 as in torch.
    """

    decoupled_weight_decay = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 skip_nonfinite=False):
        super().__init__(params, lr, betas, eps, weight_decay, skip_nonfinite)
