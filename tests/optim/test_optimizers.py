"""Optimizers, clipping and schedules: closed-form update rules step by step (float64, both
backends), torch.optim where installed, CPU-vs-CUDA parity, flat path == per-tensor path,
launch counts, resume bit-exactness, the non-finite guard and bad hyper-parameters."""
import math

import numpy as np
import pytest

import engine
import optim
from engine.parameter import FlatBuffer, Parameter
from ops.device import to_device
from ops.launch import LaunchRecorder
from tests.support.optim_check import N_STEPS, SHAPES, grad_steps, make_params, run, set_grads
from tests.support.paths import REPO_ROOT


# ------------------------------------------------------------------ references

def sgd_reference(p, grads, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
    buf = None
    for g in grads:
        g = g + weight_decay * p
        if momentum:
            buf = g.copy() if buf is None else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        p = p - lr * g
    return p


def adam_reference(p, grads, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False):
    """The textbook form: bias-corrected moments m_hat, v_hat."""
    beta1, beta2 = betas
    m = v = 0.0
    for t, g in enumerate(grads, start=1):
        if decoupled:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat, v_hat = m / (1 - beta1 ** t), v / (1 - beta2 ** t)
        p = p - lr * m_hat / (np.sqrt(v_hat) + eps)
    return p


SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01),
    dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1),
]
ADAM_CASES = [
    dict(lr=0.01),
    dict(lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    dict(lr=0.3, betas=(0.0, 0.5), eps=0.0),
]


def reference_for(kind, p0, grads, kwargs):
    if kind == "sgd":
        return sgd_reference(p0, grads, **kwargs)
    return adam_reference(p0, grads, decoupled=kind == "adamw", **kwargs)


OPTIMIZERS = {"sgd": optim.SGD, "adam": optim.Adam, "adamw": optim.AdamW}
RULE_CASES = ([("sgd", c) for c in SGD_CASES] + [("adam", c) for c in ADAM_CASES]
              + [("adamw", dict(c, weight_decay=c.get("weight_decay", 0.0) + 0.05))
                 for c in ADAM_CASES])


def case_id(case):
    kind, kwargs = case
    return kind + "-" + "-".join(f"{k}={v}" for k, v in kwargs.items())


# ------------------------------------------------------------------ update rules

@pytest.mark.parametrize("case", RULE_CASES, ids=case_id)
@pytest.mark.parametrize("flat", [True, False], ids=["flat", "per_tensor"])
def test_rule_matches_closed_form_float64(case, flat, device):
    kind, kwargs = case
    params = make_params(device, flat=flat)
    initial = [p.numpy().copy() for p in params]
    steps = grad_steps()
    result = run(lambda ps: OPTIMIZERS[kind](ps, **kwargs), params, steps)
    for i, (p0, got) in enumerate(zip(initial, result)):
        expected = reference_for(kind, p0, [s[i] for s in steps], kwargs)
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("case", RULE_CASES[1::3], ids=case_id)
def test_rule_float32_close_to_float64_formula(case, device):
    kind, kwargs = case
    params = make_params(device, dtype=np.float32)
    initial = [p.numpy().astype(np.float64) for p in params]
    steps = grad_steps(dtype=np.float32)
    result = run(lambda ps: OPTIMIZERS[kind](ps, **kwargs), params, steps)
    for i, (p0, got) in enumerate(zip(initial, result)):
        assert got.dtype == np.float32
        expected = reference_for(kind, p0, [s[i].astype(np.float64) for s in steps], kwargs)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", RULE_CASES, ids=case_id)
def test_flat_path_equals_per_tensor_path_bitwise(case, device):
    kind, kwargs = case
    steps = grad_steps(dtype=np.float32)
    flat = run(lambda ps: OPTIMIZERS[kind](ps, **kwargs), make_params(device, np.float32), steps)
    loose = run(lambda ps: OPTIMIZERS[kind](ps, **kwargs),
                make_params(device, np.float32, flat=False), steps)
    for a, b in zip(flat, loose):
        np.testing.assert_array_equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", RULE_CASES[1::2], ids=case_id)
def test_cpu_cuda_parity(case, dtype):
    kind, kwargs = case
    steps = grad_steps(dtype=dtype)
    on_cpu = run(lambda ps: OPTIMIZERS[kind](ps, **kwargs), make_params("cpu", dtype), steps)
    on_cuda = run(lambda ps: OPTIMIZERS[kind](ps, **kwargs), make_params("cuda", dtype), steps)
    rtol = 1e-6 if dtype == np.float32 else 1e-13
    for a, b in zip(on_cpu, on_cuda):
        np.testing.assert_allclose(b, a, rtol=rtol, atol=rtol)


@pytest.mark.cuda
@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
def test_update_kernel_strides_over_the_elements_past_its_grid(decoupled):
    """A large update's grid stops at SCALAR_BLOCKS_PER_SM blocks a multiprocessor and each
    thread strides on: 2 blocks of 4 threads over 37 elements update each as the CPU does."""
    from ops.cuda import cuda
    from ops.step_counter import T

    rng = np.random.default_rng(3)
    state = [rng.standard_normal(37) for _ in range(3)] + [rng.random(37)]
    counts = np.zeros(3, np.int64)
    counts[T] = 4
    # optim.Adam.hyper: lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad
    hyper = np.array([1e-2, 0.9, 0.999, 1e-8, 0.1, float(decoupled), 0.0])
    tiny = float(np.finfo(np.float64).tiny)
    update = optim.Adam.kernels.kernel(("exp_avg", "exp_avg_sq"))
    on_cpu = [a.copy() for a in state]
    update.cpu(*on_cpu, counts, hyper, tiny)
    on_cuda = [to_device(a, "cuda") for a in state]
    update.cuda[2, 4](*on_cuda, to_device(counts, "cuda"), to_device(hyper, "cuda"), tiny)
    cuda.synchronize()
    for expected, got in zip(on_cpu, on_cuda):
        np.testing.assert_allclose(got.copy_to_host(), expected, rtol=1e-13, atol=1e-15)
    assert not np.array_equal(on_cpu[0], state[0])   # the update changed the parameters


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_adam_zero_over_zero_is_nan_as_in_torch(device):
    """eps=0 and a zero gradient: m / sqrt(v) is 0/0; IEEE NaN, no ZeroDivisionError (the
    simulator runs kernels as Python floats, which raise: real GPU only)."""
    params = make_params(device)
    set_grads(params, [np.zeros(s) for s in SHAPES])
    optim.Adam(params, lr=0.1, eps=0.0).step()
    assert all(np.isnan(p.numpy()).all() for p in params)


def test_param_without_grad_is_skipped_and_keeps_its_own_step_count(device):
    """A stale slot sends a flat group to the per-parameter path; the skipped parameter's
    moments and bias correction start later, as in torch."""
    params = make_params(device)
    initial = [p.numpy().copy() for p in params]
    steps = grad_steps()
    opt = optim.Adam(params, lr=0.01)
    for k, grads in enumerate(steps):
        set_grads(params, grads)
        if k < 2:
            params[1].grad = None   # params[1] gets gradients from step 3 on
        opt.step()
        opt.zero_grad()
    assert [opt.state[p]["step"] for p in params] == [N_STEPS, N_STEPS - 2, N_STEPS]
    for i, p in enumerate(params):
        own = [s[i] for s in steps][2 if i == 1 else 0:]
        np.testing.assert_allclose(p.numpy(), adam_reference(initial[i], own, lr=0.01), rtol=1e-12)


def test_param_groups_have_their_own_hyper_parameters(device):
    a, b, c = make_params(device, flat=False)
    opt = optim.SGD([{"params": [a, b]}, {"params": [c], "lr": 0.5, "momentum": 0.9}], lr=0.1)
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["momentum"] == 0.0
    assert opt.param_groups[1]["lr"] == 0.5
    initial = [p.numpy().copy() for p in (a, b, c)]
    steps = grad_steps(2)
    for grads in steps:
        set_grads([a, b, c], grads)
        opt.step()
    np.testing.assert_allclose(a.numpy(), sgd_reference(initial[0], [s[0] for s in steps], 0.1))
    np.testing.assert_allclose(c.numpy(),
                               sgd_reference(initial[2], [s[2] for s in steps], 0.5, 0.9))


def test_add_param_group_and_duplicates():
    a, b, c = make_params("cpu", flat=False)
    opt = optim.Adam([a], lr=0.1)
    opt.add_param_group({"params": [b, c], "betas": (0.5, 0.6)})
    assert opt.param_groups[1]["lr"] == 0.1 and opt.param_groups[1]["betas"] == (0.5, 0.6)
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [a]})
    with pytest.raises(ValueError, match="appears twice"):
        optim.SGD([b, b], lr=0.1)


