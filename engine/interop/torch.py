"""Hybrid models with PyTorch, with the chain rule intact across the boundary.

``as_function(model)``: an engine model (or any differentiable engine callable) as a
``torch.nn.Module``. Its forward runs our kernels on zero-copy views of the torch inputs; its
backward takes PyTorch's ``grad_output`` and runs our tape from it
(``out.backward(grad_output)``), returning the input and parameter gradients to torch.

``from_module(module)``: a ``torch.nn.Module`` as an engine callable. It runs as one engine op;
its backward takes our tape's ``grad_out`` and hands it to ``torch.autograd.grad`` as
``grad_outputs``.

Neither direction ever starts from a loss of its own: only the root of the whole computation
does, wherever that root lives. And ONE optimizer owns every parameter:

- torch's optimizer: ``as_function`` exposes the engine parameters as ``torch.nn.Parameter``
  views of the engine's flat parameter buffer (same memory), so
  ``torch.optim.Adam(hybrid.parameters())`` sees them next to the torch layers', and their
  ``.grad`` is filled by torch from what our backward returns;
- the engine's optimizer: ``from_module`` exposes the torch parameters as engine
  ``Parameter``s packed in a flat buffer that the torch module's parameters then view, and our
  tape accumulates their gradients like any other parameter's.

Arrays cross without a copy: ``to_torch`` and ``from_torch`` share memory (``torch.from_numpy``
or the CUDA Array Interface one way, ``engine.from_dlpack`` the other).

``copy_from_module(model, module)`` and ``copy_to_module(model, module)`` copy the weights
between an engine model and a torch module tree of the same structure (a ported
``nn.Module`` class), the layers that hold weights paired in order.

``from_sequential(torch_sequential, input_shape)`` and ``to_sequential(model)`` convert whole
models instead, weights copied: a ``torch.nn.Sequential`` of the modules in
``TORCH_MODULES`` becomes the engine ``nn.Sequential`` that computes the same function (in
train and in eval mode, BatchNorm's running statistics included), and back.
"""
import contextlib

import numpy as np
import torch

from engine import autograd
from engine.autograd import apply, enable_grad, no_grad
from engine import nn
from engine.interop import sequence, sequential
from engine.interop.state_dict import load_state_dict  # noqa: F401  (torch's keys and layouts)
from engine.parameter import FlatBuffer, Parameter
from engine.tensor import Tensor, from_dlpack
from ops.device import device_of
from ops.pointwise import TABLE as POINTWISE
from ops.registry import Op

_NUMPY_DTYPES = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
                 torch.int64: np.dtype(np.int64), torch.int32: np.dtype(np.int32),
                 torch.uint8: np.dtype(np.uint8)}


# ------------------------------------------------------------------ zero-copy views

def to_torch(x):
    """A torch tensor sharing memory with engine tensor (or engine array) ``x``; no history."""
    data = x.data if isinstance(x, Tensor) else x
    if device_of(data) == "cpu":
        return torch.from_numpy(data)
    if not hasattr(data, "__cuda_array_interface__"):
        raise RuntimeError("to_torch: this CUDA tensor lives in Numba's CUDA simulator, whose "
                           "host-side arrays PyTorch cannot view as CUDA memory")
    return torch.as_tensor(data, device=torch.device("cuda", torch.cuda.current_device()))


def from_torch(x):
    """An engine tensor sharing memory with torch tensor ``x`` (detached from torch's graph).

    ``x`` must be C-contiguous: call ``x.contiguous()`` first when it may not be."""
    return from_dlpack(x.detach())


def _from_torch_contiguous(x, requires_grad=False):
    # inputs and gradients arriving from torch may be transposed or expanded views
    # (the grad_output of .sum() is a stride-0 broadcast): only those are copied
    return from_dlpack(x.detach().contiguous(), requires_grad=requires_grad)


def _address(array):
    if device_of(array) == "cuda":
        return array.__cuda_array_interface__["data"][0]
    return array.ctypes.data


