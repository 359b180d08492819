"""Keras-style layers and the ``Sequential`` model.

Shapes are inferred when a layer is added: the first layer declares ``input_shape=`` (without
the batch dimension) and every later layer is built from its predecessor's output shape, so
a layer that cannot take that shape fails at ``add`` time, not in the middle of training.

A built model keeps its parameters in one flat data buffer and one flat gradient buffer per
device and dtype (``engine.parameter.FlatBuffer``); each Parameter is a view. Optimizers run
one kernel over each buffer and ``model.to(device)`` moves each in one copy.

``model.save(path)`` writes one ``.npz``: the architecture as JSON text under
``CONFIG_KEY`` and the weights by name, through ``engine.archive.atomic_write`` (an
interrupted save leaves the previous file intact). ``load`` reads it with
``engine.archive.read_npz``: arrays and text only, never pickles, so a model file can never
run code, and any damage is a ``ValueError`` naming the file. ``load`` rebuilds the layers
by class name from ``LAYERS``: the built-in ones and those a user registers with
``@nn.register``.
"""
import importlib
import json
import math
import os
import zlib

import numpy as np

from engine import archive
from engine import distributed as dist
from engine import functional as F
from engine import init
from engine.autograd import apply
from engine.parameter import Parameter, ParameterStore
from engine.random import generator
from engine.tensor import Tensor, tensor
from ops import batch_norm as batch_norm_op
from ops import conv as conv_op
from ops import dropout as dropout_op
from ops import pool as pool_op
from ops.device import check_device, copy_into, to_device, to_host
from ops.launch import note_participant
from ops import pointwise
from ops.pointwise import ACTIVATIONS as FUSED_ACTIVATIONS

# the pointwise activations of ops.pointwise.TABLE, and softmax (not pointwise: a row's)
ACTIVATIONS = pointwise.LAYER_ACTIVATIONS + ("softmax", None)
FORMAT_VERSION = 1
CONFIG_KEY = "__config__"
TRAINING_PREFIX = "train/"   # what `python -m engine.train --save` adds beside the model
MODEL_FILE = "a model file written by model.save"


def _check_activation(name, where):
    """The activation's name; the engine's own functions (``engine.relu``, as Keras takes
    ``keras.activations.relu``) stand for their names."""
    named = getattr(name, "__name__", None)
    if callable(name) and named in ACTIVATIONS and getattr(F, named, None) is name:
        name = named
    if callable(name):
        raise ValueError(f"{where}: activation takes a name, one of {ACTIVATIONS} (or the "
                         f"engine's function of that name, engine.relu ...), got {name!r}; "
                         "for another function, put an nn.Layer subclass after the layer "
                         "(see nn.register)")
    if name not in ACTIVATIONS:
        raise ValueError(f"{where}: unknown activation {name!r}; expected one of {ACTIVATIONS}")
    return name


def _check_input_dtype(where, given, dtype):
    """A TypeError (naming ``where``) unless the input dtype ``given`` is the float ``dtype``
    of a layer; integer input (raw images) names the preprocessing that a model trained
    through ``data.DataLoader`` lacks."""
    if given == dtype:
        return
    if given.kind in "iub":
        raise TypeError(
            f"{where}: input dtype {given} (raw images?) is not the layer's "
            f"{dtype}: scale it as data.DataLoader did in training (uint8 / 255, then its "
            "normalize=(mean, std)), or start the model with nn.Rescaling(1 / 255) and "
            "nn.Normalization(mean, std ** 2), which take raw images")
    raise TypeError(f"{where}: input dtype {given} does not match the layer's {dtype}")


def _activate(x, name, alpha):
    """``x`` through the activation ``name``, unfused: Activation, and the activations whose
    derivative a Dense or Conv2D kernel cannot take from its output (softmax, gelu)."""
    if name is None:
        return x
    if name == "leaky_relu":
        return F.leaky_relu(x, alpha)
    if name == "softmax":
        return F.softmax(x, axis=-1)
    return getattr(F, name)(x)


def _feature_shape(shape, where):
    """``input_shape`` as a tuple of positive ints (an int means a 1-D feature vector)."""
    if shape is None:
        return None
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        shape = tuple(shape)
    except TypeError:
        raise TypeError(f"{where}: input_shape must be a tuple of ints, got {shape!r}") from None
    if not shape or not all(isinstance(s, (int, np.integer)) and s > 0 for s in shape):
        raise ValueError(f"{where}: input_shape must be positive ints without the batch "
                         f"dimension, e.g. (28, 28); got {shape!r}")
    return tuple(int(s) for s in shape)


def _float_dtype(target):
    """The float dtype ``target`` names for ``Sequential.to``, or None when it names a device;
    a non-float dtype is a TypeError."""
    if isinstance(target, str) and target.lower().split(":")[0] in ("cpu", "cuda", "auto"):
        return None
    try:
        dtype = np.dtype(target)
    except TypeError:
        return None
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"Sequential.to: a model converts to float32 or float64, not {dtype}")
    return dtype


def batch_shape(shape):
    """``(None, 28, 28)``: a feature shape as Keras prints it, the batch dimension open."""
    return "(" + ", ".join(["None"] + [str(s) for s in shape]) + ")"


# ------------------------------------------------------------------ layers

def _arrays_key(named):
    """The identity of each named tensor's storage and whether it requires grad."""
    return tuple((name, id(value.data), value.requires_grad) for name, value in named)