def test_lr_is_a_kernel_argument_not_a_recompile():
    sgd_cpu = optim.SGD.kernels.kernel(("momentum_buffer",)).cpu.__wrapped__
    params = make_params("cpu")
    opt = optim.SGD(params, lr=0.1, momentum=0.9)
    set_grads(params, grad_steps(1)[0])
    opt.step()
    compiled = len(sgd_cpu.signatures)
    before = params[0].numpy().copy()
    opt.param_groups[0]["lr"] = 0.0
    opt.step()
    assert len(sgd_cpu.signatures) == compiled
    np.testing.assert_array_equal(params[0].numpy(), before)   # lr 0 really reached the kernel


# -------------------------------------------------------------- gradients: zero_grad, accumulation

def _loss(params, x):
    return sum(((p * x[i]) ** 2).sum() for i, p in enumerate(params))


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "per_tensor"])
def test_zero_grad_launches_nothing_and_accumulation_works(flat, device, launches):
    params = make_params(device, flat=flat)
    x = [engine.tensor(np.full(s, 1.5), device=device) for s in SHAPES]
    expected = [2 * 1.5 ** 2 * p.numpy() for p in params]   # d/dp (1.5 p)^2
    _loss(params, x).backward()
    _loss(params, x).backward()   # no zero_grad: gradients add up, as in torch
    for p, g in zip(params, expected):
        np.testing.assert_allclose(p.grad.numpy(), 2 * g)
    opt = optim.SGD(params, lr=0.1)
    launches.clear()
    opt.zero_grad()
    assert launches.cuda_kernel_names() == []
    assert all(p.grad is None for p in params)
    if flat:
        assert not params[0].flat.grads_valid()
    _loss(params, x).backward()   # overwrites the stale slots
    for p, g in zip(params, expected):
        np.testing.assert_allclose(p.grad.numpy(), g)


# ------------------------------------------------------------------ launch counts

@pytest.fixture
def launches():
    """The kernel runs recorded while the test runs, poison mode off (it adds a fill launch
    per allocation)."""
    with engine.debug.poison(False), LaunchRecorder() as recorder:
        yield recorder


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_flat_group_step_is_one_update_launch_on_cuda(kind, launches):
    params = make_params("cuda", np.float32)
    opt = OPTIMIZERS[kind](params, lr=0.01, **({"momentum": 0.9} if kind == "sgd" else {}))
    update = f"{kind.replace('adamw', 'adam')}_cuda"
    # the step counts live on the device, advanced by one single-thread kernel before each
    # update; their set-up at the first step (and the state's zeroing) is no step work, so
    # no recorder sees it
    expected = [["advance_steps_cuda", update]] * 2
    for grads, names in zip(grad_steps(2, np.float32), expected):
        set_grads(params, grads)
        launches.clear()
        opt.step()
        assert launches.cuda_kernel_names() == names


@pytest.mark.cuda
def test_per_tensor_step_is_one_launch_per_parameter(launches):
    params = make_params("cuda", np.float32, flat=False)
    opt = optim.Adam(params, lr=0.01)
    set_grads(params, grad_steps(1, np.float32)[0])
    launches.clear()
    opt.step()
    assert launches.cuda_kernel_names() == ["advance_steps_cuda", "adam_cuda"] * len(params)


@pytest.mark.cuda
def test_clip_grad_norm_of_a_flat_buffer_is_two_launches(launches):
    params = make_params("cuda", np.float32)
    set_grads(params, grad_steps(1, np.float32)[0])
    launches.clear()
    optim.clip_grad_norm_(params, max_norm=1.0)
    assert launches.cuda_kernel_names() == ["norm_partials_cuda", "scale_by_norm_cuda"]


# ------------------------------------------------------------------ clipping

