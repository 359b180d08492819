"""MaxPool2D and AvgPool2D over NCHW inputs, with PyTorch's defaults and semantics.

Window ``(oh, ow)`` of a plane covers rows ``oh·SH - PH .. oh·SH - PH + KH - 1`` (columns
alike); ``stride`` defaults to ``kernel_size``, ``padding`` is at most half the kernel (as
torch asks), and ``OH = (H + 2·PH - KH) // SH + 1``.

- max: ``y = max`` over the window's elements inside the input (padding never wins);
  ``argmax`` is the first maximum in row-major window order (the last NaN when there is
  one: NaN propagates), and the gradient goes to it alone, as torch's does on ties.
- avg: ``y = Σ window / (KH·KW)``, padded zeros counted in the average (torch's
  ``count_include_pad=True``).

Backward: each input element sums the gradients of the windows that hold it (for max, those
whose argmax it is) in row-major window order. On CUDA one thread per input element gathers
them, so overlapping windows need no atomics; on the CPU each plane is zeroed and every
window scatters into it, in that same order (the max's 2x2 windows at stride 2, which do
not overlap, write each element once, the same bits). The CPU kernels walk planes and rows with no
index division per element, blocks of planes on the engine's threads (``ops.pool_cpu``); the
CUDA ones a thread per element. Measured on the 2-core CPU (128x32x28x28 float32, kernel 2,
best of 30, ``prange`` then): max
forward 5.6 -> 2.7 ms on two threads once the running maximum is a select (as a branch it
mispredicts on random data and ran 14.7 ms on two threads), max backward 0.83 -> 0.45, avg
forward 3.0 -> 1.5, avg backward 3.2 -> 1.6.
"""
import functools

import numpy as np

from ops.conv import pair, pool_output_sizes
from ops.cuda import cuda
from ops.dispatch import Out, run
from ops.launch import Kernel, threads_for
from ops.layout import flat
from ops.pool_cpu import (avg_pool_blocks_cpu, avg_pool_grad_blocks_cpu, max_pool_blocks_cpu,
                          max_pool_grad_blocks_cpu)
from ops.registry import Op, register

# meta: (planes = N·C, H, W, OH, OW, KH, KW, SH, SW, PH, PW), a tuple of ints both kernels
# take: the CPU kernels read it; the CUDA kernels are built with all but the plane count as
# compile-time constants (see _cuda_kernels), the plane count read from the arrays' sizes.


