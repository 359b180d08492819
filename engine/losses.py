"""Loss functions on Tensors, each one fused op of ``ops.loss``, and their callable classes.

>>> loss = engine.losses.cross_entropy(logits, labels)   # labels: integer Tensor or array
>>> criterion = engine.losses.CrossEntropyLoss(); loss = criterion(logits, labels)
"""
import numpy as np

from engine.autograd import apply
from engine.tensor import Tensor, as_tensor
from ops import loss as ls


def cross_entropy(logits, labels):
    """Mean cross-entropy of ``logits`` (N, C) against integer class ``labels`` (N,).

    Fused and stable (log-sum-exp). ``labels`` may be an integer Tensor, a NumPy array or
    a list; a label outside [0, C) raises ValueError (on CUDA at the latest one call later,
    see ``ops.loss``)."""
    if not isinstance(labels, Tensor):
        labels = np.asarray(labels)
    return apply(ls.CrossEntropy, logits, labels)


def binary_cross_entropy(probs, targets):
    """Mean binary cross-entropy of probabilities in [0, 1] against targets of the same shape
    (logs clamped at -100, as in PyTorch)."""
    return apply(ls.BinaryCrossEntropy, probs, as_tensor(targets, probs))


def mse(pred, target):
    """Mean squared error of two tensors of the same shape."""
    return apply(ls.MSE, pred, as_tensor(target, pred))


class _Loss:
    function = None

    def __call__(self, prediction, target):
        return type(self).function(prediction, target)

    def __repr__(self):
        return f"{type(self).__name__}()"


class CrossEntropyLoss(_Loss):
    """``criterion(logits, labels)``: see ``cross_entropy``."""
    function = staticmethod(cross_entropy)


class BCELoss(_Loss):
    """``criterion(probs, targets)``: see ``binary_cross_entropy``."""
    function = staticmethod(binary_cross_entropy)


class MSELoss(_Loss):
    """``criterion(pred, target)``: see ``mse``."""
    function = staticmethod(mse)
