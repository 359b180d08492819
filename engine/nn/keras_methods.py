"""Keras's model methods on every engine model (``Sequential`` and ``nn.Model``):
``compile``, ``fit(x, y, ...)``, ``evaluate(x, y)``, and Keras's losses by name.

They wrap the one training loop, ``engine.fit.fit`` (its captured step, callbacks and
records), never a loop of their own: ``model.fit`` makes a ``data.DataLoader`` of the arrays,
the optimizer ``compile`` named (kept across ``fit`` calls, as Keras keeps it), and maps the
loop's records to Keras's ``History`` (``loss``, ``accuracy``, ``val_loss``,
``val_accuracy``).

Keras's losses take probabilities unless ``from_logits=True``; the engine's models end in
logits (``nn.CrossEntropyLoss`` expects them). Both work: a softmax layer keeps the logits it
was given beside its output, and a Keras loss given that output reads those logits (what
Keras itself does), so ``Dense(10, activation="softmax")`` with
``"categorical_crossentropy"`` trains on the stable fused loss. A probability output without
them is clipped and logged, as Keras does. A softmax output fed to a loss that expects
logits (``nn.CrossEntropyLoss``, ``from_logits=True``) is a warning naming ``from_logits``.
"""
import math
import warnings

import numpy as np

from engine import functional as F
from engine import losses
from engine.tensor import Tensor

PROBABILITY_FLOOR = 1e-7   # Keras's backend.epsilon(): log(p) of a probability output


def softmax_logits(output):
    """The logits a softmax layer turned into ``output``, or None."""
    return getattr(output, "_keras_logits", None)


def _class_logits(output, from_logits):
    """Logits for a cross-entropy: ``output`` itself, the logits behind a softmax output, or
    the log of probabilities (log-softmax of those is the same log)."""
    if from_logits:
        return output
    logits = softmax_logits(output)
    if logits is not None:
        return logits
    return F.log(F.clip(output, PROBABILITY_FLOOR, 1.0 - PROBABILITY_FLOOR))


def _rows(logits, labels):
    """(N, ..., C) logits and (N, ...) labels as (rows, C) and (rows,), views."""
    if logits.ndim > 2:
        logits = F.reshape(logits, (-1, logits.shape[-1]))
        labels = F.reshape(labels, (-1,)) if isinstance(labels, Tensor) else \
            np.reshape(labels, -1)
    return logits, labels


class SparseCategoricalCrossentropy:
    """Keras's loss of integer class targets: probabilities in (``from_logits=False``,
    Keras's default) or logits. Any rank: the classes on the last axis."""

    expects_logits = False

    def __init__(self, from_logits=False):
        self.from_logits = bool(from_logits)
        self.expects_logits = self.from_logits

    def __call__(self, output, labels):
        logits = _class_logits(output, self.from_logits)
        return losses.cross_entropy(*_rows(logits, labels))

    def __repr__(self):
        return f"{type(self).__name__}(from_logits={self.from_logits})"


class CategoricalCrossentropy(SparseCategoricalCrossentropy):
    """Keras's loss of one-hot or probability targets (the classes on the last axis)."""

    def __call__(self, output, targets):
        logits = _class_logits(output, self.from_logits)
        return -(targets * F.log_softmax(logits, axis=-1)).sum(axis=-1).mean()


def mean_squared_error(output, targets):
    """Keras's "mse": the mean of the squared differences."""
    return losses.mse(output, targets)


LOSSES = {"sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
          "categorical_crossentropy": CategoricalCrossentropy,
          "mse": lambda: mean_squared_error, "mean_squared_error": lambda: mean_squared_error}
METRICS = ("accuracy", "acc")
# Keras's default learning rates of the optimizers compile takes by name
DEFAULT_LR = {"sgd": 0.01, "adam": 0.001, "adamw": 0.001, "rmsprop": 0.001, "adagrad": 0.001}


def _one_hot_labels(y):
    """The class indices of ``y`` when every row is one-hot (exactly one 1, zeros
    elsewhere), else None."""
    if y.ndim < 2 or y.dtype.kind != "f":
        return None
    ones = y == 1
    if not ((ones | (y == 0)).all() and (ones.sum(axis=-1) == 1).all()):
        return None
    return y.argmax(axis=-1).astype(np.int64)