def _engine_dtype(x, where):
    if x.dtype not in _NUMPY_DTYPES:
        raise TypeError(f"{where}: torch dtype {x.dtype} has no engine counterpart; use "
                        "torch.float32 or torch.float64 (int64/int32/uint8 for labels)")
    return _NUMPY_DTYPES[x.dtype]


def _check_boundary(where, torch_side, torch_tensor, engine_side, engine_tensor):
    """Raise when the torch and the engine tensor meeting at the boundary disagree on device
    or floating dtype, naming both sides."""
    torch_dtype = _engine_dtype(torch_tensor, where)
    if torch_tensor.device.type != engine_tensor.device:
        raise ValueError(f"{where}: {torch_side} is on {torch_tensor.device.type} but "
                         f"{engine_side} is on {engine_tensor.device}; put both on one device")
    if torch_dtype.kind == "f" and torch_dtype != engine_tensor.dtype:
        raise TypeError(f"{where}: {torch_side} is {torch_dtype} but {engine_side} is "
                        f"{engine_tensor.dtype}; convert one side to the other's dtype")


@contextlib.contextmanager
def _on_tape(tape):
    """Make ``tape`` this thread's current one for the block."""
    state = autograd._state
    previous, state.tape = state.tape, tape
    try:
        yield
    finally:
        state.tape = previous


def _pack(parameters):
    """``parameters``, those not yet in a flat buffer packed into one per device and dtype
    (packing moves a parameter's memory, so it must happen before torch views it)."""
    for p in parameters:
        if not isinstance(p, Parameter):
            raise TypeError(f"as_function: the model's parameters must be engine Parameters, "
                            f"got a {type(p).__name__}")
    groups = {}
    for p in parameters:
        if p.flat is None:
            groups.setdefault((p.device, p.dtype), []).append(p)
    for group in groups.values():
        FlatBuffer(group)
    return parameters


# ------------------------------------------------------------------ engine inside torch

class EngineModule(torch.nn.Module):
    """A ``torch.nn.Module`` running an engine model; built by ``as_function``.

    ``parameters()`` yields torch views of the engine parameters, so one torch optimizer
    updates the engine model in place."""

    def __init__(self, model):
        super().__init__()
        if not getattr(model, "built", True):
            raise RuntimeError("as_function: the engine model is not built yet, so it has no "
                               "parameters for torch to see; give its first layer "
                               "input_shape=... or call it once on a batch before wrapping")
        self.model = model
        found = model.parameters() if hasattr(model, "parameters") else []
        self.engine_parameters = _pack(list(found))
        self.engine_views = torch.nn.ParameterList(
            torch.nn.Parameter(to_torch(p)) for p in self.engine_parameters)

    def forward(self, *inputs):
        self._check(inputs)
        if torch.is_grad_enabled():
            return _EngineFunction.apply(self, *inputs, *self.engine_views)
        with no_grad():
            out = self.model(*(_from_torch_contiguous(x) for x in inputs))
        return to_torch(out)

    def train(self, mode=True):
        super().train(mode)
        switch = getattr(self.model, "train" if mode else "eval", None)
        if callable(switch):
            switch()
        return self

    def _check(self, inputs):
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"as_function: input {i} is a {type(x).__name__}; "
                                "pass torch tensors")
            if self.engine_parameters:
                first = self.engine_parameters[0]
                _check_boundary("as_function", f"torch input {i}", x,
                                "the engine model", first)
        for p, view in zip(self.engine_parameters, self.engine_views):
            if p.device != view.device.type or _address(p.data) != view.data_ptr():
                raise RuntimeError(
                    "as_function: an engine parameter no longer shares memory with its torch "
                    f"view (engine: {p.shape} on {p.device}, torch: {tuple(view.shape)} on "
                    f"{view.device}); the model was moved or converted after wrapping: "
                    "call .to() on the engine model first, then as_function")


