"""The functional convolution ops: ``conv2d``, ``max_pool2d``, ``avg_pool2d``, ``batch_norm``.

Each is the op of ``ops.conv``, ``ops.pool`` or ``ops.batch_norm`` run through
``engine.autograd.apply``, with PyTorch's layouts, argument names and defaults (NCHW; conv
weights ``(out, in / groups, kh, kw)``); the ops' own checks name the op and the shapes.
The layers of ``engine.nn`` (``Conv2D``, ``MaxPool2D``, ``AvgPool2D``, ``BatchNorm``) run
the same ops.
"""
import numpy as np

from engine.autograd import apply
from engine.tensor import Tensor
from ops.batch_norm import BatchNormOp
from ops.conv import Conv2DOp, sizes
from ops.device import device_of
from ops.fill import fill
from ops.memory import empty
from ops.pool import AvgPool2DOp, MaxPool2DOp


def conv2d(x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
    """``conv(x, w) + b`` as ``torch.nn.functional.conv2d``: x (N, C, H, W), w (O, C / groups,
    KH, KW), b (O,) or None; ``padding`` an int, a pair, "valid" or "same" (stride 1)."""
    inputs = (x, w) if b is None else (x, w, b)
    return apply(Conv2DOp, *inputs, stride=stride, padding=padding, dilation=dilation,
                 groups=groups)


def conv1d(x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
    """``conv(x, w) + b`` as ``torch.nn.functional.conv1d``: x (N, C, L), w (O, C / groups,
    K), b (O,) or None; ``padding`` an int, "valid" or "same" (stride 1). Runs conv2d's
    kernels on views of height 1."""
    shapes = f"x {tuple(x.shape)}, w {tuple(w.shape)}"
    if x.ndim != 3 or w.ndim != 3:
        raise ValueError(f"conv1d: expects x (N, C, L) and w (O, C/groups, K), got {shapes}")
    along_length = {}
    for name, value in (("stride", stride), ("dilation", dilation)):
        along_length[name] = (1,) + sizes(value, 1, name, "conv1d", 1)
    if not isinstance(padding, str):
        padding = (0,) + sizes(padding, 1, "padding", "conv1d", 0)
    x4 = x.reshape(x.shape[0], x.shape[1], 1, x.shape[2])
    w4 = w.reshape(w.shape[0], w.shape[1], 1, w.shape[2])
    inputs = (x4, w4) if b is None else (x4, w4, b)
    try:
        y = apply(Conv2DOp, *inputs, padding=padding, groups=groups, **along_length)
    except ValueError as error:   # its message is about the height-1 views
        raise ValueError(f"conv1d (conv2d over (N, C, 1, L) views): {error}") from None
    return y.reshape(y.shape[0], y.shape[1], y.shape[3])


def max_pool2d(x, kernel_size, stride=None, padding=0):
    """The maximum of each window (``stride`` defaults to ``kernel_size``; padding never
    wins), as ``torch.nn.functional.max_pool2d``."""
    return apply(MaxPool2DOp, x, kernel_size=kernel_size, stride=stride, padding=padding)


def avg_pool2d(x, kernel_size, stride=None, padding=0):
    """The mean of each window, padded zeros counted, as ``torch.nn.functional.avg_pool2d``."""
    return apply(AvgPool2DOp, x, kernel_size=kernel_size, stride=stride, padding=padding)


def batch_norm(x, running_mean, running_var, weight=None, bias=None, training=False,
               momentum=0.1, eps=1e-5):
    """Normalise each channel of x (N, C) or (N, C, H, W), as
    ``torch.nn.functional.batch_norm``: with the batch's statistics in training (updating
    ``running_mean`` and ``running_var`` in place, unbiased variance), with the running ones
    in eval. In training the running statistics may be None (none kept, as torch)."""
    if running_mean is None or running_var is None:
        if not training:
            raise ValueError("batch_norm: eval mode (training=False) normalises with the "
                             "running statistics; pass running_mean and running_var")
        # the op updates statistics in place: scratch ones that nobody keeps
        running_mean = _filled(x, 0) if running_mean is None else running_mean
        running_var = _filled(x, 1) if running_var is None else running_var
    if bias is not None and weight is None:   # the op takes a bias only after a weight
        weight = _filled(x, 1)
    inputs = [x, running_mean, running_var] + [t for t in (weight, bias) if t is not None]
    return apply(BatchNormOp, *inputs, training=training, momentum=momentum,
                 eps=eps)


def _filled(x, value):
    """An array of ``value`` per channel of ``x``, on its device and of its dtype."""
    data = x.data if isinstance(x, Tensor) else np.asarray(x)
    if data.ndim < 2:
        raise ValueError(f"batch_norm: expects x (N, C) or (N, C, H, W), got shape "
                         f"{tuple(data.shape)}")
    return fill(empty((data.shape[1],), data.dtype, device_of(data)), value)