class Layer:
    """A layer: ``build`` maps an input feature shape to its output shape (making parameters),
    ``forward`` maps a batch Tensor to a batch Tensor."""

    def __init__(self, input_shape=None):
        self.input_shape = _feature_shape(input_shape, type(self).__name__)
        self.output_shape = None
        self.name = type(self).__name__.lower()
        self.training = True
        self.built = False

    def build(self, input_shape, device="cpu", initialize=True):
        """Make parameters for inputs of ``input_shape``; returns the output feature shape.

        Raises ValueError with the reason when this layer cannot take that shape."""
        self.output_shape = self.compute_output_shape(input_shape)
        self.built = True
        return self.output_shape

    def compute_output_shape(self, input_shape):
        return input_shape

    def named_parameters(self):
        return []

    def named_buffers(self):
        """``[(name, Tensor)]``: state that is saved and moved with the model but gets no
        gradient and no optimizer update (BatchNorm's running statistics)."""
        return []

    def forward(self, x):
        raise NotImplementedError(f"{type(self).__name__}: no forward")

    def __call__(self, x):
        if not self.built:   # a layer used on its own is built from its first input
            self.build(x.shape[1:], x.device)
        note_participant(self)
        return self.forward(x)

    def capture_key(self):
        """What the host decides about this layer's kernels: its mode, its parameters and
        buffers and whether each requires grad (``engine.capture`` replays only while this
        is unchanged)."""
        return (self.training, _arrays_key(self.named_parameters()),
                _arrays_key(self.named_buffers()))

    def get_config(self):
        """Constructor arguments as JSON-able values: ``type(self)(**config)`` rebuilds it."""
        return {} if self.input_shape is None else {"input_shape": list(self.input_shape)}

    def __repr__(self):
        args = ", ".join(f"{k}={tuple(v) if isinstance(v, list) else v!r}"
                         for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


class Dense(Layer):
    """``activation(x @ W + b)`` with W of shape (in, units), one fused kernel per direction.

    The kernel defaults to He initialisation for the relu family and Xavier otherwise; the
    bias starts at zero. ``"softmax"`` runs the Dense kernel without activation, then softmax.
    """

    def __init__(self, units, activation=None, kernel_initializer=None, alpha=0.01,
                 dtype=np.float32, input_shape=None):
        super().__init__(input_shape)
        if not isinstance(units, (int, np.integer)) or units <= 0:
            raise ValueError(f"Dense: units must be a positive int, got {units!r}")
        self.units = int(units)
        self.activation = _check_activation(activation, "Dense")
        self.alpha = float(alpha)
        self.dtype = np.dtype(dtype)
        self.kernel_initializer = _kernel_initializer(kernel_initializer, activation)
        self.weight = self.bias = None

    def compute_output_shape(self, input_shape):
        if len(input_shape) != 1:
            raise ValueError(f"Dense takes inputs of shape (None, features), got "
                             f"{batch_shape(input_shape)}; add nn.Flatten() before it")
        return (self.units,)

    def build(self, input_shape, device="cpu", initialize=True):
        output_shape = super().build(input_shape, device, initialize)
        shape = (input_shape[0], self.units)
        weight = (self.kernel_initializer(shape, dtype=self.dtype) if initialize
                  else np.zeros(shape, self.dtype))
        if tuple(np.shape(weight)) != shape:
            raise ValueError(f"Dense: the kernel initialiser returned shape {np.shape(weight)} "
                             f"for {shape}")
        self.weight = Parameter(to_device(np.asarray(weight, self.dtype), device))
        self.bias = Parameter(to_device(init.zeros((self.units,), self.dtype), device))
        return output_shape

    def named_parameters(self):
        return [("weight", self.weight), ("bias", self.bias)] if self.built else []

    def forward(self, x):
        from ops import dense   # the fused kernels (ops/dense.py)
        features = self.weight.shape[0]
        if x.ndim != 2 or x.shape[1] != features:
            raise ValueError(f"{self.name} {self!r}: expects input of shape (None, {features}), "
                             f"got {x.shape}")
        _check_input_dtype(f"{self.name} {self!r}", x.dtype, self.weight.dtype)
        fused = self.activation if self.activation in FUSED_ACTIVATIONS else None
        y = apply(dense.Dense, x, self.weight, self.bias, activation=fused, alpha=self.alpha)
        return y if fused == self.activation else _activate(y, self.activation, self.alpha)

    def get_config(self):
        config = {"units": self.units, "activation": self.activation}
        return {**config, **_weighted_config(self), **super().get_config()}


def _kernel_initializer(chosen, activation):
    """The initialiser a layer with a kernel uses: the one chosen, else He for the relu
    family and Xavier otherwise."""
    if chosen is None:
        entry = pointwise.BY_NAME.get(activation)
        chosen = entry.initializer if entry is not None else "xavier_uniform"
    return init.get(chosen)


def _weighted_config(layer):
    """The config entries a layer with a kernel shares (Dense, Conv2D): alpha for leaky_relu,
    a non-default dtype, a kernel initialiser known by name."""
    config = {}
    if layer.activation == "leaky_relu":
        config["alpha"] = layer.alpha
    if layer.dtype != np.float32:
        config["dtype"] = layer.dtype.name
    name = getattr(layer.kernel_initializer, "__name__", None)
    if init.INITIALIZERS.get(name) is layer.kernel_initializer:
        config["kernel_initializer"] = name
    return config


class Activation(Layer):
    """An activation by name as a layer: one of ``ACTIVATIONS`` ("relu", "gelu", "softmax",
    ...)."""

    def __init__(self, activation, alpha=0.01, input_shape=None):
        super().__init__(input_shape)
        self.activation = _check_activation(activation, "Activation")
        self.alpha = float(alpha)

    def forward(self, x):
        return _activate(x, self.activation, self.alpha)

    def get_config(self):
        config = {"activation": self.activation}
        if self.activation == "leaky_relu":
            config["alpha"] = self.alpha
        return {**config, **super().get_config()}


class Flatten(Layer):
    """``(None, d1, d2, ...) -> (None, d1 * d2 * ...)``: a view, no kernel."""

    def compute_output_shape(self, input_shape):
        return (math.prod(input_shape),)

    def forward(self, x):
        return F.flatten(x, 1)


class Dropout(Layer):
    """Inverted dropout: in training, zero each element with probability ``p`` and scale the
    rest by ``1 / (1 - p)``; the identity in ``eval()``.

    Each training call draws a fresh mask on the device, from the layer's seed state: two
    buffers on its device, ``seed`` (the base seed, drawn from the engine's generator when
    the layer is built, like a weight: ``engine.manual_seed`` before building makes the
    masks reproducible) and ``masks_drawn`` (how many masks it has drawn). One kernel per
    call hashes the two into the call's seed and advances the count (``ops.dropout``), so
    a captured step draws a new mask at every replay, the same masks as the eager step. The
    state is saved, loaded and moved with the model, so a resumed checkpoint draws the masks
    the uninterrupted run would have."""

    def __init__(self, p=0.5, input_shape=None):
        super().__init__(input_shape)
        if not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout: p must be a probability in [0, 1), got {p!r}")
        self.p = float(p)
        self.seed = self.masks_drawn = None

    def build(self, input_shape, device="cpu", initialize=True):
        output_shape = super().build(input_shape, device, initialize)
        # a model read from a file (initialize=False) gets its seed state from the file and
        # leaves the generator as it was; a file written before Dropout had seed state keeps
        # this one, from the layer's unique name, so its Dropout layers draw different masks
        base_seed = (int(generator().integers(0, dropout_op.SEED_LIMIT)) if initialize
                     else zlib.crc32(self.name.encode()))
        self.seed, self.masks_drawn = (
            Tensor(array) for array in dropout_op.new_seed_state(base_seed, device))
        return output_shape

    def named_buffers(self):
        if not self.built:
            return []
        return [("seed", self.seed), ("masks_drawn", self.masks_drawn)]

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        seed = dropout_op.next_mask_seed(self.seed.data, self.masks_drawn.data)
        return _run_op(self, dropout_op.Dropout, x, seed, p=self.p)

    def get_config(self):
        return {"p": self.p, **super().get_config()}


def _statistics(named_buffers):
    """The float buffers (running statistics) of ``named_buffers``: the integer ones are a
    random stream's state (Dropout), never converted to another dtype nor counted as
    parameters."""
    return [(name, b) for name, b in named_buffers if b.dtype.kind == "f"]


def _compact(values):
    """Per-dimension values as the config keeps them: one int when all are equal, else a
    list."""
    return values[0] if len(set(values)) == 1 else list(values)


def _image_shape(input_shape, where):
    """``(channels, height, width)`` of a 3-D feature shape, else a ValueError saying what
    to add in front."""
    if len(input_shape) != 3:
        raise ValueError(f"{where} takes inputs of shape (None, channels, height, width), got "
                         f"{batch_shape(input_shape)}; add nn.Reshape((channels, height, "
                         "width)) before it")
    return input_shape


def _run_op(layer, op_class, *inputs, **params):
    """``apply(op_class, ...)`` with an op's refusal (shapes, dtypes) naming the layer."""
    try:
        return apply(op_class, *inputs, **params)
    except (ValueError, TypeError) as error:
        raise type(error)(f"{layer.name} {layer!r}: {error}") from None


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
                 dtype=np.float32, input_shape=None):
        super().__init__(input_shape)
        where = type(self).__name__
        if not isinstance(filters, (int, np.integer)) or isinstance(filters, bool) or filters <= 0:
            raise ValueError(f"{where}: filters must be a positive int, got {filters!r}")
        if activation not in pointwise.LAYER_ACTIVATIONS + (None,):
            raise ValueError(f"{where}: unknown activation {activation!r}; expected one of "
                             f"{pointwise.LAYER_ACTIVATIONS + (None,)}")
        if not isinstance(groups, (int, np.integer)) or isinstance(groups, bool) or groups < 1:
            raise ValueError(f"{where}: groups must be a positive int, got {groups!r}")
        if filters % groups:
            raise ValueError(f"{where}: filters ({filters}) must divide by groups ({groups})")
        self.filters, self.groups = int(filters), int(groups)
        self.kernel_size = conv_op.sizes(kernel_size, self.rank, "kernel_size", where, 1)
        self.stride = conv_op.sizes(stride, self.rank, "stride", where, 1)
        self.dilation = conv_op.sizes(dilation, self.rank, "dilation", where, 1)
        self.padding = (padding if isinstance(padding, str)
                        else _compact(conv_op.sizes(padding, self.rank, "padding", where, 0)))
        # (before, after) per spatial dimension
        self.paddings = conv_op.conv_padding(self._plane_padding(), self._plane(self.kernel_size),
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
        return (0,) * (2 - self.rank) + conv_op.sizes(self.padding, self.rank, "padding",
                                                      type(self).__name__, 0)

    def compute_output_shape(self, input_shape):
        where = type(self).__name__
        if len(input_shape) != self.rank + 1:
            raise ValueError(f"{where} takes inputs of shape {self.layout}, got "
                             f"{batch_shape(input_shape)}; add "
                             f"nn.Reshape({self.layout.replace('None, ', '')}) before it")
        channels, spatial = input_shape[0], input_shape[1:]
        if channels % self.groups:
            raise ValueError(f"{where}: the {channels} input channels must divide by groups "
                             f"({self.groups})")
        return (self.filters,) + conv_op.conv_output_sizes(
            spatial, self.kernel_size, self.stride, self.dilation, self.paddings, where)

    def build(self, input_shape, device="cpu", initialize=True):
        output_shape = super().build(input_shape, device, initialize)
        asked = self.kernel_size + (input_shape[0] // self.groups, self.filters)   # Keras's
        weight = (self.kernel_initializer(asked, dtype=self.dtype) if initialize
                  else np.zeros(asked, self.dtype))
        if tuple(np.shape(weight)) != asked:
            raise ValueError(f"{type(self).__name__}: the kernel initialiser returned shape "
                             f"{np.shape(weight)} for {asked}")
        torch_axes = (self.rank + 1, self.rank) + tuple(range(self.rank))
        weight = np.ascontiguousarray(np.transpose(weight, torch_axes), self.dtype)
        self.weight = Parameter(to_device(weight, device))
        self.bias = (Parameter(to_device(init.zeros((self.filters,), self.dtype), device))
                     if self.use_bias else None)
        return output_shape

    def named_parameters(self):
        if not self.built:
            return []
        return [("weight", self.weight)] + ([("bias", self.bias)] if self.use_bias else [])

    def forward(self, x):
        _check_input_dtype(f"{self.name} {self!r}", x.dtype, self.weight.dtype)
        fused = self.activation if self.activation in FUSED_ACTIVATIONS else None
        y = _run_op(self, conv_op.Conv2D, *self._plane_inputs(x), stride=self._plane(self.stride),
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
        return {**config, **_weighted_config(self), **super().get_config()}



class Conv1D(_Conv):
    """``activation(conv1d(x, W) + b)`` over ``(N, C, L)`` inputs, as torch's; W
    ``(filters, channels / groups, K)``. See ``_Conv``."""
    rank, layout = 1, "(None, channels, length)"


class Conv2D(_Conv):
    """``activation(conv2d(x, W) + b)`` over NCHW inputs; W ``(filters, channels / groups,
    KH, KW)``. See ``_Conv``."""
    rank, layout = 2, "(None, channels, height, width)"


class _Pool2D(Layer):
    """A pooling window over each channel of NCHW inputs: ``pool_size``, ``stride`` (default
    ``pool_size``) and ``padding`` (at most half the window), as torch's."""
    op = None   # the ops.pool op class

    def __init__(self, pool_size, stride=None, padding=0, input_shape=None):
        super().__init__(input_shape)
        where = type(self).__name__
        self.pool_size = conv_op.pair(pool_size, "pool_size", where, 1)
        self.stride = (self.pool_size if stride is None
                       else conv_op.pair(stride, "stride", where, 1))
        self.padding = conv_op.pair(padding, "padding", where, 0)
        if any(2 * p > k for p, k in zip(self.padding, self.pool_size)):
            raise ValueError(f"{where}: padding {_compact(self.padding)} must be at most half "
                             f"of pool_size {_compact(self.pool_size)}")

    def compute_output_shape(self, input_shape):
        where = type(self).__name__
        channels, height, width = _image_shape(input_shape, where)
        sizes = [conv_op.window_output_size(size, kernel, stride, 1, pad, pad)
                 for size, kernel, stride, pad in zip((height, width), self.pool_size,
                                                      self.stride, self.padding)]
        if min(sizes) < 1:
            raise ValueError(f"{where}: pool_size {_compact(self.pool_size)} does not fit in "
                             f"the padded input ({height + 2 * self.padding[0]}x"
                             f"{width + 2 * self.padding[1]})")
        return (channels, sizes[0], sizes[1])

    def forward(self, x):
        return _run_op(self, self.op, x, kernel_size=self.pool_size, stride=self.stride,
                       padding=self.padding)

    def get_config(self):
        config = {"pool_size": _compact(self.pool_size)}
        if self.stride != self.pool_size:
            config["stride"] = _compact(self.stride)
        if self.padding != (0, 0):
            config["padding"] = _compact(self.padding)
        return {**config, **super().get_config()}


class MaxPool2D(_Pool2D):
    """The maximum of each window (padding never wins; ties send the gradient to the first)."""
    op = pool_op.MaxPool2D


class AvgPool2D(_Pool2D):
    """The mean of each window, padded zeros counted (torch's ``count_include_pad``)."""
    op = pool_op.AvgPool2D


class BatchNorm(Layer):
    """Normalise each channel of (None, C, H, W) inputs, or each feature of (None, F) ones
    (also (None, C, L)), as torch's BatchNorm2d/1d: in training with the batch's mean and
    biased variance, updating the running statistics with torch's convention
    (``running = (1 - momentum)·running + momentum·batch``, the variance unbiased); in
    ``eval()`` with the running statistics. Then ``weight`` (ones) scales and ``bias``
    (zeros) shifts. The running statistics are buffers: in ``state_dict``, saved and moved
    with the model, never given a gradient or an optimizer update.

    In a data-parallel run (``engine.distributed`` with several ranks, ``--distributed``)
    the training statistics are the global batch's, averaged across the ranks (torch's
    SyncBatchNorm: ``ops.batch_norm.SyncBatchNorm``), so the run trains as one process on
    the whole batch; every rank must then run the layer's training forwards alike.
    ``sync=False`` keeps each rank's own statistics."""

    def __init__(self, momentum=0.1, eps=1e-5, dtype=np.float32, input_shape=None, sync=True):
        super().__init__(input_shape)
        if (not isinstance(momentum, (int, float)) or isinstance(momentum, bool)
                or not 0 <= momentum <= 1):
            raise ValueError(f"BatchNorm: momentum must be a number in [0, 1], got {momentum!r}")
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
            raise ValueError(f"BatchNorm: eps must be a number > 0, got {eps!r}")
        self.momentum, self.eps = float(momentum), float(eps)
        self.dtype = np.dtype(dtype)
        self.sync = bool(sync)
        self.weight = self.bias = self.running_mean = self.running_var = None

    def compute_output_shape(self, input_shape):
        if not 1 <= len(input_shape) <= 3:
            raise ValueError(f"BatchNorm takes inputs of shape (None, features) or (None, "
                             f"channels, height, width), got {batch_shape(input_shape)}")
        return input_shape

    def build(self, input_shape, device="cpu", initialize=True):
        output_shape = super().build(input_shape, device, initialize)
        channels = (input_shape[0],)
        self.weight = Parameter(to_device(np.ones(channels, self.dtype), device))
        self.bias = Parameter(to_device(init.zeros(channels, self.dtype), device))
        self.running_mean = tensor(np.zeros(channels, self.dtype), device=device)
        self.running_var = tensor(np.ones(channels, self.dtype), device=device)
        return output_shape

    def named_parameters(self):
        return [("weight", self.weight), ("bias", self.bias)] if self.built else []

    def named_buffers(self):
        if not self.built:
            return []
        return [("running_mean", self.running_mean), ("running_var", self.running_var)]

    def forward(self, x):
        _check_input_dtype(f"{self.name} {self!r}", x.dtype, self.weight.dtype)
        if self.training and self.sync and dist.several_ranks():
            return _run_op(self, batch_norm_op.SyncBatchNorm, x, self.running_mean,
                           self.running_var, self.weight, self.bias, training=True,
                           momentum=self.momentum, eps=self.eps,
                           average=dist.average_across_ranks, ranks=dist.world_size())
        return _run_op(self, batch_norm_op.BatchNorm, x, self.running_mean, self.running_var,
                       self.weight, self.bias, training=self.training, momentum=self.momentum,
                       eps=self.eps)

    def get_config(self):
        config = {"momentum": self.momentum, "eps": self.eps}
        if self.dtype != np.float32:
            config["dtype"] = self.dtype.name
        if not self.sync:
            config["sync"] = False
        return {**config, **super().get_config()}


class Reshape(Layer):
    """``(None, ...) -> (None, *shape)``: a view, no kernel. One entry of ``shape`` may be
    -1, inferred from the others."""

    def __init__(self, shape, input_shape=None):
        super().__init__(input_shape)
        if isinstance(shape, (int, np.integer)):
            shape = (shape,)
        try:
            shape = tuple(shape)
        except TypeError:
            raise TypeError(f"Reshape: shape must be a tuple of ints, got {shape!r}") from None
        if (not shape or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool)
                                 and (s > 0 or s == -1) for s in shape)
                or shape.count(-1) > 1):
            raise ValueError(f"Reshape: shape must be positive ints without the batch "
                             f"dimension (one of them may be -1), e.g. (1, 28, 28); got "
                             f"{shape!r}")
        self.shape = tuple(int(s) for s in shape)

    def compute_output_shape(self, input_shape):
        values = math.prod(input_shape)
        known = math.prod(s for s in self.shape if s != -1)
        shape = tuple(values // known if s == -1 else s for s in self.shape)
        if math.prod(shape) != values:
            raise ValueError(f"Reshape: cannot reshape {batch_shape(input_shape)} ({values} "
                             f"values per sample) to {batch_shape(self.shape)}")
        return shape

    def forward(self, x):
        return F.reshape(x, (x.shape[0],) + self.output_shape)

    def get_config(self):
        return {"shape": list(self.shape), **super().get_config()}


def _number(value, where, what):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value):
        raise ValueError(f"{where}: {what} must be a finite number, got {value!r}")
    return float(value)


def _statistic(value, where, what):
    """``value`` (a number, nested lists or an array) as a finite float64 array."""
    try:
        array = np.asarray(value.numpy() if isinstance(value, Tensor) else value, np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{where}: {what} must be a number or an array of numbers, "
                        f"got {value!r}") from None
    if not np.isfinite(array).all():
        raise ValueError(f"{where}: {what} must be finite, got {array}")
    return array


def _as_config(array):
    return float(array) if array.ndim == 0 else array.tolist()


class Rescaling(Layer):
    """``x * scale + offset`` (Keras's Rescaling): ``Rescaling(1 / 255)`` takes raw uint8
    images to [0, 1]. Integer input is cast to the layer's dtype first, so a model that starts
    with it takes images as ``data.mnist.load`` gives them. No parameters."""

    def __init__(self, scale, offset=0.0, dtype=np.float32, input_shape=None):
        super().__init__(input_shape)
        self.scale = _number(scale, "Rescaling", "scale")
        self.offset = _number(offset, "Rescaling", "offset")
        self.dtype = np.dtype(dtype)

    def forward(self, x):
        if x.dtype.kind in "iub":
            x = F.astype(x, self.dtype)
        elif x.dtype != self.dtype:
            raise TypeError(f"{self.name} {self!r}: input dtype {x.dtype} is neither an "
                            f"integer type nor the layer's {self.dtype}")
        if self.scale != 1.0:
            x = x * self.scale
        return x + self.offset if self.offset != 0.0 else x

    def get_config(self):
        config = {"scale": self.scale, "offset": self.offset}
        if self.dtype != np.float32:
            config["dtype"] = self.dtype.name
        return {**config, **super().get_config()}


class Normalization(Layer):
    """``(x - mean) / sqrt(variance)`` with fixed statistics (Keras's Normalization given
    ``mean`` and ``variance``; Keras's floor on the standard deviation, 1e-7, too). The
    statistics are numbers or arrays broadcasting against one sample, e.g. MNIST's pixel mean
    and variance after ``Rescaling(1 / 255)``. They are buffers: saved and moved with the
    model, never trained; the config keeps them too, so the layer is rebuilt from it."""

    STD_FLOOR = 1e-7   # Keras's backend.epsilon()

    def __init__(self, mean, variance, dtype=np.float32, input_shape=None):
        super().__init__(input_shape)
        self.mean_value = _statistic(mean, "Normalization", "mean")
        self.variance_value = _statistic(variance, "Normalization", "variance")
        if (self.variance_value < 0).any():
            raise ValueError(f"Normalization: variance must be >= 0, got {self.variance_value}; "
                             "pass the variance (std ** 2), not the std")
        self.dtype = np.dtype(dtype)
        self.mean = self.variance = None

    def compute_output_shape(self, input_shape):
        try:
            fits = np.broadcast_shapes(self.mean_value.shape, self.variance_value.shape,
                                       input_shape) == tuple(input_shape)
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(f"Normalization: mean {self.mean_value.shape} and variance "
                             f"{self.variance_value.shape} must broadcast against one sample "
                             f"of shape {tuple(input_shape)}")
        return input_shape

    def build(self, input_shape, device="cpu", initialize=True):
        output_shape = super().build(input_shape, device, initialize)
        self.mean = tensor(self.mean_value.astype(self.dtype), device=device)
        self.variance = tensor(self.variance_value.astype(self.dtype), device=device)
        return output_shape

    def named_buffers(self):
        return [("mean", self.mean), ("variance", self.variance)] if self.built else []

    def forward(self, x):
        _check_input_dtype(f"{self.name} {self!r}", x.dtype, self.mean.dtype)
        std = F.clip(F.sqrt(self.variance), min=self.STD_FLOOR)
        return (x - self.mean) / std

    def get_config(self):
        # the buffers once built: load_state_dict may have written other statistics
        mean, variance = ((self.mean.numpy(), self.variance.numpy()) if self.built
                          else (self.mean_value, self.variance_value))
        config = {"mean": _as_config(np.asarray(mean, np.float64)),
                  "variance": _as_config(np.asarray(variance, np.float64))}
        if self.dtype != np.float32:
            config["dtype"] = self.dtype.name
        return {**config, **super().get_config()}


LAYERS = {cls.__name__: cls for cls in (Dense, Activation, Flatten, Dropout, Conv1D, Conv2D,
                                        MaxPool2D,
                                        AvgPool2D, BatchNorm, Reshape, Rescaling, Normalization)}


def register(layer_class):
    """Class decorator: ``nn.load`` (and ``Sequential.from_config``) rebuild saved layers of
    ``layer_class`` by its name, as Keras's ``register_keras_serializable`` does. The class
    must subclass ``nn.Layer`` and its ``get_config()`` must return its constructor's
    arguments; registering another class under a taken name is a ValueError. Returns the
    class."""
    if not (isinstance(layer_class, type) and issubclass(layer_class, Layer)):
        raise TypeError(f"nn.register: expected an nn.Layer subclass, got {layer_class!r}")
    name = layer_class.__name__
    taken = LAYERS.get(name)
    if taken is not None and taken is not layer_class and \
            (taken.__module__, taken.__qualname__) != (layer_class.__module__,
                                                       layer_class.__qualname__):
        raise ValueError(f"nn.register: the layer name {name!r} is taken by "
                         f"{taken.__module__}.{taken.__qualname__}; rename the class")
    LAYERS[name] = layer_class
    return layer_class


# ------------------------------------------------------------------ the model

class Sequential:
    """A stack of layers, each fed the previous one's output.

    ``Sequential([...])`` (or torch's ``Sequential(a, b, ...)``) or ``model.add(layer)``; the
    first layer's ``input_shape=`` fixes the input (without the batch dimension). Without it
    the model is built on its first call. ``len(model)`` and ``model[i]`` are its layers.
    """

    def __init__(self, layers=(), *more_layers, name="sequential"):
        if isinstance(layers, Layer):   # torch's spelling: the layers as arguments
            layers = (layers,) + more_layers
        elif more_layers:
            raise TypeError(f"Sequential: takes a list of layers (or layers as arguments), "
                            f"got {type(layers).__name__} and then {more_layers!r}")
        if isinstance(name, Layer) or not isinstance(name, str):
            raise TypeError(f"Sequential: name must be text, got {name!r}")
        self.name = name
        self.layers = []
        self.device = "cpu"
        self.training = True
        self.input_shape = None     # feature shape of the inputs, once known
        self.output_shape = None
        self._flat = []
        self._initialize = True     # False while ``load`` rebuilds a model to fill from a file
        for layer in layers:
            self.add(layer)

    # ------------------------------------------------------------- building
    def add(self, layer):
        """Append ``layer``; builds it now when the input shape is known. Returns the model."""
        if not isinstance(layer, Layer):
            raise TypeError(f"Sequential.add: expected an engine.nn layer, got {layer!r}")
        if layer.built or any(layer is other for other in self.layers):
            raise ValueError(f"Sequential.add: {layer!r} is already built into a model; "
                             "make a new layer")
        layer.name = self._unique_name(layer)
        layer.training = self.training
        if not self.layers:
            self.input_shape = layer.input_shape
            self.output_shape = layer.input_shape
        self.layers.append(layer)
        if self.output_shape is not None:
            shape = self.output_shape
            try:
                self._build_layer(len(self.layers) - 1)
            except ValueError:
                self.layers.pop()
                self.output_shape = shape
                raise
            self._pack()
        return self

    def _unique_name(self, layer):
        base = type(layer).__name__.lower()
        taken = {other.name for other in self.layers}
        if base not in taken:
            return base
        return next(f"{base}_{k}" for k in range(1, len(self.layers) + 2)
                    if f"{base}_{k}" not in taken)

    def _build_layer(self, index):
        layer = self.layers[index]
        shape = self.output_shape
        if index == 0:
            source = f"the model input {batch_shape(shape)}"
        else:
            previous = self.layers[index - 1]
            source = (f"layer {index - 1} '{previous.name}' {previous!r} with output "
                      f"{batch_shape(shape)}")
        if layer.input_shape is not None and layer.input_shape != shape:
            raise ValueError(f"Sequential: layer {index} '{layer.name}' {layer!r} declares "
                             f"input_shape {batch_shape(layer.input_shape)} but gets {source}")
        try:
            self.output_shape = layer.build(shape, self.device, self._initialize)
        except ValueError as error:
            raise ValueError(f"Sequential: layer {index} '{layer.name}' {layer!r} cannot take "
                             f"{source}: {error}") from None

    def _build_from(self, input_shape):
        """Build every layer for inputs of ``input_shape`` (a model whose first layer had no
        ``input_shape=``, on its first call)."""
        self.input_shape = self.output_shape = tuple(input_shape)
        try:
            for index in range(len(self.layers)):
                self._build_layer(index)
        except ValueError:
            for layer in self.layers:
                layer.built = False
            self.input_shape = self.output_shape = None
            raise
        self._pack()

    def _pack(self):
        """(Re)pack all parameters into one FlatBuffer per (device, dtype), in layer order."""
        self._flat = ParameterStore(self.parameters())

    @property
    def built(self):
        return bool(self.layers) and all(layer.built for layer in self.layers)

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, index):
        """The layer at ``index`` (negative counts from the end), as torch's Sequential."""
        if isinstance(index, slice):
            raise TypeError(f"{self.name}[{index.start}:{index.stop}]: a layer belongs to one "
                            "model; take model.layers[...] for a list of layers")
        return self.layers[index]

    def _require_built(self, what):
        if not self.built:
            raise RuntimeError(f"{self.name}.{what}: the model is not built yet; give the first "
                               "layer input_shape=... or call the model once on a batch")

    # ------------------------------------------------------------- parameters and devices
    def named_parameters(self):
        """``[(name, Parameter)]`` in layer order: ``"dense.weight"``, ``"dense.bias"``, ..."""
        return [(f"{layer.name}.{name}", p) for layer in self.layers
                for name, p in layer.named_parameters()]

    def parameters(self):
        """The Parameters in a stable order (layer by layer, weight before bias). A model
        not built yet whose layers will have parameters has none to give yet (an optimizer
        would get an empty list): a RuntimeError says how to build it."""
        if not self.built and any(type(layer).named_parameters is not Layer.named_parameters
                                  for layer in self.layers):
            self._require_built("parameters")
        return [p for _, p in self.named_parameters()]

    def named_buffers(self):
        """``[(name, Tensor)]`` of the layers' buffers (``"batchnorm.running_mean"``, ...):
        saved and moved with the model, not trained."""
        return [(f"{layer.name}.{name}", b) for layer in self.layers
                for name, b in layer.named_buffers()]

    def flat_buffers(self):
        """The FlatBuffers holding all parameters and gradients (one per device and dtype)."""
        return list(self._flat)

    def to(self, target):
        """Move every flat buffer to the device ``target`` ("cpu", "cuda") in one copy each,
        or convert every parameter and buffer to the float dtype ``target`` (``np.float64``,
        for float64 checks against references; made afresh, so build the optimizer after);
        returns the model."""
        dtype = _float_dtype(target)
        if dtype is not None:
            return self._to_dtype(dtype)
        device = check_device(target)
        if self._flat:   # a model not built yet has no store: its layers build on self.device
            self._flat.to(device)
        for _, buffer in self.named_buffers():
            if buffer.device != device:
                buffer.data = to_device(buffer.data, device)
        self.device = device
        return self

    def _to_dtype(self, dtype):
        for layer in self.layers:
            if hasattr(layer, "dtype"):
                layer.dtype = dtype
            for _, value in layer.named_parameters() + _statistics(layer.named_buffers()):
                if value.dtype != dtype:
                    value.data = to_device(to_host(value.data).astype(dtype), value.device)
        if self.built:
            self._pack()
        return self

    def cuda(self):
        """``model.to("cuda")``, as torch's ``Module.cuda()``; returns the model."""
        return self.to("cuda")

    def cpu(self):
        """``model.to("cpu")``; returns the model."""
        return self.to("cpu")

    def train(self, mode=True):
        """Training mode (Dropout active, BatchNorm on the batch's statistics); returns the
        model."""
        self.training = bool(mode)
        for layer in self.layers:
            layer.training = self.training
        return self

    def eval(self):
        """Inference mode (Dropout is the identity, BatchNorm uses its running statistics);
        returns the model."""
        return self.train(False)

    # ------------------------------------------------------------- running
    def __call__(self, x):
        if not isinstance(x, Tensor):
            x = tensor(x, dtype=self._input_dtype(np.asarray(x).dtype), device=self.device)
        if x.ndim < 2:
            raise ValueError(f"{self.name}: expects a batch of shape (None, features...), "
                             f"got {x.shape}")
        if not self.built:
            if not self.layers:
                raise RuntimeError(f"{self.name}: the model has no layers")
            self._build_from(x.shape[1:])
        if x.shape[1:] != self.input_shape:
            raise ValueError(f"{self.name}: expects input of shape {batch_shape(self.input_shape)}"
                             f" (first layer '{self.layers[0].name}'), got {x.shape}")
        if x.device != self.device:
            raise ValueError(f"{self.name}: the input is on {x.device} and the model on "
                             f"{self.device}; move one of them with .to('{self.device}')")
        note_participant(self)
        for layer in self.layers:
            x = layer.forward(x)
        return x

    def capture_key(self):
        """Every layer's ``capture_key`` (``engine.capture`` replays only while it holds)."""
        return (self.device,) + tuple(layer.capture_key() for layer in self.layers)

    def _input_dtype(self, given):
        """The dtype a NumPy or list input becomes: its own when integer and the first layer
        casts it (Rescaling); a uint8 array (raw images) any other model refuses, since it
        would run on unscaled pixels; else the parameters' float dtype (lists of ints too)."""
        if given.kind in "iu" and self.layers and isinstance(self.layers[0], Rescaling):
            return given
        dtype = self._flat[0].dtype if self._flat else np.dtype(np.float32)
        if given == np.uint8:
            _check_input_dtype(self.name, given, dtype)
        return dtype

    def predict(self, x, batch_size=256):
        """The model's outputs for ``x`` (a NumPy array, list or Tensor of samples) as one
        NumPy array, computed ``batch_size`` samples at a time, in eval mode and without the
        tape; the model's mode is restored after."""
        if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool) \
                or batch_size < 1:
            raise ValueError(f"{self.name}.predict: batch_size must be a positive int, "
                             f"got {batch_size!r}")
        if not isinstance(x, Tensor):
            x = np.asarray(x)
        if x.ndim < 2:
            raise ValueError(f"{self.name}.predict: expects a batch of shape (None, "
                             f"features...), got {x.shape}")
        from engine.autograd import no_grad
        was_training = self.training
        self.eval()
        try:
            with no_grad():
                outputs = [self(x[start:start + batch_size]).numpy()
                           for start in range(0, len(x), batch_size)]
        finally:
            self.train(was_training)
        if not outputs:
            raise ValueError(f"{self.name}.predict: got no samples ({x.shape})")
        return np.concatenate(outputs)

    # ------------------------------------------------------------- summary
    def summary(self):
        """Print and return a table of layers, output shapes and parameter counts."""
        self._require_built("summary")
        rows = [("Layer (type)", "Output Shape", "Param #")]
        for layer in self.layers:
            count = sum(t.size for _, t in layer.named_parameters()
                        + _statistics(layer.named_buffers()))
            rows.append((f"{layer.name} ({type(layer).__name__})",
                         batch_shape(layer.output_shape), f"{count:,}"))
        widths = [max(len(row[k]) for row in rows) + 4 for k in range(3)]
        width = sum(widths)

        def line(row):
            return (row[0].ljust(widths[0]) + row[1].ljust(widths[1])
                    + row[2].rjust(widths[2] - 4)).rstrip()

        params, buffers = self.parameters(), [b for _, b in _statistics(self.named_buffers())]
        trainable, frozen = sum(p.size for p in params), sum(b.size for b in buffers)
        nbytes = sum(t.size * t.dtype.itemsize for t in params + buffers)
        text = "\n".join(
            [f'Model: "{self.name}" on {self.device}', "_" * width, line(rows[0]), "=" * width]
            + [line(row) for row in rows[1:]]
            + ["=" * width, f"Total params: {trainable + frozen:,} ({_human_bytes(nbytes)})",
               f"Trainable params: {trainable:,}", f"Non-trainable params: {frozen:,}",
               "_" * width])
        print(text)
        return text

    def __repr__(self):
        body = "".join(f"\n  ({layer.name}) {layer!r}" for layer in self.layers)
        return f"Sequential({body}\n)" if body else "Sequential()"

    # ------------------------------------------------------------- weights and files
    def state_dict(self):
        """``{name: NumPy array}``: a host copy of every parameter (one copy per flat
        buffer), then of every buffer (running statistics)."""
        self._require_built("state_dict")
        values = self._flat.host_values() if self._flat else {}
        return {**{name: values[id(p)] for name, p in self.named_parameters()},
                **{name: to_device(b.data, "cpu") for name, b in self.named_buffers()}}

    def load_state_dict(self, state):
        """Copy ``state`` (``{name: array}``, as from ``state_dict``) into the parameters
        and buffers.

        Every key must match a parameter or buffer and every shape its shape; nothing is
        written unless all do. Each flat buffer is written in one copy; a layer's buffers
        are written in place (a captured step keeps updating the same arrays). An integer
        buffer (Dropout's seed state) missing from ``state`` keeps its value: files written
        before Dropout had one still load."""
        self._require_built("load_state_dict")
        buffers = [(name, b) for name, b in self.named_buffers()
                   if name in state or b.dtype.kind == "f"]
        named = self.named_parameters() + buffers
        expected = [name for name, _ in self.named_parameters() + self.named_buffers()]
        missing = [name for name, _ in named if name not in state]
        unexpected = [key for key in state if key not in expected]
        if missing or unexpected:
            raise KeyError(f"load_state_dict: missing key(s) {missing}, unexpected key(s) "
                           f"{unexpected}; the model has {expected}")
        values = {}
        for name, p in named:
            value = state[name]
            value = value.numpy() if isinstance(value, Tensor) else np.asarray(value)
            if tuple(value.shape) != p.shape:
                raise ValueError(f"load_state_dict: '{name}' has shape {tuple(value.shape)}, "
                                 f"the model expects {p.shape}")
            if value.dtype.kind not in "fiu":
                raise TypeError(f"load_state_dict: '{name}' has dtype {value.dtype}, "
                                "expected numbers")
            values[id(p)] = value
        self._flat.load(values)   # reads the parameters' values, not the buffers'
        for _, buffer in buffers:
            copy_into(buffer.data, np.ascontiguousarray(values[id(buffer)], buffer.dtype))
            buffer._bump_version()   # written in place, as the parameters

    def get_config(self):
        return {"format": "engine.nn.Sequential", "version": FORMAT_VERSION, "name": self.name,
                "layers": [{"class_name": type(layer).__name__, "config": layer.get_config()}
                           for layer in self.layers]}

    @classmethod
    def from_config(cls, config):
        """A model with the architecture of ``config`` (its weights zero, not initialised).

        ``config`` is what ``get_config`` returns: ``{"format": "engine.nn.Sequential",
        "version": 1, "name": str, "layers": [{"class_name": str, "config": dict}, ...]}``;
        anything else is a ValueError saying what does not fit (a layer's own checks give
        ValueError or TypeError)."""
        kind = config.get("format") if isinstance(config, dict) else type(config).__name__
        if kind != "engine.nn.Sequential":
            raise ValueError(f"not an engine.nn.Sequential config (format {kind!r})")
        if config.get("version") != FORMAT_VERSION:
            raise ValueError(f"config version {config.get('version')!r} is not supported "
                             f"(this engine reads version {FORMAT_VERSION})")
        name, layers = config.get("name", "sequential"), config.get("layers")
        if not isinstance(name, str) or not isinstance(layers, list):
            raise ValueError("a config needs a text 'name' and a list of 'layers', got "
                             f"{type(name).__name__} and {type(layers).__name__}")
        model = cls(name=name)
        model._initialize = False
        for index, entry in enumerate(layers):
            if (not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str)
                    or not isinstance(entry.get("config"), dict)):
                raise ValueError(f"layer {index} of the config is not "
                                 "{'class_name': str, 'config': dict}")
            layer_class = LAYERS.get(entry["class_name"])
            if layer_class is None:
                raise ValueError(f"unknown layer type {entry['class_name']!r}; known: "
                                 f"{sorted(LAYERS)}; a custom layer loads once its class is "
                                 "decorated with @nn.register (import it before nn.load)")
            model.add(layer_class(**entry["config"]))
        model._initialize = True
        return model

    def save(self, path):
        """Write the architecture and weights to one file at ``path`` with
        ``engine.archive.atomic_write`` (a temporary file in the same directory renamed over
        ``path``; the file gets the mode ``open()`` would give it): a ``.safetensors`` path
        gets a safetensors file (the architecture as JSON in its metadata under
        ``CONFIG_KEY``; the formats extra), any other an ``.npz``."""
        folder = os.path.dirname(os.fspath(path)) or "."
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"{self.name}.save: the folder {folder!r} of "
                                    f"{os.fspath(path)!r} does not exist; create it first "
                                    f"(os.makedirs({folder!r}))")
        config = json.dumps(self.get_config())
        if _is_safetensors(path):
            archive.write_safetensors(path, self.state_dict(), {CONFIG_KEY: config})
            return
        archive.write_npz(path, {CONFIG_KEY: np.array(config), **self.state_dict()})

    def export_onnx(self, path, opset=None, normalize=None):
        """Write the model as ONNX to ``path``; returns the ``onnx.ModelProto``
        (``engine.onnx.export``: the layers it exports, ``normalize``, the onnx extra)."""
        # through the package facade: engine.onnx builds Sequentials on import, so it imports
        # this module, and the layering keeps nn below it
        import engine
        return engine.onnx.export(self, path, opset, normalize)


