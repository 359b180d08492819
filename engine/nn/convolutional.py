"""The convolution layers: one base of any rank (``_Conv``, Keras's ``BaseConv(rank)``),
``Conv1D`` and ``Conv2D``, all run by ``ops.conv``'s 2-D kernels."""
import numpy as np

from engine import functional as F
from engine import init
from engine.nn.layers import (Layer, _activate, _check_input_dtype, _compact, _kernel_initializer,
                              _run_op, _weighted_config, batch_shape, channels_first,
                              channels_first_shape, channels_last, channels_last_shape,
                              check_data_format)
from engine.parameter import Parameter
from ops import pointwise
from ops.conv import Conv2DOp, conv_output_sizes, conv_padding, sizes
from ops.device import to_device
from ops.pointwise import ACTIVATIONS as FUSED_ACTIVATIONS


class _Conv(Layer):
    """The convolution layers of every rank (Keras's ``BaseConv(rank)``):
    ``activation(conv(x, W) + b)`` over ``(N, C, *spatial)`` inputs with ``rank`` spatial
    dimensions, W in torch's layout ``(filters, channels / groups, *kernel_size)``. Every rank
    runs ``ops.conv``'s 2-D kernels, one fused kernel per direction: a rank-1 signal of
    length L is an image of height 1 (its kernel, stride, dilation and padding 1, 1, 1, 0
    along that height).

    ``padding`` is "valid" (none), "same" (stride 1: the output as large as the input), an
    int or one int per spatial dimension; ``kernel_size``, ``stride`` and ``dilation`` an int
    or one per dimension. The kernel defaults to He initialisation for the relu family and
    Xavier otherwise, asked of the initialiser in Keras's layout ``(*kernel_size, channels /
    groups, filters)`` (so ``fan_in`` is ``prod(kernel_size)·channels / groups`` and
    ``fan_out`` the filters); the bias starts at zero. Activations:
    ``ops.pointwise.LAYER_ACTIVATIONS`` (no softmax); those whose derivative is not exact
    from the output (gelu) run after the kernel."""
    rank = None      # spatial dimensions
    layout = None    # the input's layout, for messages

    def __init__(self, filters, kernel_size, stride=1, padding="valid", activation=None,
                 dilation=1, groups=1, use_bias=True, kernel_initializer=None, alpha=0.01,
                 dtype=np.float32, input_shape=None, data_format="channels_first"):
        super().__init__(input_shape)
        where = type(self).__name__
        self.data_format = check_data_format(data_format, where)
        if not isinstance(filters, (int, np.integer)) or isinstance(filters, bool) or filters <= 0:
            raise ValueError(f"{where}: filters must be a positive int, got {filters!r}")
        if isinstance(activation, str):   # Keras's other names ("swish" for "silu")
            activation = pointwise.KERAS_NAMES.get(activation, activation)
        if activation not in pointwise.LAYER_ACTIVATIONS + (None,):
            raise ValueError(f"{where}: unknown activation {activation!r}; expected one of "
                             f"{pointwise.LAYER_ACTIVATIONS + (None,)}")
        if not isinstance(groups, (int, np.integer)) or isinstance(groups, bool) or groups < 1:
            raise ValueError(f"{where}: groups must be a positive int, got {groups!r}")
        if filters % groups:
            raise ValueError(f"{where}: filters ({filters}) must divide by groups ({groups})")
        self.filters, self.groups = int(filters), int(groups)
        self.kernel_size = sizes(kernel_size, self.rank, "kernel_size", where, 1)
        self.stride = sizes(stride, self.rank, "stride", where, 1)
        self.dilation = sizes(dilation, self.rank, "dilation", where, 1)
        self.padding = (padding if isinstance(padding, str)
                        else _compact(sizes(padding, self.rank, "padding", where, 0)))
        # (before, after) per spatial dimension
        self.paddings = conv_padding(self._plane_padding(), self._plane(self.kernel_size),
                                             self._plane(self.dilation), self._plane(self.stride),
                                             where)[2 - self.rank:]
        self.activation = activation
        self.alpha = float(alpha)
        if self.alpha < 0:   # the backward reads the derivative from the output
            raise ValueError(f"{where}: leaky_relu alpha must be >= 0, got {alpha!r}")
        self.use_bias = bool(use_bias)
        self.dtype = np.dtype(dtype)
        self.kernel_initializer = _kernel_initializer(kernel_initializer, activation)
        self.weight = self.bias = None

    def _plane(self, values):
        """Per-dimension values as the 2-D kernels take them: 1 along a missing height."""
        return (1,) * (2 - self.rank) + tuple(values)

    def _plane_padding(self):
        if isinstance(self.padding, str):
            return self.padding
        return (0,) * (2 - self.rank) + sizes(self.padding, self.rank, "padding",
                                                      type(self).__name__, 0)

    def compute_output_shape(self, input_shape):
        if self.data_format == "channels_last" and len(input_shape) == self.rank + 1:
            return channels_last_shape(self._output_shape(channels_first_shape(input_shape)))
        return self._output_shape(input_shape)

    def _output_shape(self, input_shape):
        where = type(self).__name__
        if len(input_shape) != self.rank + 1:
            raise ValueError(f"{where} takes inputs of shape {self.layout}, got "
                             f"{batch_shape(input_shape)}; add "
                             f"nn.Reshape({self.layout.replace('None, ', '')}) before it")
        channels, spatial = input_shape[0], input_shape[1:]
        if spatial[-1] in (1, 3, 4) and spatial[-1] < self.kernel_size[-1] <= channels:
            # (28, 28, 1): channels last, Keras's and TensorFlow's layout, read as 28 channels
            raise ValueError(f"{where} takes channels first, {self.layout}, and the input "
                             f"{batch_shape(input_shape)} looks channels last (NHWC); move "
                             f"the channels first: np.moveaxis(x, -1, 1), or give the layer "
                             f"data_format='channels_last'")
        if channels % self.groups:
            raise ValueError(f"{where}: the {channels} input channels must divide by groups "
                             f"({self.groups})")
        return (self.filters,) + conv_output_sizes(
            spatial, self.kernel_size, self.stride, self.dilation, self.paddings, where)

    def build(self, input_shape, device="cpu", initialize=True):
        output_shape = super().build(input_shape, device, initialize)
        channels = input_shape[-1 if self.data_format == "channels_last" else 0]
        asked = self.kernel_size + (channels // self.groups, self.filters)   # Keras's
        weight = (self.kernel_initializer(asked, dtype=self.dtype) if initialize
                  else np.zeros(asked, self.dtype))
        if tuple(np.shape(weight)) != asked:
            raise ValueError(f"{type(self).__name__}: the kernel initialiser returned shape "
                             f"{np.shape(weight)} for {asked}")
        torch_axes = (self.rank + 1, self.rank) + tuple(range(self.rank))
        weight = np.ascontiguousarray(np.transpose(weight, torch_axes), self.dtype)
        self.weight = Parameter(to_device(weight, device))
        fan_in = int(np.prod(asked[:-1]))
        bias = (init.bias_for(self.kernel_initializer, fan_in, self.filters, self.dtype)
                if initialize else np.zeros(self.filters, self.dtype))
        self.bias = Parameter(to_device(bias, device)) if self.use_bias else None
        return output_shape

    def forward(self, x):
        _check_input_dtype(self, x.dtype, self.weight.dtype)
        if self.data_format == "channels_last":
            return channels_last(self._forward(channels_first(x, self)))
        return self._forward(x)

    def _forward(self, x):
        fused = self.activation if self.activation in FUSED_ACTIVATIONS else None
        y = _run_op(self, Conv2DOp, *self._plane_inputs(x), stride=self._plane(self.stride),
                    padding=self._plane_padding(), dilation=self._plane(self.dilation),
                    groups=self.groups, activation=fused, alpha=self.alpha)
        if self.rank == 1:
            y = F.reshape(y, (y.shape[0], y.shape[1], y.shape[3]))
        return y if fused == self.activation else _activate(y, self.activation, self.alpha)

    def _plane_inputs(self, x):
        """x and W (and b) as the 2-D op takes them: views with a height of 1 for rank 1."""
        weight = self.weight
        if self.rank == 1:
            if x.ndim != 3:
                raise ValueError(f"{self.name} {self!r}: expects input {self.layout}, got shape "
                                 f"{tuple(x.shape)}")
            x = F.reshape(x, (x.shape[0], x.shape[1], 1, x.shape[2]))
            weight = F.reshape(weight, weight.shape[:2] + (1,) + weight.shape[2:])
        return (x, weight) + ((self.bias,) if self.use_bias else ())

    def get_config(self):
        config = {"filters": self.filters, "kernel_size": _compact(self.kernel_size),
                  "stride": _compact(self.stride), "padding": self.padding,
                  "activation": self.activation}
        if self.dilation != (1,) * self.rank:
            config["dilation"] = _compact(self.dilation)
        if self.groups != 1:
            config["groups"] = self.groups
        if not self.use_bias:
            config["use_bias"] = False
        if self.data_format != "channels_first":
            config["data_format"] = self.data_format
        return {**config, **_weighted_config(self), **super().get_config()}



class Conv1D(_Conv):
    """``activation(conv1d(x, W) + b)`` over ``(N, C, L)`` inputs, as torch's; W
    ``(filters, channels / groups, K)``. See ``_Conv``."""
    rank, layout = 1, "(None, channels, length)"


class Conv2D(_Conv):
    """``activation(conv2d(x, W) + b)`` over NCHW inputs; W ``(filters, channels / groups,
    KH, KW)``. See ``_Conv``."""
    rank, layout = 2, "(None, channels, height, width)"
