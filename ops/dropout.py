"""Inverted dropout whose mask is a pure function of (seed, element index).

Each kernel thread hashes its element index with the call's seed (two rounds of a 32-bit
integer mixer) and keeps the element when the hash clears a threshold, so:
- no mask is stored or copied: backward recomputes it from the same seed;
- no random numbers travel from host to device per step: only one integer seed;
- the CPU and CUDA kernels produce the identical mask for the same seed.

Kept elements are scaled by ``1 / (1 - p)`` so the expected output equals the input.
"""
from numba import njit

from ops.cuda_backend import cuda
from ops.dispatch import Out, run
from ops.launch import Kernel, elements
from ops.layout import flat
from ops.registry import Op, register

SEED_LIMIT = 2 ** 63


def _mask_hash(jit):
    """The keep test compiled by ``jit``: one copy per device, the same integer arithmetic."""

    @jit
    def mul32(x, c):
        # (x * c) mod 2**32 for 32-bit x and c, split so no product leaves int64
        high = (((x >> 16) * c) & 0xFFFF) << 16
        return (high + (x & 0xFFFF) * c) & 0xFFFFFFFF

    @jit
    def mix32(x):
        # a 32-bit integer hash with low bias (C. Wellons' "lowbias32")
        x ^= x >> 16
        x = mul32(x, 0x7FEB352D)
        x ^= x >> 15
        x = mul32(x, 0x846CA68B)
        x ^= x >> 16
        return x

    @jit
    def keep(i, seed, threshold):
        first = mix32((i & 0xFFFFFFFF) ^ (seed & 0xFFFFFFFF))
        return mix32((first + (seed >> 32) + (i >> 32)) & 0xFFFFFFFF) >= threshold

    return keep


_keep_cpu = _mask_hash(njit(inline="always"))
_keep_cuda = _mask_hash(cuda.jit(device=True))


@njit(cache=True)
def dropout_cpu(x, out, seed, threshold, scale):
    zero = scale - scale
    for i in range(out.size):
        out[i] = x[i] * scale if _keep_cpu(i, seed, threshold) else zero


@cuda.jit(cache=True)
def dropout_cuda(x, out, seed, threshold, scale):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = x[i] * scale if _keep_cuda(i, seed, threshold) else scale - scale


DROPOUT = Kernel("dropout", dropout_cpu, dropout_cuda, elements(1))


def keep_threshold(p):
    """Elements whose 32-bit hash is at least this are kept: probability ``1 - p``."""
    return int(round(p * 2 ** 32))


def dropout(x, p, seed, out=None):
    """``x`` with the elements of the ``(seed, p)`` mask zeroed and the rest scaled."""
    scale = x.dtype.type(0.0 if p >= 1 else 1.0 / (1.0 - p))
    destination = Out(x.shape, x.dtype) if out is None else flat(out)
    result = run(DROPOUT, flat(x), destination, int(seed), keep_threshold(p), scale)
    return result if out is None else out


@register
class Dropout(Op):
    """``params``: ``p`` (drop probability in [0, 1]) and ``seed`` (an int in [0, 2**63))."""
    name = "dropout"
    kernels = (DROPOUT,)

    def __init__(self, p, seed):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout: p must be in [0, 1], got {p!r}")
        if not 0 <= int(seed) < SEED_LIMIT or int(seed) != seed:
            raise ValueError(f"dropout: seed must be an integer in [0, 2**63), got {seed!r}")
        super().__init__(p=float(p), seed=int(seed))

    def forward(self, x):
        return dropout(x, self.params["p"], self.params["seed"])

    def backward(self, grad_out, grad_dst):
        # the same mask and scale: d(x * mask * scale)/dx, recomputed from the seed
        return (dropout(grad_out, self.params["p"], self.params["seed"], out=grad_dst[0]),)
