"""The checks every optimizer's test file runs (as ``tests/support/op_check.py`` for ops): its steps
against ``torch.optim``'s one by one, eager against captured training bit for bit, a
state_dict resume bit for bit, the CPU against the CUDA kernel, and its kernels generated
the fast way (``optim.rule``)."""
import contextlib

import numpy as np

import engine
from engine.parameter import FlatBuffer, Parameter
from ops.device import to_device
from tests.support.captured_training import check_captured_equals_eager  # noqa: F401

SHAPES = [(3, 5), (7,), (2, 1, 3)]   # odd sizes: 15 + 7 + 6 = 28 elements
N_STEPS = 4


def make_params(device, dtype=np.float64, flat=True, seed=0):
    """Parameters packed in one FlatBuffer (``flat``) or plain tensors with requires_grad."""
    rng = np.random.default_rng(seed)
    values = [rng.standard_normal(shape).astype(dtype) for shape in SHAPES]
    if flat:
        params = [Parameter(to_device(v, device)) for v in values]
        FlatBuffer(params)
        return params
    return [engine.tensor(v, device=device, requires_grad=True) for v in values]


def grad_steps(n_steps=N_STEPS, dtype=np.float64, seed=1):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(shape).astype(dtype) for shape in SHAPES] for _ in range(n_steps)]


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = engine.tensor(g, device=p.device)


def run(opt_factory, params, steps):
    opt = opt_factory(params)
    for grads in steps:
        set_grads(params, grads)
        opt.step()
    return [p.numpy().copy() for p in params]


def option_id(options):
    """A test id from an optimizer's keyword arguments."""
    return ",".join(f"{key}={value}" for key, value in options.items())


def torch_run(torch_optimizer, steps, **options):
    """``make_params("cpu")``'s values after ``steps`` of ``torch_optimizer(params,
    **options)`` (a torch.optim class), as NumPy arrays."""
    import torch
    params = [torch.tensor(p.numpy(), requires_grad=True) for p in make_params("cpu")]
    opt = torch_optimizer(params, **options)
    for grads in steps:
        for p, g in zip(params, grads):
            p.grad = torch.tensor(g)
        opt.step()
    return [p.detach().numpy() for p in params]


def gpu_steps_against_torch(optimizer, torch_optimizer, steps=5, **options):
    """A million float64 parameters on the GPU after ``steps`` random gradients, under
    ``optimizer`` and under ``torch_optimizer`` (a torch.optim class) with ``options``."""
    import torch
    rng = np.random.default_rng(2)
    start = rng.standard_normal(1 << 20)
    ours = engine.tensor(start, device="cuda", requires_grad=True)
    theirs = torch.tensor(start, device="cuda", requires_grad=True)
    opt, reference = optimizer([ours], **options), torch_optimizer([theirs], **options)
    for _ in range(steps):
        grad = rng.standard_normal(start.size)
        ours.grad = engine.tensor(grad, device="cuda")
        theirs.grad = torch.tensor(grad, device="cuda")
        opt.step()
        reference.step()
    return ours.numpy(), theirs.detach().cpu().numpy()


@contextlib.contextmanager
def torch_default_dtype(dtype):
    """torch keeps scalar state (NAdam's mu_product, every step count) in its default dtype:
    float64 for a float64 comparison."""
    import torch
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64 if dtype == np.float64 else torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def check_against_torch(make, torch_class, options, device="cpu", flat=True, dtype=np.float64,
                        steps=6, rtol=None):
    """``make(params, **options)`` and ``torch_class(params, **options)`` from the same
    parameters and gradients, compared after every step (float64: to 1e-12)."""
    import torch
    rtol = rtol or (1e-12 if dtype == np.float64 else 2e-5)
    params = make_params(device, dtype, flat=flat)
    with torch_default_dtype(dtype):
        theirs = [torch.tensor(p.numpy().copy(), requires_grad=True) for p in params]
        reference = torch_class(theirs, **options)
        ours = make(params, **options)
        for n, grads in enumerate(grad_steps(steps, dtype), start=1):
            set_grads(params, grads)
            for t, g in zip(theirs, grads):
                t.grad = torch.tensor(g)
            ours.step()
            reference.step()
            for k, (p, t) in enumerate(zip(params, theirs)):
                np.testing.assert_allclose(p.numpy(), t.detach().numpy(), rtol=rtol, atol=rtol,
                                           err_msg=f"parameter {k} after {n} step(s)")
    return ours, reference


