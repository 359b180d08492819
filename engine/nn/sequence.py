"""The layers of sequence models: ``Embedding``, ``LayerNorm`` and ``MultiHeadAttention``.

They follow torch's modules in what they compute and how they start (Embedding's weight
drawn from N(0, 1) with the padding row zeroed, LayerNorm's scale ones and offset zeros,
attention's projections as torch's ``nn.MultiheadAttention``) and the engine's ``Layer``
protocol in how they are built (from the first input's feature shape) and saved.
"""
import numpy as np

from engine import functional as F
from engine import sequence as S
from engine.autograd import apply
from engine.init import xavier_uniform
from engine.nn.layers import Layer, _check_input_dtype, batch_shape, register_seed_state
from engine.nn.model import construction_deferred, register
from engine.parameter import Parameter
from engine.random import generator
from ops.dense import DenseOp
from ops.device import to_device


def _positive_int(value, where, what):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{where}: {what} must be a positive int, got {value!r}")
    return int(value)


@register
class Embedding(Layer):
    """A table of ``num_embeddings`` learned vectors of ``embedding_dim``: integer ids of any
    shape -> ``ids.shape + (embedding_dim,)`` (torch's ``nn.Embedding``). The
    ``padding_idx`` row starts at zero and gets no gradient."""
    integer_input = True   # a model starting with it keeps NumPy ids as integers
    _layouts = {"weight": "(num_embeddings, embedding_dim)"}
    built_at_construction = True   # a Sequential takes it built (``Sequential._extend``)

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, dtype=np.float32,
                 input_shape=None):
        super().__init__(input_shape)
        self.num_embeddings = _positive_int(num_embeddings, "Embedding", "num_embeddings")
        self.embedding_dim = _positive_int(embedding_dim, "Embedding", "embedding_dim")
        rows = self.num_embeddings
        if padding_idx is not None and (isinstance(padding_idx, bool) or not isinstance(
                padding_idx, (int, np.integer)) or not -rows <= padding_idx < rows):
            raise ValueError(f"Embedding: padding_idx {padding_idx!r} must be an int in "
                             f"[{-rows}, {rows}) (num_embeddings {rows})")
        self.padding_idx = None if padding_idx is None else int(padding_idx) % rows
        self.dtype = np.dtype(dtype)
        self.weight = None
        if not construction_deferred():
            # its table exists from here, as torch's: nanoGPT's ``self.head.weight =
            # self.tokens.weight`` in a Module's __init__ read None (the tie then failed at
            # the first call as "'NoneType' object has no attribute 'shape'")
            self.build(() if input_shape is None else input_shape)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.embedding_dim,)

    def build(self, input_shape, device="cpu", initialize=True):
        output_shape = super().build(input_shape, device, initialize)
        shape = (self.num_embeddings, self.embedding_dim)
        weight = (generator(None).standard_normal(shape) if initialize
                  else np.zeros(shape)).astype(self.dtype)
        if self.padding_idx is not None:
            weight[self.padding_idx] = 0
        self.weight = Parameter(to_device(weight, device))
        return output_shape

    def __call__(self, ids):
        if not self.built:   # ids may be an array or a list: the table is built on the cpu
            self.build(np.shape(ids)[1:], getattr(ids, "device", "cpu"))
        return super().__call__(ids)

    def forward(self, ids):
        try:
            return S.embedding(ids, self.weight, padding_idx=self.padding_idx)
        except (ValueError, TypeError) as error:
            raise type(error)(f"{self.name} {self!r}: {error}") from None

    def get_config(self):
        config = {"num_embeddings": self.num_embeddings, "embedding_dim": self.embedding_dim}
        if self.padding_idx is not None:
            config["padding_idx"] = self.padding_idx
        if self.dtype != np.float32:
            config["dtype"] = self.dtype.name
        return {**config, **super().get_config()}


@register
class LayerNorm(Layer):
    """Normalise the last axis of each input to mean 0 and variance 1 (biased), then scale by
    a learned ``weight`` (ones) and shift by a learned ``bias`` (zeros): torch's
    ``nn.LayerNorm(features)`` with the feature count taken from the first input.

    torch's form ``nn.LayerNorm(64)`` (an int, or a tuple of one, first: its
    ``normalized_shape``) is taken as the feature count, checked against that input; the
    engine's own first argument is ``eps`` (a float)."""

    def __init__(self, eps=1e-5, dtype=np.float32, input_shape=None, normalized_shape=None):
        super().__init__(input_shape)
        if isinstance(eps, (tuple, list)) or (isinstance(eps, (int, np.integer))
                                              and not isinstance(eps, bool) and eps >= 1):
            normalized_shape, eps = eps, 1e-5   # torch's LayerNorm(normalized_shape)
        if normalized_shape is not None:
            shape = tuple(normalized_shape) if isinstance(normalized_shape, (tuple, list)) \
                else (normalized_shape,)
            if len(shape) != 1 or not isinstance(shape[0], (int, np.integer)) or shape[0] < 1:
                raise ValueError(f"LayerNorm: normalized_shape {normalized_shape!r}: the engine "
                                 "normalises the last axis, one positive size (or none: it is "
                                 "taken from the input)")
            normalized_shape = int(shape[0])
        self.normalized_shape = normalized_shape
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"LayerNorm: eps must be a number > 0, got {eps!r}")
        self.eps = float(eps)
        self.dtype = np.dtype(dtype)
        self.weight = self.bias = None

    def compute_output_shape(self, input_shape):
        if len(input_shape) < 1:
            raise ValueError("LayerNorm takes inputs with a feature axis, got per-sample "
                             "scalars")
        return input_shape

    def build(self, input_shape, device="cpu", initialize=True):
        if self.normalized_shape not in (None, input_shape[-1] if input_shape else None):
            raise ValueError(f"LayerNorm: normalized_shape is {self.normalized_shape}, the "
                             f"input's last axis {input_shape[-1] if input_shape else 'missing'}")
        output_shape = super().build(input_shape, device, initialize)
        features = (input_shape[-1],)
        self.weight = Parameter(to_device(np.ones(features, self.dtype), device))
        self.bias = Parameter(to_device(np.zeros(features, self.dtype), device))
        return output_shape

    def forward(self, x):
        _check_input_dtype(self, x.dtype, self.weight.dtype)
        features = self.weight.shape[0]
        if x.ndim < 1 or x.shape[-1] != features:
            raise ValueError(f"{self.name} {self!r}: built for {features} features on the "
                             f"last axis, got input of shape {x.shape}")
        return S.layer_norm(x, (features,), self.weight, self.bias, self.eps)

    def get_config(self):
        config = {"eps": self.eps} if self.eps != 1e-5 else {}
        if self.normalized_shape is not None:
            config["normalized_shape"] = self.normalized_shape
        if self.dtype != np.float32:
            config["dtype"] = self.dtype.name
        return {**config, **super().get_config()}