def test_clip_grad_norm_hand_computed(device):
    a = engine.tensor([3.0, -4.0], dtype=np.float64, device=device, requires_grad=True)
    b = engine.tensor([[12.0]], dtype=np.float64, device=device, requires_grad=True)
    a.grad = engine.tensor([3.0, -4.0], dtype=np.float64)
    b.grad = engine.tensor([[12.0]], dtype=np.float64)
    total = optim.clip_grad_norm_([a, b], max_norm=6.5)   # sqrt(9 + 16 + 144) = 13
    assert isinstance(total, engine.Tensor) and total.shape == () and total.device == device
    assert total.item() == 13.0
    scale = 6.5 / (13.0 + 1e-6)
    np.testing.assert_allclose(a.grad.numpy(), [3 * scale, -4 * scale], rtol=1e-15)
    np.testing.assert_allclose(b.grad.numpy(), [[12 * scale]], rtol=1e-15)


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "per_tensor"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
def test_clip_grad_norm_orders(norm_type, flat, device):
    params = make_params(device, flat=flat)
    grads = grad_steps(1)[0]
    set_grads(params, grads)
    everything = np.concatenate([g.ravel() for g in grads])
    expected = np.linalg.norm(everything, ord=norm_type)
    total = optim.clip_grad_norm_(params, max_norm=0.5, norm_type=norm_type)
    np.testing.assert_allclose(total.item(), expected, rtol=1e-13)
    for p, g in zip(params, grads):
        np.testing.assert_allclose(p.grad.numpy(), g * (0.5 / (expected + 1e-6)), rtol=1e-13)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_grad_norm_of_a_buffer_longer_than_the_grid(norm_type, device):
    """More elements than threads in the partials grid: each thread folds a stride."""
    param = engine.tensor(np.zeros((5, 41)), device=device, requires_grad=True)
    g = np.random.default_rng(3).standard_normal((5, 41))
    param.grad = engine.tensor(g)
    total = optim.clip_grad_norm_([param], max_norm=1.0, norm_type=norm_type)
    expected = np.linalg.norm(g.ravel(), ord=norm_type)
    np.testing.assert_allclose(total.item(), expected, rtol=1e-13)
    np.testing.assert_allclose(param.grad.numpy(), g / (expected + 1e-6), rtol=1e-13)


def test_clip_grad_norm_below_max_leaves_gradients_bitwise(device):
    params = make_params(device, np.float32)
    grads = grad_steps(1, np.float32)[0]
    set_grads(params, grads)
    total = optim.clip_grad_norm_(params, max_norm=1e3)
    assert total.dtype == np.float32
    for p, g in zip(params, grads):
        np.testing.assert_array_equal(p.grad.numpy(), g)


def test_clip_grad_norm_nonfinite(device):
    params = make_params(device, flat=False)
    grads = grad_steps(1)[0]
    grads[1][3] = np.nan
    set_grads(params, grads)
    with pytest.raises(RuntimeError, match="non-finite"):
        optim.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    np.testing.assert_array_equal(params[0].grad.numpy(), grads[0])   # nothing scaled
    assert math.isnan(optim.clip_grad_norm_(params, 1.0).item())
    assert np.isnan(params[0].grad.numpy()).all()   # as torch: NaN coefficient


def test_clip_grad_norm_ignores_missing_grads_and_empty():
    a, b, c = make_params("cpu", flat=False)
    a.grad = engine.tensor(np.full(SHAPES[0], 2.0))
    assert optim.clip_grad_norm_([a, b, c], 100.0).item() == pytest.approx(2.0 * math.sqrt(15))
    assert optim.clip_grad_norm_([b, c], 1.0).item() == 0.0


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "per_tensor"])
def test_clip_grad_value(flat, device):
    params = make_params(device, flat=flat)
    grads = grad_steps(1)[0]
    grads[0][0, 0] = np.nan
    set_grads(params, grads)
    optim.clip_grad_value_(params, clip_value=0.5)
    for p, g in zip(params, grads):
        np.testing.assert_array_equal(p.grad.numpy(), np.clip(g, -0.5, 0.5))   # NaN stays NaN


@pytest.mark.parametrize("call, match", [
    (lambda ps: optim.clip_grad_norm_(ps, -1.0), "max_norm"),
    (lambda ps: optim.clip_grad_norm_(ps, 1.0, norm_type=0), "norm_type"),
    (lambda ps: optim.clip_grad_value_(ps, -0.1), "clip_value"),
    (lambda ps: optim.clip_grad_norm_([np.ones(3)], 1.0), "not an engine Tensor"),
])
def test_clip_bad_arguments(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(make_params("cpu"))


# ------------------------------------------------------------------ non-finite guard

def test_skip_nonfinite_skips_and_counts(device):
    params = make_params(device)
    opt = optim.Adam(params, lr=0.01, skip_nonfinite=True)
    steps = grad_steps(3)
    set_grads(params, steps[0])
    opt.step()
    before = [p.numpy().copy() for p in params]
    bad = [g.copy() for g in steps[1]]
    bad[2][0, 0, 1] = np.inf
    bad[0][1, 1] = np.nan
    set_grads(params, bad)
    with pytest.warns(RuntimeWarning, match="2 gradient value"):
        opt.step()
    assert opt.skipped_steps == 1
    for p, b in zip(params, before):
        np.testing.assert_array_equal(p.numpy(), b)
    assert opt.state[params[0]]["step"] == 1
    set_grads(params, steps[2])
    opt.step()
    assert opt.skipped_steps == 1 and opt.state[params[0]]["step"] == 2
    assert all(np.isfinite(p.numpy()).all() for p in params)


def test_without_the_guard_nonfinite_gradients_reach_the_parameters():
    params = make_params("cpu")
    grads = grad_steps(1)[0]
    grads[0][0, 0] = np.nan
    set_grads(params, grads)
    optim.SGD(params, lr=0.1).step()
    assert np.isnan(params[0].numpy()[0, 0]) and np.isfinite(params[1].numpy()).all()


# ------------------------------------------------------------------ state_dict: resume

@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("flat", [True, False], ids=["flat", "per_tensor"])
def test_resume_matches_uninterrupted_run_bitwise(kind, flat):
    kwargs = {"lr": 0.05, "weight_decay": 0.01}
    if kind == "sgd":
        kwargs.update(momentum=0.9, nesterov=True)
    steps = grad_steps(6, np.float32)

    def train(params, opt, sched, part):
        for grads in part:
            set_grads(params, grads)
            opt.step()
            sched.step()

    params = make_params("cpu", np.float32, flat=flat)
    opt = OPTIMIZERS[kind](params, **kwargs)
    sched = optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    train(params, opt, sched, steps)
    uninterrupted = [p.numpy().copy() for p in params]

    params = make_params("cpu", np.float32, flat=flat)
    opt = OPTIMIZERS[kind](params, **kwargs)
    sched = optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    train(params, opt, sched, steps[:3])
    saved = ([p.numpy().copy() for p in params], opt.state_dict(), sched.state_dict())
    train(params, opt, sched, steps[3:4])   # the saved copies must not change with it

    resumed = make_params("cpu", np.float32, flat=flat, seed=9)
    for p, value in zip(resumed, saved[0]):
        p.data[...] = value
    opt = OPTIMIZERS[kind](resumed, lr=123.0)
    opt.load_state_dict(saved[1])
    sched = optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    sched.load_state_dict(saved[2])
    train(resumed, opt, sched, steps[3:])
    for a, b in zip(uninterrupted, [p.numpy() for p in resumed]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.cuda
def test_state_dict_moves_between_devices():
    steps = grad_steps(4)
    on_cpu = make_params("cpu")
    opt = optim.Adam(on_cpu, lr=0.01)
    for grads in steps[:2]:
        set_grads(on_cpu, grads)
        opt.step()
    on_cuda = [Parameter(to_device(p.numpy(), "cuda")) for p in on_cpu]
    FlatBuffer(on_cuda)
    cuda_opt = optim.Adam(on_cuda, lr=0.01)
    cuda_opt.load_state_dict(opt.state_dict())
    for grads in steps[2:]:
        for params, o in ((on_cpu, opt), (on_cuda, cuda_opt)):
            set_grads(params, grads)
            o.step()
    for a, b in zip(on_cpu, on_cuda):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-13)


def _adam_state_after_a_step():
    """Parameters and the state_dict of an Adam (lr 0.01) after one step on them."""
    params = make_params("cpu")
    opt = optim.Adam(params, lr=0.01)
    set_grads(params, grad_steps(1)[0])
    opt.step()
    return params, opt.state_dict()


def test_load_state_dict_rejects_a_mismatch():
    params, state = _adam_state_after_a_step()
    with pytest.raises(ValueError, match="group 0 has 3 saved parameter"):
        optim.Adam(params[:2], lr=0.01).load_state_dict(state)
    with pytest.raises(ValueError, match="expected"):
        optim.SGD(params, lr=0.1, momentum=0.9).load_state_dict(state)


# ------------------------------------------------------------------ schedules

def _rates(scheduler, opt, steps):
    """The learning rate after each of ``steps`` steps of ``scheduler``."""
    rates = []
    for _ in range(steps):
        scheduler.step()
        rates.append(opt.param_groups[0]["lr"])
    return rates


def test_step_lr_and_cosine_and_lambda_values():
    opt = optim.SGD(make_params("cpu"), lr=0.8)
    step = optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    rates = [opt.param_groups[0]["lr"]]
    for _ in range(5):
        step.step()
        rates.append(step.get_last_lr()[0])
    assert rates == [0.8, 0.8, 0.4, 0.4, 0.2, 0.2]

    opt = optim.Adam(make_params("cpu"), lr=1.0)
    cosine = optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4, eta_min=0.2)
    rates = [opt.param_groups[0]["lr"]] + _rates(cosine, opt, 4)
    np.testing.assert_allclose(rates, [1.0, 0.2 + 0.8 * (1 + math.cos(math.pi / 4)) / 2, 0.6,
                                       0.2 + 0.8 * (1 + math.cos(3 * math.pi / 4)) / 2, 0.2])

    opt = optim.SGD(make_params("cpu"), lr=0.1)
    warmup = optim.lr_scheduler.LambdaLR(opt, lambda epoch: min(1.0, (epoch + 1) / 3))
    rates = [opt.param_groups[0]["lr"]] + _rates(warmup, opt, 3)
    np.testing.assert_allclose(rates, [0.1 / 3, 0.2 / 3, 0.1, 0.1])


