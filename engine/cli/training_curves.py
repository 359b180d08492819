"""The image ``python -m engine.train --plot PATH`` writes: the training loss of every step
and the accuracy of every epoch, drawn with matplotlib (an optional extra) without pyplot,
so no global state and no GUI backend."""
import os

import numpy as np

from engine.archive import atomic_write


def plot_format(path):
    """The matplotlib format of ``path``: its extension, PNG without one."""
    return os.path.splitext(path)[1].lstrip(".").lower() or "png"


def plot_formats():
    """The formats matplotlib writes."""
    from matplotlib.backend_bases import FigureCanvasBase
    return set(FigureCanvasBase.get_supported_filetypes())


def plot_history(history, path, step_losses=()):
    """Write the curves to ``path`` atomically and return the matplotlib Figure: left, the
    training loss of every step (``step_losses``: one array per epoch, for the last
    ``len(step_losses)`` epochs of ``history``) with each epoch's mean; right, the train and
    test accuracy per epoch. Epochs are integer ticks; step ``i`` of ``n`` in epoch ``e``
    sits at ``e - 1 + (i + 1) / n``."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
    figure = Figure(figsize=(10, 4), dpi=100)
    loss_axes, accuracy_axes = figure.subplots(1, 2)
    epochs = [record["epoch"] for record in history]
    trained = epochs[len(epochs) - len(step_losses):]
    if len(step_losses):
        steps = np.concatenate([epoch - 1 + np.arange(1, len(losses) + 1) / max(len(losses), 1)
                                for epoch, losses in zip(trained, step_losses)])
        loss_axes.plot(steps, np.concatenate(step_losses), linewidth=0.6, alpha=0.7,
                       label="per step")
    if all(record["loss"] is not None for record in history):
        loss_axes.plot(epochs, [record["loss"] for record in history], marker="o",
                       label="epoch mean")
    loss_axes.set(title="training loss", xlabel="epoch", ylabel="cross-entropy")
    for key, label in (("train_acc", "train"), ("test_acc", "test")):
        values = [record[key] for record in history]
        if all(value is not None for value in values):
            accuracy_axes.plot(epochs, [100 * value for value in values], marker="o", label=label)
    accuracy_axes.set(title="accuracy per epoch", xlabel="epoch", ylabel="accuracy (%)")
    for axes in (loss_axes, accuracy_axes):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        if axes.lines:
            axes.legend()
    figure.tight_layout()
    with atomic_write(path) as file:
        figure.savefig(file, format=plot_format(path))
    return figure
