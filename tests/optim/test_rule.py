"""``optim.rule``: an optimizer's declaration checked when its class is made, and every
registered optimizer's CPU kernel generated the fast way (issue 48: no reference counting
in the loop, and a vectorised loop)."""
import importlib

import pytest

import optim
from optim.optimizer import Optimizer
from tests.support.optim_check import check_checkpoint_round_trip, check_generated_the_fast_way


def _registered():
    """(class, buffers kept) for every registered optimizer: all its buffers, and those a
    default group keeps (SGD without momentum, Adam without amsgrad, ...)."""
    from tests.support.optim_check import make_params
    cases = {}
    for module, class_name in optim.OPTIMIZERS.values():
        cls = getattr(importlib.import_module(module), class_name)
        options = {"lr": 0.1} if class_name == "SGD" else {}
        kept = cls(make_params("cpu"), **options)._state_names(
            cls(make_params("cpu"), **options).param_groups[0])
        for buffers in {cls.buffers, tuple(kept)}:
            cases[f"{class_name}-{'-'.join(buffers) or 'no buffers'}"] = (cls, buffers)
    return cases


REGISTERED = _registered()


@pytest.mark.parametrize("name", sorted(REGISTERED))
def test_every_optimizer_s_cpu_loop_has_no_reference_counting_and_vectorises(name):
    check_generated_the_fast_way(*REGISTERED[name])


@pytest.mark.parametrize("make", [
    *(pytest.param(lambda ps, name=name: getattr(optim, name)(ps, lr=0.05), id=name)
      for name in sorted({class_name for _, class_name in optim.OPTIMIZERS.values()})),
    pytest.param(lambda ps: optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True), id="SGD-nesterov"),
    pytest.param(lambda ps: optim.Adam(ps, lr=0.05, amsgrad=True), id="Adam-amsgrad"),
    pytest.param(lambda ps: optim.AdamW(ps, lr=0.05, amsgrad=True), id="AdamW-amsgrad"),
])
def test_every_optimizer_resumes_from_a_checkpoint_bit_for_bit(make, tmp_path):
    check_checkpoint_round_trip(make, tmp_path / "checkpoint.npz")


def _rule(param, grad, velocity, lr, tiny):
    return param - lr * grad, velocity


def _declare(**declaration):
    return type("Toy", (Optimizer,), {"rule": staticmethod(_rule), "buffers": ("velocity",),
                                      "hyper": ("lr",), **declaration})


def test_a_rule_reading_an_undeclared_name_is_refused_when_the_class_is_made():
    with pytest.raises(TypeError, match=r"toy: the rule _rule reads \['lr'\], which are not "
                                        "declared"):
        _declare(hyper=())


def test_a_rule_returning_too_few_values_is_refused():
    def short(param, grad, lr):
        return param - lr * grad
    with pytest.raises(TypeError, match=r"toy: the rule short returns 1 value\(s\) at line .*"
                                        "new param and then each state buffer: 2"):
        _declare(rule=short)


def test_a_derived_scalar_must_read_declared_names_and_not_shadow_one():
    def lr_twice(lr, rate):
        return 2 * lr
    with pytest.raises(TypeError, match=r"derived scalar lr_twice reads \['rate'\]"):
        _declare(derived=(lr_twice,))

    def lr(t):
        return t
    with pytest.raises(TypeError, match="derived scalar lr has the name of a declared value"):
        _declare(derived=(lr,))


def test_a_name_declared_twice_or_one_of_the_kernel_s_own_is_refused():
    with pytest.raises(TypeError, match="a name is declared twice"):
        _declare(hyper=("lr", "velocity"))
    with pytest.raises(TypeError, match="the kernel's own"):
        _declare(hyper=("lr", "dtype"))