@pytest.mark.parametrize("make, match", [
    (lambda opt: optim.lr_scheduler.StepLR(opt, step_size=0), "step_size"),
    (lambda opt: optim.lr_scheduler.StepLR(opt, step_size=2, gamma=-1), "gamma"),
    (lambda opt: optim.lr_scheduler.CosineAnnealingLR(opt, T_max=0), "T_max"),
    (lambda opt: optim.lr_scheduler.CosineAnnealingLR(opt, T_max=3, eta_min=-1), "eta_min"),
    (lambda opt: optim.lr_scheduler.LambdaLR(opt, [lambda e: 1, lambda e: 2]), "lr_lambda"),
    (lambda opt: optim.lr_scheduler.LambdaLR(opt, 0.5), "callable"),
    (lambda opt: optim.lr_scheduler.StepLR(object(), step_size=1), "not an optim.Optimizer"),
])
def test_scheduler_bad_arguments(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make(optim.SGD(make_params("cpu"), lr=0.1))


# ------------------------------------------------------------------ bad hyper-parameters

@pytest.mark.parametrize("make, match", [
    (lambda ps: optim.SGD(ps, lr=-0.1), "SGD: invalid lr"),
    (lambda ps: optim.SGD(ps, lr=math.nan), "SGD: invalid lr"),
    (lambda ps: optim.SGD(ps, lr=math.inf), "SGD: invalid lr"),
    (lambda ps: optim.SGD(ps, lr=0.1, momentum=-0.9), "SGD: invalid momentum"),
    (lambda ps: optim.SGD(ps, lr=0.1, dampening=-1), "SGD: invalid dampening"),
    (lambda ps: optim.SGD(ps, lr=0.1, weight_decay=-1e-4), "SGD: invalid weight_decay"),
    (lambda ps: optim.SGD(ps, lr=0.1, nesterov=True), "nesterov=True requires momentum > 0"),
    (lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "dampening = 0"),
    (lambda ps: optim.SGD(ps, lr="0.1"), "SGD: lr must be a number"),
    (lambda ps: optim.Adam(ps, lr=-1e-3), "Adam: invalid lr"),
    (lambda ps: optim.Adam(ps, betas=(1.0, 0.999)), "Adam: invalid beta parameter at index 0"),
    (lambda ps: optim.Adam(ps, betas=(0.9, -0.1)), "Adam: invalid beta parameter at index 1"),
    (lambda ps: optim.Adam(ps, betas=0.9), "Adam: betas must be a pair"),
    (lambda ps: optim.Adam(ps, eps=-1e-8), "Adam: invalid eps"),
    (lambda ps: optim.Adam(ps, weight_decay=-0.1), "Adam: invalid weight_decay"),
    (lambda ps: optim.AdamW(ps, betas=(0.9, 1.5)), "AdamW: invalid beta parameter at index 1"),
    (lambda ps: optim.AdamW(ps, weight_decay=math.nan), "AdamW: invalid weight_decay"),
    (lambda ps: optim.SGD([], lr=0.1), "empty parameter list"),
    (lambda ps: optim.SGD(ps[0], lr=0.1), "single Tensor"),
    (lambda ps: optim.SGD([np.ones(3)], lr=0.1), "not an engine Tensor"),
    (lambda ps: optim.SGD([engine.tensor([1.0])], lr=0.1), "requires_grad=True"),
    (lambda ps: optim.SGD([ps[0] * 2.0], lr=0.1), "leaf"),
])
def test_bad_hyper_parameters(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make(make_params("cpu"))


# ------------------------------------------------------------------ against torch.optim

TORCH_CASES = (
    [("sgd", c) for c in SGD_CASES]
    + [("adam", c) for c in ADAM_CASES[:2]]
    + [("adamw", dict(lr=0.01)), ("adamw", dict(lr=0.02, betas=(0.8, 0.99), weight_decay=0.3))]
)


def _torch_optimizer(torch, kind, params, kwargs):
    return {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind](
        params, **kwargs)


@pytest.mark.torch
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", TORCH_CASES, ids=case_id)
def test_against_torch_optim(case, dtype):
    torch = pytest.importorskip("torch")
    kind, kwargs = case
    steps = grad_steps(6, dtype)
    params = make_params("cpu", dtype)
    theirs = [torch.tensor(p.numpy().copy(), requires_grad=True) for p in params]
    ours = run(lambda ps: OPTIMIZERS[kind](ps, **kwargs), params, steps)
    opt = _torch_optimizer(torch, kind, theirs, kwargs)
    for grads in steps:
        for t, g in zip(theirs, grads):
            t.grad = torch.tensor(g)
        opt.step()
    rtol = 2e-5 if dtype == np.float32 else 1e-12
    for a, t in zip(ours, theirs):
        np.testing.assert_allclose(a, t.detach().numpy(), rtol=rtol, atol=rtol)


@pytest.mark.torch
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_grad_norm_against_torch(norm_type):
    torch = pytest.importorskip("torch")
    params = make_params("cpu", np.float32, flat=False)
    grads = grad_steps(1, np.float32)[0]
    set_grads(params, grads)
    theirs = [torch.zeros(g.shape, requires_grad=True) for g in grads]
    for t, g in zip(theirs, grads):
        t.grad = torch.tensor(g)
    ours = optim.clip_grad_norm_(params, max_norm=0.7, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm=0.7, norm_type=norm_type)
    assert ours.item() == pytest.approx(expected.item(), rel=1e-6)
    for p, t in zip(params, theirs):
        np.testing.assert_allclose(p.grad.numpy(), t.grad.numpy(), rtol=1e-6)


@pytest.mark.torch
def test_schedulers_against_torch():
    torch = pytest.importorskip("torch")
    makers = [
        (lambda o: optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.3),
         lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.3)),
        (lambda o: optim.lr_scheduler.CosineAnnealingLR(o, T_max=7, eta_min=0.01),
         lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=7, eta_min=0.01)),
        (lambda o: optim.lr_scheduler.LambdaLR(o, lambda e: 0.9 ** e),
         lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.9 ** e)),
    ]
    for ours_maker, theirs_maker in makers:
        opt = optim.SGD(make_params("cpu"), lr=0.5)
        torch_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
        ours, theirs = ours_maker(opt), theirs_maker(torch_opt)
        for _ in range(12):
            assert opt.param_groups[0]["lr"] == pytest.approx(torch_opt.param_groups[0]["lr"],
                                                              rel=1e-12)
            torch_opt.step()
            ours.step()
            theirs.step()


