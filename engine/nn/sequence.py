"""The layers of sequence models: ``Embedding``, ``LayerNorm`` and ``MultiHeadAttention``.

They follow torch's modules in what they compute and how they start (Embedding's weight
drawn from N(0, 1) with the padding row zeroed, LayerNorm's scale ones and offset zeros,
attention's projections as torch's ``nn.MultiheadAttention``) and the engine's ``Layer``
protocol in how they are built (from the first input's feature shape) and saved.
"""
import numpy as np

from engine import sequence as S
from engine.nn.layers import Layer, _check_input_dtype
from engine.parameter import Parameter
from engine.random import generator
from ops.device import to_device


def _positive_int(value, where, what):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{where}: {what} must be a positive int, got {value!r}")
    return int(value)


class Embedding(Layer):
    """A table of ``num_embeddings`` learned vectors of ``embedding_dim``: integer ids of any
    shape -> ``ids.shape + (embedding_dim,)`` (torch's ``nn.Embedding``). The
    ``padding_idx`` row starts at zero and gets no gradient."""

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

    def named_parameters(self):
        return [("weight", self.weight)] if self.built else []

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


class LayerNorm(Layer):
    """Normalise the last axis of each input to mean 0 and variance 1 (biased), then scale by
    a learned ``weight`` (ones) and shift by a learned ``bias`` (zeros): torch's
    ``nn.LayerNorm(features)`` with the feature count taken from the first input."""

    def __init__(self, eps=1e-5, dtype=np.float32, input_shape=None):
        super().__init__(input_shape)
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
        output_shape = super().build(input_shape, device, initialize)
        features = (input_shape[-1],)
        self.weight = Parameter(to_device(np.ones(features, self.dtype), device))
        self.bias = Parameter(to_device(np.zeros(features, self.dtype), device))
        return output_shape

    def named_parameters(self):
        return [("weight", self.weight), ("bias", self.bias)] if self.built else []

    def forward(self, x):
        _check_input_dtype(f"{self.name} {self!r}", x.dtype, self.weight.dtype)
        features = self.weight.shape[0]
        if x.ndim < 1 or x.shape[-1] != features:
            raise ValueError(f"{self.name} {self!r}: built for {features} features on the "
                             f"last axis, got input of shape {x.shape}")
        return S.layer_norm(x, (features,), self.weight, self.bias, self.eps)

    def get_config(self):
        config = {"eps": self.eps} if self.eps != 1e-5 else {}
        if self.dtype != np.float32:
            config["dtype"] = self.dtype.name
        return {**config, **super().get_config()}
