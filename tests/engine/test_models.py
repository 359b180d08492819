"""The recipes the CLI and the benchmarks share: engine.models (the networks) and
data.datasets (a data set by name, its pixel statistics)."""
import numpy as np
import pytest

from data import datasets
from engine import models, nn, train


def test_the_command_names_the_recipes_own_choices():
    """engine.train spells them out for its help, answered before Numba is imported: the
    image recipes' data sets and models, then the GPT's."""
    from engine.cli.gpt_run import GPT_DATASETS
    assert train.DATASETS == datasets.DATASETS + GPT_DATASETS
    assert train.MODELS == models.MODELS + ("gpt",)


def test_parse_widths():
    assert models.parse_widths("256,128") == (256, 128)
    for text in ("", "a,b", "16,0", "16,,8"):
        with pytest.raises(ValueError, match="expected positive layer widths separated by "
                                             "commas, like 256,128"):
            models.parse_widths(text)


def test_build_model_by_name():
    mlp = models.build_model("mlp", (28, 28), (16,), 10)
    assert [type(layer) for layer in mlp] == [nn.Flatten, nn.Dense, nn.Dense]
    assert mlp[1].units == 16 and mlp[1].activation == "relu" and mlp[2].units == 10
    cnn = models.build_model("cnn", (28, 28), (16,), 10)
    assert type(cnn[0]) is nn.Reshape and type(cnn[-1]) is nn.Dense
    with pytest.raises(ValueError, match=r"cnn takes images of \(height, width\), got "
                                         r"samples of shape \(784,\)"):
        models.build_model("cnn", (784,), (), 10)
    with pytest.raises(ValueError, match="unknown model 'vit': expected one of mlp, cnn"):
        models.build_model("vit", (28, 28), (), 10)


def test_preprocessing_takes_raw_images():
    images = np.array([[[0, 255]], [[255, 0]]], np.uint8)
    rescaling, normalization = models.preprocessing(images, (0.5, 0.25))
    assert type(rescaling) is nn.Rescaling and type(normalization) is nn.Normalization
    model = models.build_mlp(images.shape[1:], (), 2, [rescaling, normalization])
    assert model[0] is rescaling and type(model[2]) is nn.Flatten


def test_load_dataset():
    (x_train, y_train), (x_test, y_test) = datasets.load_dataset("mnist", limit=7)
    assert x_train.shape == (7, 28, 28) and x_test.shape == (7, 28, 28)
    assert x_train.dtype == np.uint8 and y_train.shape == y_test.shape == (7,)
    with pytest.raises(ValueError, match="unknown dataset 'cifar': expected one of mnist, "
                                         "fashion-mnist"):
        datasets.load_dataset("cifar")
    with pytest.raises(ValueError, match="cannot load mnist from /nonexistent: ") as error:
        datasets.load_dataset("mnist", "/nonexistent")
    assert isinstance(error.value.__cause__, OSError)