class _EngineFunction(torch.autograd.Function):
    """forward: our kernels on zero-copy views; backward: our tape from torch's grad_output."""

    @staticmethod
    def forward(ctx, module, *args):
        n_inputs = len(args) - len(module.engine_parameters)
        inputs = [_from_torch_contiguous(x, requires_grad=needed and x.is_floating_point())
                  for x, needed in zip(args[:n_inputs], ctx.needs_input_grad[1:])]
        # the call records on a tape of its own, owned by ctx: torch decides when the graph dies
        # (retain_graph, or gradcheck's repeated backwards), and torch may run the backward on
        # another thread (its CUDA device threads), where the engine's per-thread tape differs
        tape = autograd.Tape()
        with enable_grad(), _on_tape(tape):
            out = module.model(*inputs)
        if not isinstance(out, Tensor):
            raise TypeError(f"as_function: the engine model returned a {type(out).__name__}; "
                            "it must return one engine Tensor")
        ctx.engine = (module, inputs, out, tape)
        return to_torch(out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        module, inputs, out, tape = ctx.engine
        parameters = module.engine_parameters
        if not out.requires_grad:
            return (None,) * (1 + len(inputs) + len(parameters))
        _check_boundary("as_function backward", "torch's grad_output", grad_output,
                        "the engine output", out)
        for x in inputs + parameters:
            x.grad = None   # each backward returns its own contribution; torch accumulates
        with _on_tape(tape):
            out.backward(_from_torch_contiguous(grad_output), retain_graph=True)
        input_grads = [None if x.grad is None else to_torch(x.grad) for x in inputs]
        # a parameter's gradient is a view of the flat gradient buffer, which the next backward
        # overwrites: torch gets its own copy to accumulate into .grad
        parameter_grads = [None if p.grad is None else to_torch(p.grad).clone()
                           for p in parameters]
        return (None, *input_grads, *parameter_grads)


def as_function(model):
    """``model`` (an engine model with ``.parameters()``, or any differentiable engine callable
    returning one Tensor) as a ``torch.nn.Module`` whose autograd runs our tape.

    Move the engine model to its device before wrapping: the torch parameters are views of its
    memory. Train with one torch optimizer over ``hybrid.parameters()``."""
    return EngineModule(model)


# ------------------------------------------------------------------ torch inside the engine

class TorchModuleOp(Op):
    """A torch module run as one engine op.

    Deliberately not in ``ops.REGISTRY``: the registry enumerates our dual-kernel ops, and this
    one runs whatever kernels torch picks."""
    name = "torch_module"

    def forward(self, *arrays):
        wrapper = self.params["wrapper"]
        leaves = [to_torch(a).requires_grad_(needed)
                  for a, needed in zip(arrays, self.needs_input_grad)]
        n_inputs = len(arrays) - len(wrapper.names)
        state = dict(zip(wrapper.names, leaves[n_inputs:]))
        recording = any(self.needs_input_grad)
        with torch.enable_grad() if recording else torch.no_grad():
            out = torch.func.functional_call(wrapper.module, state, tuple(leaves[:n_inputs]))
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"from_module: the torch module returned a {type(out).__name__}; "
                            "it must return one tensor")
        if recording:
            self.torch_out, self.leaves = out, leaves
        return _from_torch_contiguous(out).data

    def backward(self, grad_out, grad_dst):
        wanted = [leaf for leaf, needed in zip(self.leaves, self.needs_input_grad) if needed]
        grads = iter(torch.autograd.grad(self.torch_out, wanted, grad_outputs=to_torch(grad_out),
                                         allow_unused=True))
        self.torch_out = self.leaves = None
        result = []
        for needed in self.needs_input_grad:
            g = next(grads) if needed else None
            result.append(None if g is None else _from_torch_contiguous(g).data)
        return tuple(result)


