"""Loss functions on Tensors, each one fused op of ``ops.loss``, and their callable classes.

>>> loss = engine.losses.cross_entropy(logits, labels)   # labels: integer Tensor or array
>>> criterion = engine.losses.CrossEntropyLoss(); loss = criterion(logits, labels)
"""
import numpy as np

from engine.autograd import apply
from engine.tensor import Tensor, as_tensor
from ops import cross_entropy_options as ce_options
from ops import loss as ls


def cross_entropy(logits, target, label_smoothing=0.0, reduction="mean"):
    """Cross-entropy of ``logits`` (N, C) against integer class labels (N,) or class
    probabilities (N, C), as ``torch.nn.functional.cross_entropy``.

    Fused and stable (log-sum-exp). Labels may be an integer Tensor, a NumPy array or a
    list; a label outside [0, C) raises ValueError (on CUDA at the latest one call later,
    see ``ops.loss``). ``label_smoothing`` in [0, 1] mixes each target with the uniform
    distribution; ``reduction`` is "mean" (over the rows), "sum" or "none" (the (N,) row
    losses). The target gets no gradient."""
    if not isinstance(target, Tensor):
        target = np.asarray(target)
    options = dict(label_smoothing=label_smoothing, reduction=reduction)
    if target.dtype.kind == "f" and target.ndim == 2:
        if isinstance(target, Tensor) and target.requires_grad:
            raise ValueError("cross_entropy: class-probability targets get no gradient here "
                             "(torch gives them one); pass target.detach()")
        return apply(ce_options.ProbabilityCrossEntropy, logits, as_tensor(target, logits),
                     **options)
    if label_smoothing == 0 and reduction == "mean":
        return apply(ls.CrossEntropy, logits, target)   # the plain op the captured steps run
    return apply(ce_options.LabelCrossEntropy, logits, target, **options)


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
    """``criterion(logits, target)``: see ``cross_entropy`` (its options as torch's
    ``nn.CrossEntropyLoss(label_smoothing=..., reduction=...)``)."""

    def __init__(self, label_smoothing=0.0, reduction="mean"):
        ce_options.checked_options(label_smoothing, reduction)
        self.label_smoothing, self.reduction = label_smoothing, reduction

    def __call__(self, logits, target):
        return cross_entropy(logits, target, self.label_smoothing, self.reduction)

    def __repr__(self):
        options = [f"{name}={value!r}" for name, value, default in
                   (("label_smoothing", self.label_smoothing, 0.0),
                    ("reduction", self.reduction, "mean")) if value != default]
        return f"CrossEntropyLoss({', '.join(options)})"


class BCELoss(_Loss):
    """``criterion(probs, targets)``: see ``binary_cross_entropy``."""
    function = staticmethod(binary_cross_entropy)


class MSELoss(_Loss):
    """``criterion(pred, target)``: see ``mse``."""
    function = staticmethod(mse)
