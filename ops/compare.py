"""Comparisons (``<``, ``<=``, ``>``, ``>=``, ``==``, ``!=``) into bool arrays, and ``where``.

A comparison takes any numeric dtypes on either side (float32 against float64, int64 labels
against uint8 ones, bools as 0 and 1): the kernels compare in NumPy's promoted type, so
nothing is cast first. Against a Python number the number is a kernel argument, already in
the tensor's dtype where that is a float (``x == 0.1`` on float32 compares with
float32(0.1), as NumPy and torch do). NaN compares unequal to everything, itself included.
Comparisons are never differentiated: they produce bools.

``where(cond, a, b)`` picks ``a`` where ``cond`` is True and ``b`` elsewhere, with the three
broadcast together; its gradient goes to ``a`` where ``cond`` holds and to ``b`` elsewhere,
summed back to each input's shape.
"""
import math

import numpy as np
from numba import njit

from ops.cast import BOOL, BYTE, as_bytes, same_memory_as
from ops.cuda import cuda
from ops.dispatch import Meta, Out, run
from ops.launch import Kernel, elements
from ops.layout import (broadcast_layout, broadcast_offsets_cpu, broadcast_offsets_cuda,
                        broadcast_shape, broadcast_strides, coalesce, flat,
                        unravel_offsets_cpu, unravel_offsets_cuda)
from ops.reduce import REDUCE, SUM, sum_to_shape
from ops.registry import Op, register
from ops.twin import twin

LT, LE, GT, GE, EQ, NE = range(6)
NAMES = {LT: "lt", LE: "le", GT: "gt", GE: "ge", EQ: "eq", NE: "ne"}


def _compare(code, x, y):
    if code == LT:
        return x < y
    if code == LE:
        return x <= y
    if code == GT:
        return x > y
    if code == GE:
        return x >= y
    if code == EQ:
        return x == y
    return x != y


_compare_cpu, _compare_cuda = twin(_compare)


def _compare_kernels(code):
    """The twin kernels of ``a <code> b`` (broadcast by ``meta``) and of ``a <code> p``, written
    as 1 or 0 into a uint8 ``out``."""

    @njit(cache=True, error_model="numpy")
    def compare_cpu(a, b, out, meta):
        if meta[0] == 0:   # same shape: no index arithmetic
            for i in range(out.size):
                out[i] = 1 if _compare_cpu(code, a[i], b[i]) else 0
            return
        for i in range(out.size):
            offset_a, offset_b = broadcast_offsets_cpu(i, meta)
            out[i] = 1 if _compare_cpu(code, a[offset_a], b[offset_b]) else 0

    @cuda.jit(cache=True)
    def compare_cuda(a, b, out, meta):
        i = cuda.grid(1)
        if i < out.size:
            if meta[0] == 0:
                out[i] = 1 if _compare_cuda(code, a[i], b[i]) else 0
            else:
                offset_a, offset_b = broadcast_offsets_cuda(i, meta)
                out[i] = 1 if _compare_cuda(code, a[offset_a], b[offset_b]) else 0

    @njit(cache=True, error_model="numpy")
    def compare_scalar_cpu(a, out, p):
        for i in range(out.size):
            out[i] = 1 if _compare_cpu(code, a[i], p) else 0

    @cuda.jit(cache=True)
    def compare_scalar_cuda(a, out, p):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = 1 if _compare_cuda(code, a[i], p) else 0

    name = NAMES[code]
    return (Kernel(name, compare_cpu, compare_cuda, elements(2)),
            Kernel(f"{name}_scalar", compare_scalar_cpu, compare_scalar_cuda, elements(1)))


COMPARE = {code: _compare_kernels(code) for code in NAMES}


def scalar_operand(value, dtype):
    """A Python number as the kernel argument it is compared with: in ``dtype`` when that is a
    float that holds it (NumPy's rule for Python scalars; a finite number beyond float32's
    range stays a float64 rather than becoming inf), an int64 beside integers, else a
    float64."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        fits = not math.isfinite(value) or abs(value) <= float(np.finfo(dtype).max)
        return dtype.type(value) if fits else np.float64(value)
    if isinstance(value, (bool, int, np.integer)):
        if not -2**63 <= value < 2**63:
            return np.float64(value)   # beyond int64: compared as a float, still exact enough
        return np.int64(value)
    return np.float64(value)


class _Compare(Op):
    """``a <code> b`` of two arrays, or ``a <code> p`` for a Python number ``p`` (params)."""
    code = None
    same_dtype = False   # the kernels compare in the promoted type

    def __call__(self, *inputs):
        inputs = tuple(as_bytes(x) for x in inputs)
        self.integer_inputs = tuple(i for i, x in enumerate(inputs) if x.dtype.kind in "iu")
        return same_memory_as(super().__call__(*inputs), BOOL)

    def check(self, a, b=None):
        if b is not None:
            self.shape = broadcast_shape(a.shape, b.shape, self.name)

    def forward(self, a, b=None):
        tensor_kernel, scalar_kernel = COMPARE[self.code]
        if b is None:
            p = scalar_operand(self.params["p"], a.dtype)
            return run(scalar_kernel, flat(a), Out(a.shape, BYTE), p)
        meta = Meta(broadcast_layout(self.shape, tuple(a.shape), tuple(b.shape)))
        return run(tensor_kernel, flat(a), flat(b), Out(self.shape, BYTE), meta)


def _compare_op(code):
    class_name = NAMES[code].capitalize()
    return register(type(class_name, (_Compare,), {
        "name": NAMES[code], "code": code, "kernels": COMPARE[code],
        "__doc__": f"Elementwise {NAMES[code]} into a bool array."}))


COMPARE_OPS = {code: _compare_op(code) for code in NAMES}
Lt, Le, Gt, Ge, Eq, Ne = (COMPARE_OPS[code] for code in (LT, LE, GT, GE, EQ, NE))


# ------------------------------------------------------------------ where

def where_layout(shape, cond_shape, a_shape, b_shape):
    """``[ndim, shape, cond strides, a strides, b strides]`` of the coalesced output, or ``[0]``
    when all three have the output's shape."""
    if cond_shape == a_shape == b_shape == shape:
        return (0,)
    merged, strides = coalesce(shape, *(broadcast_strides(s, shape)
                                        for s in (cond_shape, a_shape, b_shape)))
    return (len(merged),) + merged + strides[0] + strides[1] + strides[2]


