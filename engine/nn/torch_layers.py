"""PyTorch's layer names, taking torch's arguments: ``nn.Linear(784, 512)``, ``nn.ReLU()``,
``nn.Conv2d(1, 32, 3)``, ``nn.MaxPool2d(2)``, ``nn.BatchNorm2d(32)``, ``nn.Module``, ...

Each is the engine's layer (a subclass, so ``isinstance(layer, nn.Dense)`` holds) built from
torch's constructor and starting from torch's default initialisation (``init.torch``: a
ported program starts from the same distribution). A layer that names its input size
(``Linear``'s ``in_features``) declares it as its ``input_shape``: a model of such layers has
its parameters before its first call, so ``optim.SGD(model.parameters())`` right after the
constructor works as in torch (a ``Linear`` makes its parameters in its constructor, as
torch's: ``self.fc2.weight = self.fc1.weight`` ties them). The sizes torch asks for and the
engine infers are checked against what reaches the layer. Weights keep the engine's layouts
(Dense's kernel is ``(in, out)``, torch's ``(out, in)``);
``engine.interop.torch.load_state_dict`` converts.
"""
import numpy as np

from engine.nn.convolutional import Conv2D
from engine.nn.layers import Activation, AvgPool2D, BatchNorm, Dense, LayerList, MaxPool2D
from engine.nn.model import Model, construction_deferred, register


def _dtype(dtype):
    return np.dtype(np.float32 if dtype is None else dtype)


def _refuse_device(device, where):
    if device not in (None, "cpu"):
        raise ValueError(f"{where}: device={device!r} at construction is not supported; build "
                         f"the model, then model.to({device!r})")


@register
class Linear(Dense):
    """torch's ``nn.Linear(in_features, out_features)``: ``x @ W + b`` over the last axis,
    W and b from torch's default distribution, made by the constructor as torch's (but while
    ``nn.load`` reads a file's architecture: ``construction_deferred``). The engine's Dense
    always has a bias."""
    built_at_construction = True   # a Sequential takes it built (``Sequential._extend``)

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        for what, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Linear: {what} must be a positive int, got {value!r}")
        if bias is not True:
            raise ValueError("Linear: bias=False is not supported (the engine's Dense kernel "
                             "always adds a bias); keep bias=True, or freeze a zero bias with "
                             "layer.bias.requires_grad_(False) after building")
        _refuse_device(device, "Linear")
        super().__init__(int(out_features), kernel_initializer="torch", dtype=_dtype(dtype),
                         input_shape=(int(in_features),))
        self.in_features, self.out_features = int(in_features), int(out_features)
        if not construction_deferred():
            # its parameters exist from here, as torch's: ``self.head.weight =
            # self.fc.weight`` in a Module's __init__ ties two Parameters (built later, both
            # were None there and each got its own), and custom init can reach them
            self.build(self.input_shape)

    def compute_output_shape(self, input_shape):
        if len(input_shape) < 1 or input_shape[-1] != self.in_features:
            raise ValueError(f"Linear: in_features is {self.in_features}, the input's last axis "
                             f"is {input_shape[-1] if input_shape else 'missing'}")
        return tuple(input_shape[:-1]) + (self.units,)

    def get_config(self):
        config = {"in_features": self.in_features, "out_features": self.out_features}
        return {**config, **({} if self.dtype == np.float32 else {"dtype": self.dtype.name})}


class _NamedActivation(Activation):
    """An activation layer of a fixed name (torch's ``nn.ReLU()``)."""
    activation_name = None

    def __init__(self, inplace=False):   # inplace: torch's memory hint; results are the same
        super().__init__(self.activation_name)

    def get_config(self):
        return {}


@register
class ReLU(_NamedActivation):
    """torch's ``nn.ReLU()``."""
    activation_name = "relu"


@register
class Sigmoid(_NamedActivation):
    """torch's ``nn.Sigmoid()``."""
    activation_name = "sigmoid"


@register
class Tanh(_NamedActivation):
    """torch's ``nn.Tanh()``."""
    activation_name = "tanh"


@register
class GELU(_NamedActivation):
    """torch's ``nn.GELU()`` (the exact erf form; ``approximate="tanh"`` is not here)."""
    activation_name = "gelu"

    def __init__(self, approximate="none"):
        if approximate != "none":
            raise ValueError(f"GELU: approximate={approximate!r} is not supported; the "
                             "engine's gelu layer is the exact form, approximate='none'")
        super().__init__()


@register
class LeakyReLU(Activation):
    """torch's ``nn.LeakyReLU(negative_slope=0.01)``."""

    def __init__(self, negative_slope=0.01, inplace=False):
        super().__init__("leaky_relu", alpha=negative_slope)

    def get_config(self):
        return {"negative_slope": self.alpha}


