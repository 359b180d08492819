"""Inverted dropout whose mask is a pure function of (seed, element index), the seed read
from device memory.

Each kernel thread hashes its element index with the call's seed (two rounds of a 32-bit
integer mixer) and keeps the element when the hash clears a threshold, so:
- no mask is stored or copied: backward recomputes it from the same seed;
- no random numbers travel from host to device per step, not even the seed;
- the CPU and CUDA kernels produce the identical mask for the same seed.

Kept elements are scaled by ``1 / (1 - p)`` so the expected output equals the input.

The seed is a one-element int64 array, never a kernel argument: a replayed CUDA graph
passes the arguments it recorded, so a seed passed by value would repeat one mask every
step. A layer keeps a seed state of two one-element int64 arrays on its device, its base
seed and an ``ops.step_counter`` counter of the masks it has drawn; ``next_mask_seed`` runs
one single-thread kernel that writes the next call's seed, a hash of (base seed, count),
into a new one-element array and advances the count. The forward reads that array and the
backward reads the same one, so it sees the forward's seed however far the count has moved
since (two Dropout calls in one step). Eager and replayed steps run the same kernels, so
they draw the same masks.
"""
import numpy as np
from numba import njit

from ops.cuda import cuda
from ops.dispatch import Out, run
from ops.launch import Kernel, elements
from ops.layout import flat
from ops.registry import Op, register
from ops.step_counter import new_counter

SEED_LIMIT = 2 ** 63
SEED_DTYPE = np.dtype(np.int64)


def _hashes(jit):
    """The keep test and the per-call seed, compiled by ``jit``: one copy per device, the
    same integer arithmetic."""

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

    @jit
    def call_seed(base, count):
        # mix32 is a bijection of 32 bits, so the low half differs for 2**32 consecutive
        # counts of one base; hashed, not added: the seeds s and s + 1 give masks that are
        # each other's neighbour-swapped copy (the keep test XORs the low halves)
        low = mix32((base & 0xFFFFFFFF) ^ mix32((count & 0xFFFFFFFF) ^ 0x9E3779B9))
        high = mix32(((base >> 32) & 0xFFFFFFFF) ^ mix32(low ^ ((count >> 32) & 0xFFFFFFFF)))
        return ((high & 0x7FFFFFFF) << 32) | low   # in [0, 2**63), as a seed given by hand

    return keep, call_seed


_keep_cpu, _call_seed_cpu = _hashes(njit(inline="always"))
_keep_cuda, _call_seed_cuda = _hashes(cuda.jit(device=True))


@njit(cache=True)
def dropout_cpu(x, out, seed, threshold, scale):
    zero = scale - scale
    call_seed = seed[0]
    for i in range(out.size):
        out[i] = x[i] * scale if _keep_cpu(i, call_seed, threshold) else zero


@cuda.jit(cache=True)
def dropout_cuda(x, out, seed, threshold, scale):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = x[i] * scale if _keep_cuda(i, seed[0], threshold) else scale - scale


DROPOUT = Kernel("dropout", dropout_cpu, dropout_cuda, elements(1))


@njit(cache=True)
def mask_seed_cpu(base_seed, masks_drawn, seed):
    seed[0] = _call_seed_cpu(base_seed[0], masks_drawn[0])
    masks_drawn[0] += 1


@cuda.jit(cache=True)
def mask_seed_cuda(base_seed, masks_drawn, seed):
    if cuda.grid(1) == 0:
        seed[0] = _call_seed_cuda(base_seed[0], masks_drawn[0])
        masks_drawn[0] += 1


# one kernel writes the seed and advances the count: ops.step_counter's advance beside it
# would be a second launch per Dropout call (~20 us each launched eagerly on the H200)
MASK_SEED = Kernel("dropout_mask_seed", mask_seed_cpu, mask_seed_cuda, lambda *args: 1)


def keep_threshold(p):
    """Elements whose 32-bit hash is at least this are kept: probability ``1 - p``."""
    return int(round(p * 2 ** 32))


def _check_seed_value(seed):
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) \
            or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"dropout: seed must be an integer in [0, 2**63), got {seed!r}")
    return int(seed)


def seed_array(seed, device):
    """A one-element int64 array on ``device`` holding ``seed`` (an int in [0, 2**63)): the
    seed of a mask given by hand."""
    return new_counter(device, _check_seed_value(seed))


def new_seed_state(base_seed, device):
    """A layer's seed state on ``device``: ``(base seed, masks drawn)``, one-element int64
    arrays holding ``base_seed`` (an int in [0, 2**63)) and 0."""
    return seed_array(base_seed, device), new_counter(device)


def _check_seed_arrays(what, arrays):
    for array in arrays:
        if np.dtype(array.dtype) != SEED_DTYPE or tuple(array.shape) != (1,):
            shapes = ", ".join(f"{np.dtype(a.dtype)} {tuple(a.shape)}" for a in arrays)
            expected = "a one-element int64 array" if len(arrays) == 1 else \
                "one-element int64 arrays"
            raise TypeError(f"dropout: {what} must be {expected}, got {shapes}")


def next_mask_seed(base_seed, masks_drawn):
    """A new one-element array holding the seed of the next mask of the seed state
    ``(base_seed, masks_drawn)``; advances ``masks_drawn`` by one (one launch, on the
    device, no host sync)."""
    _check_seed_arrays("the seed state (base seed, masks drawn)", (base_seed, masks_drawn))
    return run(MASK_SEED, base_seed, masks_drawn, Out((1,), SEED_DTYPE))


def dropout(x, p, seed, out=None):
    """``x`` with the elements of the ``(seed, p)`` mask zeroed and the rest scaled; ``seed``
    is a one-element int64 array on ``x``'s device (``seed_array``, ``next_mask_seed``)."""
    scale = x.dtype.type(0.0 if p >= 1 else 1.0 / (1.0 - p))
    destination = Out(x.shape, x.dtype) if out is None else flat(out)
    result = run(DROPOUT, flat(x), destination, seed, keep_threshold(p), scale)
    return result if out is None else out


@register
class DropoutOp(Op):
    """Inputs ``(x, seed)``, ``seed`` a one-element int64 array (read on the device, never
    by the host); ``params``: ``p`` (drop probability in [0, 1])."""
    name = "dropout"
    kernels = (DROPOUT,)
    integer_inputs = (1,)

    def __init__(self, p):
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout: p must be in [0, 1], got {p!r}")
        super().__init__(p=float(p))

    def check(self, x, seed):
        _check_seed_arrays("the seed", (seed,))

    def forward(self, x, seed):
        self.seed = seed
        return dropout(x, self.params["p"], seed)

    def backward(self, grad_out, grad_dst):
        # the same mask and scale: d(x * mask * scale)/dx, recomputed from the forward's seed
        return (dropout(grad_out, self.params["p"], self.seed, out=grad_dst[0]), None)