class TorchModule:
    """An engine callable running a ``torch.nn.Module``; built by ``from_module``.

    ``parameters()`` are engine Parameters in a flat buffer that the torch module's own
    parameters view, so one engine optimizer trains it with the rest of the engine model."""

    def __init__(self, module):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"from_module: expected a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        named = list(module.named_parameters())
        self.names = [name for name, _ in named]
        self._torch_parameters = [p for _, p in named]
        self._parameters = [Parameter(_from_torch_contiguous(p).data) for p in self._torch_parameters]
        _pack(self._parameters)
        self._point_module_at_parameters()

    def parameters(self):
        return list(self._parameters)

    def train(self):
        self.module.train()
        return self

    def eval(self):
        self.module.eval()
        return self

    def __call__(self, *inputs):
        for i, x in enumerate(inputs):
            if not isinstance(x, Tensor):
                raise TypeError(f"from_module: input {i} is a {type(x).__name__}; pass engine "
                                "Tensors")
            if self._parameters:
                _check_boundary("from_module", f"torch module {type(self.module).__name__}",
                                self._torch_parameters[0], f"engine input {i}", x)
        self._point_module_at_parameters()
        return apply(TorchModuleOp, *inputs, *self._parameters, wrapper=self)

    def _point_module_at_parameters(self):
        """Keep the torch module viewing our parameters' memory, also after the engine moved
        or repacked them, so the module itself (state_dict, plain torch calls) stays current."""
        with torch.no_grad():
            for torch_parameter, p in zip(self._torch_parameters, self._parameters):
                if (torch_parameter.device.type != p.device
                        or torch_parameter.data_ptr() != _address(p.data)):
                    torch_parameter.data = to_torch(p)


def from_module(module):
    """``module`` (a ``torch.nn.Module`` returning one tensor) as an engine callable: one engine
    op whose backward hands our ``grad_out`` to torch's autograd.

    Train it with one engine optimizer over ``wrapped.parameters()`` (and the rest of the
    engine model's)."""
    return TorchModule(module)


# ------------------------------------------------------------------ whole models, both ways

def _host(tensor):
    return tensor.detach().cpu().numpy()


def _pair(value):
    return list(value) if isinstance(value, (tuple, list)) else [value, value]


def _refuse(index, module, reason):
    return ValueError(f"from_sequential: module {index} {module!r}: {reason}")


def _from_linear(index, module):
    weight = _host(module.weight).T   # torch keeps (out, in), the engine (in, out)
    bias = _host(module.bias) if module.bias is not None else np.zeros(weight.shape[1],
                                                                        weight.dtype)
    return sequential.layer("Dense", {"units": module.out_features}, weight=weight, bias=bias)


def _from_conv2d(index, module):
    if module.padding_mode != "zeros":
        raise _refuse(index, module, f"padding_mode {module.padding_mode!r}; the engine "
                                     "pads with zeros")
    padding = module.padding if isinstance(module.padding, str) else _pair(module.padding)
    config = {"filters": module.out_channels, "kernel_size": _pair(module.kernel_size),
              "stride": _pair(module.stride), "padding": padding,
              "dilation": _pair(module.dilation), "groups": module.groups}
    weights = {"weight": _host(module.weight)}
    if module.bias is None:
        config["use_bias"] = False
    else:
        weights["bias"] = _host(module.bias)
    return sequential.layer("Conv2D", config, **weights)


def _from_pool(class_name):
    def convert(index, module):
        if getattr(module, "ceil_mode", False) or _pair(getattr(module, "dilation", 1)) != [1, 1]:
            raise _refuse(index, module, f"ceil_mode=True or a dilation has no {class_name} "
                                         "equivalent")
        if getattr(module, "return_indices", False):
            raise _refuse(index, module, "return_indices=True returns two tensors")
        if class_name == "AvgPool2D" and (not module.count_include_pad
                                          or module.divisor_override is not None):
            raise _refuse(index, module, "the engine's average counts the padded zeros "
                                         "(count_include_pad=True, no divisor_override)")
        stride = module.kernel_size if module.stride is None else module.stride
        return sequential.layer(class_name, {"pool_size": _pair(module.kernel_size),
                                             "stride": _pair(stride),
                                             "padding": _pair(module.padding)})
    return convert


