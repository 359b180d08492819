"""torch's sequence modules and the engine's layers, both ways: ``nn.Embedding``,
``nn.LayerNorm`` (over the last axis) and ``nn.MultiheadAttention(batch_first=True)``.

``from_torch(module)`` is the engine layer computing what the torch module computes (built,
on the CPU, in the module's float dtype, weights copied); ``to_torch(layer)`` the torch
module computing what a built engine layer computes. Attention's weights: torch keeps the
fused input projection as ``in_proj_weight`` (3D, D) and the output one as a Linear (D, D),
both (out, in); the engine keeps (in, out) like its Dense, so each is transposed. Embedding
and LayerNorm also convert inside whole Sequentials (``engine.interop.torch``'s
``from_sequential`` / ``to_sequential`` read ``TORCH_MODULES`` and ``ENGINE_LAYERS``);
MultiheadAttention, which takes three inputs and returns a pair, cannot sit in a torch
Sequential, so it converts on its own.
"""
import numpy as np
import torch

from engine import nn
from engine.interop import sequential

_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


def _host(tensor):
    return tensor.detach().cpu().numpy()


def _refuse(module, reason):
    return ValueError(f"engine.interop: {type(module).__name__} {module!r:.60}: {reason}")


def _embedding_entry(module):
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        raise _refuse(module, "max_norm, scale_grad_by_freq and sparse have no engine "
                              "equivalent (leave them at their defaults)")
    config = {"num_embeddings": module.num_embeddings, "embedding_dim": module.embedding_dim}
    if module.padding_idx is not None:
        config["padding_idx"] = int(module.padding_idx)
    return config, {"weight": _host(module.weight)}


def _layer_norm_entry(module):
    if len(module.normalized_shape) != 1:
        raise _refuse(module, f"normalized_shape {tuple(module.normalized_shape)}: the "
                              "engine's LayerNorm normalises the last axis (one int)")
    width = module.normalized_shape[0]
    dtype = _DTYPES.get(module.weight.dtype if module.weight is not None else torch.float32)
    weight = _host(module.weight) if module.weight is not None else np.ones(width, dtype)
    bias = _host(module.bias) if getattr(module, "bias", None) is not None \
        else np.zeros(width, weight.dtype)
    return {"eps": module.eps}, {"weight": weight, "bias": bias}


def _attention_entry(module):
    if not module._qkv_same_embed_dim or module.bias_k is not None or module.add_zero_attn:
        raise _refuse(module, "kdim/vdim other than embed_dim, add_bias_kv and add_zero_attn "
                              "have no engine equivalent")
    if not module.batch_first:
        raise _refuse(module, "the engine's attention takes (N, T, D) inputs: build the torch "
                              "module with batch_first=True")
    config = {"num_heads": module.num_heads, "dropout": float(module.dropout)}
    weights = {"in_proj.weight": _host(module.in_proj_weight).T,
               "out_proj.weight": _host(module.out_proj.weight).T}
    if module.in_proj_bias is not None:
        weights["in_proj.bias"] = _host(module.in_proj_bias)
        weights["out_proj.bias"] = _host(module.out_proj.bias)
    else:
        config["use_bias"] = False
    return config, weights


_ENTRIES = {"Embedding": ("Embedding", _embedding_entry, lambda m: ()),
            "LayerNorm": ("LayerNorm", _layer_norm_entry, lambda m: (m.normalized_shape[0],)),
            "MultiheadAttention": ("MultiHeadAttention", _attention_entry,
                                   lambda m: (None, m.embed_dim))}


def from_torch(module):
    """The built engine layer (CPU, the module's dtype) computing what ``module`` (a torch
    ``nn.Embedding``, ``nn.LayerNorm`` or ``nn.MultiheadAttention(batch_first=True)``)
    computes, with copies of its weights; its train or eval mode too."""
    kind = type(module).__name__
    if kind not in _ENTRIES or type(module).__module__.split(".")[0] != "torch":
        raise TypeError(f"from_torch: expected torch's Embedding, LayerNorm or "
                        f"MultiheadAttention, got {kind}")
    class_name, entry, input_shape = _ENTRIES[kind]
    config, weights = entry(module)
    dtype = next(iter(weights.values())).dtype
    layer = getattr(nn, class_name)(**config, dtype=dtype)
    layer.build(input_shape(module), "cpu", initialize=False)
    for name, parameter in layer.named_parameters():
        np.copyto(parameter.data, weights[name].astype(dtype))
    layer.training = module.training
    return layer


def to_torch(layer):
    """The torch module computing what the built engine ``layer`` (Embedding, LayerNorm or
    MultiHeadAttention) computes, with copies of its weights, in its dtype and mode (an
    engine attention becomes ``nn.MultiheadAttention(batch_first=True)``: call it as
    ``module(x, x, x, need_weights=False, attn_mask=..., is_causal=...)``)."""
    if not getattr(layer, "built", False):
        raise TypeError(f"to_torch: expected a built engine layer, got {layer!r:.80}")
    state = {name: np.asarray(p.numpy()) for name, p in layer.named_parameters()}
    kind = type(layer).__name__
    if kind not in ENGINE_LAYERS:
        raise TypeError(f"to_torch: converts Embedding, LayerNorm and MultiHeadAttention, "
                        f"got {kind}")
    dtype = {np.dtype(v): k for k, v in _DTYPES.items()}[layer.dtype]
    (module,) = ENGINE_LAYERS[kind](layer, None, state, dtype)
    return module.train(layer.training)


def _set(parameter, array):
    parameter.data = torch.from_numpy(np.ascontiguousarray(array))


def _embedding_module(layer, input_shape, state, dtype):
    module = torch.nn.Embedding(layer.num_embeddings, layer.embedding_dim,
                                padding_idx=layer.padding_idx, dtype=dtype)
    _set(module.weight, state["weight"])
    return [module]


def _layer_norm_module(layer, input_shape, state, dtype):
    module = torch.nn.LayerNorm(state["weight"].shape[0], eps=layer.eps, dtype=dtype)
    _set(module.weight, state["weight"])
    _set(module.bias, state["bias"])
    return [module]


def _attention_module(layer, input_shape, state, dtype):
    width = state["in_proj.weight"].shape[0]
    module = torch.nn.MultiheadAttention(width, layer.num_heads, dropout=layer.dropout,
                                         bias=layer.use_bias, batch_first=True, dtype=dtype)
    _set(module.in_proj_weight, state["in_proj.weight"].T)
    _set(module.out_proj.weight, state["out_proj.weight"].T)
    if layer.use_bias:
        _set(module.in_proj_bias, state["in_proj.bias"])
        _set(module.out_proj.bias, state["out_proj.bias"])
    return [module]


def _sequential_entry(class_name, entry):
    def convert(index, module):
        config, weights = entry(module)
        return sequential.layer(class_name, config, **weights)
    return convert


# torch module -> the layer description engine.interop.torch.from_sequential builds
TORCH_MODULES = {"Embedding": _sequential_entry("Embedding", _embedding_entry),
                 "LayerNorm": _sequential_entry("LayerNorm", _layer_norm_entry)}
# engine layer -> its torch modules, for to_sequential (and to_torch)
ENGINE_LAYERS = {"Embedding": _embedding_module, "LayerNorm": _layer_norm_module,
                 "MultiHeadAttention": _attention_module}