def check_resume_bit_for_bit(make, device, state_names, steps=6):
    """Three steps, ``state_dict()``, a new optimizer (another lr) loads it and takes the
    rest: the same parameters, bit for bit, as the run without the break; the saved state
    holds ``state_names`` and ``"step"``."""
    grads = grad_steps(steps)
    straight = run(make, make_params(device), grads)
    params = make_params(device)
    first = make(params)
    for step in grads[:3]:
        set_grads(params, step)
        first.step()
    saved = first.state_dict()
    assert set(saved["state"][0]) == {"step", *state_names}
    lr = first.param_groups[0]["lr"]
    second = make(params)
    second.param_groups[0]["lr"] = lr * 7
    second.load_state_dict(saved)
    assert second.param_groups[0]["lr"] == lr   # the saved hyper-parameters win, as torch
    resumed = run(lambda _: second, params, grads[3:])
    for a, b in zip(resumed, straight):
        np.testing.assert_array_equal(a, b)


def check_cpu_equals_cuda(make, dtype):
    """The same steps on both devices (tiny odd shapes: the simulator is slow)."""
    grads = grad_steps(3, dtype)
    on_cpu, on_cuda = (run(make, make_params(device, dtype), grads) for device in ("cpu", "cuda"))
    rtol = 1e-6 if dtype == np.float32 else 1e-13
    for a, b in zip(on_cpu, on_cuda):
        np.testing.assert_allclose(b, a, rtol=rtol, atol=rtol)


def generated_cpu_kernel(cls, kept, dtype=np.float32, runs=False):
    """The optimized LLVM IR of ``cls``'s CPU kernel for the buffers ``kept`` (over runs of
    the arrays with ``runs``; compiled here, uncached: Numba shows no code of a kernel its
    cache loaded), and its array count."""
    from numba import njit
    from optim.rule import _CPU_FLAGS
    kernel = cls.kernels.kernel(kept, runs).cpu.__wrapped__
    fresh = njit(**dict(_CPU_FLAGS, cache=False))(kernel.py_func)
    a = np.ones(64, dtype)
    arrays = (a, a.copy(), *(a.copy() for _ in kept), np.array([1, 1, 0], np.int64),
              np.zeros(len(cls.hyper)))
    last = (np.array([[0, 30], [40, 64]], np.int64),) if runs else ()
    fresh(*arrays, float(np.finfo(dtype).tiny), *last)
    [ir] = fresh.inspect_llvm().values()
    return ir, len(arrays) + len(last)


def check_generated_the_fast_way(cls, kept):
    """Issue 48's cause must not come back: the loop of ``cls``'s CPU kernel was
    vectorised (LLVM's ``vector.body``), and the kernel increfs each array at most once (at
    its start), not per element: an element function that took the arrays left 2 NRT_incref
    and 2 NRT_decref calls per element in the loop, which then did not vectorise."""
    for runs in (False, True):   # over all the elements, and over runs of them
        ir, arrays = generated_cpu_kernel(cls, kept, runs=runs)
        increfs = ir.count("call void @NRT_incref")
        assert increfs <= arrays, f"{cls.__name__} {kept} {runs=}: {increfs} NRT_incref calls"
        assert "vector.body" in ir, f"{cls.__name__} {kept} {runs=}: the loop did not vectorise"


def check_checkpoint_round_trip(make, path):
    """A small model trained 3 steps, ``engine.fit.save_checkpoint`` to ``path``, restored
    into a new model and optimizer (``read_checkpoint``, ``restore_checkpoint``), trained 3
    more: the same weights and optimizer state, bit for bit, as 6 steps without the break."""
    import engine
    from engine import nn
    from engine.fit import read_checkpoint, restore_checkpoint, save_checkpoint
    from engine.losses import cross_entropy
    rng = np.random.default_rng(0)
    batches = [(engine.tensor(rng.standard_normal((6, 5)), dtype=np.float32),
                engine.tensor(rng.integers(0, 4, 6))) for _ in range(6)]

    def fresh():
        engine.manual_seed(0)
        model = nn.Sequential([nn.Dense(7, activation="relu", input_shape=(5,)), nn.Dense(4)])
        return model, make(model.parameters())

    def train(model, opt, part):
        for x, y in part:
            opt.zero_grad()
            cross_entropy(model(x), y).backward()
            opt.step()

    straight = fresh()
    train(*straight, batches)
    first = fresh()
    train(*first, batches[:3])
    save_checkpoint(path, *first, epoch=1)
    resumed = fresh()
    restore_checkpoint(read_checkpoint(path), *resumed)
    train(*resumed, batches[3:])
    for name, value in straight[0].state_dict().items():
        np.testing.assert_array_equal(resumed[0].state_dict()[name], value, err_msg=name)
    expected, got = straight[1].state_dict()["state"], resumed[1].state_dict()["state"]
    assert expected.keys() == got.keys()
    for index, state in expected.items():
        assert state.keys() == got[index].keys()
        for name, value in state.items():
            np.testing.assert_array_equal(got[index][name], value, err_msg=name)
