"""cross_entropy with torch's label_smoothing, reduction and class-probability targets:
``check_op`` on odd shapes (both devices), torch as the float64 oracle, bad options named."""
import numpy as np
import pytest

import engine
from engine.losses import CrossEntropyLoss, cross_entropy
from tests.support.op_check import Case, check_op


def _log_softmax(x):
    top = x.max(axis=1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=1, keepdims=True))


def _reference(logits, target, smoothing, reduction):
    """torch's definition in NumPy float64: target probabilities mixed with the uniform."""
    classes = logits.shape[1]
    if target.dtype.kind in "iu":
        target = np.eye(classes)[target]
    mixed = (1 - smoothing) * target + smoothing / classes
    rows = -(mixed * _log_softmax(logits)).sum(axis=1)
    return {"none": rows, "mean": rows.mean(), "sum": rows.sum()}[reduction]


def _label_inputs(rows, classes):
    return lambda rng: [rng.uniform(-3, 3, size=(rows, classes)),
                        rng.integers(0, classes, size=rows)]


def _probability_inputs(rows, classes):
    def make(rng):
        weights = rng.uniform(0, 1, size=(rows, classes))
        return [rng.uniform(-3, 3, size=(rows, classes)), weights / weights.sum(1, keepdims=True)]
    return make


CASES = [
    Case("label_cross_entropy", ((5, 7), (5,)),
         lambda x, y: cross_entropy(x, y, label_smoothing=0.1),
         lambda x, y: _reference(x, y, 0.1, "mean"), make_inputs=_label_inputs(5, 7),
         grad=(True, False)),
    Case("label_cross_entropy", ((3, 4), (3,)),
         lambda x, y: cross_entropy(x, y, reduction="none"),
         lambda x, y: _reference(x, y, 0.0, "none"), make_inputs=_label_inputs(3, 4),
         grad=(True, False)),
    Case("label_cross_entropy", ((6, 3), (6,)),
         lambda x, y: cross_entropy(x, y, label_smoothing=0.35, reduction="sum"),
         lambda x, y: _reference(x, y, 0.35, "sum"), make_inputs=_label_inputs(6, 3),
         grad=(True, False)),
    Case("probability_cross_entropy", ((4, 5), (4, 5)),
         lambda x, t: cross_entropy(x, t),
         lambda x, t: _reference(x, t, 0.0, "mean"), make_inputs=_probability_inputs(4, 5),
         grad=(True, False)),
    Case("probability_cross_entropy", ((3, 6), (3, 6)),
         lambda x, t: cross_entropy(x, t, label_smoothing=0.2, reduction="none"),
         lambda x, t: _reference(x, t, 0.2, "none"), make_inputs=_probability_inputs(3, 6),
         grad=(True, False)),
    Case("probability_cross_entropy", ((2, 3), (2, 3)),
         lambda x, t: cross_entropy(x, t, reduction="sum"),
         lambda x, t: _reference(x, t, 0.0, "sum"), make_inputs=_probability_inputs(2, 3),
         grad=(True, False)),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_op(case, device):
    check_op(case, device)


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("probabilities", [False, True])
def test_against_torch(smoothing, reduction, probabilities):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((7, 5)) * 3
    if probabilities:
        target = rng.uniform(0, 1, size=(7, 5))   # unnormalised rows are allowed, as in torch
    else:
        target = rng.integers(0, 5, size=7)
    x = engine.tensor(logits, requires_grad=True)
    ours = cross_entropy(x, target, label_smoothing=smoothing, reduction=reduction)
    grad_out = rng.standard_normal(ours.shape)
    (ours * engine.tensor(grad_out)).sum().backward()
    tx = torch.tensor(logits, requires_grad=True)
    theirs = torch.nn.functional.cross_entropy(tx, torch.tensor(target),
                                               label_smoothing=smoothing, reduction=reduction)
    (theirs * torch.tensor(grad_out)).sum().backward()
    np.testing.assert_allclose(ours.numpy(), theirs.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-12, atol=1e-12)


def test_the_plain_case_keeps_the_plain_op():
    """Integer labels, no smoothing, the mean: the op the captured MLP step has always run."""
    from ops.launch import LaunchRecorder
    logits = engine.tensor(np.zeros((2, 3), np.float32), requires_grad=True)
    with LaunchRecorder() as recorder:
        cross_entropy(logits, np.array([0, 2]))
    assert [run.kernel.name for run in recorder.runs] == ["cross_entropy"]


def test_the_loss_class_takes_torch_s_options():
    criterion = CrossEntropyLoss(label_smoothing=0.1, reduction="sum")
    assert repr(criterion) == "CrossEntropyLoss(label_smoothing=0.1, reduction='sum')"
    logits = np.array([[2.0, 0.0, -1.0]])
    assert np.isclose(criterion(engine.tensor(logits), [0]).item(),
                      _reference(logits, np.array([0]), 0.1, "sum"))


@pytest.mark.parametrize("options, words", [
    (dict(label_smoothing=1.5), r"label_smoothing must be a number in \[0, 1\], got 1.5"),
    (dict(label_smoothing=-0.1), "label_smoothing"),
    (dict(reduction="average"), r"reduction must be one of \['mean', 'none', 'sum'\]"),
])
def test_bad_options_are_named(options, words):
    with pytest.raises(ValueError, match=words):
        cross_entropy(engine.tensor(np.zeros((2, 3))), [0, 1], **options)
    with pytest.raises(ValueError, match=words):
        CrossEntropyLoss(**options)


def test_probability_targets_of_another_shape_are_refused():
    with pytest.raises(ValueError, match=r"logits' shape \(2, 3\), got \(2, 4\)"):
        cross_entropy(engine.tensor(np.zeros((2, 3))), np.zeros((2, 4)))


def test_a_bad_label_is_named_with_smoothing_too():
    with pytest.raises(ValueError, match=r"label 5 at row 1 is outside \[0, 3\)"):
        cross_entropy(engine.tensor(np.zeros((2, 3))), [0, 5], label_smoothing=0.1)