# ------------------------------------------------------------------ groups in one FlatBuffer

def _split_groups(params, kwargs):
    """AdamW's recipe: a group of the first and last parameters with the case's settings and
    one of the middle one with its own learning rate and no weight decay (two groups whose
    slots interleave in one FlatBuffer)."""
    return [{"params": [params[0], params[2]]},
            {"params": [params[1]], "weight_decay": 0.0, "lr": kwargs["lr"] * 0.5}]


@pytest.mark.parametrize("case", RULE_CASES[1::2], ids=case_id)
def test_groups_in_one_flat_buffer_equal_the_per_tensor_path_bitwise(case, device):
    kind, kwargs = case
    steps = grad_steps(dtype=np.float32)

    def make(ps):
        return OPTIMIZERS[kind](_split_groups(ps, kwargs), **kwargs)

    flat = make_params(device, np.float32)
    slots = run(make, flat, steps)
    loose = run(make, make_params(device, np.float32, flat=False), steps)
    for a, b in zip(slots, loose):
        np.testing.assert_array_equal(a, b)


def test_groups_in_one_flat_buffer_are_one_update_each():
    from optim.flat_slots import FlatSlots
    params = make_params("cpu", np.float32)
    opt = optim.AdamW(_split_groups(params, {"lr": 0.01}), lr=0.01)
    for grads in grad_steps(2, np.float32):   # the second step: no set-up
        set_grads(params, grads)
        with LaunchRecorder() as recorder:
            opt.step()
    assert [run.kernel.name for run in recorder.runs] == ["advance_steps", "adam"] * 2
    units = [opt._unit_of[p] for p in params]
    assert all(isinstance(unit, FlatSlots) for unit in units)
    assert units[0] is units[2] is not units[1]
    assert units[0].runs("cpu").tolist() == [[0, 15], [22, 28]]   # shapes (3, 5), (7,), (2, 1, 3)
    assert opt.state[params[0]]["step"] == opt.state[params[1]]["step"] == 2


@pytest.mark.cuda
def test_groups_in_one_flat_buffer_are_one_update_launch_each_on_cuda(launches):
    params = make_params("cuda", np.float32)
    opt = optim.AdamW(_split_groups(params, {"lr": 0.01}), lr=0.01)
    for grads in grad_steps(2, np.float32):
        set_grads(params, grads)
        launches.clear()
        opt.step()
        assert launches.cuda_kernel_names() == ["advance_steps_cuda", "adam_cuda"] * 2


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_groups_in_one_flat_buffer_resume_bitwise(kind):
    kwargs = {"lr": 0.05, "weight_decay": 0.01}
    if kind == "sgd":
        kwargs.update(momentum=0.9)
    steps = grad_steps(5, np.float32)

    def train(params, opt, part):
        for grads in part:
            set_grads(params, grads)
            opt.step()

    params = make_params("cpu", np.float32)
    train(params, OPTIMIZERS[kind](_split_groups(params, kwargs), **kwargs), steps)
    uninterrupted = [p.numpy().copy() for p in params]

    params = make_params("cpu", np.float32)
    opt = OPTIMIZERS[kind](_split_groups(params, kwargs), **kwargs)
    train(params, opt, steps[:2])
    values, saved = [p.numpy().copy() for p in params], opt.state_dict()
    resumed = make_params("cpu", np.float32, seed=9)
    for p, value in zip(resumed, values):
        p.data[...] = value
    opt = OPTIMIZERS[kind](_split_groups(resumed, kwargs), **kwargs)
    opt.load_state_dict(saved)
    train(resumed, opt, steps[2:])
    assert isinstance(opt._unit_of[resumed[0]], optim.flat_slots.FlatSlots)
    for a, p in zip(uninterrupted, resumed):
        np.testing.assert_array_equal(p.numpy(), a)


