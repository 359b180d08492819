"""``keras.layers``: the engine's layers made with Keras's arguments and defaults.

Convolutions and pooling take channels-last images (NHWC) unless ``data_format=
"channels_first"``; kernels start Glorot-uniform (Keras's ``glorot_uniform``, the engine's
``xavier_uniform``) and biases at zero. Each function returns the engine's layer (an
``engine.nn.Conv2D``, ...), so models save, load and export as any other."""
from engine import functional as F
from engine import nn
from engine.nn import Layer, batch_shape, register
from engine.nn.layers import (BatchNorm, channels_first, channels_first_shape, channels_last,
                              check_data_format)
from engine.nn import (Activation, Dropout, Embedding, Flatten, Input,  # noqa: F401
                       InputLayer, Normalization, Rescaling, Reshape)

_GLOROT = "xavier_uniform"


def _kernel_initializer(name):
    return _GLOROT if name in ("glorot_uniform", None) else name


def _data_format(data_format):
    return "channels_last" if data_format is None else data_format


def _padding(padding, where):
    if padding not in ("valid", "same"):
        raise ValueError(f"{where}: padding must be 'valid' or 'same', got {padding!r}")
    return padding


def Dense(units, activation=None, use_bias=True, kernel_initializer="glorot_uniform",
          input_shape=None):
    """Keras's ``Dense(units, activation=None)``: over the last axis, Glorot-uniform."""
    if use_bias is not True:
        raise ValueError("Dense: use_bias=False is not supported (the engine's Dense always "
                         "adds a bias)")
    return nn.Dense(units, activation=activation,
                    kernel_initializer=_kernel_initializer(kernel_initializer),
                    input_shape=input_shape)


def _conv(layer_class, where, filters, kernel_size, strides, padding, data_format,
          dilation_rate, groups, activation, use_bias, kernel_initializer, input_shape):
    return layer_class(filters, kernel_size, stride=strides, padding=_padding(padding, where),
                       activation=activation, dilation=dilation_rate, groups=groups,
                       use_bias=use_bias,
                       kernel_initializer=_kernel_initializer(kernel_initializer),
                       input_shape=input_shape, data_format=_data_format(data_format))


def Conv2D(filters, kernel_size, strides=(1, 1), padding="valid", data_format=None,
           dilation_rate=(1, 1), groups=1, activation=None, use_bias=True,
           kernel_initializer="glorot_uniform", input_shape=None):
    """Keras's ``Conv2D(filters, kernel_size, ...)`` on channels-last images by default."""
    return _conv(nn.Conv2D, "Conv2D", filters, kernel_size, strides, padding, data_format,
                 dilation_rate, groups, activation, use_bias, kernel_initializer, input_shape)


def Conv1D(filters, kernel_size, strides=1, padding="valid", data_format=None,
           dilation_rate=1, groups=1, activation=None, use_bias=True,
           kernel_initializer="glorot_uniform", input_shape=None):
    """Keras's ``Conv1D(filters, kernel_size, ...)`` on channels-last signals (N, L, C)."""
    return _conv(nn.Conv1D, "Conv1D", filters, kernel_size, strides, padding, data_format,
                 dilation_rate, groups, activation, use_bias, kernel_initializer, input_shape)


def _pool(layer_class, where, pool_size, strides, padding, data_format, input_shape):
    if padding != "valid":
        raise ValueError(f"{where}: padding={padding!r} is not supported; 'valid' (none) is")
    return layer_class(pool_size, stride=strides, input_shape=input_shape,
                       data_format=_data_format(data_format))


def MaxPooling2D(pool_size=(2, 2), strides=None, padding="valid", data_format=None,
                 input_shape=None):
    """Keras's ``MaxPooling2D(pool_size=(2, 2))`` on channels-last images by default."""
    return _pool(nn.MaxPool2D, "MaxPooling2D", pool_size, strides, padding, data_format,
                 input_shape)


