"""Adam and AdamW with ``amsgrad=True`` against torch's step by step (float64 and float32,
with weight decay, flat and per-parameter), captured training equal to eager bit for bit,
``max_exp_avg_sq`` saved and resumed bit for bit, CPU == CUDA, and the flag's check."""
import numpy as np
import pytest
import torch

import optim
from tests.support.optim_check import (check_against_torch, check_captured_equals_eager,
                                       check_cpu_equals_cuda, check_resume_bit_for_bit, grad_steps,
                                       make_params, option_id, run)

AMSGRAD_CASES = [(optim.Adam, torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
         (optim.Adam, torch.optim.Adam,
          dict(lr=2e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, amsgrad=True)),
         (optim.AdamW, torch.optim.AdamW, dict(lr=1e-2, amsgrad=True)),
         (optim.AdamW, torch.optim.AdamW,
          dict(lr=2e-2, betas=(0.5, 0.9), weight_decay=0.3, amsgrad=True))]
IDS = [f"{ours.__name__}-{option_id(options)}" for ours, _, options in AMSGRAD_CASES]


@pytest.mark.parametrize("case", AMSGRAD_CASES, ids=IDS)
@pytest.mark.parametrize("flat", [True, False], ids=["flat", "per_tensor"])
def test_amsgrad_matches_torch_step_by_step_in_float64(case, flat):
    ours, theirs, options = case
    # 8 steps: with beta2 0.9 some v fall below their maximum, which then decides the step
    check_against_torch(ours, theirs, options, flat=flat, steps=8)


@pytest.mark.parametrize("case", AMSGRAD_CASES[1::2], ids=IDS[1::2])
def test_amsgrad_float32_matches_torch(case):
    ours, theirs, options = case
    check_against_torch(ours, theirs, options, dtype=np.float32)


def test_amsgrad_changes_the_steps():
    """The maximum is used: without it the same run ends elsewhere."""
    steps = grad_steps(8)
    with_max, without = (run(lambda ps, amsgrad=amsgrad: optim.Adam(
        ps, lr=2e-2, betas=(0.8, 0.5), amsgrad=amsgrad), make_params("cpu"), steps)
        for amsgrad in (True, False))
    assert not all(np.array_equal(a, b) for a, b in zip(with_max, without))


@pytest.mark.parametrize("kind", [optim.Adam, optim.AdamW], ids=["adam", "adamw"])
def test_captured_amsgrad_training_equals_eager_bit_for_bit(kind):
    check_captured_equals_eager(lambda params: kind(params, lr=1e-2, amsgrad=True))


@pytest.mark.parametrize("kind", [optim.Adam, optim.AdamW], ids=["adam", "adamw"])
def test_amsgrad_state_is_torchs_and_resumes_bit_for_bit(kind, device):
    check_resume_bit_for_bit(lambda params: kind(params, lr=2e-2, betas=(0.8, 0.5),
                                                 amsgrad=True),
                             device, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"))


def test_amsgrad_state_loads_into_torch_and_goes_on_alike():
    """Our state_dict, as torch tensors, loaded by torch.optim.Adam: both go on alike."""
    params = make_params("cpu")
    ours = optim.Adam(params, lr=1e-2, amsgrad=True)
    steps = grad_steps(6)
    run(lambda _: ours, params, steps[:3])
    saved = ours.state_dict()
    twins = [torch.tensor(p.numpy().copy(), requires_grad=True) for p in params]
    theirs = torch.optim.Adam(twins, lr=1e-2, amsgrad=True)
    theirs.load_state_dict({
        "state": {k: {name: torch.tensor(float(v) if name == "step" else v)
                      for name, v in entry.items()} for k, entry in saved["state"].items()},
        "param_groups": [{**group, "foreach": None, "maximize": False, "capturable": False,
                          "differentiable": False, "fused": None}
                         for group in saved["param_groups"]]})
    for grads in steps[3:]:
        for t, g in zip(twins, grads):
            t.grad = torch.tensor(g)
        theirs.step()
    for a, t in zip(run(lambda _: ours, params, steps[3:]), twins):
        np.testing.assert_allclose(a, t.detach().numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_amsgrad_cpu_equals_cuda(dtype):
    check_cpu_equals_cuda(lambda params: optim.AdamW(params, lr=2e-2, betas=(0.8, 0.5),
                                                     amsgrad=True), dtype)


@pytest.mark.parametrize("kind", [optim.Adam, optim.AdamW], ids=["Adam", "AdamW"])
def test_amsgrad_must_be_a_bool(kind):
    with pytest.raises(TypeError, match=f"{kind.__name__}: amsgrad must be True or False, "
                                        "got 'yes'"):
        kind(make_params("cpu"), amsgrad="yes")