def _from_batch_norm(index, module):
    if not module.track_running_stats or module.momentum is None:
        raise _refuse(index, module, "the engine's BatchNorm keeps running statistics with a "
                                     "momentum (track_running_stats=True, momentum a number)")
    channels = module.num_features
    dtype = _host(module.running_mean).dtype
    weight = _host(module.weight) if module.affine else np.ones(channels, dtype)
    bias = _host(module.bias) if module.affine else np.zeros(channels, dtype)
    return sequential.layer("BatchNorm", {"momentum": module.momentum, "eps": module.eps},
                            weight=weight, bias=bias, running_mean=_host(module.running_mean),
                            running_var=_host(module.running_var))


def _from_softmax(index, module, rank):
    """``rank``: the number of axes of the module's input, the batch's included."""
    dim = module.dim
    if dim is None:   # torch's implicit dim (torch.nn.functional._get_softmax_dim)
        dim = 0 if rank in (0, 1, 3) else 1
        given = f"dim=None, which torch reads as dim={dim} for a {rank}-d input"
    else:
        given = f"dim={dim}"
    if dim % max(rank, 1) != rank - 1:
        raise _refuse(index, module, f"{given}; the engine's softmax is over the last axis "
                                     f"of this {rank}-d input: give dim=-1")
    return sequential.layer("Activation", {"activation": "softmax"})


def _input_ranks(torch_sequential, input_shape):
    """``{id(module): ndim of its input}`` for the Softmax modules, from one forward on a
    batch of one zero sample (in eval mode, without gradients: nothing in the module
    changes)."""
    ranks, hooks = {}, []
    for module in _modules(torch_sequential):
        if isinstance(module, torch.nn.Softmax):
            hooks.append(module.register_forward_pre_hook(
                lambda module, args: ranks.__setitem__(id(module), args[0].ndim)))
    if not hooks:
        return ranks
    dtype = next((p.dtype for p in torch_sequential.parameters()), torch.float32)
    training = torch_sequential.training
    try:
        with torch.no_grad():
            torch_sequential.eval()(torch.zeros((1, *input_shape), dtype=dtype))
    finally:
        torch_sequential.train(training)
        for hook in hooks:
            hook.remove()
    return ranks


def _from_flatten(index, module):
    if (module.start_dim, module.end_dim) != (1, -1):
        raise _refuse(index, module, "the engine's Flatten keeps the batch and flattens the "
                                     "rest (start_dim=1, end_dim=-1)")
    return sequential.layer("Flatten", {})


def _from_unflatten(index, module):
    if module.dim not in (1, -1):
        raise _refuse(index, module, "the engine's Reshape reshapes all the features of "
                                     "(batch, features) inputs: dim=1")
    return sequential.layer("Reshape", {"shape": list(module.unflattened_size)})


def _from_gelu(index, module):
    if module.approximate != "none":
        raise _refuse(index, module, f"approximate={module.approximate!r}; the engine's GELU "
                                     "activation is the exact one (approximate='none')")
    return sequential.layer("Activation", {"activation": "gelu"})


def _activation(name, **config):
    return lambda index, module: sequential.layer("Activation", {"activation": name, **config})


TORCH_MODULES = {
    "Linear": _from_linear, "Conv2d": _from_conv2d, "MaxPool2d": _from_pool("MaxPool2D"),
    "AvgPool2d": _from_pool("AvgPool2D"), "BatchNorm1d": _from_batch_norm,
    "BatchNorm2d": _from_batch_norm,
    # the activations of ops.pointwise.TABLE by their torch module; two with a parameter
    **{entry.torch: _activation(entry.name) for entry in POINTWISE if entry.torch},
    "LeakyReLU": lambda index, module: sequential.layer(
        "Activation", {"activation": "leaky_relu", "alpha": module.negative_slope}),
    "GELU": _from_gelu, "Softmax": _from_softmax,
    "Flatten": _from_flatten, "Unflatten": _from_unflatten,
    "Dropout": lambda index, module: sequential.layer("Dropout", {"p": module.p}),
    "Identity": lambda index, module: None, **sequence.TORCH_MODULES}