@register
class Softmax(Activation):
    """torch's ``nn.Softmax(dim)`` over the last axis (the only one the engine's softmax
    takes: ``dim=-1``, or the index of the last axis)."""

    def __init__(self, dim=-1):
        if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool):
            raise ValueError(f"Softmax: dim must be an int, got {dim!r}")
        super().__init__("softmax")
        self.dim = int(dim)

    def forward(self, x):
        if self.dim not in (-1, x.ndim - 1):
            raise ValueError(f"Softmax(dim={self.dim}): the engine's softmax runs over the last "
                             f"axis, and the input {x.shape} has {x.ndim}; move that axis last "
                             "(x.transpose(...)) or use dim=-1")
        return super().forward(x)

    def get_config(self):
        return {"dim": self.dim}


def _check_channels(layer, where, expected, input_shape):
    if len(input_shape) >= 1 and input_shape[0] != expected:
        raise ValueError(f"{where}: built for {expected} channels (its first argument), the "
                         f"input has {input_shape[0]} (shape {tuple(input_shape)})")


@register
class Conv2d(Conv2D):
    """torch's ``nn.Conv2d(in_channels, out_channels, kernel_size, stride=1, padding=0,
    dilation=1, groups=1, bias=True)`` on NCHW input, from torch's default distribution,
    its parameters made by the constructor (as ``Linear``'s)."""
    built_at_construction = True

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=True, padding_mode="zeros", device=None, dtype=None):
        if padding_mode != "zeros":
            raise ValueError(f"Conv2d: padding_mode={padding_mode!r} is not supported; only "
                             "'zeros'")
        _refuse_device(device, "Conv2d")
        super().__init__(out_channels, kernel_size, stride=stride, padding=padding,
                         dilation=dilation, groups=groups, use_bias=bias,
                         kernel_initializer="torch", dtype=_dtype(dtype))
        self.in_channels = int(in_channels)
        if not construction_deferred():
            # its parameters from here, as torch's (they need the channels, not the image
            # size: built on the smallest image the kernel takes, its output shape unset)
            smallest = tuple(d * (k - 1) + 1 for k, d in zip(self.kernel_size, self.dilation))
            self.build((self.in_channels,) + smallest)
            self.output_shape = None

    def compute_output_shape(self, input_shape):
        _check_channels(self, "Conv2d", self.in_channels, input_shape)
        return super().compute_output_shape(input_shape)

    def get_config(self):
        config = super().get_config()
        for key in ("filters", "activation", "kernel_initializer"):
            config.pop(key, None)
        if config.pop("use_bias", True) is False:
            config["bias"] = False
        return {"in_channels": self.in_channels, "out_channels": self.filters, **config}


class _TorchPool:
    """torch's pooling arguments: ``kernel_size, stride=None, padding=0``."""

    def __init__(self, kernel_size, stride=None, padding=0):
        super().__init__(kernel_size, stride=stride, padding=padding)

    def get_config(self):
        config = super().get_config()
        config["kernel_size"] = config.pop("pool_size")
        return config


@register
class MaxPool2d(_TorchPool, MaxPool2D):
    """torch's ``nn.MaxPool2d(kernel_size, stride=None, padding=0)``."""


@register
class AvgPool2d(_TorchPool, AvgPool2D):
    """torch's ``nn.AvgPool2d(kernel_size, stride=None, padding=0)`` (padding counted)."""


class _TorchBatchNorm(BatchNorm):
    """torch's ``BatchNorm1d/2d(num_features, eps=1e-5, momentum=0.1)``, its parameters and
    running statistics made by the constructor (as ``Linear``'s)."""
    built_at_construction = True

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, device=None, dtype=None):
        where = type(self).__name__
        if not affine or not track_running_stats:
            raise ValueError(f"{where}: affine=False and track_running_stats=False are not "
                             "supported (the engine's BatchNorm learns a scale and offset and "
                             "keeps running statistics)")
        if momentum is None:
            raise ValueError(f"{where}: momentum=None (a cumulative average) is not supported")
        _refuse_device(device, where)
        super().__init__(momentum=momentum, eps=eps, dtype=_dtype(dtype))
        self.num_features = int(num_features)
        if not construction_deferred():   # its parameters and statistics from here
            self.build((self.num_features,))
            self.output_shape = None

    def compute_output_shape(self, input_shape):
        _check_channels(self, type(self).__name__, self.num_features, input_shape)
        return super().compute_output_shape(input_shape)

    def get_config(self):
        config = super().get_config()
        return {"num_features": self.num_features,
                **{k: config[k] for k in ("eps", "momentum", "dtype") if k in config}}


@register
class BatchNorm1d(_TorchBatchNorm):
    """torch's ``nn.BatchNorm1d(num_features)`` on (N, C) or (N, C, L)."""


@register
class BatchNorm2d(_TorchBatchNorm):
    """torch's ``nn.BatchNorm2d(num_features)`` on (N, C, H, W)."""


Module = Model          # torch's base class: a model (or a part of one) with any forward
ModuleList = LayerList  # torch's nn.ModuleList