def _human_bytes(nbytes):
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.2f} {unit}" if unit != "B" else f"{nbytes} B"
        nbytes /= 1024


def _is_safetensors(path):
    return os.fspath(path).lower().endswith(".safetensors")


def _read_safetensors(path):
    """The config text and the weights of a safetensors model file."""
    state, metadata = archive.read_safetensors(path, MODEL_FILE)
    if CONFIG_KEY not in metadata:
        raise ValueError(f"{path!r} holds weights ({len(state)} arrays) but no architecture "
                         f"(metadata {CONFIG_KEY!r}): build the model and call "
                         "model.load_state_dict(safetensors.numpy.load_file(path))")
    return metadata[CONFIG_KEY], state


def _read_npz(path):
    """The config text and the weights of an ``.npz`` model file or checkpoint."""
    entries = archive.read_npz(path, MODEL_FILE,
                               keep=lambda name: not name.startswith(TRAINING_PREFIX))
    config = archive.text_entry(entries, CONFIG_KEY, path, MODEL_FILE)
    return config, {key: value for key, value in entries.items() if key != CONFIG_KEY}


def load(path, device="cpu"):
    """The model saved at ``path`` by ``model.save`` (or a training checkpoint, whose
    ``train/`` entries are skipped unread), on ``device``; a ``.safetensors`` path is read
    as safetensors, an ``.onnx`` one by ``engine.onnx.load``, any other as an ``.npz``.

    The file holds arrays and JSON text, never code. A file that is not such a model,
    damaged or crafted, is a ValueError naming it; a file that cannot be opened is the
    OSError of ``open`` (FileNotFoundError, PermissionError)."""
    path = os.fspath(path)
    if path.lower().endswith(".onnx"):
        import engine   # the facade, as in export_onnx
        return engine.onnx.load(path).to(device)
    try:
        text, state = (_read_safetensors if _is_safetensors(path) else _read_npz)(path)
        config = archive.loads_json(text, f"{path!r}: the architecture ({CONFIG_KEY})")
    except ValueError as error:
        raise ValueError(f"nn.load: {error}") from None
    try:
        model = Sequential.from_config(config)
        model.load_state_dict(state)
    except (KeyError, ValueError, TypeError) as error:
        raise ValueError(f"nn.load: {path!r}: {error}") from None
    except MemoryError:   # a crafted architecture far larger than the weights in the file
        raise ValueError(f"nn.load: {path!r}: the architecture needs more memory than this "
                         "machine has; the file does not hold such weights") from None
    return model.to(device)