def _modules(module):
    """The leaf modules of ``module``, nested Sequentials opened."""
    if isinstance(module, torch.nn.Sequential):
        return [leaf for child in module for leaf in _modules(child)]
    return [module]


def from_sequential(torch_sequential, input_shape):
    """The engine ``nn.Sequential`` computing what ``torch_sequential`` computes on inputs of
    ``input_shape`` (without the batch dimension), weights and BatchNorm statistics copied:
    ``Linear`` becomes ``Dense`` (the kernel transposed), ``Conv2d`` ``Conv2D``,
    ``MaxPool2d``/``AvgPool2d`` the engine's pools, ``BatchNorm1d``/``2d`` ``BatchNorm``,
    the activations ``Activation`` (fused into the Dense or Conv2D before them), ``Flatten``
    and ``Unflatten`` ``Flatten`` and ``Reshape``, ``Dropout`` ``Dropout``; in the module's
    float dtype, on the CPU, in the module's train or eval mode (in train mode a Dropout
    layer draws its masks from the engine's generator, not torch's). A module without an
    engine layer is a ValueError naming it."""
    if not isinstance(torch_sequential, torch.nn.Sequential):
        raise TypeError(f"from_sequential: expected a torch.nn.Sequential, got "
                        f"{type(torch_sequential).__name__}")
    dtypes = {p.dtype for p in torch_sequential.parameters()} or {torch.float32}
    if len(dtypes) > 1 or not dtypes <= {torch.float32, torch.float64}:
        raise TypeError(f"from_sequential: the parameters are {sorted(map(str, dtypes))}; "
                        "convert the module to one of torch.float32, torch.float64")
    layers = []
    ranks = _input_ranks(torch_sequential, tuple(input_shape))
    for index, module in enumerate(_modules(torch_sequential)):
        convert = TORCH_MODULES.get(type(module).__name__)
        if convert is None or type(module).__module__.split(".")[0] != "torch":
            raise _refuse(index, module, f"{type(module).__name__} has no engine layer; "
                                         f"converted: {', '.join(TORCH_MODULES)}")
        layer = (_from_softmax(index, module, ranks[id(module)]) if convert is _from_softmax
                 else convert(index, module))
        if layer is not None:
            layers.append(layer)
    model = sequential.build(sequential.fuse_activations(layers), input_shape,
                             _NUMPY_DTYPES[dtypes.pop()], "sequential", "from_sequential")
    return model.train(torch_sequential.training)


def _activation_module(name, alpha):
    if name is None:
        return []
    modules = {**{entry.name: getattr(torch.nn, entry.torch) for entry in POINTWISE
                  if entry.torch},
               "softmax": lambda: torch.nn.Softmax(dim=-1),
               "leaky_relu": lambda: torch.nn.LeakyReLU(alpha)}
    if name not in modules:
        raise ValueError(f"to_sequential: activation {name!r} has no torch module here; "
                         f"converted: {', '.join(modules)}")
    return [modules[name]()]


def _set(parameter, array):
    parameter.data = torch.from_numpy(np.ascontiguousarray(array))


def _engine_kind(layer):
    """The engine layer class ``layer`` is: its own name, or for torch's names
    (``nn.Linear``, a Dense) the first engine class among its bases."""
    for cls in type(layer).__mro__:   # a user's subclass keeps its own name (refused)
        if cls.__module__ != "engine.nn.torch_layers":
            return cls.__name__