@register
class MultiHeadAttention(Layer):
    """Self-attention over (N, T, D) inputs with ``num_heads`` heads of ``D / num_heads``:
    one fused input projection to queries, keys and values (``in_proj``, D -> 3D), scaled
    dot-product attention per head (``causal``: each position sees itself and the earlier
    ones; ``dropout`` on the attention weights in training), and an output projection
    (``out_proj``, D -> D). torch's ``nn.MultiheadAttention(D, num_heads,
    batch_first=True)`` called as ``mha(x, x, x)``, with the weights stored (in, out) as
    the engine's Dense (``engine.interop.torch`` converts them)."""

    def __init__(self, num_heads, causal=False, dropout=0.0, use_bias=True, dtype=np.float32,
                 input_shape=None):
        super().__init__(input_shape)
        self.num_heads = _positive_int(num_heads, "MultiHeadAttention", "num_heads")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) \
                or not 0.0 <= dropout < 1.0:
            raise ValueError(f"MultiHeadAttention: dropout must be in [0, 1), got {dropout!r}")
        self.causal, self.dropout, self.use_bias = bool(causal), float(dropout), bool(use_bias)
        self.dtype = np.dtype(dtype)
        self.in_weight = self.in_bias = self.out_weight = self.out_bias = None
        self.register_buffer("seed", None)
        self.register_buffer("masks_drawn", None)

    def compute_output_shape(self, input_shape):
        if len(input_shape) != 2:
            raise ValueError(f"MultiHeadAttention takes inputs of shape (None, T, D), got "
                             f"{batch_shape(input_shape)}")
        width = input_shape[-1]
        if width % self.num_heads:
            raise ValueError(f"MultiHeadAttention: the width {width} is not divisible by "
                             f"num_heads {self.num_heads}; choose heads that divide it")
        return input_shape

    def build(self, input_shape, device="cpu", initialize=True):
        output_shape = super().build(input_shape, device, initialize)
        width = input_shape[-1]

        def weight(shape):   # torch's: xavier_uniform for in_proj, its Linear's for out_proj
            return xavier_uniform(shape, self.dtype) if initialize else np.zeros(shape,
                                                                                 self.dtype)
        self.in_weight = Parameter(to_device(weight((width, 3 * width)), device))
        self.out_weight = Parameter(to_device(weight((width, width)), device))
        if self.use_bias:
            self.in_bias = Parameter(to_device(np.zeros(3 * width, self.dtype), device))
            self.out_bias = Parameter(to_device(np.zeros(width, self.dtype), device))
        register_seed_state(self, device, initialize)
        return output_shape

    def _own_parameters(self):   # torch's names: in_proj.weight, out_proj.bias, ...
        named = [("in_proj.weight", self.in_weight), ("in_proj.bias", self.in_bias),
                 ("out_proj.weight", self.out_weight), ("out_proj.bias", self.out_bias)]
        return [(name, p) for name, p in named if p is not None]

    def _project(self, x, weight, bias):
        if bias is None:
            return F.matmul(x, weight)
        return apply(DenseOp, x, weight, bias, activation=None, alpha=0.01)

    def forward(self, x):
        _check_input_dtype(self, x.dtype, self.in_weight.dtype)
        width = self.in_weight.shape[0]
        if x.ndim != 3 or x.shape[-1] != width:
            raise ValueError(f"{self.name} {self!r}: expects input of shape (N, T, {width}), "
                             f"got {x.shape}")
        n, t, heads = x.shape[0], x.shape[1], self.num_heads
        qkv = self._project(F.reshape(x, (n * t, width)), self.in_weight, self.in_bias)
        qkv = F.permute(F.reshape(qkv, (n, t, 3, heads, width // heads)), 2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        out = S.packed_attention(qkv, dropout_p=p, is_causal=self.causal,
                                 seed_state=(self.seed.data, self.masks_drawn.data))
        out = F.reshape(F.permute(out, 0, 2, 1, 3), (n * t, width))
        return F.reshape(self._project(out, self.out_weight, self.out_bias), (n, t, width))

    def get_config(self):
        config = {"num_heads": self.num_heads}
        if self.causal:
            config["causal"] = True
        if self.dropout:
            config["dropout"] = self.dropout
        if not self.use_bias:
            config["use_bias"] = False
        if self.dtype != np.float32:
            config["dtype"] = self.dtype.name
        return {**config, **super().get_config()}
