"""Embedding: the rows of a weight table (num_embeddings, dim) that integer ids pick.

Forward: ``out[i, j] = weight[ids[i], j]`` for the ids flattened, one thread per output
element; the result has shape ``ids.shape + (dim,)``.

Backward, deterministic without float atomics: a repeated id sums its rows of ``grad_out``
in ascending position order, in a float64 accumulator, cast once at the end, on both
devices, so the same inputs give the same bits on the CPU and on CUDA. The CPU walks the ids
once into a float64 table. CUDA sorts the positions by id first, a counting sort with
integer atomics alone (count each id, scan the counts into bucket starts, place each
position in its bucket), then gives each row of the gradient and tile of its columns a
block that sorts its bucket's positions in shared memory and adds their rows of
``grad_out`` in that order; a bucket too large to sort there scans all ids in order. The
``padding_idx`` row gets a zero gradient, as in torch.

Bad ids. An id below 0 or at least num_embeddings is an IndexError naming the op, the id,
its position and num_embeddings. Host ids are checked on the host before any kernel runs. On
the device the forward kernel checks every id too (a replayed step runs no Python): a bad id
writes NaN, is recorded in the op's fault words (``ops.flag_buffer``), which gate an
optimizer's update as a bad label does, and the error follows after the call on the CPU and
in the simulator, at the next call or sync on a GPU.
"""
import math

import numpy as np
from numba import float64, int32, int64, njit

from ops.cuda import SIMULATOR, cuda
from ops.device import device_of, to_device
from ops.dispatch import Out, run
from ops.fill import fill_cuda
from ops.flag_buffer import flag_buffer
from ops.input_fault import fault_message, record_fault_cpu, record_fault_cuda
from ops.launch import CPU_KERNEL, THREADS_PER_BLOCK, Kernel, elements
from ops.layout import flat
from ops.memory import empty
from ops.registry import Op, register
from ops.twin import twin

NO_PADDING = -1
# threads of a CUDA gradient block: columns of the owned row, and ids tested per tile
GRAD_THREADS = 8 if SIMULATOR else 128
# the largest bucket (positions of one id) sorted in shared memory: sorting costs
# size**2 / GRAD_THREADS compares a thread, scanning all ids N: a 1024 bucket costs a
# scan of 8192 ids. Tiny in the simulator, so its small tests take both paths.
SORTED_MAX = 4 if SIMULATOR else 1024
SCAN_THREADS = 8 if SIMULATOR else 1024


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
def count_ids_cuda(ids, counts, rows):
    """``counts[row]`` += 1 for each valid id (integer atomics: the counts are exact)."""
    i = cuda.grid(1)
    if i < ids.size and 0 <= ids[i] < rows:
        cuda.atomic.add(counts, ids[i], 1)


@cuda.jit(cache=True)
def exclusive_scan_cuda(counts):
    """One block: ``counts`` becomes its exclusive prefix sums, in place. Each thread sums a
    contiguous segment, the block scans the segment totals (Hillis-Steele), then each
    thread writes its segment's prefixes."""
    totals = cuda.shared.array(SCAN_THREADS, int64)
    t = cuda.threadIdx.x
    segment = (counts.size + SCAN_THREADS - 1) // SCAN_THREADS
    first, stop = min(t * segment, counts.size), min((t + 1) * segment, counts.size)
    total = 0
    for r in range(first, stop):
        total += counts[r]
    totals[t] = total
    cuda.syncthreads()
    step = 1
    while step < SCAN_THREADS:
        add = totals[t - step] if t >= step else 0
        cuda.syncthreads()
        totals[t] += add
        cuda.syncthreads()
        step *= 2
    running = totals[t] - total
    for r in range(first, stop):
        count = counts[r]
        counts[r] = running
        running += count


