"""The layers of ``engine.nn`` but the convolutional ones: ``Layer``, the base every
layer (and a user's ``@nn.register`` one) derives from, and Dense, Activation, Flatten,
Dropout, the pools, BatchNorm, Reshape, Rescaling and Normalization."""
import math
import zlib

import numpy as np

from engine import distributed as dist
from engine import functional as F
from engine import init
from engine.autograd import apply
from engine.parameter import Parameter
from engine.random import generator
from engine.tensor import Tensor, tensor
from ops import pointwise
from ops.batch_norm import BatchNormOp, SyncBatchNormOp
from ops.conv import check_pool_padding, pair, pool_output_sizes
from ops.dense import DenseOp
from ops.device import to_device
from ops.dropout import SEED_LIMIT, DropoutOp, new_seed_state, next_mask_seed
from ops.launch import note_participant
from ops.pointwise import ACTIVATIONS as FUSED_ACTIVATIONS
from ops.pool import AvgPool2DOp, MaxPool2DOp


# the pointwise activations of ops.pointwise.TABLE, and softmax (not pointwise: a row's)
ACTIVATIONS = pointwise.LAYER_ACTIVATIONS + ("softmax", None)


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


def _as_tuple(value, where, what):
    """``value`` (an int or an iterable of them) as a tuple; a TypeError naming ``what``
    otherwise. The entries are checked by the caller."""
    if isinstance(value, (int, np.integer)):
        return (value,)
    try:
        return tuple(value)
    except TypeError:
        raise TypeError(f"{where}: {what} must be a tuple of ints, got {value!r}") from None


def _feature_shape(shape, where):
    """``input_shape`` as a tuple of positive ints (an int means a 1-D feature vector)."""
    if shape is None:
        return None
    shape = _as_tuple(shape, where, "input_shape")
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
        features = self.weight.shape[0]
        if x.ndim != 2 or x.shape[1] != features:
            raise ValueError(f"{self.name} {self!r}: expects input of shape (None, {features}), "
                             f"got {x.shape}")
        _check_input_dtype(f"{self.name} {self!r}", x.dtype, self.weight.dtype)
        fused = self.activation if self.activation in FUSED_ACTIVATIONS else None
        y = apply(DenseOp, x, self.weight, self.bias, activation=fused, alpha=self.alpha)
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
        base_seed = (int(generator().integers(0, SEED_LIMIT)) if initialize
                     else zlib.crc32(self.name.encode()))
        self.seed, self.masks_drawn = (
            Tensor(array) for array in new_seed_state(base_seed, device))
        return output_shape

    def named_buffers(self):
        if not self.built:
            return []
        return [("seed", self.seed), ("masks_drawn", self.masks_drawn)]

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        seed = next_mask_seed(self.seed.data, self.masks_drawn.data)
        return _run_op(self, DropoutOp, x, seed, p=self.p)

    def get_config(self):
        return {"p": self.p, **super().get_config()}


def _float_buffers(named_buffers):
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



class _Pool2D(Layer):
    """A pooling window over each channel of NCHW inputs: ``pool_size``, ``stride`` (default
    ``pool_size``) and ``padding`` (at most half the window), as torch's."""
    op = None   # the ops.pool op class

    def __init__(self, pool_size, stride=None, padding=0, input_shape=None):
        super().__init__(input_shape)
        where = type(self).__name__
        self.pool_size = pair(pool_size, "pool_size", where, 1)
        self.stride = (self.pool_size if stride is None
                       else pair(stride, "stride", where, 1))
        self.padding = pair(padding, "padding", where, 0)
        check_pool_padding(self.pool_size, self.padding, where, "pool_size")

    def compute_output_shape(self, input_shape):
        where = type(self).__name__
        channels, height, width = _image_shape(input_shape, where)
        return (channels,) + pool_output_sizes(
            (height, width), self.pool_size, self.stride, self.padding, where, "pool_size")

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
    op = MaxPool2DOp


class AvgPool2D(_Pool2D):
    """The mean of each window, padded zeros counted (torch's ``count_include_pad``)."""
    op = AvgPool2DOp


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
            return _run_op(self, SyncBatchNormOp, x, self.running_mean,
                           self.running_var, self.weight, self.bias, training=True,
                           momentum=self.momentum, eps=self.eps,
                           average=dist.average_across_ranks, ranks=dist.world_size())
        return _run_op(self, BatchNormOp, x, self.running_mean, self.running_var,
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
        shape = _as_tuple(shape, "Reshape", "shape")
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
