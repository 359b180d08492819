"""A character-level GPT in nanoGPT's architecture (Karpathy's ``model.py``), from the
engine's layers: token and position embeddings, pre-LayerNorm blocks of causal multi-head
attention and a 4x GELU MLP, dropout, a final LayerNorm, and a head tied to the token
embedding (the logits are ``x @ tokens.weightᵀ``).

```python
from engine import data, models
tok = data.CharTokenizer(text)
model = models.build_gpt(vocab_size=tok.vocab_size, block_size=64, n_layer=4, n_head=4,
                         n_embd=128, dropout=0.0)
logits = model(xb)                                  # (N, T) int64 ids -> (N, T, vocab)
loss = models.gpt_loss(logits, yb)                  # mean cross-entropy over every position
out = model.generate(engine.tensor(tok.encode("ROMEO:"))[None], max_new_tokens=200,
                     temperature=0.8, top_k=40, seed=0)
```

Weights start as nanoGPT's: every Dense kernel and embedding from N(0, 0.02), the residual
projections (attention's output, the MLP's second layer) from N(0, 0.02 / sqrt(2 n_layer)),
biases at zero, LayerNorms at one and zero. ``generate`` samples on the model's device:
each token is one forward over the last ``block_size`` ids, top-k and temperature, and a
draw (``engine.multinomial``) whose result stays on the device, so no token crosses to the
host until the caller reads the output.
"""
import math

import numpy as np

from engine import nn
from engine import sequence as S
from engine.autograd import no_grad
from engine.functional import cat, reshape, softmax, transpose
from engine.losses import cross_entropy
from engine.random import generator
from engine.tensor import arange

INIT_STD = 0.02   # nanoGPT's


class Block(nn.Layer):
    """``x + attention(norm1(x))``, then ``x + dropout(proj(gelu(fc(norm2(x)))))``: the
    layers take any number of positions (a Sequential is built for one input shape)."""

    def __init__(self, n_embd, n_head, dropout=0.0, **kwargs):
        super().__init__(**kwargs)
        self.norm1, self.norm2 = nn.LayerNorm(), nn.LayerNorm()
        self.attention = nn.MultiHeadAttention(n_head, causal=True, dropout=dropout)
        self.fc = nn.Dense(4 * n_embd, activation="gelu")
        self.proj = nn.Dense(n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.drop(self.proj(self.fc(self.norm2(x))))


@nn.register
class GPT(nn.Model):
    """nanoGPT's GPT over ``vocab_size`` tokens and contexts of up to ``block_size``."""

    def __init__(self, vocab_size, block_size=64, n_layer=4, n_head=4, n_embd=128,
                 dropout=0.0, **kwargs):
        super().__init__(**kwargs)
        for name, value in (("vocab_size", vocab_size), ("block_size", block_size),
                            ("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"GPT: {name} must be an integer >= 1, got {value!r}")
        if n_embd % n_head:
            raise ValueError(f"GPT: n_embd {n_embd} is not a multiple of n_head {n_head}")
        self.vocab_size, self.block_size = int(vocab_size), int(block_size)
        self.n_layer, self.n_head, self.n_embd = int(n_layer), int(n_head), int(n_embd)
        self.dropout = float(dropout)
        self.tokens = nn.Embedding(self.vocab_size, self.n_embd)
        self.positions = nn.Embedding(self.block_size, self.n_embd)
        self.drop = nn.Dropout(self.dropout)
        self.blocks = nn.LayerList([Block(self.n_embd, self.n_head, self.dropout)
                                    for _ in range(self.n_layer)])
        self.norm = nn.LayerNorm()

    def forward(self, ids):
        length = ids.shape[1]
        if length > self.block_size:
            raise ValueError(f"GPT: a context of {length} tokens is longer than block_size "
                             f"{self.block_size}")
        x = self.drop(self.tokens(ids) + self.positions(arange(length, device=ids.device)))
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        rows = reshape(x, (-1, self.n_embd))
        logits = rows @ transpose(self.tokens.weight)   # the head tied to the embedding
        return reshape(logits, (ids.shape[0], length, self.vocab_size))

    def get_config(self):
        return {"vocab_size": self.vocab_size, "block_size": self.block_size,
                "n_layer": self.n_layer, "n_head": self.n_head, "n_embd": self.n_embd,
                "dropout": self.dropout}

    def generate(self, ids, max_new_tokens, temperature=1.0, top_k=None, seed=None):
        """``ids`` (N, T) followed by ``max_new_tokens`` sampled ids, as nanoGPT's
        ``generate``: logits of the last position divided by ``temperature``, cut to the
        ``top_k`` largest, softmax, one draw. ``seed`` makes the samples repeatable."""
        if not temperature > 0:
            raise ValueError(f"generate: temperature must be > 0, got {temperature!r}")
        if top_k is not None and (not isinstance(top_k, (int, np.integer)) or top_k < 1):
            raise ValueError(f"generate: top_k must be an integer >= 1 or None, got {top_k!r}")
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise ValueError(f"generate: ids must be (N, T) integers, got shape {ids.shape} "
                             f"of {ids.dtype}")
        base = int(generator().integers(2 ** 62)) if seed is None else int(seed)
        was_training = self.training
        self.eval()
        try:
            with no_grad():
                for index in range(int(max_new_tokens)):
                    context = ids if ids.shape[1] <= self.block_size else \
                        ids[:, ids.shape[1] - self.block_size:]
                    logits = self(context)[:, -1, :] / temperature
                    if top_k is not None:
                        kth = S.topk(logits, min(int(top_k), self.vocab_size))[0][:, -1:]
                        logits = S.masked_fill(logits, logits < kth, -math.inf)
                    drawn = S.multinomial(softmax(logits, axis=-1), 1, seed=base + index)
                    ids = cat([ids, drawn.astype(ids.dtype)], axis=1)
        finally:
            self.train(was_training)
        return ids


def gpt_loss(logits, targets):
    """Mean cross-entropy of (N, T, vocab) logits against (N, T) next-token ids."""
    return cross_entropy(reshape(logits, (-1, logits.shape[-1])), reshape(targets, (-1,)))


def init_like_nanogpt(model):
    """Draw ``model``'s weights as nanoGPT does (module docstring), from the engine's
    generator (``engine.manual_seed``)."""
    rng = generator()
    residual_std = INIT_STD / math.sqrt(2 * model.n_layer)
    state = {}
    for name, value in model.state_dict().items():
        value = np.asarray(value)
        if name.endswith("bias") or ".norm" in name or name.startswith("norm"):
            state[name] = value   # LayerNorm's ones and zeros, zero biases: as built
        elif name.endswith(("out_proj.weight", ".proj.weight")):
            state[name] = rng.normal(0.0, residual_std, value.shape).astype(value.dtype)
        elif name.endswith("weight") or name.endswith("kernel"):
            state[name] = rng.normal(0.0, INIT_STD, value.shape).astype(value.dtype)
        else:
            state[name] = value
    model.load_state_dict(state)
    return model
