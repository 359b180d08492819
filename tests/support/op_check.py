"""``check_op``: the one helper that tests every registered op (tinygrad's ``helper_test_op``).

For one case on one device it checks, with inputs drawn from a fixed seed:
1. the forward in float64 against a NumPy reference;
2. the backward with ``engine.gradcheck`` (float64 central differences; on CUDA along
   ``CUDA_DIRECTIONS`` random directions, since the simulator is slow and step 3 compares
   every element with the CPU);
3. on CUDA, float32 parity of forward and gradients against the CPU kernels;
4. poison mode: forward and backward again with every allocation NaN-filled give the same
   values, so no kernel leaves part of an output unwritten.
"""
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

import engine

CUDA_DIRECTIONS = 3   # random directions per input for the CUDA gradcheck

@dataclass
class Case:
    op: str                              # the registry name this case covers
    shapes: tuple                        # one shape per input
    fn: Callable                         # engine function of the input Tensors
    ref: Callable                        # NumPy float64 reference of the input arrays
    low: float = -2.0
    high: float = 2.0
    grad: tuple = None                   # which inputs require grad (default: all)
    make_inputs: Callable = None         # rng -> list of arrays, overrides shapes/low/high
    atol32: float = 1e-5                 # float32 CPU-vs-CUDA tolerance
    rtol32: float = 1e-4
    gradcheck_kwargs: dict = field(default_factory=dict)

    def __str__(self):
        return f"{self.op}{list(self.shapes)}"

    def inputs(self, seed=0):
        rng = np.random.default_rng(seed)
        if self.make_inputs is not None:
            return self.make_inputs(rng)
        return [rng.uniform(self.low, self.high, size=s) for s in self.shapes]

    def requires(self, arrays):
        if self.grad is not None:
            return self.grad
        return tuple(np.asarray(a).dtype.kind == "f" for a in arrays)


def _tensors(case, arrays, device, dtype):
    requires = case.requires(arrays)
    return [engine.tensor(a, dtype=dtype if np.asarray(a).dtype.kind == "f" else None,
                          device=device, requires_grad=r)
            for a, r in zip(arrays, requires)]


def _forward_backward(case, arrays, device, dtype):
    tensors = _tensors(case, arrays, device, dtype)
    out = case.fn(*tensors)
    weights = np.random.default_rng(1).standard_normal(out.shape)
    (out * engine.tensor(weights, dtype=dtype, device=device)).sum().backward()
    grads = [None if t.grad is None else t.grad.numpy() for t in tensors if t.requires_grad]
    return out.numpy(), grads


def check_op(case, device):
    arrays = case.inputs()
    expected = case.ref(*[np.asarray(a) for a in arrays])
    out64, grads64 = _forward_backward(case, arrays, device, np.float64)
    np.testing.assert_allclose(out64, expected, rtol=1e-7, atol=1e-9,
                               err_msg=f"{case} forward on {device} vs NumPy")
    tensors = _tensors(case, arrays, device, np.float64)
    if any(t.requires_grad for t in tensors):
        kwargs = dict(case.gradcheck_kwargs)
        kwargs.setdefault("fast", device == "cuda")
        for seed in range(CUDA_DIRECTIONS if kwargs["fast"] else 1):
            engine.gradcheck(case.fn, tensors, seed=seed, **kwargs)
    if device == "cuda":
        out_gpu, grads_gpu = _forward_backward(case, arrays, "cuda", np.float32)
        out_cpu, grads_cpu = _forward_backward(case, arrays, "cpu", np.float32)
        np.testing.assert_allclose(out_gpu, out_cpu, rtol=case.rtol32, atol=case.atol32,
                                   err_msg=f"{case} float32 forward CUDA vs CPU")
        for k, (g_gpu, g_cpu) in enumerate(zip(grads_gpu, grads_cpu)):
            np.testing.assert_allclose(g_gpu, g_cpu, rtol=case.rtol32, atol=case.atol32,
                                       err_msg=f"{case} float32 grad {k} CUDA vs CPU")
    with engine.debug.poison():
        out_p, grads_p = _forward_backward(case, arrays, device, np.float64)
    np.testing.assert_allclose(out_p, out64, rtol=1e-12, atol=1e-12,
                               err_msg=f"{case} forward changed in poison mode on {device}")
    for k, (g_p, g) in enumerate(zip(grads_p, grads64)):
        np.testing.assert_allclose(g_p, g, rtol=1e-12, atol=1e-12,
                                   err_msg=f"{case} grad {k} changed in poison mode on {device}")