def test_a_group_s_update_over_runs_has_the_same_bits_on_any_thread_count(monkeypatch):
    """On the CPU an update over many elements splits across the engine's threads: each
    block the same kernel on the whole arrays with its own cut of the group's runs."""
    from ops import cpu_threads, element_kernel, kernel_pace
    monkeypatch.setattr(cpu_threads, "MIN_BLOCK_SECONDS", 1e-12)   # every block is worth it
    splits = []
    run_blocks = element_kernel.run_blocks
    monkeypatch.setattr(element_kernel, "run_blocks",
                        lambda blocks: (splits.append(len(blocks)), run_blocks(blocks)))
    shapes = [(300, 400), (999,), (400, 300), (7,)]
    results = []
    previous = engine.get_num_threads()
    try:
        for threads in (1, 2):
            engine.set_num_threads(threads)
            params = [Parameter(np.full(shape, k, np.float32)) for k, shape in enumerate(shapes)]
            FlatBuffer(params)
            opt = optim.AdamW([{"params": params[::2]},
                               {"params": params[1::2], "weight_decay": 0.0}], lr=0.01)
            grads = np.random.default_rng(5)
            for _ in range(kernel_pace.TIMED_CALLS + 3):   # past the timed whole calls
                set_grads(params, [grads.standard_normal(s).astype(np.float32) for s in shapes])
                opt.step()
            results.append([p.numpy().copy() for p in params])
    finally:
        engine.set_num_threads(previous)
    assert 2 in splits
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_runs_are_cut_at_the_blocks_edges():
    from ops.element_kernel import _runs_between
    runs = np.array([[0, 15], [22, 28], [40, 50]], np.int64)
    lengths = runs[:, 1] - runs[:, 0]
    assert _runs_between(runs, lengths, 0, 31).tolist() == [[0, 15], [22, 28], [40, 50]]
    assert _runs_between(runs, lengths, 10, 18).tolist() == [[10, 15], [22, 25]]
    assert _runs_between(runs, lengths, 21, 31).tolist() == [[40, 50]]


def test_a_kept_flat_update_follows_every_change_its_decision_read(monkeypatch):
    """``Optimizer._step_group`` keeps a group's flat update (``_FlatPlan``) from step to
    step: through a step without gradients, momentum turned on, a reloaded state, a frozen
    parameter and a re-packed buffer, the parameters move as they do when every step
    decides afresh."""
    from optim import optimizer as optimizer_module

    def events(params, opt, grads, kept):
        set_grads(params, grads[0])
        opt.step()
        opt.step()
        opt.param_groups[0]["momentum"] = 0.9   # a buffer the rule keeps from now on
        opt.step()
        opt.zero_grad()
        opt.step()                        # no gradient: nothing moves
        set_grads(params, grads[1])
        opt.step()
        opt.load_state_dict(opt.state_dict())   # state made anew from the saved one
        opt.step()
        set_grads(params, grads[2])
        opt.step()
        kept.append(bool(opt._plans))
        params[1].requires_grad_(False)   # frozen: the per-parameter path, it stays put
        opt.step()
        params[1].requires_grad_(True)
        FlatBuffer(params[::-1])          # re-packed: other offsets, other arrays
        set_grads(params, grads[3])
        opt.step()
        return [p.numpy().copy() for p in params]

    steps = grad_steps(4)
    kept = []
    params = make_params("cpu")
    with_plans = events(params, optim.SGD(params, lr=0.05), steps, kept)
    assert kept == [True]   # the flat update was kept until the freeze
    monkeypatch.setattr(optimizer_module._FlatPlan, "fits", lambda self, optimizer, group: False)
    params = make_params("cpu")
    decided = events(params, optim.SGD(params, lr=0.05), steps, [])
    for a, b in zip(with_plans, decided):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ moved and re-packed parameters

def test_state_follows_a_repacked_flat_buffer():
    """A model re-packs its parameters into a new FlatBuffer (say, built on first call)
    after the optimizer made its state: the state moves into the new flat state buffers."""
    steps = grad_steps(4)
    uninterrupted = run(lambda ps: optim.Adam(ps, lr=0.01), make_params("cpu"), steps)
    params = make_params("cpu")
    opt = optim.Adam(params, lr=0.01)
    for k, grads in enumerate(steps):
        if k == 2:
            FlatBuffer(params[::-1])   # another order, other offsets
        set_grads(params, grads)
        opt.step()
    for a, p in zip(uninterrupted, params):
        np.testing.assert_array_equal(p.numpy(), a)


@pytest.mark.cuda
def test_state_follows_a_model_moved_to_cuda(launches):
    steps = grad_steps(4)
    on_cpu = run(lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9), make_params("cpu"), steps)
    params = make_params("cpu")
    opt = optim.SGD(params, lr=0.1, momentum=0.9)
    for k, grads in enumerate(steps):
        if k == 2:
            params[0].flat.to("cuda")
        set_grads(params, grads)
        launches.clear()
        opt.step()
    assert launches.cuda_kernel_names() == ["advance_steps_cuda", "sgd_cuda"]
    for a, p in zip(on_cpu, params):
        assert p.device == "cuda"
        np.testing.assert_allclose(p.numpy(), a, rtol=1e-13)


# ------------------------------------------------------------------ the reference MLP

@pytest.mark.cuda
def test_mlp_training_step_launches_on_cuda(launches):
    """engine.nn packs a model's parameters in one FlatBuffer: clipping is two launches and
    the optimizer step two (its step count's advance and the update), whatever the number
    of layers."""
    from engine import nn
    model = nn.Sequential([nn.Dense(7, activation="relu", input_shape=(5,)), nn.Dense(6),
                           nn.Dense(3)]).to("cuda")
    opt = optim.Adam(model.parameters(), lr=1e-2)
    x = engine.randn(4, 5, device="cuda")
    target = engine.randn(4, 3, device="cuda")
    losses = []
    for step in range(3):
        opt.zero_grad()
        loss = ((model(x) - target) ** 2).mean()
        loss.backward()
        losses.append(loss.item())
        launches.clear()
        optim.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        assert launches.cuda_kernel_names() == ["norm_partials_cuda", "scale_by_norm_cuda",
                                                "advance_steps_cuda", "adam_cuda"]
    assert losses[-1] < losses[0]


@pytest.mark.cuda
def test_the_nonfinite_guard_costs_two_launches(launches):
    params = make_params("cuda", np.float32)
    opt = optim.SGD(params, lr=0.1, skip_nonfinite=True)
    set_grads(params, grad_steps(1, np.float32)[0])
    launches.clear()
    opt.step()
    assert launches.cuda_kernel_names() == ["zero_count_cuda", "count_nonfinite_cuda",
                                            "advance_steps_cuda", "sgd_cuda"]


# ------------------------------------------------------------------ real GPU, MNIST-MLP sizes

