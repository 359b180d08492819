"""The functions a sequence model's code reaches for, as torch spells them: ``embedding``,
``layer_norm``, ``scaled_dot_product_attention``, ``tril``/``triu``, ``masked_fill``,
``split``/``chunk``, the (values, indices) ``max``/``min`` over a dim, ``topk`` and
``multinomial`` (the elementwise ``maximum``/``minimum`` are ``engine.functional``'s). Each runs registered ops (``ops.embedding``,
``ops.layer_norm``, ``ops.attention``, ...) or composes existing ones; Tensor binds the
methods among them.

This module sits beside ``engine.functional``, below ``engine.tensor``: it sees tensors as
``engine.autograd.Value``s.
"""
import collections

import numpy as np

from engine import functional as F
from engine.autograd import Value, apply
from engine.random import generator
from ops.attention import AttentionOp, PackedAttentionOp
from ops.dropout import SEED_LIMIT, new_seed_state, next_mask_seed, seed_array
from ops.embedding import EmbeddingOp
from ops.fill import fill
from ops.layout import normalize_axes
from ops.memory import empty
from ops.multinomial import Multinomial
from ops.step_counter import new_counter
from ops.topk import TakeAlongRows, TopK
from ops.triangle import Triangle
from ops.layer_norm import HAS_BIAS, HAS_WEIGHT, LayerNormOp


def embedding(ids, weight, padding_idx=None):
    """The rows of ``weight`` (num_embeddings, dim) that the integer ``ids`` (any shape; a
    Tensor, an array or a list) pick: shape ``ids.shape + (dim,)``, torch's
    ``F.embedding``. The ``padding_idx`` row (negative counts from the end) gets no gradient;
    an id outside [0, num_embeddings) is an IndexError."""
    if not isinstance(weight, Value):
        raise TypeError(f"embedding: the weight must be an engine Tensor, got "
                        f"{type(weight).__name__}")
    if isinstance(ids, Value):
        ids = ids.data
    else:
        ids = np.asarray(ids)
    if np.dtype(ids.dtype).kind not in "iu":
        raise TypeError(f"embedding: ids must be integers, got {ids.dtype}")
    rows = weight.shape[0] if weight.ndim else 0
    if padding_idx is not None:
        if isinstance(padding_idx, bool) or not isinstance(padding_idx, (int, np.integer)) \
                or not -rows <= padding_idx < rows:
            raise ValueError(f"embedding: padding_idx {padding_idx!r} must be an int in "
                             f"[{-rows}, {rows}) (num_embeddings {rows})")
        padding_idx = int(padding_idx) % rows
    return apply(EmbeddingOp, ids, weight, padding_idx=padding_idx)


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """torch's ``F.layer_norm``: each row of the trailing ``normalized_shape`` dims (an int
    or a tuple) scaled to mean 0 and variance 1 (biased), ``/ sqrt(var + eps)``, then times
    ``weight`` and plus ``bias`` (tensors of ``normalized_shape``) where given."""
    if isinstance(normalized_shape, (int, np.integer)):
        normalized_shape = (int(normalized_shape),)
    normalized_shape = tuple(int(size) for size in normalized_shape)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"layer_norm: eps must be a number, got {eps!r}")
    affine = (HAS_WEIGHT if weight is not None else 0) | (HAS_BIAS if bias is not None else 0)
    operands = [x._operand(v) if v is not None and not isinstance(v, Value) else v
                for v in (weight, bias)]
    operands = [x.data if v is None else v for v in operands]   # an absent one: never read
    return apply(LayerNormOp, x, *operands, normalized_shape=normalized_shape,
                 eps=float(eps), affine=affine)


# ------------------------------------------------------------------ masks and pieces

def tril(x, diagonal=0):
    """The lower triangle of the last two dims (``col - row <= diagonal``), the rest 0."""
    return apply(Triangle, x, diagonal=_int("tril", "diagonal", diagonal), upper=False)


def triu(x, diagonal=0):
    """The upper triangle of the last two dims (``col - row >= diagonal``), the rest 0."""
    return apply(Triangle, x, diagonal=_int("triu", "diagonal", diagonal), upper=True)


