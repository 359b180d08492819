"""engine.vision.transforms against torch's arithmetic (torchvision is not installed: its
ToTensor is ``permute(2, 0, 1).float().div(255)`` of a uint8 image, its Normalize
``sub_(mean[:, None, None]).div_(std[:, None, None])``)."""
import numpy as np
import pytest
import torch

import engine
from engine.vision.transforms import Compose, Normalize, ToTensor, loader_form


def _images():
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)


def test_to_tensor_scales_uint8_channels_first_as_torchvision():
    image = _images()
    expected = torch.from_numpy(image).permute(2, 0, 1).float().div(255).numpy()
    out = ToTensor()(image)
    assert isinstance(out, engine.Tensor) and out.dtype == np.float32
    assert np.array_equal(out.numpy(), expected)
    gray = ToTensor()(image[:, :, 0])
    assert gray.shape == (1, 5, 7) and np.array_equal(gray.numpy()[0], expected[0])
    assert np.array_equal(ToTensor()(engine.tensor(image)).numpy(), expected)


def test_to_tensor_keeps_other_dtypes_and_refuses_other_ranks():
    values = np.linspace(0, 3, 12).reshape(3, 4)
    out = ToTensor()(values)
    assert out.dtype == np.float64 and np.array_equal(out.numpy()[0], values)
    with pytest.raises(ValueError, match=r"ToTensor: expected an image \[H, W\] or \[H, W, C\], "
                                         r"got shape \(2, 3, 4, 5\)"):
        ToTensor()(np.zeros((2, 3, 4, 5), np.uint8))


def test_to_tensor_takes_a_pil_image():
    from PIL import Image
    image = _images()[:, :, 0]
    assert np.array_equal(ToTensor()(Image.fromarray(image)).numpy(), ToTensor()(image).numpy())


def test_normalize_per_channel_as_torch():
    image = ToTensor()(_images())
    mean, std = (0.5, 0.25, 0.125), (0.2, 0.3, 0.4)
    expected = torch.from_numpy(image.numpy().copy())
    expected.sub_(torch.tensor(mean)[:, None, None]).div_(torch.tensor(std)[:, None, None])
    out = Normalize(mean, std)(image)
    assert np.array_equal(out.numpy(), expected.numpy())
    assert not np.array_equal(image.numpy(), out.numpy())   # not in place by default
    one = Normalize((0.5,), (0.2,))(image)
    assert np.allclose(one.numpy(), (image.numpy() - 0.5) / 0.2, rtol=1e-6)
    same = Normalize(mean, std, inplace=True)(image)
    assert same is image and np.array_equal(image.numpy(), expected.numpy())


def test_normalize_refuses_what_it_cannot_do():
    image = ToTensor()(_images())
    with pytest.raises(ValueError, match="Normalize: std .* has a zero"):
        Normalize((0.5,), (0.0,))(image)
    with pytest.raises(ValueError, match=r"need 1 or 3 values .*shape \(3, 5, 7\)"):
        Normalize((0.5, 0.5), (1.0, 1.0))(image)
    with pytest.raises(TypeError, match="put ToTensor\\(\\) before it.*ndarray"):
        Normalize((0.5,), (1.0,))(_images())


def test_compose_runs_in_order_and_loader_form_recognises_only_what_it_can_batch():
    chain = Compose([ToTensor(), Normalize((0.1307,), (0.3081,))])
    image = _images()[:, :, 0]
    assert np.array_equal(chain(image).numpy(),
                          Normalize((0.1307,), (0.3081,))(ToTensor()(image)).numpy())
    assert loader_form(ToTensor(), channels=1).normalize is None
    mean, std = loader_form(chain, channels=1).normalize
    assert mean.shape == std.shape == (1, 1, 1) and mean.dtype == np.float32
    for other in (Compose([]), Compose([Normalize((0.5,), (1.0,)), ToTensor()]),
                  Compose([ToTensor(), lambda x: x]), lambda x: x,
                  Compose([ToTensor(), Normalize((0.5,) * 3, (1.0,) * 3)])):
        assert loader_form(other, channels=1) is None