def AveragePooling2D(pool_size=(2, 2), strides=None, padding="valid", data_format=None,
                     input_shape=None):
    """Keras's ``AveragePooling2D(pool_size=(2, 2))`` on channels-last images by default."""
    return _pool(nn.AvgPool2D, "AveragePooling2D", pool_size, strides, padding, data_format,
                 input_shape)


MaxPool2D, AvgPool2D = MaxPooling2D, AveragePooling2D   # Keras's aliases


@register
class GlobalAveragePooling2D(Layer):
    """Keras's ``GlobalAveragePooling2D()``: the mean of each channel over the image, ``(N,
    H, W, C) -> (N, C)`` (channels last by default; ``data_format="channels_first"`` takes
    NCHW). ``keepdims=True`` keeps the two spatial axes as 1s."""

    def __init__(self, data_format=None, keepdims=False, input_shape=None):
        super().__init__(input_shape)
        self.data_format = check_data_format(_data_format(data_format),
                                             "GlobalAveragePooling2D")
        self.keepdims = bool(keepdims)

    def _spatial_axes(self):
        return (1, 2) if self.data_format == "channels_last" else (2, 3)

    def compute_output_shape(self, input_shape):
        if len(input_shape) != 3:
            raise ValueError(f"GlobalAveragePooling2D takes images (None, height, width, "
                             f"channels) or channels first, got {batch_shape(input_shape)}")
        if not self.keepdims:
            return (input_shape[-1 if self.data_format == "channels_last" else 0],)
        return tuple(1 if axis + 1 in self._spatial_axes() else size
                     for axis, size in enumerate(input_shape))

    def forward(self, x):
        return F.mean(x, axis=self._spatial_axes(), keepdims=self.keepdims)

    def get_config(self):
        config = {"data_format": self.data_format}
        if self.keepdims:
            config["keepdims"] = True
        return {**config, **super().get_config()}


@register
class BatchNormalization(BatchNorm):
    """Keras's ``BatchNormalization(axis=-1, momentum=0.99, epsilon=1e-3)``: the engine's
    BatchNorm over the last axis (channels-last images, or features) or ``axis=1``
    (channels first). Keras's ``momentum`` weighs the running statistics, torch's (and the
    engine's) the batch: ``nn.BatchNorm(momentum=1 - momentum)``. The running variance is
    updated with the unbiased batch variance, as torch does (Keras uses the biased one)."""

    def __init__(self, axis=-1, momentum=0.99, epsilon=1e-3, input_shape=None):
        if axis not in (-1, 1):
            raise ValueError(f"BatchNormalization: axis must be -1 (channels last) or 1 "
                             f"(channels first), got {axis!r}")
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) \
                or not 0 <= momentum <= 1:
            raise ValueError(f"BatchNormalization: momentum must be a number in [0, 1], got "
                             f"{momentum!r}")
        super().__init__(momentum=1 - momentum, eps=epsilon, input_shape=input_shape)
        self.axis = axis

    def _moves_channels(self, rank):
        return self.axis == -1 and rank > 1   # a feature vector's last axis is its first

    def compute_output_shape(self, input_shape):
        moved = self._moves_channels(len(input_shape))
        super().compute_output_shape(channels_first_shape(input_shape) if moved else input_shape)
        return tuple(input_shape)

    def build(self, input_shape, device="cpu", initialize=True):
        moved = self._moves_channels(len(input_shape))
        super().build(channels_first_shape(input_shape) if moved else input_shape, device,
                      initialize)
        self.output_shape = tuple(input_shape)
        return self.output_shape

    def forward(self, x):
        if self._moves_channels(x.ndim - 1):
            return channels_last(super().forward(channels_first(x, self)))
        return super().forward(x)

    def get_config(self):
        config = {"axis": self.axis, "momentum": 1 - self.momentum, "epsilon": self.eps}
        return {**config, **({"input_shape": list(self.input_shape)}
                             if self.input_shape is not None else {})}
