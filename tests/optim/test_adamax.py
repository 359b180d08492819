"""Adamax against ``torch.optim.Adamax`` step by step (float64 and float32, with weight
decay, flat and per-parameter), captured training equal to eager bit for bit, a resume bit
for bit, CPU == CUDA, and its hyper-parameter checks."""
import numpy as np
import pytest
import torch

import optim
from tests.support.optim_check import (check_against_torch, check_captured_equals_eager,
                                       check_cpu_equals_cuda, check_resume_bit_for_bit, make_params,
                                       option_id)

OPTIONS = [dict(lr=2e-3),
           dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
           dict(lr=0.3, betas=(0.0, 0.5), eps=0.0)]


@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
@pytest.mark.parametrize("flat", [True, False], ids=["flat", "per_tensor"])
def test_adamax_matches_torch_step_by_step_in_float64(options, flat):
    check_against_torch(optim.Adamax, torch.optim.Adamax, options, flat=flat)


@pytest.mark.parametrize("options", OPTIONS[:2], ids=option_id)
def test_adamax_float32_matches_torch(options):
    check_against_torch(optim.Adamax, torch.optim.Adamax, options, dtype=np.float32)


def test_captured_adamax_training_equals_eager_bit_for_bit():
    check_captured_equals_eager(lambda params: optim.Adamax(params, lr=1e-2, weight_decay=0.1))


def test_adamax_keeps_torchs_state_names_and_resumes_bit_for_bit(device):
    check_resume_bit_for_bit(lambda params: optim.Adamax(params, lr=1e-2, weight_decay=0.1),
                             device, ("exp_avg", "exp_inf"))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_adamax_cpu_equals_cuda(dtype):
    check_cpu_equals_cuda(lambda params: optim.Adamax(params, **OPTIONS[1]), dtype)


@pytest.mark.parametrize("argument, value, error, match", [
    ("lr", -1.0, ValueError, "invalid lr: -1.0"),
    ("lr", float("nan"), ValueError, "invalid lr: nan"),
    ("betas", (0.9, 1.0), ValueError, "invalid beta parameter at index 1: 1.0"),
    ("betas", (-0.5, 0.9), ValueError, "invalid beta parameter at index 0: -0.5"),
    ("betas", (0.9,), ValueError, "betas must be a pair"),
    ("eps", -1.0, ValueError, "invalid eps: -1.0"),
    ("weight_decay", -0.1, ValueError, "invalid weight_decay: -0.1"),
    ("weight_decay", "0.1", TypeError, "weight_decay must be a number"),
])
def test_adamax_validates_every_hyper_parameter(argument, value, error, match):
    with pytest.raises(error, match=f"Adamax: {match}"):
        optim.Adamax(make_params("cpu"), **{argument: value})


def test_adamax_defaults_are_torchs():
    assert optim.Adamax(make_params("cpu")).defaults == dict(
        lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
