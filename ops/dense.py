"""Fused Dense: ``act(x @ W + b)`` forward in one kernel, backward in at most two.

Forward: on CUDA the GEMM template of ``ops.matmul`` adds the bias and applies the
activation in its epilogue; on the CPU BLAS writes ``x @ W`` into the output and one loop
adds the bias and activates in place.

Backward, with ``G = grad_out * act'(x)`` written in terms of the saved output ``y``:
- ``dX = G @ Wᵀ`` (skipped when x needs no gradient: the first layer);
- ``dW = xᵀ @ G`` and ``db = Σ_rows G`` in one kernel: on CUDA ``db`` is the last row of
  ``[xᵀ; 1ᵀ] @ G``, a virtual row of ones in the GEMM, so it is summed in the GEMM's fixed
  order. G is never stored on CUDA: each GEMM scales the gradient tile as it loads it.
When the tape hands over the parameters' slots of a flat gradient buffer (``grad_dst``),
dW and db are written straight into them.

Because act' is read from y, leaky_relu needs ``alpha >= 0`` (then y > 0 exactly when x > 0).
"""
import numpy as np
from numba import njit

from ops.device import SIMULATOR, device_of
from ops.layout import same_device, same_dtype
from ops.matmul import (ACT_NONE, ACTIVATIONS, FORWARD, GRAD_A, GRAD_B, SIMULATED, SMALL,
                        _gemm_kernels, activate_cpu, launch_gemm, scaled_grad_cpu)
from ops.memory import empty
from ops.registry import Op, register


@njit(cache=True)
def dense_forward_cpu(x, w, bias, out, act, alpha):
    np.dot(x, w, out)
    rows, cols = out.shape
    for i in range(rows):
        for j in range(cols):
            out[i, j] = activate_cpu(act, out[i, j] + bias[j], alpha)


@njit(cache=True)
def dense_backward_cpu(x, w, y, grad_out, grad_x, grad_w, grad_b, act, alpha, needs_x,
                       needs_params):
    rows, cols = grad_out.shape
    g = np.empty_like(grad_out)   # BLAS needs G = grad_out * act' in memory
    for i in range(rows):
        for j in range(cols):
            g[i, j] = scaled_grad_cpu(act, grad_out[i, j], y[i, j], alpha)
    if needs_x:
        np.dot(g, w.T, grad_x)
    if needs_params:
        np.dot(x.T, g, grad_w)
        for j in range(cols):
            grad_b[j] = 0
        for i in range(rows):   # row by row: the same order as the CUDA kernel's K loop
            for j in range(cols):
                grad_b[j] += g[i, j]


def _registered_cuda_kernels():
    f32 = np.dtype(np.float32)
    tiling = SIMULATED if SIMULATOR else SMALL
    return (_gemm_kernels(f32, tiling, False, False, FORWARD, ACT_NONE),
            _gemm_kernels(f32, tiling, False, True, GRAD_A, ACT_NONE),
            _gemm_kernels(f32, tiling, True, False, GRAD_B, ACT_NONE))


@register
class Dense(Op):
    """``act(x @ W + b)``, x (N, in), W (in, out), b (out,); params activation, alpha."""
    name = "dense"
    cpu_kernels = (dense_forward_cpu, dense_backward_cpu)
    cuda_kernels = _registered_cuda_kernels()

    def forward(self, x, w, b):
        activation = self.params.get("activation")
        if activation not in ACTIVATIONS:
            raise ValueError(f"dense: unknown activation {activation!r}; expected one of "
                             f"{sorted(ACTIVATIONS, key=str)}")
        self.act = ACTIVATIONS[activation]
        alpha = float(self.params.get("alpha", 0.01))
        if alpha < 0:
            raise ValueError(f"dense: leaky_relu alpha must be >= 0, got {alpha}")
        device = same_device("dense", x, w, b)
        dtype = same_dtype("dense", x, w, b)
        if x.ndim != 2 or w.ndim != 2 or b.ndim != 1 or x.shape[1] != w.shape[0] \
                or b.shape[0] != w.shape[1]:
            raise ValueError(f"dense: expects x (N, in), W (in, out), b (out,), got "
                             f"{tuple(x.shape)}, {tuple(w.shape)}, {tuple(b.shape)}")
        self.alpha = dtype.type(alpha)
        out = empty((x.shape[0], w.shape[1]), dtype, device)
        if device == "cuda":
            launch_gemm(FORWARD, out.shape[0], out.shape[1], dtype, False, False, self.act,
                        x, w, b, out, self.alpha)
        else:
            dense_forward_cpu(x, w, b, out, self.act, self.alpha)
        self.x, self.w, self.y = x, w, out
        return out

    def backward(self, grad_out, grad_dst):
        needs_x, needs_w, needs_b = self.needs_input_grad
        needs_params = needs_w or needs_b
        x, w, y = self.x, self.w, self.y
        device, dtype = device_of(x), np.dtype(x.dtype)
        grad_x = grad_w = grad_b = None
        if needs_x:
            grad_x = empty(x.shape, dtype, device) if grad_dst[0] is None else grad_dst[0]
        if needs_params:
            grad_w = empty(w.shape, dtype, device) if grad_dst[1] is None else grad_dst[1]
            grad_b = empty((w.shape[1],), dtype, device) if grad_dst[2] is None else grad_dst[2]
        if device == "cuda":
            if needs_x:
                launch_gemm(GRAD_A, x.shape[0], x.shape[1], dtype, False, True, self.act,
                            grad_out, y, w, grad_x, self.alpha)
            if needs_params:
                launch_gemm(GRAD_B, w.shape[0] + 1, w.shape[1], dtype, True, False, self.act,
                            x, grad_out, y, grad_w, grad_b, self.alpha)
        else:
            unused = np.empty((0, 0), dtype)
            dense_backward_cpu(x, w, y, grad_out,
                               grad_x if needs_x else unused,
                               grad_w if needs_params else unused,
                               grad_b if needs_params else np.empty(0, dtype),
                               self.act, self.alpha, needs_x, needs_params)
        return grad_x, (grad_w if needs_w else None), (grad_b if needs_b else None)
