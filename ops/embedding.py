"""Embedding: the rows of a weight table (num_embeddings, dim) that integer ids pick.

Forward: ``out[i, j] = weight[ids[i], j]`` for the ids flattened, one thread per output
element; the result has shape ``ids.shape + (dim,)``.

Backward, deterministic without float atomics: a repeated id sums its rows of ``grad_out``
in ascending position order, in a float64 accumulator, cast once at the end, on both
devices, so the same inputs give the same bits on the CPU and on CUDA. On CUDA each block
owns one row of the weight's gradient (and a tile of its columns) and scans the ids in
order, a tile at a time: its threads test a tile of ids against the row into shared memory,
then each thread adds the matching rows of ``grad_out`` to its column. Every block reads all
ids (num_embeddings x N reads, mostly from the cache): little for a character vocabulary
(65), a lot for a 50k-token one, which wants the ids sorted first (counting sort, then a
block per present id); not yet measured on a GPU. The CPU walks the ids once into a float64
table. The ``padding_idx`` row gets a zero
gradient, as in torch.

Bad ids. An id below 0 or at least num_embeddings is an IndexError naming the op, the id,
its position and num_embeddings. Host ids are checked on the host before any kernel runs. On
the device the forward kernel checks every id too (a replayed step runs no Python): a bad id
writes NaN, is recorded in the op's fault words (``ops.flag_buffer``), which gate an
optimizer's update as a bad label does, and the error follows after the call on the CPU and
in the simulator, at the next call or sync on a GPU.
"""
import math

import numpy as np
from numba import float64, int64, njit

from ops.cuda import SIMULATOR, cuda
from ops.device import device_of, to_device
from ops.dispatch import Out, run
from ops.flag_buffer import flag_buffer
from ops.input_fault import fault_message, record_fault_cpu, record_fault_cuda
from ops.launch import CPU_KERNEL, Kernel, elements
from ops.layout import flat
from ops.registry import Op, register
from ops.twin import twin

NO_PADDING = -1
# threads of a CUDA gradient block: columns of the owned row, and ids tested per tile
GRAD_THREADS = 8 if SIMULATOR else 128


def _gather_element_with(record_fault):
    def gather_element(k, ids, weight, out, dim, rows, bad):
        """``out[k]`` = its weight element; a bad id is recorded in ``bad`` and gives NaN."""
        i = k // dim
        row = ids[i]
        if row < 0 or row >= rows:
            record_fault(bad, row, i, rows)
            out[k] = math.nan
        else:
            out[k] = weight[row * dim + k - i * dim]
    return gather_element


_gather_element_cpu, _gather_element_cuda = twin(_gather_element_with,
                                                 (record_fault_cpu, record_fault_cuda))


@njit(**CPU_KERNEL, error_model="numpy")
def embedding_cpu(ids, weight, out, dim, rows, bad):
    for i in range(ids.size):   # a row at a time: one id test, then a contiguous copy
        row = ids[i]
        if row < 0 or row >= rows:
            _gather_element_cpu(i * dim, ids, weight, out, dim, rows, bad)   # records it
            for j in range(dim):
                out[i * dim + j] = math.nan
        else:
            for j in range(dim):
                out[i * dim + j] = weight[row * dim + j]


@cuda.jit(cache=True)
def embedding_cuda(ids, weight, out, dim, rows, bad):
    k = cuda.grid(1)
    if k < out.size:
        _gather_element_cuda(k, ids, weight, out, dim, rows, bad)


@njit(**CPU_KERNEL)
def embedding_grad_cpu(ids, grad_out, grad_weight, dim, rows, padding):
    sums = np.zeros((rows, dim), np.float64)
    for i in range(ids.size):   # ascending positions: the order of the CUDA blocks' scans
        row = ids[i]
        if 0 <= row < rows:
            for j in range(dim):
                sums[row, j] += grad_out[i * dim + j]
    for row in range(rows):
        for j in range(dim):
            grad_weight[row * dim + j] = 0.0 if row == padding else sums[row, j]