@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_mnist_mlp_sized_buffer_matches_cpu_on_gpu(kind):
    shapes = [(784, 256), (256,), (256, 128), (128,), (128, 10), (10,)]
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(s).astype(np.float32) * 0.05 for s in shapes]
    steps = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(3)]
    kwargs = {"lr": 0.01, **({"momentum": 0.9, "nesterov": True} if kind == "sgd" else {})}
    results, norms = {}, {}
    for device in ("cpu", "cuda"):
        params = [Parameter(to_device(v, device)) for v in values]
        FlatBuffer(params)
        opt = OPTIMIZERS[kind](params, **kwargs)
        norms[device] = []
        for grads in steps:
            set_grads(params, grads)
            norms[device].append(optim.clip_grad_norm_(params, max_norm=5.0).item())
            opt.step()
        results[device] = [p.numpy() for p in params]
    np.testing.assert_allclose(norms["cuda"], norms["cpu"], rtol=1e-6)
    for a, b in zip(results["cpu"], results["cuda"]):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ chainable schedules

def test_step_lr_reads_the_groups_current_rate():
    opt = optim.SGD(make_params("cpu"), lr=0.1)
    sched = optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    opt.param_groups[0]["lr"] = 0.01    # set by hand: the schedule carries on from it
    sched.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.005 and sched.get_last_lr() == [0.005]


def test_two_schedulers_compose():
    opt = optim.SGD(make_params("cpu"), lr=1.0)
    halve_every_2 = optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    tenth_every_3 = optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.1)
    rates = []
    for _ in range(6):
        halve_every_2.step()
        tenth_every_3.step()
        rates.append(opt.param_groups[0]["lr"])
    np.testing.assert_allclose(rates, [1, 0.5, 0.05, 0.025, 0.025, 0.00125], rtol=1e-15)


def _torch_schedule_pairs(torch):
    return [
        (lambda o: optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.3),
         lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.3)),
        (lambda o: optim.lr_scheduler.CosineAnnealingLR(o, T_max=4, eta_min=0.01),
         lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4, eta_min=0.01)),
    ]


@pytest.mark.torch
@pytest.mark.parametrize("pair", [0, 1], ids=["step", "cosine"])
def test_chained_and_composed_schedules_equal_torchs_exactly(pair):
    """A rate written by hand mid-run, a second scheduler on the same optimizer, and cosine
    past T_max (its special branch): torch's values bit for bit."""
    torch = pytest.importorskip("torch")
    ours_maker, theirs_maker = _torch_schedule_pairs(torch)[pair]
    opt = optim.SGD(make_params("cpu"), lr=0.5)
    torch_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    ours = [ours_maker(opt), optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)]
    theirs = [theirs_maker(torch_opt), torch.optim.lr_scheduler.StepLR(torch_opt, 5, 0.7)]
    for epoch in range(14):
        if epoch == 6:
            opt.param_groups[0]["lr"] = torch_opt.param_groups[0]["lr"] = 0.2
        torch_opt.step()
        for a, b in zip(ours, theirs):
            a.step()
            b.step()
        assert opt.param_groups[0]["lr"] == torch_opt.param_groups[0]["lr"], epoch
        assert ours[0].get_last_lr() == theirs[0].get_last_lr()


SCHEDULE_ARGUMENTS = ("step_size", "gamma", "T_max", "eta_min")


def _rebuilt(scheduler, optimizer, last_epoch):
    """A scheduler of ``scheduler``'s class and arguments on ``optimizer``, at ``last_epoch``."""
    arguments = {k: getattr(scheduler, k) for k in SCHEDULE_ARGUMENTS if hasattr(scheduler, k)}
    return type(scheduler)(optimizer, **arguments, last_epoch=last_epoch)


@pytest.mark.torch
@pytest.mark.parametrize("pair", [0, 1], ids=["step", "cosine"])
def test_resuming_with_last_epoch_equals_torchs(pair):
    """Load the optimizer's state, rebuild the scheduler with last_epoch: the rates go on as
    torch's do, bit for bit."""
    torch = pytest.importorskip("torch")
    ours_maker, theirs_maker = _torch_schedule_pairs(torch)[pair]
    opt = optim.SGD(make_params("cpu"), lr=0.5)
    torch_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    ours, theirs = ours_maker(opt), theirs_maker(torch_opt)
    for _ in range(5):
        torch_opt.step()
        ours.step()
        theirs.step()
    saved, torch_saved = opt.state_dict(), torch_opt.state_dict()
    opt = optim.SGD(make_params("cpu"), lr=9.0)
    opt.load_state_dict(saved)
    torch_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=9.0)
    torch_opt.load_state_dict(torch_saved)
    resumed, torch_resumed = _rebuilt(ours, opt, 4), _rebuilt(theirs, torch_opt, 4)
    for _ in range(6):
        assert opt.param_groups[0]["lr"] == torch_opt.param_groups[0]["lr"]
        assert resumed.last_epoch == torch_resumed.last_epoch
        torch_opt.step()
        resumed.step()
        torch_resumed.step()


def test_cosine_rebuilt_with_last_epoch_goes_on_bit_for_bit():
    """engine's resume of a recursive cosine: the loaded rate, then the same recursion."""
    opt = optim.SGD(make_params("cpu"), lr=0.6)
    sched = optim.lr_scheduler.CosineAnnealingLR(opt, T_max=9, eta_min=0.01)
    for _ in range(4):
        sched.step()
    saved = opt.state_dict()
    straight = _rates(sched, opt, 7)
    opt = optim.SGD(make_params("cpu"), lr=9.0)
    opt.load_state_dict(saved)
    resumed = optim.lr_scheduler.CosineAnnealingLR(opt, T_max=9, eta_min=0.01, last_epoch=3)
    assert resumed.last_epoch == 4 and opt.param_groups[0]["lr"] == saved["param_groups"][0]["lr"]
    assert _rates(resumed, opt, 7) == straight


def test_a_scheduler_loaded_from_its_state_goes_on_bit_for_bit():
    opt = optim.SGD(make_params("cpu"), lr=0.5)
    sched = optim.lr_scheduler.CosineAnnealingLR(opt, T_max=7, eta_min=0.01)
    for _ in range(3):
        sched.step()
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()
    straight = _rates(sched, opt, 6)
    opt = optim.SGD(make_params("cpu"), lr=9.0)
    opt.load_state_dict(saved_opt)
    sched = optim.lr_scheduler.CosineAnnealingLR(opt, T_max=7, eta_min=0.01)
    sched.load_state_dict(saved_sched)
    assert _rates(sched, opt, 6) == straight


# ------------------------------------------------------------------ SGD: momentum changed mid-run

def _torch_twins(torch, params):
    return [torch.tensor(p.numpy().copy(), requires_grad=True) for p in params]


def _sgd_step_both(torch, params, opt, twins, torch_opt, grads):
    set_grads(params, grads)
    for t, g in zip(twins, grads):
        t.grad = torch.tensor(g)
    opt.step()
    torch_opt.step()
    for p, t in zip(params, twins):
        np.testing.assert_allclose(p.numpy(), t.detach().numpy(), rtol=1e-13, atol=1e-15)


