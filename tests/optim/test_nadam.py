"""NAdam against ``torch.optim.NAdam`` step by step (float64 and float32, L2 and decoupled
weight decay, a momentum_decay of its own, flat and per-parameter), captured training equal
to eager bit for bit, a resume bit for bit, CPU == CUDA, and its hyper-parameter checks."""
import numpy as np
import pytest
import torch

import optim
from tests.support.optim_check import (check_against_torch, check_captured_equals_eager,
                                       check_cpu_equals_cuda, check_resume_bit_for_bit, make_params,
                                       option_id)

OPTIONS = [dict(lr=2e-3),
           dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, momentum_decay=0.01),
           dict(lr=1e-2, weight_decay=0.05, decoupled_weight_decay=True),
           dict(lr=0.3, betas=(0.0, 0.5), eps=0.0, momentum_decay=0.0)]


@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
@pytest.mark.parametrize("flat", [True, False], ids=["flat", "per_tensor"])
def test_nadam_matches_torch_step_by_step_in_float64(options, flat):
    check_against_torch(optim.NAdam, torch.optim.NAdam, options, flat=flat)


@pytest.mark.parametrize("options", OPTIONS[:3], ids=option_id)
def test_nadam_float32_matches_torch(options):
    check_against_torch(optim.NAdam, torch.optim.NAdam, options, dtype=np.float32)


def test_captured_nadam_training_equals_eager_bit_for_bit():
    check_captured_equals_eager(lambda params: optim.NAdam(params, lr=1e-2, weight_decay=0.1))


def test_nadam_keeps_torchs_state_names_and_resumes_bit_for_bit(device):
    check_resume_bit_for_bit(lambda params: optim.NAdam(params, lr=1e-2, weight_decay=0.1),
                             device, ("exp_avg", "exp_avg_sq", "mu_product"))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nadam_cpu_equals_cuda(dtype):
    check_cpu_equals_cuda(lambda params: optim.NAdam(params, **OPTIONS[1]), dtype)


@pytest.mark.parametrize("argument, value, error, match", [
    ("lr", -1.0, ValueError, "invalid lr: -1.0"),
    ("lr", float("inf"), ValueError, "invalid lr: inf"),
    ("betas", (1.0, 0.999), ValueError, "invalid beta parameter at index 0: 1.0"),
    ("betas", (0.9, -0.1), ValueError, "invalid beta parameter at index 1: -0.1"),
    ("betas", 0.9, ValueError, "betas must be a pair"),
    ("eps", -1e-8, ValueError, "invalid eps: -1e-08"),
    ("weight_decay", float("nan"), ValueError, "invalid weight_decay: nan"),
    ("momentum_decay", -4e-3, ValueError, "invalid momentum_decay: -0.004"),
    ("momentum_decay", float("inf"), ValueError, "invalid momentum_decay: inf"),
    ("decoupled_weight_decay", 1, TypeError, "decoupled_weight_decay must be True or False"),
])
def test_nadam_validates_every_hyper_parameter(argument, value, error, match):
    with pytest.raises(error, match=f"NAdam: {match}"):
        optim.NAdam(make_params("cpu"), **{argument: value})


def test_nadam_defaults_are_torchs():
    assert optim.NAdam(make_params("cpu")).defaults == dict(
        lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, momentum_decay=4e-3,
        decoupled_weight_decay=False)
