"""A torch ``state_dict`` into the equivalent engine model: ``load_state_dict(model, state)``
(also ``engine.interop.torch.load_state_dict``).

The keys are torch's: a model ported module for module (an ``nn.Model`` whose attributes
have the torch module's names, a Sequential of the same layers in the same places) has the
same dotted paths, with a Sequential's layers by position (``stack.0.weight``) as torch names
them. The values are torch tensors (any device, detached) or NumPy arrays, in torch's
layouts: a Linear's weight ``(out, in)`` (the engine's Dense keeps ``(in, out)``: transposed
here), convolutions OIHW (the engine's too), BatchNorm's running statistics, LayerNorm,
Embedding and MultiheadAttention (``in_proj_weight`` ...). torch's ``num_batches_tracked``
has no engine counterpart (its BatchNorm always has a momentum) and is skipped.

Errors are torch's: a RuntimeError "Error(s) in loading state_dict for <class>:" listing the
missing and unexpected keys and each size mismatch (shapes in torch's layout); nothing is
written unless every entry fits. ``strict=False`` loads the keys that match and returns
torch's ``(missing_keys, unexpected_keys)``.
"""
from collections import namedtuple

import numpy as np

from engine.nn.layers import Dense
from engine.nn.model import Sequential
from engine.nn.sequence import MultiHeadAttention
from engine.tensor import Tensor
from ops.device import copy_into

IncompatibleKeys = namedtuple("IncompatibleKeys", ("missing_keys", "unexpected_keys"))

SKIPPED = ("num_batches_tracked",)   # torch's BatchNorm counter: nothing to load it into
# torch's MultiheadAttention keeps its fused input projection as two parameters of its own
_ATTENTION_NAMES = {"in_proj.weight": "in_proj_weight", "in_proj.bias": "in_proj_bias"}


def torch_keys(model, aliases=None):
    """``[(torch key, engine key, tensor, transposed)]`` for every parameter and float buffer
    of ``model``: the key torch's equivalent module would give it, and whether torch's layout
    is the transpose of the engine's. A tensor held twice (a tie) is listed at its first
    place; ``aliases``, when given, gets ``{torch key of a later place: the first's}`` (torch's
    state_dict lists a tied parameter under every key)."""
    entries, seen = [], {}

    def walk(layer, torch_prefix, engine_prefix):
        own = layer._own_parameters() + [(n, b) for n, b in layer._own_buffers()
                                          if b is not None and b.dtype.kind == "f"]
        for name, value in own:
            if value is None:
                continue
            torch_name, transposed = name, isinstance(layer, Dense) and name == "weight"
            if isinstance(layer, MultiHeadAttention):   # kernels (in, out), torch's (out, in)
                torch_name = _ATTENTION_NAMES.get(name, name)
                transposed = name.endswith("weight")
            if id(value) in seen:
                if aliases is not None:
                    aliases[torch_prefix + torch_name] = seen[id(value)]
                continue
            seen[id(value)] = torch_prefix + torch_name
            entries.append((torch_prefix + torch_name, engine_prefix + name, value, transposed))
        for index, (name, child) in enumerate(layer.named_children()):
            torch_name = str(index) if isinstance(layer, Sequential) else name
            walk(child, f"{torch_prefix}{torch_name}.", f"{engine_prefix}{name}.")

    walk(model, "", "")
    return entries


def _as_array(value, key):
    if isinstance(value, Tensor):
        return value.numpy()
    if hasattr(value, "detach") and hasattr(value, "cpu"):   # a torch tensor, any device
        value = value.detach().cpu()
        if not value.dtype.is_floating_point:
            return value.numpy()
        return value.double().numpy() if value.dtype.itemsize > 4 else value.float().numpy()
    array = np.asarray(value)
    if array.dtype.kind not in "fiub":
        raise TypeError(f"load_state_dict: {key} holds {type(value).__name__} of dtype "
                        f"{array.dtype}, expected numbers (a tensor or an array)")
    return array


def _torch_size(shape):
    return f"torch.Size({list(shape)})"


def load_state_dict(model, state_dict, strict=True):
    """Copy the torch ``state_dict`` into the built engine ``model`` (see the module's doc).
    Returns ``(missing_keys, unexpected_keys)`` as torch does (both empty when strict)."""
    where = type(model).__name__
    if not hasattr(state_dict, "items"):
        raise TypeError(f"load_state_dict: expected a state_dict (a mapping of names to "
                        f"tensors), got {type(state_dict).__name__}")
    model._require_weights("load_state_dict")   # builds the layers that declare their size
    aliases = {}
    entries = torch_keys(model, aliases)
    known = {key for key, *_ in entries}
    missing = [key for key, *_ in entries if key not in state_dict]
    unexpected = [key for key in state_dict if key not in known and key not in aliases
                  and key.rsplit(".", 1)[-1] not in SKIPPED]
    values, mismatches = {}, []
    for alias, key in aliases.items():   # torch's tie: one tensor under both keys
        if alias in state_dict and key in state_dict and not np.array_equal(
                _as_array(state_dict[alias], alias), _as_array(state_dict[key], key)):
            mismatches.append(f"{alias} and {key} are one tied parameter in the current "
                              "model, and the checkpoint holds different values for them.")
    for key, engine_key, tensor, transposed in entries:
        if key not in state_dict:
            continue
        value = _as_array(state_dict[key], key)
        expected = tensor.shape[::-1] if transposed else tensor.shape
        if tuple(value.shape) != tuple(expected):
            mismatches.append(f"size mismatch for {key}: copying a param with shape "
                              f"{_torch_size(value.shape)} from checkpoint, the shape in "
                              f"current model is {_torch_size(expected)}.")
            continue
        values[engine_key] = value.T if transposed else value
    errors = list(mismatches)
    if strict and unexpected:
        errors.insert(0, "Unexpected key(s) in state_dict: "
                      + ", ".join(f'"{k}"' for k in unexpected) + ". ")
    if strict and missing:
        errors.insert(0, "Missing key(s) in state_dict: "
                      + ", ".join(f'"{k}"' for k in missing) + ". ")
    if errors:
        hint = ""
        if missing and unexpected:
            hint = ("\n\t(the engine model's keys, torch's way: "
                    + ", ".join(f'"{k}"' for k, *_ in entries) + "; a Sequential's layers are "
                    "numbered by position, so a Dense with activation= in place of torch's "
                    "Linear and ReLU modules shifts the numbers after it)")
        raise RuntimeError(f"Error(s) in loading state_dict for {where}:\n\t"
                           + "\n\t".join(errors) + hint)
    if model.built:   # one copy per flat buffer
        state = model.state_dict()
        for engine_key, value in values.items():
            state[engine_key] = np.asarray(value, state[engine_key].dtype)
        model.load_state_dict(state)
    else:   # its layers are built, the model not packed yet: each tensor in place
        for _, engine_key, tensor, _ in entries:
            if engine_key in values:
                copy_into(tensor.data, np.ascontiguousarray(values[engine_key], tensor.dtype))
                tensor._bump_version()
    return IncompatibleKeys(missing, unexpected)
