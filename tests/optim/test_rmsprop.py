"""RMSprop step by step against ``torch.optim.RMSprop`` in float64 for every option
combination, on both devices, on the flat and the per-parameter paths; its hyper-parameter
checks; and its state_dict resume. Capture: tests/engine/test_capture.py; the CLI:
tests/engine/test_train.py."""
import itertools

import numpy as np
import pytest
import torch

import engine
import optim
from tests.support.optim_check import (N_STEPS, gpu_steps_against_torch, grad_steps, make_params,
                                       option_id, run, torch_run)

OPTIONS = [dict(weight_decay=wd, momentum=momentum, centered=centered, alpha=alpha)
           for wd, momentum, centered, alpha in itertools.product(
               (0, 0.1), (0, 0.9), (False, True), (0.99, 0.5))]


@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
@pytest.mark.parametrize("flat", [True, False], ids=["flat", "per_tensor"])
def test_rmsprop_matches_torch_step_by_step_in_float64(options, flat, device):
    steps = grad_steps()
    for n in range(1, N_STEPS + 1, N_STEPS - 1):   # after the first step and after all
        mine = run(lambda params: optim.RMSprop(params, lr=0.01, **options),
                   make_params(device, flat=flat), steps[:n])
        theirs = torch_run(torch.optim.RMSprop, steps[:n], lr=0.01, **options)
        for k, (a, b) in enumerate(zip(mine, theirs)):
            np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-15,
                                       err_msg=f"parameter {k} after {n} steps")


@pytest.mark.cuda
@pytest.mark.parametrize("options", OPTIONS[5::6], ids=option_id)
def test_rmsprop_float32_cpu_equals_cuda(options):
    steps = grad_steps(dtype=np.float32)
    results = [run(lambda params: optim.RMSprop(params, lr=0.01, **options),
                   make_params(device, dtype=np.float32), steps) for device in ("cpu", "cuda")]
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_rmsprop_keeps_torchs_state_names_and_resumes_bit_for_bit(device):
    steps = grad_steps(6)
    options = dict(lr=0.01, momentum=0.5, centered=True)
    straight = run(lambda params: optim.RMSprop(params, **options), make_params(device), steps)
    params = make_params(device)
    first = optim.RMSprop(params, **options)
    for grads in steps[:3]:
        for p, g in zip(params, grads):
            p.grad = engine.tensor(g, device=device)
        first.step()
    saved = first.state_dict()
    assert set(saved["state"][0]) == {"step", "square_avg", "momentum_buffer", "grad_avg"}
    second = optim.RMSprop(params, lr=0.5)
    second.load_state_dict(saved)
    assert second.param_groups[0]["lr"] == 0.01   # the saved hyper-parameters win, as torch
    resumed = run(lambda _: second, params, steps[3:])
    for a, b in zip(resumed, straight):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("argument, value, error, match", [
    ("lr", -1.0, ValueError, "invalid lr: -1.0"),
    ("lr", float("inf"), ValueError, "invalid lr: inf"),
    ("alpha", 1.5, ValueError, r"invalid alpha: 1.5 \(must be in \[0, 1\]\)"),
    ("alpha", -0.1, ValueError, "invalid alpha"),
    ("eps", -1e-8, ValueError, "invalid eps"),
    ("weight_decay", -0.1, ValueError, "invalid weight_decay"),
    ("momentum", float("nan"), ValueError, "invalid momentum"),
    ("momentum", "0.9", TypeError, "momentum must be a number"),
    ("centered", 1, TypeError, "centered must be True or False"),
])
def test_rmsprop_validates_every_hyper_parameter(argument, value, error, match):
    with pytest.raises(error, match=f"RMSprop: {match}"):
        optim.RMSprop(make_params("cpu"), **{argument: value})


def test_rmsprop_defaults_are_torchs():
    defaults = optim.RMSprop(make_params("cpu")).defaults
    assert defaults == dict(lr=0.01, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0,
                            centered=False)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [OPTIONS[0], OPTIONS[-1]], ids=option_id)
def test_rmsprop_on_a_million_parameters_matches_torch_on_the_gpu(options):
    # float64: centered with alpha 0.5 takes sqrt(E[g²] - E[g]²), whose float32 cancellation
    # left some of a million elements past 1e-5 of torch's (another summation order)
    ours, theirs = gpu_steps_against_torch(optim.RMSprop, torch.optim.RMSprop, lr=1e-3,
                                           **options)
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-12)
