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
from engine.parameter import Parameter as _Parameter
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
    if isinstance(name, str):   # Keras's other names: its "swish" is the engine's "silu"
        name = pointwise.KERAS_NAMES.get(name, name)
    if name not in ACTIVATIONS:
        raise ValueError(f"{where}: unknown activation {name!r}; expected one of {ACTIVATIONS}")
    return name


def _check_input_dtype(where, given, dtype):
    """A TypeError (naming ``where``: text, or a layer, named with its config only when
    raising: a layer's repr on every call took 4-5 us of each Linear's forward) unless the
    input dtype ``given`` is the float ``dtype`` of a layer; integer input (raw images)
    names the preprocessing that a model trained through ``data.DataLoader`` lacks."""
    if given == dtype:
        return
    if isinstance(where, Layer):
        where = f"{where.name} {where!r}"
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
    if name == "softmax":   # the logits stay beside it: a Keras loss of its output reads them
        y = F.softmax(x, axis=-1)
        y._keras_logits = x
        return y
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


def _holds_weights(value):
    """Whether ``value`` (a list, tuple, dict or set) holds a layer, a model or a tensor:
    weights an attribute of a layer would hold untracked."""
    items = value.values() if isinstance(value, dict) else value
    return any(isinstance(item, (Layer, Tensor)) for item in items)


def _walk(root, prefix, seen, named):
    """``named(layer)``'s ``(name, value)`` pairs of ``root`` and its tracked sub-layers,
    depth first with dotted names; a value (a shared layer's parameter) only once."""
    for name, value in named(root):
        if value is not None and id(value) not in seen:
            seen.add(id(value))
            yield prefix + name, value
    for child_name, child in root.named_children():
        yield from _walk(child, f"{prefix}{child_name}.", seen, named)


