"""Keras's names over the engine, for a Keras program to run with its imports changed::

    from engine import keras
    from engine.keras import layers

    model = keras.Sequential([keras.Input(shape=(28, 28, 1)),
                              layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
                              layers.MaxPooling2D(pool_size=(2, 2)), layers.Flatten(),
                              layers.Dense(10, activation="softmax")])
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])

``keras.layers`` makes the engine's layers with Keras's defaults: images channels last
(NHWC, ``data_format="channels_last"``) and Glorot-uniform kernels with zero biases, so a
ported program reads its data and starts from its weights' distribution as in Keras. The
models are ``engine.nn``'s (``Sequential``, ``Model``) with Keras's ``compile``/``fit``/
``evaluate``/``predict``. ``keras.utils.to_categorical`` and ``keras.datasets.mnist`` /
``fashion_mnist`` (``load_data()``) are here too.
"""
from engine.keras import datasets, layers, utils  # noqa: F401
from engine.nn import Input, Model, Sequential  # noqa: F401
