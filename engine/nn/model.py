"""``Sequential``, the model: build, pack, move, train/eval, call, summary, state dicts,
the config codec, save and ONNX export; and ``load``, which rebuilds one from a file."""
import json
import os

import numpy as np

from engine import archive
from engine.nn.convolutional import Conv1D, Conv2D
from engine.nn.layers import (Activation, AvgPool2D, BatchNorm, Dense, Dropout, Flatten, Layer,
                              MaxPool2D, Normalization, Rescaling, Reshape, _check_input_dtype,
                              _float_buffers, _float_dtype, batch_shape)
from engine.nn.serialization import (CONFIG_KEY, FORMAT_VERSION, _is_safetensors, _read_npz,
                                     _read_safetensors, check_architecture, check_layer_dtype)
from engine.parameter import ParameterStore
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


# ------------------------------------------------------------------ the model

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
        self._extend(layers)

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

    def _extend(self, layers):
        """``add`` each of ``layers``, packing the parameters once at the end: linear in the
        number of layers (``add`` repacks the whole model and rescans every name each time,
        quadratic over a model read from a file of thousands of layers)."""
        names = _NameAllocator(self.layers)
        seen = {id(other) for other in self.layers}
        for layer in layers:
            if not isinstance(layer, Layer):
                raise TypeError(f"Sequential.add: expected an engine.nn layer, got {layer!r}")
            if layer.built or id(layer) in seen:
                raise ValueError(f"Sequential.add: {layer!r} is already built into a model; "
                                 "make a new layer")
            seen.add(id(layer))
            layer.name = names.allocate(type(layer).__name__.lower())
            layer.training = self.training
            if not self.layers:
                self.input_shape = self.output_shape = layer.input_shape
            self.layers.append(layer)
            if self.output_shape is not None:
                self._build_layer(len(self.layers) - 1)
        if self.output_shape is not None:
            self._pack()

    def _unique_name(self, layer):
        return _NameAllocator(self.layers).allocate(type(layer).__name__.lower())

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
            for _, value in layer.named_parameters() + _float_buffers(layer.named_buffers()):
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
                        + _float_buffers(layer.named_buffers()))
            rows.append((f"{layer.name} ({type(layer).__name__})",
                         batch_shape(layer.output_shape), f"{count:,}"))
        widths = [max(len(row[k]) for row in rows) + 4 for k in range(3)]
        width = sum(widths)

        def line(row):
            return (row[0].ljust(widths[0]) + row[1].ljust(widths[1])
                    + row[2].rjust(widths[2] - 4)).rstrip()

        params, buffers = self.parameters(), [b for _, b in _float_buffers(self.named_buffers())]
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
        self._flat.load(values)   # reads the parameters' values, not the buffers'
        for _, buffer in buffers:
            copy_into(buffer.data, np.ascontiguousarray(values[id(buffer)], buffer.dtype))
            buffer._bump_version()   # written in place, as the parameters

    def get_config(self):
        return {"format": "engine.nn.Sequential", "version": FORMAT_VERSION, "name": self.name,
                "layers": [{"class_name": type(layer).__name__, "config": layer.get_config()}
                           for layer in self.layers]}

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
            check_layer_dtype(index, entry["class_name"], entry["config"])
            made.append(layer_class(**entry["config"]))
        if weights is not None:
            check_architecture(made, weights)
        model = cls(name=name)
        model._initialize = False
        model._extend(made)
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
        model = Sequential.from_config(config, weights=state)
        model.load_state_dict(state)
    except (KeyError, ValueError, TypeError) as error:
        raise ValueError(f"nn.load: {path!r}: {error}") from None
    except MemoryError:   # a crafted architecture far larger than the weights in the file
        raise ValueError(f"nn.load: {path!r}: the architecture needs more memory than this "
                         "machine has; the file does not hold such weights") from None
    return model.to(device)
