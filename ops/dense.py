"""Fused Dense: ``act(x @ W + b)`` forward in one kernel, backward in at most two (on CUDA a
split-K GEMM adds its sum kernel to each).

Forward: on CUDA the GEMM template of ``ops.gemm`` adds the bias and applies the
activation in its epilogue; on the CPU BLAS writes ``x @ W`` into the output
(``ops.gemm.cpu.blas_product``, NumPy's BLAS called from Python) and one ``@njit`` loop adds
the bias and activates in place (NumPy's add for a linear layer). The CPU side compiles only
those loops: with ``np.dot`` inside the kernels, Numba's GEMM wrapper was compiled once per
operand layout and again into each of the four kernels of the MLP, 1.7-2.1 s of its cold
first step, against 0.7 for the three loops now (``python -m bench.mlp``, 2-core machine).

A large CPU GEMM runs in blocks of its output across the engine's threads
(``ops.cpu_threads``), each block the same BLAS call on slices (``ops.gemm.cpu.
product_blocks``): of the output's columns when the left operand is the smaller (each block
packs it whole and a slice of the right one: a batch of 64 into 512 units), else of its
rows; a forward's row blocks also run the compiled epilogue on their rows, column blocks
leave it to one pass after. The backward's dX and dW, independent once G is made, share the
threads in one hand-off (``ops.cpu_threads.thread_shares``: on 2 threads each GEMM whole on
its core). A block is the same dot products summed in the same order, so the results are
bit-identical on any thread count
(tests/ops/test_thread_determinism.py).

Backward, with ``G = grad_out * act'(x)`` written in terms of the saved output ``y``:
- ``dX = G @ Wᵀ`` (skipped when x needs no gradient: the first layer);
- ``dW = xᵀ @ G`` and ``db = Σ_rows G`` (on the CPU one kernel for every activation;
  a linear layer's G is grad_out itself): on CUDA ``db`` is the last row of
  ``[xᵀ; 1ᵀ] @ G``, a virtual row of ones in the GEMM, so it is summed in the GEMM's fixed
  order. G is never stored on CUDA: each GEMM scales the gradient tile as it loads it.
When the tape hands over the parameters' slots of a flat gradient buffer (``grad_dst``),
dW and db are written straight into them.

Because act' is read from y, leaky_relu needs ``alpha >= 0`` (then y > 0 exactly when x > 0).
The activation and its derivative are ``ops.pointwise``'s, the code the elementwise ops run.
"""
import numpy as np
from numba import njit

from ops.cpu_threads import run_blocks, thread_shares
from ops.dispatch import Out, run
from ops.constant_code import kernels_of_code
from ops.launch import CPU_KERNEL, Kernel
from ops.gemm import cpu as gemm_cpu
from ops.gemm.cpu import product_calls
from ops.gemm.plans import gemm_plan
from ops.gemm.tilings import FORWARD, GRAD_A, GRAD_B
from ops.pointwise import ACTIVATIONS, IDENTITY, derivative_cpu, value_cpu
from ops.registry import Op, register


@njit(**CPU_KERNEL, nogil=True)
def bias_gradient_cpu(g, grad_b):
    """db = Σ_rows G, row by row: the same order as the CUDA kernel's K loop. One kernel
    for every activation (it reads G only)."""
    rows, cols = g.shape
    for j in range(cols):
        grad_b[j] = 0
    for i in range(rows):
        for j in range(cols):
            grad_b[j] += g[i, j]


def with_bias_gradient(product, args, g, grad_b):
    """A block of dW's product, and db = Σ_rows G (beside the first block)."""
    product(*args)
    bias_gradient_cpu(g, grad_b)


