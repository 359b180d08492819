"""``Sequential``, the model: build, pack, move, train/eval, call, summary, state dicts,
the config codec, save and ONNX export; and ``load``, which rebuilds one from a file."""
import contextlib
import json
import os
import threading

import numpy as np

from engine import archive
from engine.nn.convolutional import Conv1D, Conv2D
from engine.nn.keras_methods import KerasMethods
from engine.nn.layers import (Activation, AvgPool2D, BatchNorm, Dense, Dropout, Flatten,
                              InputLayer, Layer, MaxPool2D, Normalization, Rescaling, Reshape,
                              _check_input_dtype, _feature_shape, _float_buffers, _float_dtype,
                              _traced_output_shape, batch_shape)
from engine.nn.serialization import (CONFIG_KEY, FORMAT_VERSION, _is_safetensors, _read_npz,
                                     _read_safetensors, check_architecture, check_layer_dtype)
from engine.parameter import ParameterStore, zero_grads
from engine.random import generator
from engine.tensor import Tensor, tensor
from ops.device import check_device, copy_into, to_device, to_host
from ops.launch import note_participant


LAYERS = {cls.__name__: cls for cls in (Dense, Activation, Flatten, Dropout, Conv1D, Conv2D,
                                        MaxPool2D, AvgPool2D, BatchNorm, Reshape, Rescaling,
                                        Normalization)}


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
        # a built-in layer by its public name (engine.nn.Dense, not engine.nn.layers.Dense)
        module = "engine.nn" if taken.__module__.startswith("engine.nn.") else taken.__module__
        raise ValueError(f"nn.register: the layer name {name!r} is taken by "
                         f"{module}.{taken.__qualname__}; rename the class")
    LAYERS[name] = layer_class
    return layer_class


_DEFERRAL = threading.local()   # .depth: how many deferred_construction blocks are open


@contextlib.contextmanager
def deferred_construction():
    """While open, a layer that would make its parameters in its constructor (torch's
    ``nn.Linear``) leaves them to its build: a model read from a file is built without
    initialising (no generator draws) and only once its architecture fits in the file's
    weights (``serialization.check_architecture``), which a constructor would come before."""
    _DEFERRAL.depth = getattr(_DEFERRAL, "depth", 0) + 1
    try:
        yield
    finally:
        _DEFERRAL.depth -= 1


def construction_deferred():
    """Whether a ``deferred_construction`` block is open in this thread."""
    return getattr(_DEFERRAL, "depth", 0) > 0


# ------------------------------------------------------------------ the model

