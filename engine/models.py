"""The model recipes: the MLP and the CNN that ``python -m engine.train`` trains and the
benchmarks measure (``bench.mlp``, ``bench.cnn``, ``bench.distributed``), built from
``engine.nn`` layers, as ``torchvision.models`` builds its networks.

```python
from engine import models
model = models.build_mlp((28, 28), (256, 128), 10)          # Flatten, Dense 256 relu, 128 relu, 10
model = models.build_cnn((28, 28), 10, models.preprocessing(images, (0.1307, 0.3081)))
```

``preprocessing`` gives the first layers that take images as the data set ships them (uint8
0-255); ``data.datasets.pixel_statistics`` computes its ``(mean, std)``.
"""
import numpy as np

from engine import nn
from engine.gpt import GPT, gpt_loss, init_like_nanogpt  # noqa: F401  (gpt_loss: the recipe's loss)

MODELS = ("mlp", "cnn")
CNN_DESCRIPTION = "conv32-maxpool-conv64-batchnorm-avgpool-128"


def parse_widths(text):
    """The layer widths of ``"256,128"`` as a tuple; a ValueError naming ``text`` unless it
    is positive integers separated by commas."""
    try:
        widths = tuple(int(part) for part in text.split(","))
    except ValueError:
        widths = ()
    if not widths or min(widths) < 1:
        raise ValueError(f"{text!r}: expected positive layer widths separated by commas, "
                         "like 256,128")
    return widths


def preprocessing(images, normalize):
    """The layers that take ``images`` as the data set ships them to what the network trains
    on: ``Rescaling(1 / 255)`` for uint8 (the loader's scaling), then ``Normalization`` with
    the training images' ``normalize=(mean, std)``. The CLI's models start with them, so the
    saved model and its ONNX export both take raw images."""
    scale = 1 / 255 if images.dtype == np.uint8 else 1.0
    mean, std = normalize
    return [nn.Rescaling(scale, input_shape=images.shape[1:]), nn.Normalization(mean, std ** 2)]


def build_mlp(input_shape, hidden, classes, first_layers=()):
    """``first_layers`` (``preprocessing``), Flatten, then a ReLU Dense layer per hidden
    width, then a linear Dense to ``classes``."""
    layers = list(first_layers) + [nn.Flatten(input_shape=None if first_layers
                                              else tuple(input_shape))]
    layers += [nn.Dense(width, activation="relu") for width in hidden]
    layers.append(nn.Dense(classes))
    return nn.Sequential(layers)


def build_cnn(input_shape, classes, first_layers=()):
    """``first_layers`` (``preprocessing``), then the network engine/API.md lists under
    "Models" for images of ``input_shape`` (height, width), as one channel.
    A ValueError unless ``input_shape`` has two dimensions."""
    if len(input_shape) != 2:
        raise ValueError(f"cnn takes images of (height, width), got samples of shape "
                         f"{tuple(input_shape)}")
    return nn.Sequential(list(first_layers) + [
        nn.Reshape((1,) + tuple(input_shape),
                   input_shape=None if first_layers else tuple(input_shape)),
        nn.Conv2D(32, 3, padding="same", activation="relu"),
        nn.MaxPool2D(2),
        nn.Conv2D(64, 3, padding="same", activation="relu"),
        nn.BatchNorm(),
        nn.AvgPool2D(2),
        nn.Flatten(),
        nn.Dense(128, activation="relu"),
        nn.Dense(classes),
    ])


def build_model(name, input_shape, hidden, classes, first_layers=()):
    """``build_mlp`` (``hidden`` its widths) or ``build_cnn`` (``hidden`` unused) by name,
    one of ``MODELS``."""
    if name == "cnn":
        return build_cnn(input_shape, classes, first_layers)
    if name == "mlp":
        return build_mlp(input_shape, hidden, classes, first_layers)
    raise ValueError(f"unknown model {name!r}: expected one of {', '.join(MODELS)}")


def build_gpt(vocab_size, block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.0,
              device="cpu"):
    """nanoGPT's GPT (``engine.gpt.GPT``), built on ``device`` for (N, ``block_size``) ids,
    its weights drawn as nanoGPT draws them. The defaults are nanoGPT's CPU configuration of
    the character-level Shakespeare model."""
    model = GPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout)
    model.build((block_size,), device=device, dtype=np.int64)
    return init_like_nanogpt(model)