@kernels_of_code("act")
def _dense_kernels(act):
    """The forward and backward twins of a Dense layer with activation ``act`` (an
    ``ops.pointwise`` code), a constant of their loops (``ops.constant_code``): the compiler
    folds the activation and vectorises them; the CUDA side is the GEMM template's."""

    @njit(**CPU_KERNEL, nogil=True)
    def dense_epilogue_cpu(out, bias, alpha):
        """out = act(out + bias), in place over the rows of a block."""
        rows, cols = out.shape
        for i in range(rows):
            for j in range(cols):
                out[i, j] = value_cpu(act, out[i, j] + bias[j], alpha)

    @njit(**CPU_KERNEL, nogil=True)
    def dense_gradient_cpu(y, grad_out, g, alpha):
        """G = grad_out * act'(y) (BLAS needs it in memory), over the rows of a block."""
        rows, cols = grad_out.shape
        for i in range(rows):
            for j in range(cols):
                g[i, j] = grad_out[i, j] * derivative_cpu(act, y[i, j], y[i, j], alpha)

    def epilogue(out, bias, alpha):
        if act == IDENTITY:   # NumPy's add: the same float32 sums, and no kernel to compile
            np.add(out, bias, out=out)
        else:
            dense_epilogue_cpu(out, bias, alpha)

    def forward_rows(x, w, bias, out, alpha):
        gemm_cpu.blas_product(x, w, out)   # looked up here: bench.cpu_step times it
        epilogue(out, bias, alpha)

    def dense_forward(x, w, bias, out, alpha):
        calls = product_calls(x, w, out)
        if len(calls) == 1:
            forward_rows(x, w, bias, out, alpha)
        else:   # the GEMM's blocks (the workers run them as CBLAS calls), then the epilogue
            run_blocks(calls)
            epilogue(out, bias, alpha)

    def dense_backward(x, w, y, grad_out, grad_x, grad_w, grad_b, alpha, needs_x,
                       needs_params):
        rows, features = grad_out.shape[0], x.shape[1]
        if act == IDENTITY:   # act' = 1: G is grad_out
            g = grad_out
        else:
            g = np.empty_like(grad_out)
            dense_gradient_cpu(y, grad_out, g, alpha)
        # dX = G @ Wᵀ and dW = xᵀ @ G (both need all of G) at once, sharing the threads
        shares = thread_shares([grad_out.size * features] * (needs_x + needs_params))
        together = shares is not None   # else one after another, each whole
        shares = shares or [1, 1]
        calls = []   # dW's first block (with db) on this thread: the workers' are GEMMs alone
        if needs_params:
            (product, args), *rest = product_calls(x.T, g, grad_w, shares[-1])
            calls += [(with_bias_gradient, (product, args, g, grad_b)), *rest]
        if needs_x:
            calls += product_calls(g, w.T, grad_x, shares[0])
        if together:
            run_blocks(calls)
        else:
            for function, args in calls:
                function(*args)

    # the compiled kernels behind each (a linear layer's forward compiles none)
    dense_forward.__wrapped__ = dense_epilogue_cpu
    dense_backward.__wrapped__ = bias_gradient_cpu if act == IDENTITY else dense_gradient_cpu

    def forward_plan(args):
        x, w, bias, out, alpha = args
        return gemm_plan(FORWARD, x.shape[0], w.shape[1], x.shape[1], out.dtype, False, False,
                         act, args)

    def backward_plan(args):   # each GEMM one launch, or two under split-K
        x, w, y, grad_out, grad_x, grad_w, grad_b, alpha, needs_x, needs_params = args
        launches = []
        if needs_x:   # dX (batch, in) = G (batch, out) @ Wᵀ
            launches += gemm_plan(GRAD_A, x.shape[0], x.shape[1], w.shape[1], x.dtype, False,
                                  True, act, (grad_out, y, w, grad_x, alpha))
        if needs_params:   # dW (in, out) = xᵀ @ G, K = batch; the bias row is the kernel's own
            launches += gemm_plan(GRAD_B, w.shape[0], w.shape[1], x.shape[0], x.dtype, True,
                                  False, act, (x, grad_out, y, grad_w, grad_b, alpha))
        return launches

    name = next(key for key, code in ACTIVATIONS.items() if code == act) or "linear"
    return (Kernel(f"dense_forward_{name}", dense_forward, cuda_plan=forward_plan),
            Kernel(f"dense_backward_{name}", dense_backward, cuda_plan=backward_plan))


DENSE = {code: _dense_kernels(code) for code in ACTIVATIONS.values()}


@register
class DenseOp(Op):
    """``act(x @ W + b)``, x (N, in), W (in, out), b (out,); params activation, alpha."""
    name = "dense"
    kernels = tuple(kernel for pair in DENSE.values() for kernel in pair)

    def check(self, x, w, b):
        activation = self.params.get("activation")
        if activation not in ACTIVATIONS:
            raise ValueError(f"dense: unknown activation {activation!r}; expected one of "
                             f"{sorted(ACTIVATIONS, key=str)}")
        self.act = ACTIVATIONS[activation]
        alpha = float(self.params.get("alpha", 0.01))
        if alpha < 0:
            raise ValueError(f"dense: leaky_relu alpha must be >= 0, got {alpha}")
        if x.ndim != 2 or w.ndim != 2 or b.ndim != 1 or x.shape[1] != w.shape[0] \
                or b.shape[0] != w.shape[1]:
            raise ValueError(f"dense: expects x (N, in), W (in, out), b (out,), got "
                             f"{tuple(x.shape)}, {tuple(w.shape)}, {tuple(b.shape)}")
        self.alpha = np.dtype(x.dtype).type(alpha)

    def forward(self, x, w, b):
        out = run(DENSE[self.act][0], x, w, b, Out((x.shape[0], w.shape[1]), x.dtype,
                                                   flat=False), self.alpha)
        self.x, self.w, self.y = x, w, out
        return out

    def onnx(self, graph, inputs):   # Gemm computes x @ W + b with W (in, out) as held
        return graph.activation(self.params.get("activation"), graph.node("Gemm", inputs),
                                float(self.alpha))

    def backward(self, grad_out, grad_dst):
        needs_x, needs_w, needs_b = self.needs_input_grad
        needs_params = needs_w or needs_b
        x, w, dtype = self.x, self.w, self.x.dtype
        # each gradient goes into the tape's buffer when it gave one, else a new output; one
        # that is not needed gets an empty array the kernel never writes
        grad_x = (grad_dst[0] if grad_dst[0] is not None else Out(x.shape, dtype, flat=False)) \
            if needs_x else Out((0, 0), dtype, flat=False)
        grad_w, grad_b = grad_dst[1], grad_dst[2]
        if needs_params:
            grad_w = grad_w if grad_w is not None else Out(w.shape, dtype, flat=False)
            grad_b = grad_b if grad_b is not None else Out((w.shape[1],), dtype, flat=False)
        else:
            grad_w, grad_b = Out((0, 0), dtype, flat=False), Out((0,), dtype, flat=False)
        run(DENSE[self.act][1], x, w, self.y, grad_out, grad_x, grad_w, grad_b, self.alpha,
            needs_x, needs_params)
        return (_made(grad_x) if needs_x else None, _made(grad_w) if needs_w else None,
                _made(grad_b) if needs_b else None)


def _made(slot):
    """The array behind a gradient slot: the tape's buffer, or the output the run made."""
    return slot.array if type(slot) is Out else slot