@cuda.jit(device=True)
def _windows_holding(i, kernel, stride, pad, count):
    """``[lo, hi)``: the window positions along one axis whose span holds input index i."""
    first = i + pad - kernel + 1
    lo = 0 if first <= 0 else (first + stride - 1) // stride
    hi = min(count, (i + pad) // stride + 1)
    return lo, max(lo, hi)


@cuda.jit(device=True)
def _max_window(x, plane, oh, ow, geometry):
    """The window's maximum and its plane-relative index ``ih·W + iw``: the first maximum,
    or the last NaN (torch's rule ``value > best or isnan(value)``)."""
    h, w, oh_n, ow_n, kh, kw, sh, sw, ph, pw = geometry
    base = plane * h * w
    h0, w0 = oh * sh - ph, ow * sw - pw
    best_at = max(h0, 0) * w + max(w0, 0)   # a window always holds an input element
    best = x[base + best_at]
    for ih in range(max(h0, 0), min(h0 + kh, h)):
        for iw in range(max(w0, 0), min(w0 + kw, w)):
            value = x[base + ih * w + iw]
            if value > best or value != value:
                best, best_at = value, ih * w + iw
    return best, best_at


@cuda.jit(device=True)
def _avg_window(x, plane, oh, ow, geometry, scale):
    """Σ window · scale, window in row-major order: the padding adds zeros."""
    h, w, oh_n, ow_n, kh, kw, sh, sw, ph, pw = geometry
    base = plane * h * w
    h0, w0 = oh * sh - ph, ow * sw - pw
    total = scale - scale
    for ih in range(max(h0, 0), min(h0 + kh, h)):
        for iw in range(max(w0, 0), min(w0 + kw, w)):
            total += x[base + ih * w + iw]
    return total * scale


@cuda.jit(device=True)
def _max_grad_at(argmax, grad_out, plane, ih, iw, geometry):
    """d loss / d x[plane, ih, iw]: the gradients of the windows whose argmax it is."""
    h, w, oh_n, ow_n, kh, kw, sh, sw, ph, pw = geometry
    oh_lo, oh_hi = _windows_holding(ih, kh, sh, ph, oh_n)
    ow_lo, ow_hi = _windows_holding(iw, kw, sw, pw, ow_n)
    me = ih * w + iw
    total = grad_out.dtype.type(0)
    base = plane * oh_n * ow_n
    for oh in range(oh_lo, oh_hi):
        for ow in range(ow_lo, ow_hi):
            if argmax[base + oh * ow_n + ow] == me:
                total += grad_out[base + oh * ow_n + ow]
    return total


@cuda.jit(device=True)
def _avg_grad_at(grad_out, plane, ih, iw, geometry, scale):
    """d loss / d x[plane, ih, iw]: (Σ over the windows holding it of grad_out) · scale."""
    h, w, oh_n, ow_n, kh, kw, sh, sw, ph, pw = geometry
    oh_lo, oh_hi = _windows_holding(ih, kh, sh, ph, oh_n)
    ow_lo, ow_hi = _windows_holding(iw, kw, sw, pw, ow_n)
    total = scale - scale
    base = plane * oh_n * ow_n
    for oh in range(oh_lo, oh_hi):
        for ow in range(ow_lo, ow_hi):
            total += grad_out[base + oh * ow_n + ow]
    return total * scale


@functools.cache
def _cuda_kernels(window):
    """The four CUDA kernels, one thread per output (forward) or input (backward) element,
    with the window geometry ``window`` = (H, W, OH, OW, KH, KW, SH, SW, PH, PW) compile-time
    constants: the element's (plane, row, column) and the window bounds come from divisions
    by constants (multiplications). The kernels before these read the geometry from a device
    array and divided by runtime 64-bit values; the CNN's pool forwards then ran about 4x
    PyTorch's time on the H200 (bench.conv_ops)."""
    h, w, oh_n, ow_n = window[:4]
    out_plane, in_plane = oh_n * ow_n, h * w

    @cuda.jit(cache=True)
    def max_pool_cuda(x, out, argmax):
        at = cuda.grid(1)
        if at < out.size:
            plane, position = at // out_plane, at % out_plane
            out[at], argmax[at] = _max_window(x, plane, position // ow_n, position % ow_n,
                                              window)

    @cuda.jit(cache=True)
    def max_pool_grad_cuda(argmax, grad_out, grad_in):
        at = cuda.grid(1)
        if at < grad_in.size:
            plane, position = at // in_plane, at % in_plane
            grad_in[at] = _max_grad_at(argmax, grad_out, plane, position // w, position % w,
                                       window)

    @cuda.jit(cache=True)
    def avg_pool_cuda(x, out, scale):
        at = cuda.grid(1)
        if at < out.size:
            plane, position = at // out_plane, at % out_plane
            out[at] = _avg_window(x, plane, position // ow_n, position % ow_n, window, scale)

    @cuda.jit(cache=True)
    def avg_pool_grad_cuda(grad_out, grad_in, scale):
        at = cuda.grid(1)
        if at < grad_in.size:
            plane, position = at // in_plane, at % in_plane
            grad_in[at] = _avg_grad_at(grad_out, plane, position // w, position % w, window,
                                       scale)

    return max_pool_cuda, max_pool_grad_cuda, avg_pool_cuda, avg_pool_grad_cuda


def _elementwise_plan(which, elements_of, drop):
    """The plan of kernel ``which`` of _cuda_kernels: one thread per element of argument
    ``elements_of``, the arguments without the meta tuple (position ``drop``)."""
    def plan(args):
        kernel = _cuda_kernels(tuple(args[drop][1:]))[which]
        count = args[elements_of].size
        threads = threads_for(count)
        return [(kernel, -(-count // threads), threads,
                 tuple(args[:drop]) + tuple(args[drop + 1:]))]
    return plan


MAX_POOL = Kernel("max_pool2d", max_pool_blocks_cpu,
                  cuda_plan=_elementwise_plan(0, 1, 3))
MAX_POOL_GRAD = Kernel("max_pool2d_grad", max_pool_grad_blocks_cpu,
                       cuda_plan=_elementwise_plan(1, 2, 3))
AVG_POOL = Kernel("avg_pool2d", avg_pool_blocks_cpu,
                  cuda_plan=_elementwise_plan(2, 1, 2))
AVG_POOL_GRAD = Kernel("avg_pool2d_grad", avg_pool_grad_blocks_cpu,
                       cuda_plan=_elementwise_plan(3, 1, 2))


# ------------------------------------------------------------------ ops


class _Pool2D(Op):
    def check(self, x):
        name = self.name
        if x.ndim != 4:
            raise ValueError(f"{name}: expects x (N, C, H, W), got shape {tuple(x.shape)}")
        kernel = pair(self.params.get("kernel_size"), "kernel_size", name, 1)
        stride = self.params.get("stride")
        stride = kernel if stride is None else pair(stride, "stride", name, 1)
        padding = pair(self.params.get("padding", 0), "padding", name, 0)
        nb, channels, h, w = x.shape
        oh, ow = pool_output_sizes((h, w), kernel, stride, padding, name)
        self.x_shape = tuple(x.shape)
        self.out_shape = (nb, channels, oh, ow)
        self.meta = tuple(int(v) for v in (nb * channels, h, w, oh, ow) + kernel + stride
                          + padding)
        self.scale = np.dtype(x.dtype).type(1.0 / (kernel[0] * kernel[1]))

    def onnx(self, graph, inputs):   # meta: ..., kernel (2), stride (2), padding (2)
        kernel, stride, (rows, columns) = self.meta[5:7], self.meta[7:9], self.meta[9:11]
        extra = {"count_include_pad": 1} if self.name == "avg_pool2d" else {}
        return graph.node("MaxPool" if self.name == "max_pool2d" else "AveragePool", inputs,
                          kernel_shape=list(kernel), strides=list(stride),
                          pads=[rows, columns, rows, columns], **extra)


@register
class MaxPool2DOp(_Pool2D):
    """Max over each window; params kernel_size, stride (default kernel_size), padding."""
    name = "max_pool2d"
    kernels = (MAX_POOL, MAX_POOL_GRAD)

    def forward(self, x):
        out, self.argmax = run(MAX_POOL, flat(x), Out(self.out_shape, x.dtype),
                               Out(self.out_shape, np.int32), self.meta)
        return out

    def backward(self, grad_out, grad_dst):
        return (run(MAX_POOL_GRAD, flat(self.argmax), flat(grad_out),
                    Out(self.x_shape, grad_out.dtype), self.meta),)


@register
class AvgPool2DOp(_Pool2D):
    """Mean of each window, padded zeros counted; params kernel_size, stride, padding."""
    name = "avg_pool2d"
    kernels = (AVG_POOL, AVG_POOL_GRAD)

    def forward(self, x):
        return run(AVG_POOL, flat(x), Out(self.out_shape, x.dtype), self.meta, self.scale)

    def backward(self, grad_out, grad_dst):
        return (run(AVG_POOL_GRAD, flat(grad_out), Out(self.x_shape, grad_out.dtype),
                    self.meta, self.scale),)
