"""The optimizers added after Adam, each against its ``torch.optim`` twin from one table:
step by step in float64 (flat and per-parameter) and float32, captured training equal to eager
bit for bit, a resume bit for bit under torch's state names, CPU == CUDA, every
hyper-parameter's check, and torch's defaults. A new optimizer of this kind is its
``optim/<name>.py`` and a row here."""
import numpy as np
import pytest
import torch

import optim
from tests.support.optim_check import (check_against_torch, check_captured_equals_eager,
                                       check_cpu_equals_cuda, check_resume_bit_for_bit, make_params,
                                       option_id)

_ADAM_LIKE_ERRORS = [   # the checks Adamax and NAdam share with Adam
    ("lr", -1.0, ValueError, "invalid lr: -1.0"),
    ("lr", float("nan"), ValueError, "invalid lr: nan"),
    ("lr", float("inf"), ValueError, "invalid lr: inf"),
    ("betas", (0.9, 1.0), ValueError, "invalid beta parameter at index 1: 1.0"),
    ("betas", (1.0, 0.999), ValueError, "invalid beta parameter at index 0: 1.0"),
    ("betas", (-0.5, 0.9), ValueError, "invalid beta parameter at index 0: -0.5"),
    ("betas", (0.9, -0.1), ValueError, "invalid beta parameter at index 1: -0.1"),
    ("betas", (0.9,), ValueError, "betas must be a pair"),
    ("betas", 0.9, ValueError, "betas must be a pair"),
    ("eps", -1.0, ValueError, "invalid eps: -1.0"),
    ("eps", -1e-8, ValueError, "invalid eps: -1e-08"),
    ("weight_decay", -0.1, ValueError, "invalid weight_decay: -0.1"),
    ("weight_decay", float("nan"), ValueError, "invalid weight_decay: nan"),
    ("weight_decay", "0.1", TypeError, "weight_decay must be a number"),
]

# name: (the torch class, option sets (the first `float32` also in float32), the state
# names, the defaults, the checks of its own hyper-parameters)
OPTIMIZERS = {
    "Adamax": (torch.optim.Adamax,
               [dict(lr=2e-3), dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
                dict(lr=0.3, betas=(0.0, 0.5), eps=0.0)], 2,
               ("exp_avg", "exp_inf"),
               dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0), []),
    "NAdam": (torch.optim.NAdam,
              [dict(lr=2e-3),
               dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, momentum_decay=0.01),
               dict(lr=1e-2, weight_decay=0.05, decoupled_weight_decay=True),
               dict(lr=0.3, betas=(0.0, 0.5), eps=0.0, momentum_decay=0.0)], 3,
              ("exp_avg", "exp_avg_sq", "mu_product"),
              dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, momentum_decay=4e-3,
                   decoupled_weight_decay=False),
              [("momentum_decay", -4e-3, ValueError, "invalid momentum_decay: -0.004"),
               ("momentum_decay", float("inf"), ValueError, "invalid momentum_decay: inf"),
               ("decoupled_weight_decay", 1, TypeError,
                "decoupled_weight_decay must be True or False")]),
}


def _cases(pick):
    return [pytest.param(name, *case, id=f"{name}-{case_id}")
            for name, row in OPTIMIZERS.items() for case_id, case in pick(row)]


def _engine(name):
    return getattr(optim, name)


@pytest.mark.parametrize("name, options", _cases(
    lambda row: [(option_id(options), (options,)) for options in row[1]]))
@pytest.mark.parametrize("flat", [True, False], ids=["flat", "per_tensor"])
def test_matches_torch_step_by_step_in_float64(name, options, flat):
    check_against_torch(_engine(name), OPTIMIZERS[name][0], options, flat=flat)


@pytest.mark.parametrize("name, options", _cases(
    lambda row: [(option_id(options), (options,)) for options in row[1][:row[2]]]))
def test_float32_matches_torch(name, options):
    check_against_torch(_engine(name), OPTIMIZERS[name][0], options, dtype=np.float32)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_captured_training_equals_eager_bit_for_bit(name):
    check_captured_equals_eager(lambda params: _engine(name)(params, lr=1e-2, weight_decay=0.1))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_keeps_torchs_state_names_and_resumes_bit_for_bit(name, device):
    check_resume_bit_for_bit(lambda params: _engine(name)(params, lr=1e-2, weight_decay=0.1),
                             device, OPTIMIZERS[name][3])


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cpu_equals_cuda(name, dtype):
    check_cpu_equals_cuda(lambda params: _engine(name)(params, **OPTIMIZERS[name][1][1]), dtype)


@pytest.mark.parametrize("name, argument, value, error, match", _cases(
    lambda row: [(f"{argument}={value!r}", (argument, value, error, match))
                 for argument, value, error, match in _ADAM_LIKE_ERRORS + row[5]]))
def test_validates_every_hyper_parameter(name, argument, value, error, match):
    with pytest.raises(error, match=f"{name}: {match}"):
        _engine(name)(make_params("cpu"), **{argument: value})


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_defaults_are_torchs(name):
    assert _engine(name)(make_params("cpu")).defaults == OPTIMIZERS[name][4]