@pytest.mark.torch
@pytest.mark.parametrize("flat", [True, False], ids=["flat", "per_tensor"])
def test_sgd_momentum_switched_through_param_groups_matches_torch(flat):
    torch = pytest.importorskip("torch")
    params = make_params("cpu", flat=flat)
    twins = _torch_twins(torch, params)
    opt = optim.SGD(params, lr=0.1, weight_decay=0.01)
    torch_opt = torch.optim.SGD(twins, lr=0.1, weight_decay=0.01)
    schedule = [0.0, 0.0, 0.9, 0.9, 0.9, 0.0, 0.5, 0.5]   # on after two steps, off, on again
    for momentum, grads in zip(schedule, grad_steps(len(schedule))):
        opt.param_groups[0]["momentum"] = torch_opt.param_groups[0]["momentum"] = momentum
        _sgd_step_both(torch, params, opt, twins, torch_opt, grads)


@pytest.mark.torch
@pytest.mark.parametrize("flat", [True, False], ids=["flat", "per_tensor"])
@pytest.mark.parametrize("before, has_buffer", [((0.9, 0.9, 0.0), True), ((0.0, 0.0, 0.0), False)],
                         ids=["buffer_kept_momentum_off", "no_buffer"])
def test_sgd_loads_a_state_saved_with_another_momentum_setting(flat, before, has_buffer):
    """A state saved with (or without) a momentum buffer loads into an SGD built with another
    momentum; the saved hyper-parameters win, and turning momentum on afterwards goes on as
    torch does (from the kept buffer, or from a new one)."""
    torch = pytest.importorskip("torch")
    steps = grad_steps(6)
    params = make_params("cpu", flat=flat)
    twins = _torch_twins(torch, params)
    opt = optim.SGD(params, lr=0.1)
    torch_opt = torch.optim.SGD(twins, lr=0.1)
    for momentum, grads in zip(before, steps[:3]):
        opt.param_groups[0]["momentum"] = torch_opt.param_groups[0]["momentum"] = momentum
        _sgd_step_both(torch, params, opt, twins, torch_opt, grads)
    saved, torch_saved = opt.state_dict(), torch_opt.state_dict()
    assert ("momentum_buffer" in saved["state"][0]) == has_buffer

    opt = optim.SGD(params, lr=0.3, momentum=0.5)
    opt.load_state_dict(saved)
    torch_opt = torch.optim.SGD(twins, lr=0.3, momentum=0.5)
    torch_opt.load_state_dict(torch_saved)
    assert opt.param_groups[0]["momentum"] == 0.0 == torch_opt.param_groups[0]["momentum"]
    for momentum, grads in zip([0.0, 0.9, 0.9], steps[3:]):
        opt.param_groups[0]["momentum"] = torch_opt.param_groups[0]["momentum"] = momentum
        _sgd_step_both(torch, params, opt, twins, torch_opt, grads)


def test_sgd_momentum_turned_on_later_starts_its_buffer_from_the_gradient(device):
    params = make_params(device)
    opt = optim.SGD(params, lr=0.1)
    steps = grad_steps(3)
    set_grads(params, steps[0])
    opt.step()
    after_one = [p.numpy().copy() for p in params]
    opt.param_groups[0]["momentum"] = 0.9
    for grads in steps[1:]:
        set_grads(params, grads)
        opt.step()
    for p, start, g1, g2 in zip(params, after_one, steps[1], steps[2]):
        expected = sgd_reference(start, [g1, g2], lr=0.1, momentum=0.9)
        np.testing.assert_allclose(p.numpy(), expected, rtol=1e-13)
    assert "momentum_buffer" in opt.state_dict()["state"][0]


def test_adam_refuses_a_state_without_its_buffers():
    params, state = _adam_state_after_a_step()
    del state["state"][1]["exp_avg"]
    with pytest.raises(ValueError, match=r"saved state has \['exp_avg_sq', 'step'\], expected"):
        optim.Adam(params, lr=0.01).load_state_dict(state)


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_state_that_decays_below_the_smallest_normal_number_is_stored_as_zero(device, kind):
    """A gradient stuck at 0 lets momentum decay into subnormal floats (x86 computes those
    ~20x slower): they are stored as 0 instead, on both devices alike."""
    params = make_params(device, np.float32)
    opt = (optim.Adam(params, lr=1e-3) if kind == "adam"
           else optim.SGD(params, lr=1e-3, momentum=0.9))
    name = "exp_avg" if kind == "adam" else "momentum_buffer"
    tiny = np.finfo(np.float32).tiny
    first = [np.full(p.shape, 1e-35, np.float32) for p in params]   # m: 1e-36 (Adam), 1e-35
    seen_normal = False
    for step in range(70):
        set_grads(params, first if step == 0 else [np.zeros(p.shape, np.float32) for p in params])
        opt.step()
        buffers = [opt.state[p][name].copy_to_host() if device == "cuda"
                   else opt.state[p][name] for p in params]
        values = np.abs(np.concatenate([b.ravel() for b in buffers]))
        assert not np.any((values > 0) & (values < tiny)), f"subnormal {name} at step {step}"
        seen_normal |= bool(np.all(values >= tiny))
    assert seen_normal and np.all(values == 0)   # it was normal, decayed, then became 0


def test_the_cpu_update_leaves_the_callers_floating_point_mode_alone():
    """Adam's CPU kernel flushes subnormals only while it runs (ops.subnormals)."""
    params = make_params("cpu", np.float32)
    opt = optim.Adam(params, lr=1e-3)
    set_grads(params, grad_steps(1, np.float32)[0])
    opt.step()
    half_of_tiny = np.float32(np.finfo(np.float32).tiny) * np.float32(0.5)
    assert half_of_tiny > 0   # a subnormal result, not flushed to 0 after the kernel


# ------------------------------------------------------------------ the registry

def test_every_registered_optimizer_is_its_module_s_class_and_the_command_offers_it():
    import importlib

    from engine.cli import arguments
    for name, (module, class_name) in optim.OPTIMIZERS.items():
        cls = getattr(importlib.import_module(module), class_name)
        assert issubclass(cls, optim.Optimizer) and getattr(optim, class_name) is cls, name
    assert arguments.OPTIMIZERS == tuple(sorted(optim.OPTIMIZERS))
    assert set(dir(optim)) >= {"SGD", "Adam", "lr_scheduler", "clip_grad_norm_", "OPTIMIZERS"}
    with pytest.raises(AttributeError, match="module 'optim' has no attribute 'Lion'"):
        optim.Lion


def test_import_optim_imports_no_numba():
    """The command's help lists optim.OPTIMIZERS before Numba is imported."""
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-c", "import sys, optim; print('numba' in "
                             "sys.modules, sorted(optim.OPTIMIZERS))"], capture_output=True,
                            text=True, cwd=REPO_ROOT)
    assert result.stdout.split()[0] == "False", result.stderr