class Model(KerasMethods, Layer):
    """A model with any ``forward`` (torch's ``nn.Module`` as a root, Keras's subclassed
    ``Model``): layers, Sequentials, ``LayerList``s and ``Parameter``s assigned to its
    attributes are tracked, as in ``Layer``.

    It is built by its first call (each sub-layer builds from what reaches it) or by
    ``build(input_shape, dtype=...)`` (one traced call on a zero sample, in eval mode);
    building packs every parameter of the tree into one flat buffer per device and dtype,
    as a Sequential's, so optimizers, ``engine.capture``, ``fit``, ``state_dict`` and the
    files treat both alike. ``save`` needs the class registered (``@nn.register``) and a
    ``get_config()`` giving its constructor's arguments: ``nn.load`` rebuilds it from them.
    """

    def __init__(self, input_shape=None, name=None):
        super().__init__(input_shape, name)
        self.device = "cpu"
        self.input_dtype = None     # the dtype of the inputs it was built for
        self._flat = []

    parameterless = True   # its own parameters exist from __init__; its layers say for theirs

    # ------------------------------------------------------------- building
    def build(self, input_shape, device=None, initialize=True, dtype=None):
        """Build for inputs of the feature shape ``input_shape`` (without the batch
        dimension; Keras's leading None is accepted) and ``dtype`` (float32 by default;
        an integer dtype for token ids): one call on a zero sample, in eval mode and without
        the tape, then the parameters are packed. Returns the output feature shape."""
        shape = tuple(input_shape)
        if shape and shape[0] is None:
            shape = shape[1:]
        shape = _feature_shape(shape, f"{self.name}.build")
        if device is not None:
            self.to(device)
        if self.built:
            if shape != self.input_shape:
                raise ValueError(f"{self.name}: built for inputs {batch_shape(self.input_shape)},"
                                 f" asked for {batch_shape(shape)}")
            return self.output_shape
        dtype = np.dtype(np.float32 if dtype is None else dtype)
        # (``initialize``, Layer.build's protocol: a loaded model's weights are overwritten)
        self.output_shape = _traced_output_shape(self, shape, self.device, dtype)
        self.input_shape, self.input_dtype = shape, dtype
        self._pack()
        return self.output_shape

    def _pack(self):
        """(Re)pack all parameters of the tree into one FlatBuffer per (device, dtype), in
        ``named_parameters`` order. The root holds the store: a model inside it gives up
        its own."""
        self._apply_trainable()
        self._flat = ParameterStore([p for _, p in self.named_parameters()])
        for _, layer in self.named_layers():
            if isinstance(layer, Model):
                layer._flat = []

    def _unbuilt_layers(self):
        """The layers of the tree not built yet that make parameters when they build."""
        layers = [("", self)] + self.named_layers()
        return [name for name, layer in layers if not layer.built
                and type(layer).build is not Layer.build
                and not getattr(layer, "parameterless", False)]

    def _require_built(self, what):
        if not self.built:
            raise RuntimeError(f"{self.name}.{what}: the model is not built yet; call it once "
                               "on a batch, or model.build(input_shape)")

    def _require_weights(self, what):
        """``_require_built``, unless every layer has its parameters already (those that
        declare their input size, torch's Linears): their weights save and load before the
        first call."""
        if not self.built:
            self._build_declared()
            if self._unbuilt_layers():
                self._require_built(what)

    def _build_declared(self):
        """Build each unbuilt layer of the tree that declares its input shape and holds no
        layers (its parameters need nothing else); the model is still built by its call.
        A Sequential's chain build keeps such a layer (``Sequential._build_layer``)."""
        def walk(layer):
            for _, child in layer.named_children():
                if (not child.built and child.input_shape is not None and not child._children
                        and not isinstance(child, Model)):
                    child.build(child.input_shape, self.device)
                    child._apply_trainable()
                walk(child)
        walk(self)

    # ------------------------------------------------------------- parameters and devices
    def parameters(self):
        """The Parameters in a stable order (``named_parameters``'). A model whose layers
        make their parameters when built has none to give before (an optimizer would get
        an empty list): a RuntimeError says how to build it. Layers that declare their input
        shape (``input_shape=``, torch's ``nn.Linear(784, 512)``) are built here, as torch
        makes a module's parameters in its constructor."""
        self._require_weights("parameters")
        return [p for _, p in self.named_parameters()]

    def zero_grad(self, set_to_none=True):
        """torch's ``model.zero_grad()``: forget the gradient of every parameter of the tree
        (``set_to_none=False``: write zeros into those that exist; see
        ``engine.parameter.zero_grads``)."""
        zero_grads([p for _, p in self.named_parameters()], set_to_none)

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
        if self._flat and self._flat.stale():
            # a shared layer another root packed since: moving this store's copy of its
            # values would bind them back, old; packing afresh takes the values it reads
            self._pack()
        if self._flat:
            self._flat.to(device)
        packed = {id(p) for buffer in self._flat for p in buffer.params}
        for _, value in self.named_parameters() + self.named_buffers():
            if id(value) not in packed and value.device != device:
                value.data = to_device(value.data, device)   # not packed yet, or a buffer
        for _, layer in [("", self)] + self.named_layers():
            if isinstance(layer, Model):
                layer.device = device
        return self

    def _to_dtype(self, dtype):
        for _, layer in [("", self)] + self.named_layers():
            if hasattr(layer, "dtype"):
                layer.dtype = dtype
            for _, value in layer._own_parameters() + _float_buffers(layer._own_buffers()):
                if value is not None and value.dtype != dtype:
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

    # ------------------------------------------------------------- running
    def __call__(self, x, *args, **kwargs):
        if not isinstance(x, Tensor):
            x = self._as_input(x)
        if x.device != self.device:
            raise ValueError(f"{self.name}: the input is on {x.device} and the model on "
                             f"{self.device}; move one of them with .to('{self.device}')")
        note_participant(self)
        if self.built:
            return self.forward(x, *args, **kwargs)
        self.built = True   # the first call builds: each layer from what reaches it
        try:
            y = self.forward(x, *args, **kwargs)
        except BaseException:
            self.built = False
            raise
        self.input_shape, self.input_dtype = tuple(x.shape[1:]), x.dtype
        self.output_shape = tuple(y.shape[1:]) if isinstance(y, Tensor) else None
        self._pack()
        return y

    def capture_key(self):
        """The device, and the tree's modes, parameters and buffers (``Layer.capture_key``):
        ``engine.capture`` replays only while it holds."""
        return (self.device,) + super().capture_key()

    def _input_dtype(self, given):
        """The dtype a NumPy or list input becomes: integers stay integers (token ids), floats
        take the parameters' dtype."""
        if given.kind in "iub":
            return given
        return self._flat[0].dtype if self._flat else np.dtype(np.float32)

    def _as_input(self, x):
        """A NumPy array or a list as the input Tensor on the model's device. A list of
        numbers takes the model's dtype (``engine.tensor([[1.0]])`` is float32); a NumPy array
        of another float dtype is refused as a Tensor of that dtype is (torch's rule: no
        silent narrowing of float64 data), naming both fixes. ``predict`` and Keras's ``fit``
        / ``evaluate`` convert arrays instead, as Keras does."""
        given = np.asarray(x).dtype
        dtype = self._input_dtype(given)
        if isinstance(x, np.ndarray) and given.kind == "f" and given != dtype:
            raise TypeError(
                f"{self.name}: input dtype {given} (a NumPy array) does not match the model's "
                f"{dtype}; convert the input (x.astype(np.{dtype.name})), or the model "
                f"(model.to(np.{given.name})); a Tensor input is refused the same way")
        return tensor(x, dtype=dtype, device=self.device)

    def _host_input(self, x):
        """``x`` as Keras's methods take it: a NumPy array whose floats are the model's float
        dtype (Keras casts inputs to the layers' dtype)."""
        x = x.numpy() if isinstance(x, Tensor) else np.asarray(x)
        dtype = self._flat[0].dtype if self._flat else None
        if dtype is not None and x.dtype.kind == "f" and x.dtype != dtype:
            x = x.astype(dtype)
        return x

    def predict(self, x, batch_size=256, verbose=0):  # verbose: Keras's signature; quiet
        """The model's outputs for ``x`` (a NumPy array, list or Tensor of samples) as one
        NumPy array, computed ``batch_size`` samples at a time, in eval mode and without the
        tape; the model's mode is restored after."""
        if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool) \
                or batch_size < 1:
            raise ValueError(f"{self.name}.predict: batch_size must be a positive int, "
                             f"got {batch_size!r}")
        if not isinstance(x, Tensor):
            x = self._host_input(x)
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
        """Print and return a table of the layers this model holds directly (each with its
        output shape and the parameters under it), and the totals."""
        self._require_built("summary")
        rows = [("Layer (type)", "Output Shape", "Param #")]
        own = sum(p.size for _, p in self._own_parameters() if p is not None)
        if own:
            rows.append(("(its own parameters)", "", f"{own:,}"))
        for name, layer in self.named_children():
            count = sum(t.size for _, t in layer.named_parameters()
                        + _float_buffers(layer.named_buffers()))
            shape = "" if layer.output_shape is None else batch_shape(layer.output_shape)
            label = name if name == layer.name else f"{name}: {layer.name}"
            rows.append((f"{label} ({type(layer).__name__})", shape, f"{count:,}"))
        widths = [max(len(row[k]) for row in rows) + 4 for k in range(3)]
        width = sum(widths)

        def line(row):
            return (row[0].ljust(widths[0]) + row[1].ljust(widths[1])
                    + row[2].rjust(widths[2] - 4)).rstrip()

        params = self.parameters()
        buffers = [b for _, b in _float_buffers(self.named_buffers())]
        trainable = sum(p.size for p in params if p.requires_grad)
        frozen = sum(p.size for p in params if not p.requires_grad) + sum(b.size for b in buffers)
        nbytes = sum(t.size * t.dtype.itemsize for t in params + buffers)
        text = "\n".join(
            [f'Model: "{self.name}" on {self.device}', "_" * width, line(rows[0]), "=" * width]
            + [line(row) for row in rows[1:]]
            + ["=" * width, f"Total params: {trainable + frozen:,} ({_human_bytes(nbytes)})",
               f"Trainable params: {trainable:,}", f"Non-trainable params: {frozen:,}",
               "_" * width])
        print(text)
        return text

    # ------------------------------------------------------------- weights and files
    def state_dict(self):
        """``{name: NumPy array}``: a host copy of every parameter (one copy per flat
        buffer), then of every buffer (running statistics)."""
        self._require_weights("state_dict")
        values = self._flat.host_values() if self._flat else {}
        return {**{name: values[id(p)] if id(p) in values else to_host(p.data)
                   for name, p in self.named_parameters()},
                **{name: to_device(b.data, "cpu") for name, b in self.named_buffers()}}

    def load_state_dict(self, state):
        """Copy ``state`` (``{name: array}``, as from ``state_dict``) into the parameters
        and buffers.

        Every key must match a parameter or buffer and every shape its shape; nothing is
        written unless all do. Each flat buffer is written in one copy; a layer's buffers
        are written in place (a captured step keeps updating the same arrays). An integer
        buffer (Dropout's seed state) missing from ``state`` keeps its value: files written
        before Dropout had one still load. A model whose layers all have their parameters
        before its first call (torch's Linears) loads before it, as torch's ``model =
        Net(); model.load_state_dict(saved)``."""
        self._require_weights("load_state_dict")
        buffers = [(name, b) for name, b in self.named_buffers()
                   if name in state or b.dtype.kind == "f"]
        named = self.named_parameters() + buffers
        expected = [name for name, _ in self.named_parameters() + self.named_buffers()]
        missing = [name for name, _ in named if name not in state]
        known = set(expected)   # a list's `in` would make this quadratic in the layers
        unexpected = [key for key in state if key not in known]
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
        stored = set()
        if self._flat:
            for buffer in self._flat:
                for p in buffer.params:
                    stored.add(id(p))
                    if id(p) not in values:   # its layer replaced since: it keeps its values
                        values[id(p)] = to_host(p.data)
            self._flat.load(values)   # reads the parameters' values, not the buffers'
        for _, p in self.named_parameters():
            if id(p) not in stored:   # not packed yet, or made since (model.head = Linear())
                copy_into(p.data, np.ascontiguousarray(values[id(p)], p.dtype))
                p._bump_version()
        for _, buffer in buffers:
            copy_into(buffer.data, np.ascontiguousarray(values[id(buffer)], buffer.dtype))
            buffer._bump_version()   # written in place, as the parameters

    def get_config(self):
        """The constructor's arguments (a subclass that takes any gives them): ``nn.load``
        rebuilds the model as ``type(model)(**config)``."""
        return {}

    def _file_config(self):
        """What ``save`` writes as the architecture: the registered class, its config and
        the input it was built for; a model ``nn.load`` could not rebuild is refused."""
        cls, where = type(self), f"{self.name}.save"
        if LAYERS.get(cls.__name__) is not cls:
            raise TypeError(f"{where}: {cls.__name__} is not registered, so nn.load could not "
                            f"rebuild it; decorate the class with @nn.register and give it a "
                            "get_config() returning its constructor's arguments (or save "
                            "the weights alone: model.state_dict(), safetensors)")
        config = self.get_config()
        try:
            cls(**config)
            text = json.dumps(config)
        except (TypeError, ValueError) as error:
            raise TypeError(f"{where}: {cls.__name__}(**get_config()) fails ({error}); "
                            "get_config() must return the constructor's arguments as "
                            "JSON values") from None
        return json.dumps({"format": "engine.nn.Model", "version": FORMAT_VERSION,
                           "class_name": cls.__name__, "config": json.loads(text),
                           "input_shape": list(self.input_shape),
                           "input_dtype": np.dtype(self.input_dtype).name})

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
        self._require_built("save")
        config = self._file_config()
        if _is_safetensors(path):
            archive.write_safetensors(path, self.state_dict(), {CONFIG_KEY: config})
            return
        archive.write_npz(path, {CONFIG_KEY: np.array(config), **self.state_dict()})

    @classmethod
    def from_file_config(cls, config):
        """The model an ``engine.nn.Model`` file config describes, built (weights not
        loaded yet)."""
        name = config.get("class_name")
        model_class = LAYERS.get(name) if isinstance(name, str) else None
        if model_class is None or not issubclass(model_class, Model):
            raise ValueError(f"unknown model class {name!r}; a model class loads once it is "
                             "decorated with @nn.register (import it before nn.load)")
        arguments, shape = config.get("config"), config.get("input_shape")
        if not isinstance(arguments, dict) or not isinstance(shape, list):
            raise ValueError("a model config needs a 'config' dict and an 'input_shape' list")
        state = generator().bit_generator.state   # building draws no numbers a load keeps
        try:
            with deferred_construction():
                model = model_class(**arguments)
            model.build(tuple(shape), initialize=False, dtype=config.get("input_dtype"))
        finally:
            generator().bit_generator.state = state
        return model


