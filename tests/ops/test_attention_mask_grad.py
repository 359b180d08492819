"""scaled_dot_product_attention gives a float ``attn_mask`` that requires grad its gradient,
as torch's SDPA does: dS, summed over the dims the mask broadcast along. ``check_op``
(NumPy float64 forward, float64 gradcheck of every input, the mask's too, CPU == CUDA,
poison) on masks broadcast over the slices, over heads, over queries, and not at all; torch
as a second oracle for the gradient."""
import numpy as np
import pytest

import engine
from tests.support.op_check import Case, check_op
from tests.support.references import np_attention

torch = pytest.importorskip("torch")

Q = (2, 2, 3, 2)
KV = ((2, 2, 4, 2), (2, 2, 4, 3))
MASKS = [(3, 4),            # one mask for every slice
         (2, 1, 1, 4),      # per batch, broadcast over heads and queries
         (2, 2, 3, 4),      # one per slice
         (1, 2, 3, 1)]      # per head and query, broadcast over batch and keys

CASES = [Case("attention", (Q, *KV, mask),
              lambda q, k, v, m: engine.scaled_dot_product_attention(q, k, v, attn_mask=m),
              lambda q, k, v, m: np_attention(q, k, v, mask=m)) for mask in MASKS]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_float_mask_gets_its_gradient(case, device):
    check_op(case, device)


@pytest.mark.parametrize("mask_shape", MASKS, ids=str)
def test_mask_gradient_matches_torch(mask_shape):
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(s) for s in (Q, *KV, mask_shape)]
    upstream = rng.standard_normal(Q[:-1] + (KV[1][-1],))
    ours = [engine.tensor(a, requires_grad=True) for a in arrays]
    (engine.scaled_dot_product_attention(*ours[:3], attn_mask=ours[3])
     * engine.tensor(upstream)).sum().backward()
    theirs = [torch.tensor(a, requires_grad=True) for a in arrays]
    (torch.nn.functional.scaled_dot_product_attention(*theirs[:3], attn_mask=theirs[3])
     * torch.tensor(upstream)).sum().backward()
    for mine, reference in zip(ours, theirs):
        np.testing.assert_allclose(mine.grad.numpy(), reference.grad.numpy(), rtol=1e-10,
                                   atol=1e-12)


def test_a_mask_without_grad_gets_none():
    rng = np.random.default_rng(6)
    q, k, v = (engine.tensor(rng.standard_normal(s), requires_grad=True) for s in (Q, *KV))
    mask = engine.tensor(rng.standard_normal((3, 4)))
    engine.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()
    assert mask.grad is None and q.grad is not None