def masked_fill(x, mask, value):
    """``x`` with ``value`` (a number) where the bool ``mask`` (broadcast to x's shape)
    holds; differentiable in x (zero gradient where filled)."""
    mask_shape = tuple(np.shape(mask.data if isinstance(mask, Value) else mask))
    try:
        fits = np.broadcast_shapes(mask_shape, x.shape) == tuple(x.shape)
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"masked_fill: the mask of shape {mask_shape} does not broadcast to "
                         f"the tensor's shape {tuple(x.shape)}")
    if isinstance(value, Value):
        if value.ndim != 0:
            raise ValueError(f"masked_fill: value must be a number or a 0-d tensor, got "
                             f"shape {value.shape}")
    elif not isinstance(value, (int, float, np.number)):
        raise TypeError(f"masked_fill: value must be a number, got {type(value).__name__}")
    return F.where(mask, value, x)


def split(x, split_size, dim=-1):
    """torch's ``split``: pieces of ``split_size`` along ``dim`` (the last smaller), or of the
    sizes in a list; each piece differentiable."""
    (axis,) = normalize_axes(dim, x.ndim, "split")
    length = x.shape[axis]
    if isinstance(split_size, (list, tuple)):
        sizes = [_int("split", "a split size", size) for size in split_size]
        if sum(sizes) != length or any(size < 0 for size in sizes):
            raise ValueError(f"split: the sizes {list(sizes)} must be >= 0 and sum to the "
                             f"length {length} of dim {dim} (shape {tuple(x.shape)})")
    else:
        size = _int("split", "split_size", split_size)
        if size <= 0:
            raise ValueError(f"split: split_size must be positive, got {size}")
        sizes = [min(size, length - start) for start in range(0, length, size)] or [0]
    pieces, start = [], 0
    for size in sizes:
        key = (slice(None),) * axis + (slice(start, start + size),)
        pieces.append(F.index(x, key))
        start += size
    return tuple(pieces)