class _NameAllocator:
    """The names a model gives its layers: a class's lower-case name, then ``name_1``,
    ``name_2``, ... (the first one free); one allocator names many layers in linear time."""

    def __init__(self, layers):
        self.taken = {layer.name for layer in layers}
        self.next_suffix = {}

    def allocate(self, base):
        name = base
        if name in self.taken:
            suffix = self.next_suffix.get(base, 1)
            while f"{base}_{suffix}" in self.taken:
                suffix += 1
            self.next_suffix[base] = suffix + 1
            name = f"{base}_{suffix}"
        self.taken.add(name)
        return name


class Sequential(Model):
    """A stack of layers, each fed the previous one's output.

    ``Sequential([...])`` (or torch's ``Sequential(a, b, ...)``) or ``model.add(layer)``; the
    first layer's ``input_shape=`` fixes the input (without the batch dimension). Without it
    the model is built on its first call. ``len(model)`` and ``model[i]`` are its layers. A
    Sequential (or an ``nn.Model``) may be one of the layers.
    """

    def __init__(self, layers=(), *more_layers, name="sequential"):
        if isinstance(layers, Layer):   # torch's spelling: the layers as arguments
            layers = (layers,) + more_layers
        elif more_layers:
            raise TypeError(f"Sequential: takes a list of layers (or layers as arguments), "
                            f"got {type(layers).__name__} and then {more_layers!r}")
        if isinstance(name, Layer) or not isinstance(name, str):
            raise TypeError(f"Sequential: name must be text, got {name!r}")
        super().__init__(name=name)
        self.layers = []
        self._initialize = True     # False while ``load`` rebuilds a model to fill from a file
        self._extend(layers)

    # ------------------------------------------------------------- building
    def add(self, layer):
        """Append ``layer``; builds it now when the input shape is known. Returns the model."""
        return self._extend([layer])

    def _extend(self, layers):
        """Append each of ``layers`` (``add``), packing the parameters once at the end and
        naming them with one allocator: linear in the number of layers (a model read from a
        file of thousands of layers was quadratic, repacked and renamed at every layer)."""
        names = _NameAllocator(self.layers)
        seen = {id(other) for other in self.layers}
        grew = False
        for layer in layers:
            if isinstance(layer, InputLayer):   # Keras's Input(shape): the model's input shape
                if self.layers:
                    raise ValueError(f"Sequential.add: {layer!r} declares the input shape; it "
                                     "comes first, before any layer")
                if layer.input_shape is not None:   # else (a None size) the first call builds
                    self.input_shape = self.output_shape = layer.input_shape
                continue
            if not isinstance(layer, Layer):
                raise TypeError(f"Sequential.add: expected an engine.nn layer, got {layer!r}")
            # a layer built by its own constructor (torch's Linear) is not yet in a model
            if layer is self or id(layer) in seen or (
                    layer.built and not isinstance(layer, Model)
                    and not getattr(layer, "built_at_construction", False)):
                raise ValueError(f"Sequential.add: {layer!r} is already built into a model; "
                                 "make a new layer")
            seen.add(id(layer))
            layer.name = names.allocate(type(layer).__name__.lower())
            layer.training = self.training
            if not self.layers and (self.input_shape is None or layer.input_shape is not None):
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
                grew = True
        if grew:
            self._pack()
        return self

    def named_children(self):
        """``[(name, layer)]``: its layers, by their unique names."""
        return [(layer.name, layer) for layer in self.layers]

    def _build_layer(self, index):
        layer = self.layers[index]
        shape = self.output_shape
        if index == 0:
            source = f"the model input {batch_shape(shape)}"
        else:
            previous = self.layers[index - 1]
            source = (f"layer {index - 1} '{previous.name}' {previous!r} with output "
                      f"{batch_shape(shape)}")
        declared = layer.input_shape
        last_axis = isinstance(layer, Dense) and len(declared or ()) == 1   # any rank, as torch
        if declared is not None and declared != shape and not (
                last_axis and len(shape) > 1 and shape[-1:] == declared):
            raise ValueError(f"Sequential: layer {index} '{layer.name}' {layer!r} declares "
                             f"input_shape {batch_shape(layer.input_shape)} but gets {source}")
        if layer.built and (declared is not None
                            or getattr(layer, "built_at_construction", False)):
            # built before the chain reached it, from its declaration by ``parameters()``
            # (torch's ``nn.Sequential(nn.Flatten(), nn.Linear(784, 512))``) or by its own
            # constructor (torch's Conv2d, BatchNorm): a second build would make new
            # parameters, and the optimizer given the first ones would train nothing. Only
            # the shape is new here.
            try:
                output = (layer.output_shape if declared == shape
                          else layer.compute_output_shape(shape))
            except ValueError as error:
                raise ValueError(f"Sequential: layer {index} '{layer.name}' {layer!r} cannot "
                                 f"take {source}: {error}") from None
            self.output_shape = layer.output_shape = output
            return
        try:
            self.output_shape = layer.build(shape, self.device, self._initialize)
        except ValueError as error:
            raise ValueError(f"Sequential: layer {index} '{layer.name}' {layer!r} cannot take "
                             f"{source}: {error}") from None

    def _build_from(self, input_shape):
        """Build every layer for inputs of ``input_shape`` (a model whose first layer had no
        ``input_shape=``, on its first call)."""
        self.input_shape = self.output_shape = tuple(input_shape)
        unbuilt = [layer for layer in self.layers if not layer.built]
        try:
            for index in range(len(self.layers)):
                self._build_layer(index)
        except ValueError:
            for layer in unbuilt:   # those built before keep the parameters handed out
                layer.built = False
            self.input_shape = self.output_shape = None
            raise
        self._pack()

    def build(self, input_shape, device=None, initialize=True, dtype=None):
        """Build every layer for inputs of the feature shape ``input_shape`` (as a layer of
        another model, or by hand); returns the output feature shape."""
        shape = tuple(input_shape)
        if shape and shape[0] is None:
            shape = shape[1:]
        if device is not None:
            self.to(device)
        if self.built:
            if tuple(shape) != self.input_shape:
                raise ValueError(f"{self.name}: built for inputs {batch_shape(self.input_shape)},"
                                 f" gets {batch_shape(shape)}")
            return self.output_shape
        if not self.layers:
            raise ValueError(f"{self.name}: the model has no layers")
        self._initialize = initialize
        try:
            self._build_from(shape)
        finally:
            self._initialize = True
        return self.output_shape

    @property
    def built(self):
        # (the input shape too: torch's Conv2d and BatchNorm are built by their constructors)
        return (bool(self.layers) and self.input_shape is not None
                and all(layer.built for layer in self.layers))

    @built.setter
    def built(self, value):
        """(Layer's constructor says False: a Sequential is built when its layers are.)"""

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

    def _unbuilt_layers(self):
        return [layer.name for layer in self.layers if not layer.built
                and not getattr(layer, "parameterless", False)
                and (type(layer).build is not Layer.build or layer.named_children())]

    # ------------------------------------------------------------- running
    def __call__(self, x):
        if not isinstance(x, Tensor):
            x = self._as_input(x)
        if x.ndim < 2:
            raise ValueError(f"{self.name}: expects a batch of shape (None, features...), "
                             f"got {x.shape}")
        if not self.built:
            if not self.layers:
                raise RuntimeError(f"{self.name}: the model has no layers")
            self._build_from(x.shape[1:])
        if x.shape[1:] != self.input_shape:
            self._check_other_shape(tuple(x.shape[1:]))
        if x.device != self.device:
            raise ValueError(f"{self.name}: the input is on {x.device} and the model on "
                             f"{self.device}; move one of them with .to('{self.device}')")
        note_participant(self)
        return self.forward(x)

    def _check_other_shape(self, shape):
        """Inputs of another feature shape than the model was built for (another sequence
        length, another image size) run when every layer takes them, as torch's modules do:
        the layers' output shapes are worked out first, so a shape that a layer cannot take
        is refused here, naming the layer, before any kernel runs."""
        source = f"the input {batch_shape(shape)}"
        for index, layer in enumerate(self.layers):
            if layer._children or isinstance(layer, Model):
                return   # its forward decides (a traced shape would run it)
            features = getattr(layer, "weight", None)
            try:
                if isinstance(layer, Dense) and features is not None \
                        and shape[-1:] != features.shape[:1]:
                    raise ValueError(f"it takes {features.shape[0]} features on the last axis")
                shape = layer.compute_output_shape(shape)
            except ValueError as error:
                raise ValueError(
                    f"{self.name}: built for inputs {batch_shape(self.input_shape)}; layer "
                    f"{index} '{layer.name}' {layer!r} cannot take {source}: {error}") from None
            source = f"layer {index} '{layer.name}''s output {batch_shape(shape)}"

    def forward(self, x):
        for layer in self.layers:
            x = layer.forward(x)
        return x

    def _input_dtype(self, given):
        """The dtype a NumPy or list input becomes: its own when integer and the first layer
        casts it (Rescaling) or takes ids (Embedding); a uint8 array (raw images) any other
        model refuses, since it would run on unscaled pixels; else the parameters' float
        dtype (lists of ints too)."""
        first = self.layers[0] if self.layers else None
        if given.kind in "iu" and (isinstance(first, Rescaling)
                                   or getattr(first, "integer_input", False)):
            return given
        dtype = self._flat[0].dtype if self._flat else np.dtype(np.float32)
        if given == np.uint8:
            _check_input_dtype(self.name, given, dtype)
        return dtype

    def __repr__(self):
        body = "".join(f"\n  ({layer.name}) {layer!r}" for layer in self.layers)
        return f"Sequential({body}\n)" if body else "Sequential()"

    def get_config(self):
        config = {"format": "engine.nn.Sequential", "version": FORMAT_VERSION, "name": self.name,
                  "layers": [{"class_name": type(layer).__name__, "config": layer.get_config()}
                             for layer in self.layers]}
        if self.built and self.layers[0].input_shape != self.input_shape:
            # built by its first call, build() or Input(shape): the file says for what
            config["input_shape"] = list(self.input_shape)
        return config

    @classmethod
    def from_config(cls, config, weights=None):
        """A model with the architecture of ``config`` (its weights zero, not initialised).

        ``config`` is what ``get_config`` returns: ``{"format": "engine.nn.Sequential",
        "version": 1, "name": str, "layers": [{"class_name": str, "config": dict}, ...]}``;
        anything else is a ValueError saying what does not fit (a layer's own checks give
        ValueError or TypeError). With ``weights`` (``{name: array}``, what ``nn.load``
        read from the file) the architecture must fit in them before any parameter is made
        (``serialization.check_architecture``): a small file cannot declare gigabytes."""
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
        input_shape = config.get("input_shape")
        if input_shape is not None and (not isinstance(input_shape, list) or not all(
                isinstance(size, int) and size > 0 for size in input_shape)):
            raise ValueError(f"the config's input_shape must be a list of positive ints, got "
                             f"{input_shape!r}")
        made = []
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
            config = entry["config"]
            check_layer_dtype(index, entry["class_name"], config)
            with deferred_construction():
                made.append(layer_class.from_config(config)
                            if issubclass(layer_class, Sequential) else layer_class(**config))
        if weights is not None:
            check_architecture(made, weights)
        model = cls(name=name)
        model._initialize = False
        model._extend(made)
        if input_shape is not None and not model.built:
            model._build_from(tuple(input_shape))
        model._initialize = True
        return model

    def _file_config(self):
        return json.dumps(self.get_config())

    def export_onnx(self, path, opset=None, normalize=None):
        """Write the model as ONNX to ``path``; returns the ``onnx.ModelProto``
        (``engine.onnx.export``: the layers it exports, ``normalize``, the onnx extra)."""
        # through the package facade: engine.onnx builds Sequentials on import, so it imports
        # this module, and the layering keeps nn below it
        import engine
        return engine.onnx.export(self, path, opset, normalize)


LAYERS[Sequential.__name__] = Sequential   # a layer of another Sequential


def _human_bytes(nbytes):
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.2f} {unit}" if unit != "B" else f"{nbytes} B"
        nbytes /= 1024


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
        model = (Model.from_file_config(config)
                 if isinstance(config, dict) and config.get("format") == "engine.nn.Model"
                 else Sequential.from_config(config, weights=state))
        model.load_state_dict(state)
    except (KeyError, ValueError, TypeError) as error:
        raise ValueError(f"nn.load: {path!r}: {error}") from None
    except MemoryError:   # a crafted architecture far larger than the weights in the file
        raise ValueError(f"nn.load: {path!r}: the architecture needs more memory than this "
                         "machine has; the file does not hold such weights") from None
    return model.to(device)