@cuda.jit(cache=True)
def embedding_grad_cuda(ids, grad_out, grad_weight, dim, rows, padding):
    hits = cuda.shared.array(GRAD_THREADS, int64)
    t = cuda.threadIdx.x
    column_tiles = (dim + GRAD_THREADS - 1) // GRAD_THREADS
    row = cuda.blockIdx.x // column_tiles
    j = (cuda.blockIdx.x - row * column_tiles) * GRAD_THREADS + t
    count = ids.size
    total = float64(0.0)
    for start in range(0, count, GRAD_THREADS):
        i = start + t
        hits[t] = 1 if i < count and ids[i] == row else 0
        cuda.syncthreads()
        if j < dim:
            for k in range(min(GRAD_THREADS, count - start)):
                if hits[k]:
                    total += grad_out[(start + k) * dim + j]
        cuda.syncthreads()
    if j < dim:
        grad_weight[row * dim + j] = 0.0 if row == padding else total


def _grad_grid(ids, grad_out, grad_weight, dim, rows, padding):
    return (rows * ((dim + GRAD_THREADS - 1) // GRAD_THREADS), GRAD_THREADS)


EMBEDDING = Kernel("embedding", embedding_cpu, embedding_cuda, elements(2))
EMBEDDING_GRAD = Kernel("embedding_grad", embedding_grad_cpu, embedding_grad_cuda, _grad_grid)


_bad_id_message = fault_message("embedding: id {0} at position {1} is out of range for "
                                "num_embeddings {2} (ids must lie in [0, {2}))",
                                "ids of a recent CUDA call")


def _bad_ids(device):
    return flag_buffer("embedding", device, _bad_id_message, IndexError)


def check_ids_on_host(ids, rows):
    """Raise the op's IndexError for the first id of the host array ``ids`` outside
    [0, rows)."""
    flat_ids = np.asarray(ids).reshape(-1)
    bad = np.flatnonzero((flat_ids < 0) | (flat_ids >= rows))
    if bad.size:
        raise IndexError(_bad_id_message((1, flat_ids[bad[0]], bad[0], rows), False))


@register
class EmbeddingOp(Op):
    """``weight[ids]``: ids of any integer shape, weight (num_embeddings, dim); params
    ``padding_idx`` (a row, already non-negative, or None) whose gradient is zero."""
    name = "embedding"
    kernels = (EMBEDDING, EMBEDDING_GRAD)
    integer_inputs = (0,)
    host_inputs = (0,)   # host ids are checked on the host, then copied

    def onnx(self, graph, inputs):   # Gather's data is the table, its indices the ids
        return graph.node("Gather", [inputs[1], graph.int64(inputs[0])], axis=0)

    def check(self, ids, weight):
        if weight.ndim != 2:
            raise ValueError(f"embedding: the weight must be 2-D (num_embeddings, dim), got "
                             f"shape {tuple(weight.shape)}")
        padding = self.params.get("padding_idx")
        if padding is not None and not 0 <= padding < weight.shape[0]:
            raise ValueError(f"embedding: padding_idx {padding} is outside [0, "
                             f"{weight.shape[0]}) (num_embeddings {weight.shape[0]})")

    def forward(self, ids, weight):
        device, rows = device_of(weight), weight.shape[0]
        if device_of(ids) == "cpu":
            ids = np.asarray(ids, order="C")
            check_ids_on_host(ids, rows)   # before any kernel runs
            ids = to_device(ids, device) if device == "cuda" else ids
        bad = _bad_ids(device)
        if bad.deferred:
            bad.raise_if_flagged()   # an earlier call's bad id, read without a sync
        out = run(EMBEDDING, flat(ids), flat(weight),
                  Out(tuple(ids.shape) + (weight.shape[1],), weight.dtype), weight.shape[1],
                  rows, bad.device)
        if not bad.deferred:
            bad.raise_if_flagged()
        self.ids, self.weight_shape = ids, tuple(weight.shape)
        return out

    def backward(self, grad_out, grad_dst):
        rows, dim = self.weight_shape
        bad = _bad_ids(device_of(grad_out))
        if bad.deferred:
            bad.raise_if_flagged()
        padding = self.params.get("padding_idx")
        destination = Out(self.weight_shape, grad_out.dtype) if grad_dst[1] is None \
            else flat(grad_dst[1])
        made = run(EMBEDDING_GRAD, flat(self.ids), flat(grad_out), destination, dim, rows,
                   NO_PADDING if padding is None else padding)
        return None, (grad_dst[1] if grad_dst[1] is not None else made)