def _to_modules(layer, input_shape, state, dtype):
    """The torch modules computing ``layer`` on features of ``input_shape``, in ``dtype``,
    their parameters and statistics set from ``state`` (the layer's entries)."""
    t, kind = torch.nn, _engine_kind(layer)
    if getattr(layer, "data_format", "channels_first") != "channels_first":
        raise ValueError(f"to_sequential: layer '{layer.name}' ({kind}) takes channels-last "
                         "images and torch's layers channels first; rebuild it with "
                         "data_format='channels_first'")
    if kind in sequence.ENGINE_LAYERS:
        return sequence.ENGINE_LAYERS[kind](layer, input_shape, state, dtype)
    if kind == "Dense":
        module = t.Linear(input_shape[0], layer.units, dtype=dtype)
        _set(module.weight, state["weight"].T)
        _set(module.bias, state["bias"])
        return [module] + _activation_module(layer.activation, layer.alpha)
    if kind == "Conv2D":
        padding = tuple(layer.padding) if isinstance(layer.padding, list) else layer.padding
        module = t.Conv2d(input_shape[0], layer.filters, layer.kernel_size, layer.stride,
                          padding, layer.dilation, layer.groups, layer.use_bias, dtype=dtype)
        for entry in ("weight", "bias") if layer.use_bias else ("weight",):
            _set(getattr(module, entry), state[entry])
        return [module] + _activation_module(layer.activation, layer.alpha)
    if kind in ("MaxPool2D", "AvgPool2D"):
        pool = t.MaxPool2d if kind == "MaxPool2D" else t.AvgPool2d
        return [pool(layer.pool_size, layer.stride, layer.padding)]
    if kind == "BatchNorm":
        norm = t.BatchNorm2d if len(input_shape) == 3 else t.BatchNorm1d
        module = norm(input_shape[0], eps=layer.eps, momentum=layer.momentum, dtype=dtype)
        for entry in ("weight", "bias", "running_mean", "running_var"):
            _set(getattr(module, entry), state[entry])
        return [module]
    if kind == "Activation":
        return _activation_module(layer.activation, layer.alpha)
    if kind == "Flatten":
        return [t.Flatten()]
    if kind == "Reshape":   # Unflatten splits one axis: the features' when they have one
        return [t.Flatten()] * (len(input_shape) > 1) + [t.Unflatten(1, layer.output_shape)]
    if kind == "Dropout":
        return [t.Dropout(layer.p)]
    raise ValueError(f"to_sequential: layer '{layer.name}' ({kind}) has no torch module here; "
                     "converted: Dense, Conv2D, MaxPool2D, AvgPool2D, BatchNorm, Activation, "
                     "Flatten, Reshape, Dropout")


def to_sequential(model):
    """The ``torch.nn.Sequential`` computing what the engine ``model`` (a built
    ``nn.Sequential``) computes, with copies of its weights and BatchNorm statistics, in
    its float dtype, on the CPU, in its train or eval mode (``from_sequential``'s
    correspondence, the other way). A layer without a torch module is a ValueError naming
    it."""
    if not isinstance(model, nn.Sequential) or not model.built:
        raise TypeError("to_sequential: expected a built engine nn.Sequential (give its "
                        f"first layer input_shape=...), got {model!r:.80}")
    dtypes = {p.dtype for p in model.parameters()} or {np.dtype(np.float32)}
    if len(dtypes) > 1:
        raise TypeError(f"to_sequential: the parameters mix {sorted(map(str, dtypes))}; "
                        "convert the model with model.to(dtype)")
    dtype = {np.dtype(v): k for k, v in _NUMPY_DTYPES.items()}[dtypes.pop()]
    state = model.state_dict()
    modules, shape = [], model.input_shape
    for layer in model.layers:
        own = {name[len(layer.name) + 1:]: value for name, value in state.items()
               if name.startswith(layer.name + ".")}
        modules += _to_modules(layer, shape, own, dtype)
        shape = layer.output_shape
    return torch.nn.Sequential(*modules).train(model.training)


# ------------------------------------------------------------------ module trees