def chunk(x, chunks, dim=-1):
    """torch's ``chunk``: ``chunks`` pieces along ``dim`` of ``ceil(length / chunks)`` each
    (fewer pieces when the length runs out, as torch)."""
    chunks = _int("chunk", "chunks", chunks)
    if chunks <= 0:
        raise ValueError(f"chunk: chunks must be positive, got {chunks}")
    (axis,) = normalize_axes(dim, x.ndim, "chunk")
    length = x.shape[axis]
    return split(x, max(-(-length // chunks), 1), dim=axis)


# ------------------------------------------------------------------ extrema along an axis

MaxResult = collections.namedtuple("max", ["values", "indices"])
MinResult = collections.namedtuple("min", ["values", "indices"])
TopKResult = collections.namedtuple("topk", ["values", "indices"])


def _along_last(x, axis):
    """``x`` with ``axis`` swapped with the last (itself when it is the last)."""
    return x if axis == x.ndim - 1 else F.transpose(x, axis, x.ndim - 1)


def _extremum_along(name, x, dim, keepdim, arg):
    (axis,) = normalize_axes(dim, x.ndim, name)
    moved = _along_last(x, axis)
    positions = arg(moved, axis=-1, keepdims=True)
    values = _along_last(apply(TakeAlongRows, moved, positions.data), axis)
    if not keepdim:
        values = F.squeeze(values, axis)
    result = MaxResult if name == "max" else MinResult
    return result(values, arg(x, axis=axis, keepdims=keepdim))


def max_along(x, dim, keepdim=False):
    """torch's ``x.max(dim)``: the named tuple ``(values, indices)`` of the first maximum
    along ``dim``; the gradient goes to that element."""
    return _extremum_along("max", x, dim, keepdim, F.argmax)


def min_along(x, dim, keepdim=False):
    """torch's ``x.min(dim)``: ``(values, indices)`` of the first minimum along ``dim``."""
    return _extremum_along("min", x, dim, keepdim, F.argmin)


def topk(x, k, dim=-1, largest=True, sorted=True):
    """torch's ``topk``: the named tuple ``(values, indices)`` of the ``k`` largest (or
    smallest) elements along ``dim``, in order (ties: the lower position first; NaN is the
    largest); differentiable in the values."""
    k = _int("topk", "k", k)
    (axis,) = normalize_axes(dim, x.ndim, "topk") if x.ndim else (0,)
    moved = _along_last(x, axis) if x.ndim else x
    positions = F._untracked(TopK, moved, k=k, largest=bool(largest))
    values = apply(TakeAlongRows, moved, positions.data) if x.ndim else moved
    if x.ndim and axis != x.ndim - 1:   # positions go back through float64 (exact below 2**53)
        values = _along_last(values, axis)
        positions = F.astype(_along_last(F.astype(positions, np.float64), axis), np.int64)
    return TopKResult(values, positions)


def multinomial(probs, num_samples, replacement=False, seed=None):
    """torch's ``multinomial``: ``num_samples`` category positions (int64) drawn from each
    row of the non-negative weights ``probs`` ((n,) or (rows, n)), without replacement
    unless ``replacement``; ``seed`` (an int) makes the draw repeatable, else it comes from
    the engine's generator (``engine.manual_seed``)."""
    num_samples = _int("multinomial", "num_samples", num_samples)
    if seed is None:
        seed = int(generator().integers(SEED_LIMIT))
    seed = seed_array(seed, probs.device)
    return F._untracked(Multinomial, probs, seed, samples=num_samples,
                        replacement=bool(replacement))


def _int(name, what, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: {what} must be an int, got {value!r}")
    return int(value)


def extremum_method(name, x, args, kwargs):
    """``x.max(...)`` / ``x.min(...)`` as torch and NumPy read their arguments (see
    ``Tensor.max``)."""
    reduce_values, along, pairwise = ((F.max, max_along, F.maximum) if name == "max"
                                      else (F.min, min_along, F.minimum))
    if args and not isinstance(args[0], (int, np.integer, tuple, list, type(None))):
        if len(args) > 1 or kwargs:
            raise TypeError(f"{name}: x.{name}(other) takes no more arguments")
        return pairwise(x, args[0])   # torch's x.max(other)
    if "axis" in kwargs or "keepdims" in kwargs or (args and isinstance(args[0], (tuple,
                                                                                   list))):
        return reduce_values(x, *args, **kwargs)   # NumPy's: the values
    unknown = set(kwargs) - {"dim", "keepdim"}
    if unknown or len(args) > 2 or (args and "dim" in kwargs):
        raise TypeError(f"{name}: expected x.{name}(dim, keepdim=False), x.{name}(axis=..., "
                        f"keepdims=...) or x.{name}(other), got {len(args)} positional "
                        f"arguments and {sorted(kwargs)}")
    dim = args[0] if args else kwargs.get("dim")
    keepdim = args[1] if len(args) > 1 else kwargs.get("keepdim", False)
    if dim is None:
        return reduce_values(x)
    if isinstance(dim, (tuple, list)):   # several dims: the values (torch's amax/amin)
        return reduce_values(x, axis=tuple(dim), keepdims=bool(keepdim))
    return along(x, dim, bool(keepdim))


# ------------------------------------------------------------------ attention

_dropout_seed_states = {}   # device -> (the generator it came from, the functional attention's
#                              dropout seed state): engine.manual_seed starts a new one
_no_seeds = {}              # device -> the one-element array a call without dropout passes


def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, *, seed_state=None):
    """torch's ``F.scaled_dot_product_attention``: ``softmax(q kᵀ · scale + mask) v`` over q
    (..., Tq, d), k (..., Tk, d), v (..., Tk, dv) with the same leading dims ((N, H) or
    (N,)). ``attn_mask``: a bool mask (True takes part) or a float mask added to the scores,
    broadcastable to (..., Tq, Tk); ``is_causal``: query i sees keys j <= i; ``dropout_p``:
    dropout on the attention weights (drawn from the device seed, as nn.Dropout);
    ``scale``: default ``1 / sqrt(d)``. One fused kernel per direction on CUDA.
    ``seed_state``: a layer's own dropout seed state (``ops.dropout.new_seed_state``'s two
    arrays) instead of the one this module keeps per device. A float mask that requires grad
    gets its gradient, summed over the dims it broadcast along."""
    name = "scaled_dot_product_attention"
    for label, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Value):
            raise TypeError(f"{name}: {label} must be an engine Tensor, got {type(t).__name__}")
        if t.ndim < 2:
            raise ValueError(f"{name}: {label} needs 2 or more dims (..., T, head dim), got "
                             f"shape {t.shape}")
    lead = q.shape[:-2]
    if k.shape[:-2] != lead or v.shape[:-2] != lead or k.shape[-1] != q.shape[-1] \
            or v.shape[-2] != k.shape[-2]:
        raise ValueError(f"{name}: expects q (..., Tq, d), k (..., Tk, d) and v (..., Tk, dv) "
                         f"with the same leading dims, got {q.shape}, {k.shape}, {v.shape}")
    if is_causal and attn_mask is not None:
        raise ValueError(f"{name}: give attn_mask or is_causal=True, not both (a causal mask "
                         "and another one: combine them into attn_mask)")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) \
            or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{name}: dropout_p must be a number in [0, 1), got {dropout_p!r}")
    tq, tk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    bh = int(np.prod(lead)) if lead else 1
    mask, strides = _attention_mask(name, q, attn_mask, lead, tq, tk)
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    seed = _attention_seed(q.device, dropout_p, seed_state)
    out = apply(AttentionOp, F.reshape(q, (bh, tq, d)), F.reshape(k, (bh, tk, d)),
                F.reshape(v, (bh, tk, dv)), mask, seed, scale=scale, causal=bool(is_causal),
                mask_strides=strides, dropout_p=float(dropout_p))
    return F.reshape(out, lead + (tq, dv))


def packed_attention(qkv, dropout_p=0.0, is_causal=False, *, seed_state=None):
    """``scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], ...)`` without a mask, for
    ``qkv`` (3, ..., T, d) holding the three (multi-head attention's projection permuted
    once): one op whose gradient is one array, where indexing out the three would give each
    a zero-filled gradient of the whole, summed by the tape. Returns (..., T, d)."""
    if qkv.ndim < 3 or qkv.shape[0] != 3:
        raise ValueError(f"packed_attention: expects qkv of shape (3, ..., T, d), got "
                         f"{tuple(qkv.shape)}")
    lead, (t, d) = tuple(qkv.shape[1:-2]), qkv.shape[-2:]
    bh = int(np.prod(lead)) if lead else 1
    seed = _attention_seed(qkv.device, dropout_p, seed_state)
    out = apply(PackedAttentionOp, F.reshape(qkv, (3, bh, t, d)), seed, scale=1.0 / np.sqrt(d),
                causal=bool(is_causal), mask_strides=(0, 0, 0), dropout_p=float(dropout_p))
    return F.reshape(out, lead + (t, d))


def _attention_mask(name, q, attn_mask, lead, tq, tk):
    """The additive float mask (an array in q's dtype) and its (slice, query, key) strides."""
    if attn_mask is None:
        return empty((0,), q.dtype, q.device), (0, 0, 0)
    if not isinstance(attn_mask, Value):
        attn_mask = q._operand(attn_mask, dtype=np.asarray(attn_mask).dtype)
    shape = tuple(attn_mask.shape)
    target = lead + (tq, tk)
    try:
        fits = np.broadcast_shapes(shape, target) == target
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"{name}: attn_mask of shape {shape} does not broadcast to the "
                         f"scores' shape {target} (..., Tq, Tk)")
    if attn_mask.dtype == np.bool_:
        attn_mask = F.where(attn_mask, 0.0, -np.inf)
        attn_mask = F.astype(attn_mask, q.dtype) if attn_mask.dtype != q.dtype else attn_mask
    elif attn_mask.dtype != q.dtype:
        attn_mask = F.astype(attn_mask, q.dtype)
    shape = (1,) * (len(target) - len(shape)) + tuple(attn_mask.shape)
    mask_lead, (rows, cols) = shape[:-2], shape[-2:]
    if any(size != 1 for size in mask_lead) and mask_lead != lead:
        # some leading dims broadcast, some not: spread over all of them
        attn_mask = F.add(attn_mask, q._wrap(fill(empty(lead + (1, 1), q.dtype, q.device), 0)))
        mask_lead = lead
    slice_stride = rows * cols if mask_lead == lead and any(s != 1 for s in lead) else 0
    # a float mask that requires grad gets dS (torch's SDPA too); a bool one is constant
    return attn_mask, (slice_stride, cols if rows != 1 else 0, 1 if cols != 1 else 0)


def _attention_seed(device, dropout_p, seed_state):
    """The call's dropout seed (a one-element device array): the next of ``seed_state`` (or
    this device's), drawn on the device; without dropout a fixed array nobody reads."""
    if dropout_p == 0:
        if device not in _no_seeds:
            _no_seeds[device] = new_counter(device)
        return _no_seeds[device]
    if seed_state is not None:
        return next_mask_seed(*seed_state)
    drawn_from, state = _dropout_seed_states.get(device, (None, None))
    if drawn_from is not generator():   # the first call, or engine.manual_seed since
        state = new_seed_state(int(generator().integers(SEED_LIMIT)), device)
        _dropout_seed_states[device] = (generator(), state)
    return next_mask_seed(*state)