class _CompiledLoss:
    """The loss ``fit`` steps with: the chosen one, after a check of the first output (a
    softmax output fed to a loss that expects logits trains worse: a warning)."""

    def __init__(self, loss):
        self.loss = loss
        self.checked = False

    def __call__(self, output, targets):
        if not self.checked:
            self.checked = True
            if softmax_logits(output) is not None and _expects_logits(self.loss):
                warnings.warn(
                    f"the model ends in a softmax but the loss {self.loss!r} expects logits: "
                    "it would train on log-probabilities of probabilities, slower and worse; "
                    "drop the softmax (the loss has it), or use a Keras loss with "
                    "from_logits=False (loss=\"sparse_categorical_crossentropy\")",
                    UserWarning, stacklevel=3)
        return self.loss(output, targets)


def _expects_logits(loss):
    if isinstance(loss, SparseCategoricalCrossentropy):
        return loss.expects_logits
    return isinstance(loss, losses.CrossEntropyLoss) or loss is losses.cross_entropy


def _check_fraction(value, where):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{where}: validation_split must be a fraction in [0, 1), got {value!r}")
    return float(value)


class KerasMethods:
    """``compile``, ``fit``, ``evaluate`` for ``nn.Model`` and ``nn.Sequential``."""

    def compile(self, optimizer="adam", loss=None, metrics=None):
        """Choose the optimizer (a name, Keras's default learning rate, or an ``optim``
        instance), the loss (a Keras name: ``"sparse_categorical_crossentropy"``,
        ``"categorical_crossentropy"``, ``"mse"``; or a callable ``loss(output, target)``)
        and the metrics (``["accuracy"]``) that ``fit`` and ``evaluate`` use."""
        import engine   # the facade: optim is imported on first use, never by the core
        if isinstance(optimizer, str):
            if optimizer.lower() not in engine.optim.OPTIMIZERS:
                raise ValueError(f"{self.name}.compile: unknown optimizer {optimizer!r}; "
                                 f"expected one of {sorted(engine.optim.OPTIMIZERS)} or an "
                                 "optim instance")
        elif not hasattr(optimizer, "step"):
            raise TypeError(f"{self.name}.compile: optimizer must be a name or an optim "
                            f"instance, got {optimizer!r}")
        if isinstance(loss, str):
            if loss not in LOSSES:
                raise ValueError(f"{self.name}.compile: unknown loss {loss!r}; expected one of "
                                 f"{sorted(LOSSES)} or a callable loss(output, target)")
            loss_name, loss = loss, LOSSES[loss]()
        elif callable(loss):
            loss_name = getattr(loss, "__name__", type(loss).__name__)
        else:
            raise TypeError(f"{self.name}.compile: loss must be a name or a callable "
                            f"loss(output, target), got {loss!r}")
        metrics = list(metrics or ())
        unknown = [m for m in metrics if m not in METRICS]
        if unknown:
            raise ValueError(f"{self.name}.compile: unknown metric(s) {unknown}; the engine "
                             f"reports {METRICS[0]!r}")
        self._keras = {"optimizer": optimizer, "loss": _CompiledLoss(loss),
                       "loss_name": loss_name, "accuracy": bool(metrics)}
        return None

    def _compiled(self, where):
        compiled = getattr(self, "_keras", None)
        if compiled is None:
            raise RuntimeError(f"{self.name}.{where}: call model.compile(optimizer=..., "
                               "loss=..., metrics=[...]) first")
        return compiled

    def _optimizer(self, compiled):
        """The compiled optimizer, made from its name on the first ``fit`` (the model is
        built by then) and kept, with its state, for the next."""
        optimizer = compiled["optimizer"]
        if isinstance(optimizer, str):
            import engine
            name = optimizer.lower()
            optimizer = getattr(engine.optim, engine.optim.OPTIMIZERS[name][1])(
                self.parameters(), lr=DEFAULT_LR[name])
            compiled["optimizer"] = optimizer
        return optimizer

    def _targets(self, compiled, y, where):
        """``y`` as the loss takes it: one-hot rows for a categorical cross-entropy become
        class indices (the same loss, the fused kernel, and an accuracy)."""
        y = y.numpy() if isinstance(y, Tensor) else np.asarray(y)
        loss = compiled["loss"].loss
        if type(loss) is CategoricalCrossentropy:
            labels = _one_hot_labels(y)
            if labels is not None:
                return labels, SparseCategoricalCrossentropy(loss.from_logits)
            if y.dtype.kind != "f":
                raise ValueError(f"{where}: categorical_crossentropy takes one-hot or "
                                 f"probability targets (float, classes last), got {y.dtype} "
                                 f"of shape {y.shape}; for class indices use "
                                 "\"sparse_categorical_crossentropy\"")
        return y, None

    def _loader(self, x, y, batch_size, shuffle):
        import engine
        x = x if isinstance(x, np.ndarray) and x.dtype.kind != "f" else self._host_input(x)
        return engine.data.DataLoader(x, y, batch_size=batch_size, shuffle=shuffle,
                                      device=self.device)

    def _build_for(self, x):
        if not self.built:
            x = np.asarray(x) if not isinstance(x, Tensor) else x
            dtype = x.dtype if x.dtype.kind in "iu" and x.dtype != np.uint8 else np.float32
            self.build(tuple(x.shape[1:]), dtype=dtype)

    def fit(self, x, y, batch_size=32, epochs=1, verbose=1, callbacks=None,
            validation_split=0.0, validation_data=None, shuffle=True):
        """Train on the arrays ``x``, ``y`` (Keras's ``Model.fit``): ``validation_split``
        holds out the last fraction of the samples (before shuffling, as Keras);
        ``validation_data=(x_val, y_val)`` gives them. Returns a History:
        ``history.history["loss"]`` (and ``"accuracy"``, ``"val_loss"``,
        ``"val_accuracy"``), one value per epoch; ``history.records`` the loop's records."""
        import engine   # the facade: the loop (engine.fit) imports nn, so nn never imports it
        where = f"{self.name}.fit"
        compiled = self._compiled("fit")
        x = x.numpy() if isinstance(x, Tensor) else np.asarray(x)
        y, loss = self._targets(compiled, y, where)
        if len(x) != len(y):
            raise ValueError(f"{where}: x has {len(x)} samples, y {len(y)}")
        split = _check_fraction(validation_split, where)
        if validation_data is not None:
            validation_data = (validation_data[0],
                               self._targets(compiled, validation_data[1], where)[0])
        elif split:
            at = int(math.ceil(len(x) * (1.0 - split)))   # Keras's split: the last part
            x, y, validation_data = x[:at], y[:at], (x[at:], y[at:])
        self._build_for(x)
        # the same loss object every call: fit keeps its captured step for it
        loss = compiled["loss"] if loss is None else compiled.setdefault(
            "one_hot_loss", _CompiledLoss(loss))
        test_loader = None
        if validation_data is not None:
            test_loader = self._loader(*validation_data, max(batch_size, 256), False)
        records = engine.fit.fit(self, self._loader(x, y, batch_size, shuffle),
                                 self._optimizer(compiled), loss, epochs, test_loader=test_loader,
                                 callbacks=list(callbacks or ()), progress=verbose == 1,
                                 verbose=bool(verbose))
        return History(records, compiled["accuracy"], test_loader is not None)

    def evaluate(self, x, y, batch_size=32, verbose=0):
        """The loss on ``x``, ``y`` (in eval mode), and ``[loss, accuracy]`` when compiled
        with ``metrics=["accuracy"]``, as Keras's ``Model.evaluate``."""
        import engine
        compiled = self._compiled("evaluate")
        y, loss = self._targets(compiled, y, f"{self.name}.evaluate")
        self._build_for(np.asarray(x) if not isinstance(x, Tensor) else x)
        loss_value, accuracy = engine.fit.evaluate(
            self, self._loader(x, y, batch_size, False), loss or compiled["loss"])
        return [loss_value, accuracy] if compiled["accuracy"] else loss_value


class History:
    """What ``model.fit`` returns, as Keras's: ``history`` maps each metric to its values
    per epoch; ``epoch`` lists the epochs (from 0); ``records`` are ``engine.fit``'s."""

    def __init__(self, records, accuracy, validation):
        self.records = list(records)
        self.epoch = list(range(len(self.records)))
        keys = [("loss", "loss")] + ([("accuracy", "train_acc")] if accuracy else [])
        if validation:
            keys += [("val_loss", "test_loss")] + (
                [("val_accuracy", "test_acc")] if accuracy else [])
        self.history = {name: [record[key] for record in self.records] for name, key in keys}

    def __repr__(self):
        return f"History({self.history})"