def _torch_owners(module):
    """``[(name, module)]``: the modules of a torch tree holding parameters or float buffers
    of their own, in ``modules()`` order (a module's own before its children's)."""
    return [(name, m) for name, m in module.named_modules()
            if any(True for _ in m.parameters(recurse=False))
            or any(b.is_floating_point() for b in m.buffers(recurse=False))]


def _engine_owners(model):
    """``[(name, layer)]``: the layers of an engine tree holding parameters or float buffers
    of their own, in the same order as ``_torch_owners``'."""
    return [(name, layer) for name, layer in [("", model)] + model.named_layers()
            if any(p is not None for _, p in layer._own_parameters())
            or any(b is not None and b.dtype.kind == "f" for _, b in layer._own_buffers())]


def _torch_arrays(module):
    """``{engine name: array}`` of a torch module's own state, in the engine's layout."""
    arrays = {name: _host(p) for name, p in module.named_parameters(recurse=False)}
    arrays.update({name: _host(b) for name, b in module.named_buffers(recurse=False)
                   if b.is_floating_point()})
    if isinstance(module, torch.nn.Linear):
        arrays["weight"] = arrays["weight"].T   # torch (out, in), the engine (in, out)
    return arrays


def _pairs(model, module, where):
    """The state owners of both trees, paired in order; a ValueError naming the first pair
    that differs."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{where}: expected a torch.nn.Module, got {type(module).__name__}")
    if not model.built:
        raise RuntimeError(f"{where}: build the engine model first (call it once, or "
                           "model.build(input_shape))")
    ours, theirs = _engine_owners(model), _torch_owners(module)
    for (name, layer), (torch_name, torch_module) in zip(ours, theirs):
        own = {n for n, p in layer._own_parameters() + layer._own_buffers()
               if p is not None and p.dtype.kind == "f"}
        if own != set(_torch_arrays(torch_module)):
            raise ValueError(f"{where}: engine layer '{name}' ({type(layer).__name__}, "
                             f"{sorted(own)}) does not match torch module '{torch_name}' "
                             f"({type(torch_module).__name__}, "
                             f"{sorted(_torch_arrays(torch_module))})")
    if len(ours) != len(theirs):
        raise ValueError(f"{where}: the engine model has {len(ours)} layers with weights, the "
                         f"torch module {len(theirs)}: {[n for n, _ in ours]} against "
                         f"{[n for n, _ in theirs]}")
    return list(zip(ours, theirs))


def copy_from_module(model, module):
    """Copy the weights and BatchNorm statistics of the torch module tree ``module`` into
    the built engine ``model`` of the same structure (a ported ``nn.Module`` class): the
    layers that hold weights are paired in order (torch's ``modules()``, the engine's
    ``named_layers()``), each with the same entries and shapes (a ``Linear``'s kernel
    transposed into a ``Dense``'s). Nothing is written unless every pair fits. Returns
    ``model``."""
    state = {}
    for (name, _), (_, torch_module) in _pairs(model, module, "copy_from_module"):
        state.update({(f"{name}.{key}" if name else key): value
                      for key, value in _torch_arrays(torch_module).items()})
    current = model.state_dict()
    state.update({key: value for key, value in current.items() if key not in state})
    model.load_state_dict(state)
    return model


def copy_to_module(model, module):
    """The other way: the engine ``model``'s weights and statistics into the torch module
    tree ``module`` of the same structure (``copy_from_module``'s pairing). Returns
    ``module``."""
    state = model.state_dict()
    pairs = _pairs(model, module, "copy_to_module")
    with torch.no_grad():
        for (name, _), (_, torch_module) in pairs:
            for key, target in list(torch_module.named_parameters(recurse=False)) + [
                    (k, b) for k, b in torch_module.named_buffers(recurse=False)
                    if b.is_floating_point()]:
                value = state[f"{name}.{key}" if name else key]
                if isinstance(torch_module, torch.nn.Linear) and key == "weight":
                    value = value.T
                target.copy_(torch.from_numpy(np.ascontiguousarray(value)))
    return module
