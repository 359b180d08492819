"""Matrix products: the ``matmul`` op and ``gemm``, the array-level GEMM every other product
calls.

CPU: BLAS (``ops.gemm.cpu``), a large product in row blocks across the engine's threads.
CUDA: our own tiled, register-blocked GEMM template (``ops.gemm.template``), whose tiling and
split-K count ``ops.gemm.choices`` picks and whose launches ``ops.gemm.plans`` makes; the
same template carries Dense's fused kernels (``ops.dense``) and the convolutions
(``ops.conv``). How a call flows from here to a kernel: ops/gemm/README.md."""
import math

from ops.dispatch import Out, run
from ops.gemm.cpu import gemm_split_cpu
from ops.gemm.plans import gemm_plan
from ops.gemm.tilings import PLAIN
from ops.launch import Kernel
from ops.pointwise import IDENTITY
from ops.registry import Op, register

# ------------------------------------------------------------------ array-level GEMM

def _gemm_plan(args):
    a, b, out, trans_a, trans_b = args
    m, n = out.shape
    k = a.shape[0] if trans_a else a.shape[1]
    return gemm_plan(PLAIN, m, n, k, a.dtype, trans_a, trans_b, IDENTITY, (a, b, out))


GEMM = Kernel("gemm", gemm_split_cpu, cuda_plan=_gemm_plan)


def gemm(a, b, trans_a=False, trans_b=False, out=None):
    """``op(a) @ op(b)`` for 2-D arrays of one device and dtype, ``op`` a transpose when asked.

    ``out`` (C-contiguous, the right shape) receives the result when given."""
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"matmul: gemm takes 2-D arrays, got shapes {tuple(a.shape)} "
                         f"and {tuple(b.shape)}")
    m, k = (a.shape[1], a.shape[0]) if trans_a else tuple(a.shape)
    k_b, n = (b.shape[1], b.shape[0]) if trans_b else tuple(b.shape)
    if k != k_b:
        raise ValueError(f"matmul: inner dimensions differ: {_described(a, trans_a)} @ "
                         f"{_described(b, trans_b)}")
    flags = (bool(trans_a), bool(trans_b))
    if out is None:
        return run(GEMM, a, b, Out((m, n), a.dtype, flat=False), *flags)
    if tuple(out.shape) != (m, n):
        raise ValueError(f"matmul: output buffer has shape {tuple(out.shape)}, expected {(m, n)}")
    run(GEMM, a, b, out, *flags)
    return out


def _described(x, transposed):
    return f"{tuple(x.shape)}" + ("ᵀ" if transposed else "")


# ------------------------------------------------------------------ the op

@register
class MatMul(Op):
    """``a @ b`` for a (..., K) and b (K, N); backward uses the transposed GEMMs."""
    name = "matmul"

    def onnx(self, graph, inputs):   # ONNX's MatMul broadcasts batches as numpy.matmul
        return graph.node("MatMul", inputs)
    kernels = (GEMM,)

    def check(self, a, b):
        a_shape, b_shape = tuple(a.shape), tuple(b.shape)
        if len(a_shape) < 2 or len(b_shape) != 2:
            raise ValueError(f"matmul: expects a (..., K) @ (K, N) product (2-D x 2-D or N-D x "
                             f"2-D), got shapes {a_shape} and {b_shape}")
        if a_shape[-1] != b_shape[0]:
            raise ValueError(f"matmul: inner dimensions differ: {a_shape} @ {b_shape}")

    def forward(self, a, b):
        a_shape = tuple(a.shape)
        self.a_shape = a_shape
        self.a2 = a.reshape(math.prod(a_shape[:-1]), a_shape[-1])   # C-contiguous: a free view
        self.b = b
        return gemm(self.a2, b).reshape(a_shape[:-1] + (b.shape[1],))

    def backward(self, grad_out, grad_dst):
        needs_a, needs_b = self.needs_input_grad
        g = grad_out.reshape(self.a2.shape[0], self.b.shape[1])
        grad_a = grad_b = None
        if needs_a:   # dA = G @ Bᵀ
            dst = grad_dst[0].reshape(self.a2.shape) if grad_dst[0] is not None else None
            grad_a = gemm(g, self.b, trans_b=True, out=dst)
            grad_a = grad_dst[0] if dst is not None else grad_a.reshape(self.a_shape)
        if needs_b:   # dB = Aᵀ @ G
            grad_b = gemm(self.a2, g, trans_a=True, out=grad_dst[1])
        return grad_a, grad_b
