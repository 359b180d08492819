"""``gradcheck``: the analytic gradients of a function against central finite differences.

The function's output is projected onto a fixed random direction (so any output shape
becomes one scalar), one backward gives every analytic gradient, and each input element is
nudged by +-eps to get the numeric one. ``fast=True`` checks one random direction per input
instead of every element (Chainer's ``gradient_check`` idea): one pair of evaluations per
input, suited to larger inputs.

While it nudges an input, the input's ``.data`` is a scratch copy; afterwards it is the very
array object it was before (a model's parameters stay views into their flat buffer, so an
optimizer's later step still updates what the model reads), with its values untouched.
"""
import numpy as np

from engine.autograd import no_grad
from engine.tensor import Tensor
from ops.device import to_device, to_host


class GradcheckError(AssertionError):
    pass


def gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-3, fast=False, seed=0):
    """True when every input's analytic gradient matches the numeric one, else raises
    ``GradcheckError`` naming the input, the worst element and both values."""
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    checked = [i for i, x in enumerate(inputs) if isinstance(x, Tensor) and x.requires_grad]
    if not checked:
        raise ValueError("gradcheck: no input has requires_grad=True")
    for i in checked:
        if inputs[i].dtype != np.float64:
            raise TypeError(f"gradcheck: input {i} is {inputs[i].dtype}; finite differences "
                            "need float64 inputs")
    rng = np.random.default_rng(seed)
    output = fn(*inputs)
    if not isinstance(output, Tensor) or not output.requires_grad:
        raise ValueError("gradcheck: fn must return a Tensor that depends on the inputs")
    direction = Tensor(to_device(rng.standard_normal(output.shape), output.device))

    def projected():
        with no_grad():
            return float((fn(*inputs) * direction).sum().item())

    for i in checked:
        inputs[i].grad = None
    (output * direction).sum().backward()
    for i in checked:
        x = inputs[i]
        analytic = np.zeros(x.shape) if x.grad is None else x.grad.numpy().astype(np.float64)
        original_data = x.data
        original = to_host(original_data).copy()

        def value_at(values):
            x.data = to_device(values, x.device)
            return projected()

        try:
            if fast:
                step = rng.standard_normal(x.shape)
                numeric = ((value_at(original + eps * step) - value_at(original - eps * step))
                           / (2 * eps))
                _compare(i, x.shape, "along a random direction", numeric,
                         float(np.sum(analytic * step)), atol, rtol)
                continue
            numeric = np.empty(x.shape)
            for k in np.ndindex(x.shape):
                shifted = original.copy()
                shifted[k] += eps
                upper = value_at(shifted)
                shifted[k] -= 2 * eps
                numeric[k] = (upper - value_at(shifted)) / (2 * eps)
        finally:
            x.data = original_data
        error = np.abs(numeric - analytic) - (atol + rtol * np.abs(numeric))
        if error.size and error.max() > 0:
            worst = np.unravel_index(int(np.argmax(error)), x.shape)
            _compare(i, x.shape, f"at element {tuple(int(w) for w in worst)}",
                     numeric[worst], analytic[worst], atol, rtol)
    return True


def _compare(index, shape, where, numeric, analytic, atol, rtol):
    if abs(numeric - analytic) > atol + rtol * abs(numeric):
        raise GradcheckError(
            f"gradcheck: input {index} (shape {shape}) {where}: numeric {numeric:.8g} vs "
            f"analytic {analytic:.8g} (|diff| {abs(numeric - analytic):.3g} > "
            f"atol {atol:g} + rtol {rtol:g} * |numeric|)")