# ------------------------------------------------------------------ losses

_LOSSES = ("CrossEntropyLoss", "BCELoss", "MSELoss")


# PyTorch's names that the engine spells its own (Keras's) way
TORCH_EQUIVALENTS = {
    "Linear": "nn.Dense(units, activation=None) (the input size is inferred)",
    "Conv2d": "nn.Conv2D(filters, kernel_size, stride=1, padding='valid')",
    "ReLU": "nn.Activation('relu'), or nn.Dense(units, activation='relu')",
    "Sigmoid": "nn.Activation('sigmoid')",
    "Tanh": "nn.Activation('tanh')",
    "Softmax": "nn.Activation('softmax')",
    "LeakyReLU": "nn.Activation('leaky_relu', alpha=0.01)",
    "MaxPool2d": "nn.MaxPool2D(pool_size)",
    "AvgPool2d": "nn.AvgPool2D(pool_size)",
    "BatchNorm1d": "nn.BatchNorm()",
    "BatchNorm2d": "nn.BatchNorm()",
    "Module": "nn.Layer (a layer: build, forward, get_config) inside an nn.Sequential",
}


def __getattr__(name):
    """``nn.CrossEntropyLoss`` and friends are ``engine.losses``'s, imported on first use;
    PyTorch's names of layers the engine spells otherwise name the engine's."""
    if name in _LOSSES:
        return getattr(importlib.import_module("engine.losses"), name)
    if name in TORCH_EQUIVALENTS:
        raise AttributeError(f"module 'engine.nn' has no attribute {name!r}; the engine's "
                             f"equivalent is {TORCH_EQUIVALENTS[name]}")
    raise AttributeError(f"module 'engine.nn' has no attribute {name!r}")
