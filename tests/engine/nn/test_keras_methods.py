"""Keras's model methods (compile, fit, evaluate, predict) on Sequential and nn.Model."""
import warnings

import numpy as np
import pytest

import engine
from engine import losses, nn


def _data(n=200, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 6)).astype(np.float32)
    return x, ((x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.3)).astype(np.int64)


def _softmax_model():
    engine.manual_seed(0)
    return nn.Sequential([nn.Dense(32, activation="relu", input_shape=(6,)),
                          nn.Dense(3, activation="softmax")])


def test_compile_fit_evaluate_predict_with_validation_split():
    x, y = _data()
    model = _softmax_model()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    history = model.fit(x, y, batch_size=16, epochs=20, validation_split=0.2, verbose=0)
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert len(history.history["loss"]) == 20
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert history.history["accuracy"][-1] > 0.6
    loss, accuracy = model.evaluate(x[160:], y[160:])
    # validation_split holds out the LAST 20% (Keras's): evaluate on them agrees
    assert loss == pytest.approx(history.history["val_loss"][-1], rel=1e-5)
    assert accuracy == pytest.approx(history.history["val_accuracy"][-1])
    probabilities = model.predict(x[:4])
    np.testing.assert_allclose(probabilities.sum(axis=1), 1, rtol=1e-5)


def test_one_hot_targets_train_as_their_class_indices():
    x, y = _data()
    one_hot = np.eye(3, dtype=np.float32)[y]
    runs = []
    for targets, loss in ((one_hot, "categorical_crossentropy"),
                          (y, "sparse_categorical_crossentropy")):
        model = _softmax_model()
        model.compile(optimizer="sgd", loss=loss, metrics=["accuracy"])
        runs.append(model.fit(x, targets, epochs=2, shuffle=False, verbose=0).history)
    assert runs[0] == runs[1]


def test_probability_targets_and_mse():
    x, y = _data()
    soft = np.full((len(y), 3), 0.05, np.float32)
    soft[np.arange(len(y)), y] = 0.9
    model = _softmax_model()
    model.compile(optimizer="adam", loss="categorical_crossentropy")
    history = model.fit(x, soft, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert set(history.history) == {"loss"}
    regression = nn.Sequential([nn.Dense(8, activation="tanh", input_shape=(6,)), nn.Dense(1)])
    regression.compile(optimizer="adam", loss="mse")
    target = x[:, :1] * 0.5
    history = regression.fit(x, target, epochs=5, verbose=0, validation_data=(x[:50],
                                                                              target[:50]))
    assert history.history["val_loss"][-1] < history.history["val_loss"][0]
    assert regression.evaluate(x, target) == pytest.approx(
        float(np.mean((regression.predict(x) - target) ** 2)), rel=1e-4)


def test_a_softmax_output_with_a_loss_expecting_logits_warns():
    x, y = _data()
    model = _softmax_model()
    model.compile(optimizer="adam", loss=losses.CrossEntropyLoss())
    with pytest.warns(UserWarning, match="from_logits"):
        model.fit(x, y, epochs=1, verbose=0)
    logits_model = nn.Sequential([nn.Dense(3, input_shape=(6,))])
    logits_model.compile(optimizer="adam",
                         loss=nn.SparseCategoricalCrossentropy(from_logits=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logits_model.fit(x, y, epochs=1, verbose=0)


def test_keras_methods_on_a_model_with_any_forward():
    class TwoPaths(nn.Model):
        def __init__(self):
            super().__init__()
            self.left, self.right = nn.Dense(16, activation="relu"), nn.Dense(16)
            self.head = nn.Dense(3)

        def forward(self, x):
            return self.head(self.left(x) + self.right(x))

    x, y = _data()
    engine.manual_seed(0)
    model = TwoPaths()
    model.compile(optimizer="adam",
                  loss=nn.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    history = model.fit(x, y, epochs=4, batch_size=16, verbose=0)   # built by fit
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert model.predict(x[:7]).shape == (7, 3)


def test_bad_compile_arguments():
    model = _softmax_model()
    with pytest.raises(RuntimeError, match="compile"):
        model.fit(*_data(), verbose=0)
    with pytest.raises(ValueError, match="unknown optimizer 'adamx'"):
        model.compile(optimizer="adamx", loss="mse")
    with pytest.raises(ValueError, match="unknown loss 'hinge'"):
        model.compile(loss="hinge")
    with pytest.raises(ValueError, match="unknown metric"):
        model.compile(loss="mse", metrics=["auc"])
    model.compile(loss="categorical_crossentropy")
    with pytest.raises(ValueError, match="sparse_categorical_crossentropy"):
        model.fit(*_data(), verbose=0)
    model.compile(loss="mse")
    with pytest.raises(ValueError, match="validation_split"):
        model.fit(_data()[0], np.zeros((200, 3), np.float32), validation_split=1.5, verbose=0)
