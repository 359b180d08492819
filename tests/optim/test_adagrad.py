"""Adagrad step by step against ``torch.optim.Adagrad`` in float64 for every option
combination, on both devices, on the flat and the per-parameter paths; its hyper-parameter
checks; its state_dict resume; a captured step; and the command's --optimizer adagrad."""
import itertools

import numpy as np
import pytest
import torch

import engine
import optim
from tests.support.optim_check import (N_STEPS, gpu_steps_against_torch, grad_steps, make_params,
                                       option_id, run, torch_run)

OPTIONS = [dict(lr_decay=lr_decay, weight_decay=wd, initial_accumulator_value=start, eps=eps)
           for lr_decay, wd, start, eps in itertools.product(
               (0, 0.3), (0, 0.1), (0, 0.5), (1e-10, 0.1))]


@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
@pytest.mark.parametrize("flat", [True, False], ids=["flat", "per_tensor"])
def test_adagrad_matches_torch_step_by_step_in_float64(options, flat):
    steps = grad_steps()
    for n in range(1, N_STEPS + 1, N_STEPS - 1):   # after the first step and after all
        mine = run(lambda params: optim.Adagrad(params, lr=0.1, **options),
                   make_params("cpu", flat=flat), steps[:n])
        theirs = torch_run(torch.optim.Adagrad, steps[:n], lr=0.1, **options)
        for k, (a, b) in enumerate(zip(mine, theirs)):
            np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-15,
                                       err_msg=f"parameter {k} after {n} steps")


@pytest.mark.cuda
def test_adagrad_on_cuda_matches_torch_and_the_cpu():
    """Every branch on the device: lr decay, weight decay, a non-zero start, and the sum's
    first and later updates."""
    options = OPTIONS[-1]
    steps = grad_steps(3)
    results = [run(lambda params: optim.Adagrad(params, lr=0.1, **options),
                   make_params(device), steps) for device in ("cpu", "cuda")]
    for a, b, theirs in zip(*results, torch_run(torch.optim.Adagrad, steps, lr=0.1, **options)):
        np.testing.assert_allclose(b, theirs, rtol=1e-13, atol=1e-15)
        np.testing.assert_allclose(a, b, rtol=1e-14, atol=1e-15)


def test_adagrad_keeps_torchs_state_names_and_resumes_bit_for_bit():
    steps = grad_steps(6)
    options = dict(lr=0.1, lr_decay=0.2, initial_accumulator_value=0.3)
    straight = run(lambda params: optim.Adagrad(params, **options), make_params("cpu"), steps)
    params = make_params("cpu")
    first = optim.Adagrad(params, **options)
    for grads in steps[:3]:
        for p, g in zip(params, grads):
            p.grad = engine.tensor(g)
        first.step()
    saved = first.state_dict()
    assert set(saved["state"][0]) == {"step", "sum"} and saved["state"][0]["step"] == 3
    second = optim.Adagrad(params, lr=0.5)
    second.load_state_dict(saved)
    assert second.param_groups[0]["initial_accumulator_value"] == 0.3   # the saved win
    resumed = run(lambda _: second, params, steps[3:])   # the sum goes on, not from 0.3
    for a, b in zip(resumed, straight):
        np.testing.assert_array_equal(a, b)


def test_a_captured_adagrad_step_replays_with_its_own_step_count():
    """lr decays with t, which the kernel reads from the device step counts: a replayed
    step is the eager one, bit for bit."""
    runs = []
    for captured in (False, True):
        params = make_params("cpu")
        opt = optim.Adagrad(params, lr=0.1, lr_decay=0.5)
        grads = [engine.tensor(g) for g in grad_steps(1)[0]]

        def step():
            for p, g in zip(params, grads):
                p.grad = g * 1.0
            opt.step()
        step = engine.capture(step) if captured else step
        for _ in range(5):
            step()
        if captured:
            assert step.eager_reason is None and step.replayed >= 3
        runs.append([p.numpy().copy() for p in params])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("argument, value, error, match", [
    ("lr", -1.0, ValueError, "invalid lr: -1.0"),
    ("lr", float("inf"), ValueError, "invalid lr: inf"),
    ("lr_decay", -0.1, ValueError, "invalid lr_decay: -0.1"),
    ("weight_decay", float("nan"), ValueError, "invalid weight_decay"),
    ("initial_accumulator_value", -1, ValueError, "invalid initial_accumulator_value: -1"),
    ("eps", -1e-10, ValueError, "invalid eps"),
    ("eps", "1e-10", TypeError, "eps must be a number"),
    ("lr_decay", True, TypeError, "lr_decay must be a number"),
])
def test_adagrad_validates_every_hyper_parameter(argument, value, error, match):
    with pytest.raises(error, match=f"Adagrad: {match}"):
        optim.Adagrad(make_params("cpu"), **{argument: value})


def test_adagrad_defaults_are_torchs():
    assert optim.Adagrad(make_params("cpu")).defaults == dict(
        lr=0.01, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10)


def test_the_command_trains_with_adagrad(tmp_path, monkeypatch, capsys):
    from engine.train import main
    monkeypatch.chdir(tmp_path)
    main(["--limit", "200", "--epochs", "2", "--hidden", "16", "--batch-size", "50",
          "--device", "cpu", "--no-progress", "--no-save", "--optimizer", "adagrad",
          "--lr", "0.05"])
    out = capsys.readouterr().out
    assert "adagrad lr 0.05 cosine" in out
    losses = [float(line.split("train loss ")[1].split()[0]) for line in out.splitlines()
              if line.startswith("epoch ")]
    assert len(losses) == 2 and losses[1] < losses[0]


@pytest.mark.gpu
def test_adagrad_on_a_million_parameters_matches_torch_on_the_gpu():
    ours, theirs = gpu_steps_against_torch(optim.Adagrad, torch.optim.Adagrad, lr=1e-2,
                                           lr_decay=0.1, weight_decay=0.01,
                                           initial_accumulator_value=0.1)
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-12)
