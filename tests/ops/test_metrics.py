"""The on-device running metrics behind ``engine.train.fit``."""
import numpy as np

import engine
from ops.metrics import RunningMetrics


def test_running_loss_and_accuracy_match_numpy(device):
    rng = np.random.default_rng(0)
    metrics = RunningMetrics(device)
    losses, correct, rows = [], 0, 0
    for batch in (7, 5, 3):
        logits = rng.standard_normal((batch, 4)).astype(np.float32)
        labels = rng.integers(0, 4, batch)
        loss = np.float32(rng.uniform())
        metrics.add(engine.tensor([loss], device=device).data,
                    engine.tensor(logits, device=device).data,
                    engine.tensor(labels, device=device).data)
        losses.append(loss * batch)
        correct += int(np.sum(logits.argmax(axis=1) == labels))
        rows += batch
    mean_loss, accuracy, counted = metrics.read()
    assert counted == rows
    np.testing.assert_allclose(mean_loss, sum(losses) / rows, rtol=1e-6)
    assert accuracy == correct / rows


def test_no_accuracy_without_class_labels(device):
    metrics = RunningMetrics(device)
    metrics.add(engine.tensor([0.5], device=device).data,
                engine.tensor(np.ones((3, 1)), device=device).data,
                engine.tensor(np.ones((3, 1)), device=device).data)
    assert metrics.read() == (0.5, None, 3)


def test_accuracy_only_pass_has_no_loss(device):
    metrics = RunningMetrics(device)
    logits = np.array([[0.1, 0.9], [0.8, 0.2]], np.float32)
    metrics.add(None, engine.tensor(logits, device=device).data,
                engine.tensor([1, 1], device=device).data)
    assert metrics.read() == (None, 0.5, 2)