class Layer:
    """A layer: ``build`` maps an input feature shape to its output shape (making parameters),
    ``forward`` maps a batch Tensor to a batch Tensor.

    A layer holds layers, models, ``nn.LayerList``s and ``nn.Parameter``s assigned to its
    attributes, as torch's modules and Keras's layers do: ``named_parameters()``,
    ``named_buffers()``, ``named_layers()``, ``train()``/``eval()``, ``trainable`` and the
    capture key walk them with dotted names (``blocks.0.mlp.dense.weight``). State that is
    saved and moved but not trained is a buffer (``register_buffer``). Holding layers or
    tensors in a plain list, tuple or dict, or a tensor that is neither, is refused at the
    assignment, since they would be weights no optimizer and no file sees."""

    # attribute -> how the layer lays out the Parameter it holds there, where that differs
    # from another layer's: a Parameter tied across layers must mean the same to both
    _layouts = {}

    def __init__(self, input_shape=None, name=None):
        object.__setattr__(self, "_children", {})   # attribute -> Layer, in assignment order
        object.__setattr__(self, "_parameters", {})   # attribute -> Parameter (or None)
        object.__setattr__(self, "_buffers", {})    # attribute -> Tensor (or None)
        self.input_shape = _feature_shape(input_shape, type(self).__name__)
        self.output_shape = None
        if name is not None and not isinstance(name, str):
            raise TypeError(f"{type(self).__name__}: name must be text, got {name!r}")
        self.name = name or type(self).__name__.lower()
        self.training = True
        self.built = False
        self._trainable = True

    # ------------------------------------------------------------- tracking
    def __setattr__(self, name, value):
        tables = self.__dict__.get("_children")
        if tables is None and isinstance(value, (Layer, Tensor)):
            raise AttributeError(f"{type(self).__name__}: cannot assign {name!r} before "
                                 "super().__init__() runs; call it first in __init__")
        if tables is not None and not name.startswith("__"):
            self._track(name, value)
        object.__setattr__(self, name, value)

    def _track(self, name, value):
        children, params, buffers = self._children, self._parameters, self._buffers
        where = f"{type(self).__name__}.{name}"
        if isinstance(value, Layer):
            params.pop(name, None), buffers.pop(name, None)
            children[name] = value
        elif isinstance(value, _Parameter):
            if name in self._layouts:
                self._check_layout(name, value)
            children.pop(name, None), buffers.pop(name, None)
            params[name] = value
        elif isinstance(value, Tensor):
            if name not in buffers:
                raise TypeError(
                    f"{where}: a plain Tensor (shape {value.shape}) assigned to a layer is "
                    f"neither trained nor saved; wrap a weight as nn.Parameter(tensor), or "
                    f"keep state with self.register_buffer({name!r}, tensor)")
            buffers[name] = value
        elif value is None:
            children.pop(name, None)   # a parameter or buffer slot keeps its place, empty
            if name in params:
                params[name] = None
            if name in buffers:
                buffers[name] = None
        elif isinstance(value, (list, tuple, dict, set)) and _holds_weights(value):
            raise TypeError(
                f"{where}: a {type(value).__name__} of layers or tensors is not tracked (its "
                "weights would be neither trained nor saved); hold layers in "
                "nn.LayerList([...]), and each Parameter as an attribute of its own")
        else:
            for table in (children, params, buffers):
                table.pop(name, None)

    def _check_layout(self, name, value):
        """Mark ``value`` with this layer's layout of ``name``, or refuse it when another
        layer laid it out otherwise: nanoGPT's ``self.head.weight = self.tok_emb.weight``
        gives a Dense, whose weight is (in, out), an Embedding's (vocabulary, width) table,
        torch's (out, in) Linear layout; with a square table it ran silently as x @ E where
        torch computes x @ E.T."""
        layout = self._layouts[name]
        held = value.__dict__.get("_layout")
        if held is None:
            value.__dict__["_layout"] = (layout, f"{type(self).__name__}.{name}")
        elif held[0] != layout:
            raise TypeError(
                f"{type(self).__name__}.{name}: this Parameter is {held[1]}, laid out as "
                f"{held[0]}, where {type(self).__name__}.{name} is {layout} (the engine's "
                "Dense/Linear weight is torch's transposed), so the tie would not compute "
                "torch's; use the one Parameter in forward instead, e.g. logits = x @ "
                "self.tok_emb.weight.T (as engine.gpt's head does)")

    def __delattr__(self, name):
        for table in (self._children, self._parameters, self._buffers):
            table.pop(name, None)
        object.__delattr__(self, name)

    def register_buffer(self, name, value):
        """Keep ``value`` (a Tensor, or None for now) as the attribute ``name``: saved,
        loaded and moved with the model, never trained (torch's ``register_buffer``)."""
        if value is not None and not isinstance(value, Tensor):
            raise TypeError(f"{type(self).__name__}.register_buffer({name!r}): expected a "
                            f"Tensor or None, got {type(value).__name__}")
        self._children.pop(name, None), self._parameters.pop(name, None)
        self._buffers[name] = value
        object.__setattr__(self, name, value)

    def named_children(self):
        """``[(attribute, layer)]``: the layers this one holds directly."""
        return list(self._children.items())

    def named_layers(self):
        """``[(dotted name, layer)]``: every layer under this one, depth first (each once)."""
        found, seen = [], set()

        def walk(layer, prefix):
            for name, child in layer.named_children():
                if id(child) not in seen:
                    seen.add(id(child))
                    found.append((prefix + name, child))
                    walk(child, f"{prefix}{name}.")
        walk(self, "")
        return found

    def named_parameters(self):
        """``[(dotted name, Parameter)]``: this layer's, then each sub-layer's (a parameter
        shared by two layers once, under its first name)."""
        return list(_walk(self, "", set(), lambda layer: layer._own_parameters()))

    def _own_parameters(self):
        return list(self._parameters.items())

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def named_buffers(self):
        """``[(name, Tensor)]``: state that is saved and moved with the model but gets no
        gradient and no optimizer update (BatchNorm's running statistics)."""
        return list(_walk(self, "", set(), lambda layer: layer._own_buffers()))

    def _own_buffers(self):
        return list(self._buffers.items())

    @property
    def trainable(self):
        """False freezes the layer (Keras's ``layer.trainable = False``): each of its
        parameters, and its sub-layers', stops requiring grad; optimizers leave them."""
        return self._trainable

    @trainable.setter
    def trainable(self, value):
        self._trainable = bool(value)
        for _, layer in [("", self)] + self.named_layers():
            layer._trainable = self._trainable
            for _, p in layer._own_parameters():
                if p is not None:
                    p.requires_grad = self._trainable

    def _apply_trainable(self):
        """Freeze the parameters a frozen layer made when it was built."""
        for _, layer in [("", self)] + self.named_layers():
            if not layer._trainable:
                for _, p in layer._own_parameters():
                    if p is not None:
                        p.requires_grad = False

    def train(self, mode=True):
        """Training mode for this layer and every layer under it; returns it."""
        self.training = bool(mode)
        for _, layer in self.named_layers():
            layer.training = self.training
        return self

    def eval(self):
        """Inference mode for this layer and every layer under it; returns it."""
        return self.train(False)

    # ------------------------------------------------------------- building and running
    def build(self, input_shape, device="cpu", initialize=True):
        """Make parameters for inputs of ``input_shape``; returns the output feature shape.

        A layer that holds layers finds its output shape by running its forward once on a
        zero sample, in eval mode and without the tape (its sub-layers build on the way).
        Raises ValueError with the reason when this layer cannot take that shape."""
        if self._children and type(self).compute_output_shape is Layer.compute_output_shape:
            self.output_shape = _traced_output_shape(self, input_shape, device)
        else:
            self.output_shape = self.compute_output_shape(input_shape)
        self.built = True
        return self.output_shape

    def compute_output_shape(self, input_shape):
        return input_shape

    def forward(self, x):
        raise NotImplementedError(f"{type(self).__name__}: no forward")

    def __call__(self, x, *args, **kwargs):
        if not self.built:   # a layer used on its own is built from its first input
            if self._children:   # its sub-layers build in the forward that follows
                self.built = True
            else:
                self.build(x.shape[1:], x.device)
                self._apply_trainable()
        note_participant(self)
        y = self.forward(x, *args, **kwargs)
        if self.output_shape is None and isinstance(y, Tensor):
            self.output_shape = y.shape[1:]
            self._apply_trainable()
        return y

    def capture_key(self):
        """What the host decides about this layer's kernels: its mode and its sub-layers',
        its parameters and buffers and whether each requires grad (``engine.capture``
        replays only while this is unchanged)."""
        return (self.training, tuple(layer.training for _, layer in self.named_layers()),
                _arrays_key(self.named_parameters()), _arrays_key(self.named_buffers()))

    def get_config(self):
        """Constructor arguments as JSON-able values: ``type(self)(**config)`` rebuilds it."""
        return {} if self.input_shape is None else {"input_shape": list(self.input_shape)}

    def __repr__(self):
        """Its config; for a layer holding layers the tree, as torch prints a module."""
        children = self.named_children()
        if children:
            body = "".join("\n  (" + name + "): " + repr(layer).replace("\n", "\n  ")
                           for name, layer in children)
            return f"{type(self).__name__}({body}\n)"
        args = ", ".join(f"{k}={tuple(v) if isinstance(v, list) else v!r}"
                         for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


def _traced_output_shape(layer, input_shape, device, dtype=np.float32):
    """The feature shape ``layer``'s forward gives a zero sample of ``input_shape``, run in
    eval mode (no running statistics move, no dropout mask is drawn) without the tape."""
    from engine.autograd import no_grad
    was_training = layer.training
    layer.eval()
    layer.built = True
    try:
        with no_grad():
            y = layer.forward(Tensor(to_device(np.zeros((1,) + tuple(input_shape), dtype),
                                               device)))
    except (ValueError, TypeError):
        layer.built = False
        raise
    finally:
        layer.train(was_training)
    return tuple(y.shape[1:])


class LayerList(Layer):
    """Layers in a list, each tracked (torch's ``nn.ModuleList``): index, iterate, append.
    Their parameters are named by position: ``blocks.0.dense.weight``."""

    def __init__(self, layers=()):
        super().__init__()
        self._items = []
        for layer in layers:
            self.append(layer)

    def append(self, layer):
        if not isinstance(layer, Layer):
            raise TypeError(f"LayerList.append: expected an engine.nn layer or model, got "
                            f"{type(layer).__name__}")
        self._items.append(layer)
        self._children[str(len(self._items) - 1)] = layer
        return self

    def extend(self, layers):
        for layer in layers:
            self.append(layer)
        return self

    def __getitem__(self, index):
        return self._items[index]

    def __len__(self):
        return len(self._items)

    def __iter__(self):
        return iter(self._items)

    def forward(self, x):
        raise TypeError("LayerList holds layers but is not one to call: iterate over it in "
                        "the forward of the layer that holds it")


# Keras's names of the initialisers the engine names otherwise
_INITIALIZER_ALIASES = {"glorot_uniform": "xavier_uniform", "glorot_normal": "xavier_normal"}


class Parameter(_Parameter):
    """A trainable tensor a layer owns once assigned to one of its attributes:
    ``nn.Parameter(shape, initializer="glorot_uniform", dtype=np.float32)`` makes its values
    (any initialiser of ``engine.init`` by name, Keras's ``glorot_*`` names, "zeros",
    "ones", or a function ``(shape, dtype) -> array``); ``nn.Parameter(array)`` takes them."""

    def __init__(self, data, initializer="glorot_uniform", dtype=np.float32):
        if isinstance(data, (int, np.integer)) and not isinstance(data, bool):
            data = (data,)
        if isinstance(data, tuple) and all(isinstance(s, (int, np.integer)) for s in data):
            shape, dtype = tuple(int(s) for s in data), np.dtype(dtype)
            if initializer == "ones":
                values = np.ones(shape, dtype)
            else:
                values = init.get(_INITIALIZER_ALIASES.get(initializer, initializer))(
                    shape, dtype=dtype)
            data = np.ascontiguousarray(values, dtype)
        elif isinstance(data, Tensor):
            data = to_device(data.data, data.device)   # its own copy, as torch's
        elif not isinstance(data, np.ndarray) and not hasattr(data, "__cuda_array_interface__"):
            data = np.array(data, dtype=dtype)
        super().__init__(data)


class Dense(Layer):
    """``activation(x @ W + b)`` with W of shape (in, units), one fused kernel per direction.

    The kernel defaults to He initialisation for the relu family and Xavier otherwise; the
    bias starts at zero. ``"softmax"`` runs the Dense kernel without activation, then softmax.
    """
    _layouts = {"weight": "(in_features, out_features)"}

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
        if len(input_shape) < 1:
            raise ValueError(f"Dense takes inputs of shape (None, ..., features), got "
                             f"{batch_shape(input_shape)}")
        return tuple(input_shape[:-1]) + (self.units,)

    def build(self, input_shape, device="cpu", initialize=True):
        output_shape = super().build(input_shape, device, initialize)
        shape = (input_shape[-1], self.units)
        weight = (self.kernel_initializer(shape, dtype=self.dtype) if initialize
                  else np.zeros(shape, self.dtype))
        if tuple(np.shape(weight)) != shape:
            raise ValueError(f"Dense: the kernel initialiser returned shape {np.shape(weight)} "
                             f"for {shape}")
        self.weight = _Parameter(to_device(np.asarray(weight, self.dtype), device))
        bias = (init.bias_for(self.kernel_initializer, shape[0], self.units, self.dtype)
                if initialize else np.zeros(self.units, self.dtype))
        self.bias = _Parameter(to_device(bias, device))
        return output_shape

    def forward(self, x):
        features = self.weight.shape[0]
        if x.ndim < 2 or x.shape[-1] != features:
            raise ValueError(f"{self.name} {self!r}: expects input of shape (None, ..., "
                             f"{features}), got {x.shape}")
        _check_input_dtype(self, x.dtype, self.weight.dtype)
        fused = self.activation if self.activation in FUSED_ACTIVATIONS else None
        leading = x.shape[:-1]
        if len(leading) > 1:   # the last axis of any rank: rows of one 2-D GEMM (a view)
            x = F.reshape(x, (-1, features))
        y = apply(DenseOp, x, self.weight, self.bias, activation=fused, alpha=self.alpha)
        if len(leading) > 1:
            y = F.reshape(y, leading + (self.units,))
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


def register_seed_state(layer, device, initialize):
    """Give ``layer`` the device seed state its dropout masks are drawn from: the buffers
    ``seed`` (drawn from the engine's generator, as a weight is) and ``masks_drawn``. A model
    read from a file (``initialize=False``) gets them from the file and leaves the generator
    as it was; a file written before the layer had seed state keeps this one, from the
    layer's unique name, so its layers draw different masks."""
    base_seed = (int(generator().integers(0, SEED_LIMIT)) if initialize
                 else zlib.crc32(layer.name.encode()))
    seed, masks_drawn = new_seed_state(base_seed, device)
    layer.register_buffer("seed", Tensor(seed))
    layer.register_buffer("masks_drawn", Tensor(masks_drawn))


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
        register_seed_state(self, device, initialize)
        return output_shape

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



def check_data_format(data_format, where):
    """Keras's ``data_format``: "channels_first" (NCHW, the engine's and torch's) or
    "channels_last" (NHWC, Keras's default), where the layer moves the channels first for
    its kernel and back after (two copies)."""
    if data_format not in ("channels_first", "channels_last"):
        raise ValueError(f"{where}: data_format must be 'channels_first' or 'channels_last', "
                         f"got {data_format!r}")
    return data_format


def channels_first_shape(shape):
    return (shape[-1],) + tuple(shape[:-1])


def channels_last_shape(shape):
    return tuple(shape[1:]) + (shape[0],)


def channels_first(x, layer):
    """``(N, *spatial, C) -> (N, C, *spatial)`` for a channels-last layer."""
    if x.ndim < 3:
        raise ValueError(f"{layer.name} {layer!r}: expects channels-last input (None, ..., "
                         f"channels), got shape {tuple(x.shape)}")
    return F.permute(x, (0, x.ndim - 1) + tuple(range(1, x.ndim - 1)))


def channels_last(y):
    return F.permute(y, (0,) + tuple(range(2, y.ndim)) + (1,))


class _Pool2D(Layer):
    """A pooling window over each channel of NCHW inputs (NHWC with
    ``data_format="channels_last"``): ``pool_size``, ``stride`` (default ``pool_size``) and
    ``padding`` (at most half the window), as torch's."""
    op = None   # the ops.pool op class

    def __init__(self, pool_size, stride=None, padding=0, input_shape=None,
                 data_format="channels_first"):
        super().__init__(input_shape)
        where = type(self).__name__
        self.data_format = check_data_format(data_format, where)
        self.pool_size = pair(pool_size, "pool_size", where, 1)
        self.stride = (self.pool_size if stride is None
                       else pair(stride, "stride", where, 1))
        self.padding = pair(padding, "padding", where, 0)
        check_pool_padding(self.pool_size, self.padding, where, "pool_size")

    def compute_output_shape(self, input_shape):
        where = type(self).__name__
        last = self.data_format == "channels_last"
        channels, height, width = _image_shape(
            channels_first_shape(input_shape) if last and len(input_shape) == 3 else input_shape,
            where)
        shape = (channels,) + pool_output_sizes(
            (height, width), self.pool_size, self.stride, self.padding, where, "pool_size")
        return channels_last_shape(shape) if last else shape

    def forward(self, x):
        if self.data_format == "channels_last":
            return channels_last(self._pool(channels_first(x, self)))
        return self._pool(x)

    def _pool(self, x):
        return _run_op(self, self.op, x, kernel_size=self.pool_size, stride=self.stride,
                       padding=self.padding)

    def get_config(self):
        config = {"pool_size": _compact(self.pool_size)}
        if self.stride != self.pool_size:
            config["stride"] = _compact(self.stride)
        if self.padding != (0, 0):
            config["padding"] = _compact(self.padding)
        if self.data_format != "channels_first":
            config["data_format"] = self.data_format
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
        self.weight = _Parameter(to_device(np.ones(channels, self.dtype), device))
        self.bias = _Parameter(to_device(init.zeros(channels, self.dtype), device))
        self.register_buffer("running_mean", tensor(np.zeros(channels, self.dtype), device=device))
        self.register_buffer("running_var", tensor(np.ones(channels, self.dtype), device=device))
        return output_shape

    def forward(self, x):
        _check_input_dtype(self, x.dtype, self.weight.dtype)
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
        self.register_buffer("mean", tensor(self.mean_value.astype(self.dtype), device=device))
        self.register_buffer("variance", tensor(self.variance_value.astype(self.dtype),
                                                device=device))
        return output_shape

    def forward(self, x):
        _check_input_dtype(self, x.dtype, self.mean.dtype)
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


class InputLayer(Layer):
    """Keras's input declaration, the first item of a Sequential: ``nn.Input(shape=(28, 28,
    1))`` (the feature shape, without the batch dimension) says what the model takes, as
    ``input_shape=`` on its first layer does. The Sequential keeps the shape, not the
    object: it is no layer of the model and runs nothing. A ``None`` size (Keras's
    variable sequence length, ``Input(shape=(None, 64))``) leaves the model to be built by
    its first call; later calls may differ there, as its layers allow."""

    def __init__(self, shape=None, batch_size=None, dtype=None, name=None, input_shape=None):
        shape = input_shape if shape is None else shape
        if shape is None:
            raise ValueError("Input: give the feature shape, Input(shape=(...)) (without the "
                             "batch dimension)")
        shape = tuple(shape)
        super().__init__(None if None in shape else shape, name)
        self.shape = shape
        self.dtype = None if dtype is None else np.dtype(dtype)

    def forward(self, x):
        raise TypeError("nn.Input declares a Sequential's input shape (its first item); "
                        "it is no layer to call. A model with several inputs: an nn.Model "
                        "subclass whose forward takes them")


def Input(shape=None, batch_size=None, dtype=None, name=None):
    """Keras's ``keras.Input(shape)``: an ``InputLayer`` declaring a Sequential's input."""
    return InputLayer(shape, batch_size, dtype, name)