@cuda.jit(cache=True)
def place_ids_cuda(ids, cursors, order, rows):
    """Each valid position into its id's bucket of ``order``: ``cursors`` (the buckets'
    starts) end as the buckets' ends. The order within a bucket varies run to run; the
    summing kernel sorts it."""
    i = cuda.grid(1)
    if i < ids.size and 0 <= ids[i] < rows:
        slot = cuda.atomic.add(cursors, ids[i], 1)
        if 0 <= slot < order.size:   # always, but for a launch replayed alone (bench.gpu_step)
            order[slot] = i


@cuda.jit(cache=True)
def sum_buckets_cuda(ids, ends, order, grad_out, grad_weight, dim, rows, padding):
    """Block (row, column tile): the row's bucket ``order[ends[row - 1]:ends[row]]`` sorted
    in shared memory (each position's rank is the count of smaller ones), then each thread
    sums its column over the bucket in ascending position order. A bucket over
    ``SORTED_MAX`` positions scans all ids in order instead, a tile at a time."""
    held = cuda.shared.array(SORTED_MAX, int32)
    ascending = cuda.shared.array(SORTED_MAX, int32)
    hits = cuda.shared.array(GRAD_THREADS, int32)
    t = cuda.threadIdx.x
    column_tiles = (dim + GRAD_THREADS - 1) // GRAD_THREADS
    row = cuda.blockIdx.x // column_tiles
    j = (cuda.blockIdx.x - row * column_tiles) * GRAD_THREADS + t
    # the bucket clamped to ``order``: a launch replayed alone (bench.gpu_step times each
    # launch by itself) sees counts of earlier replays, even overflowed ones, never an
    # address outside ``order``
    first = max(0, min(ends[row - 1], order.size)) if row > 0 else 0
    size = max(0, min(ends[row], order.size) - first)
    total = float64(0.0)
    if row == padding or size == 0:
        pass
    elif size <= SORTED_MAX:
        for k in range(t, size, GRAD_THREADS):
            held[k] = order[first + k]
        cuda.syncthreads()
        for k in range(t, size, GRAD_THREADS):
            rank = 0
            for u in range(size):
                rank += held[u] < held[k]
            ascending[rank] = held[k]
        # (positions are distinct, so the ranks fill ``ascending``; a launch replayed alone
        # can repeat one, leaving a slot unwritten: the sum skips what is not a position)
        cuda.syncthreads()
        if j < dim:
            for k in range(size):
                position = ascending[k]
                if 0 <= position < ids.size:   # always, but for a launch replayed alone
                    total += grad_out[position * dim + j]
    else:
        count = ids.size
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


def _grad_plan(args):
    """Counting sort of the positions by id (integer atomics only), then a block per row
    and column tile sums its bucket in ascending order: work in proportion to the ids and
    the table, not their product (every block once read all ids: 282 ms at 50304 x 384 on
    the H200, torch 0.3 ms)."""
    ids, grad_out, grad_weight, dim, rows, padding = args
    ends = empty(rows, np.int32, "cuda")
    order = empty(max(ids.size, 1), np.int32, "cuda")
    per_id = -(-ids.size // THREADS_PER_BLOCK)
    column_tiles = -(-dim // GRAD_THREADS)
    return ((fill_cuda, -(-rows // THREADS_PER_BLOCK), THREADS_PER_BLOCK, (ends, 0)),
            (count_ids_cuda, per_id, THREADS_PER_BLOCK, (ids, ends, rows)),
            (exclusive_scan_cuda, 1, SCAN_THREADS, (ends,)),
            (place_ids_cuda, per_id, THREADS_PER_BLOCK, (ids, ends, order, rows)),
            (sum_buckets_cuda, rows * column_tiles, GRAD_THREADS,
             (ids, ends, order, grad_out, grad_weight, dim, rows, padding)))


EMBEDDING = Kernel("embedding", embedding_cpu, embedding_cuda, elements(2))
EMBEDDING_GRAD = Kernel("embedding_grad", embedding_grad_cpu, cuda_plan=_grad_plan)


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
