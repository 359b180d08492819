"""``keras.datasets``: ``mnist.load_data()`` and ``fashion_mnist.load_data()``, the engine's
``data.mnist`` (shipped) and ``data.fashion_mnist`` (see its doc for where it is read)."""


class _DataSet:
    """A data set with Keras's ``load_data()``: ``(x_train, y_train), (x_test, y_test)``,
    uint8 images ``(N, 28, 28)`` and uint8 labels."""

    def __init__(self, module_name):
        self._module_name = module_name

    def load_data(self):
        import importlib
        return importlib.import_module(f"data.{self._module_name}").load()


mnist = _DataSet("mnist")
fashion_mnist = _DataSet("fashion_mnist")
