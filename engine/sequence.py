"""The functions a sequence model's code reaches for, as torch spells them: ``embedding``,
``layer_norm``, ``scaled_dot_product_attention``, ``tril``/``triu``, ``masked_fill``,
``split``/``chunk``, ``maximum``/``minimum``, the (values, indices) ``max``/``min`` over a
dim, ``topk`` and ``multinomial``. Each runs registered ops (``ops.embedding``,
``ops.layer_norm``, ``ops.attention``, ...) or composes existing ones; Tensor binds the
methods among them.

This module sits beside ``engine.functional``, below ``engine.tensor``: it sees tensors as
``engine.autograd.Value``s.
"""
import numpy as np

from engine.autograd import Value, apply
from ops.embedding import EmbeddingOp
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