@njit(cache=True, error_model="numpy")
def where_cpu(cond, a, b, out, meta):
    for i in range(out.size):
        if meta[0] == 0:
            out[i] = a[i] if cond[i] else b[i]
        else:
            at_cond, at_a, at_b = unravel_offsets_cpu(i, meta, 1, meta[0], 3)
            out[i] = a[at_a] if cond[at_cond] else b[at_b]


@cuda.jit(cache=True)
def where_cuda(cond, a, b, out, meta):
    i = cuda.grid(1)
    if i < out.size:
        if meta[0] == 0:
            out[i] = a[i] if cond[i] else b[i]
        else:
            at_cond, at_a, at_b = unravel_offsets_cuda(i, meta, 1, meta[0], 3)
            out[i] = a[at_a] if cond[at_cond] else b[at_b]


@njit(cache=True, error_model="numpy")
def where_grad_cpu(cond, grad_out, grad_a, grad_b, meta):
    """grad_a = grad_out where cond holds, else 0; grad_b the rest (both at the output's
    shape; ``meta`` is the where layout, whose a and b strides are not read)."""
    for i in range(grad_out.size):
        at_cond = i if meta[0] == 0 else unravel_offsets_cpu(i, meta, 1, meta[0], 1)[0]
        g = grad_out[i]
        grad_a[i] = g if cond[at_cond] else 0.0
        grad_b[i] = 0.0 if cond[at_cond] else g


@cuda.jit(cache=True)
def where_grad_cuda(cond, grad_out, grad_a, grad_b, meta):
    i = cuda.grid(1)
    if i < grad_out.size:
        at_cond = i if meta[0] == 0 else unravel_offsets_cuda(i, meta, 1, meta[0], 1)[0]
        g = grad_out[i]
        grad_a[i] = g if cond[at_cond] else 0.0
        grad_b[i] = 0.0 if cond[at_cond] else g


WHERE = Kernel("where", where_cpu, where_cuda, elements(3))
WHERE_GRAD = Kernel("where_grad", where_grad_cpu, where_grad_cuda, elements(1))


@register
class Where(Op):
    """``a`` where the bool ``cond`` holds, else ``b``: differentiable in ``a`` and ``b``."""
    name = "where"
    kernels = (WHERE, WHERE_GRAD, REDUCE[SUM])   # the sum undoes broadcasting
    integer_inputs = (0,)   # cond, seen as its uint8 bytes

    def __call__(self, cond, a, b):
        if cond.dtype != BOOL:
            raise TypeError(f"where: cond must be a bool tensor (a comparison such as x > 0), "
                            f"got {cond.dtype}; turn it into one with x != 0")
        return super().__call__(as_bytes(cond), a, b)

    def check(self, cond, a, b):
        shape = broadcast_shape(a.shape, b.shape, self.name)
        self.shape = broadcast_shape(cond.shape, shape, self.name)

    def forward(self, cond, a, b):
        self.cond = cond
        self.a_shape, self.b_shape = tuple(a.shape), tuple(b.shape)
        self.meta = Meta(where_layout(self.shape, tuple(cond.shape), self.a_shape, self.b_shape))
        return run(WHERE, flat(cond), flat(a), flat(b), Out(self.shape, a.dtype), self.meta)

    def backward(self, grad_out, grad_dst):
        grad_a, grad_b = run(WHERE_GRAD, flat(self.cond), flat(grad_out),
                             Out(self.shape, grad_out.dtype), Out(self.shape, grad_out.dtype),
                             self.meta)
        _, needs_a, needs_b = self.needs_input_grad
        return (None, sum_to_shape(grad_a, self.a_shape) if needs_a else None,
                sum_to_shape(grad_b, self.b_shape) if needs_b else None)
