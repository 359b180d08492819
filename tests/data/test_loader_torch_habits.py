"""DataLoader as a PyTorch user writes it: over a map-style Dataset, with loader.dataset."""
import numpy as np
import pytest

import data


class Squares:
    """A torch-style map dataset: (sample, target) pairs by index."""

    def __len__(self):
        return 10

    def __getitem__(self, index):
        return np.full((2, 3), index, np.float32), index % 3


def test_a_map_style_dataset_is_read_once_and_batched():
    loader = data.DataLoader(Squares(), batch_size=4)
    assert len(loader.dataset) == 10 and isinstance(loader.dataset, Squares)
    batches = [(x.numpy(), y.numpy()) for x, y in loader]
    assert [x.shape for x, _ in batches] == [(4, 2, 3), (4, 2, 3), (2, 2, 3)]
    np.testing.assert_array_equal(batches[1][0][:, 0, 0], [4, 5, 6, 7])
    np.testing.assert_array_equal(batches[2][1], [2, 0])
    assert len(data.DataLoader(Squares(), 5)) == 2   # torch's positional batch size


def test_a_torch_dataset_of_tensors():
    torch = pytest.importorskip("torch")
    dataset = torch.utils.data.TensorDataset(torch.arange(12.0).reshape(6, 2), torch.arange(6))
    loader = data.DataLoader(dataset, batch_size=6)
    (x, y), = list(loader)
    np.testing.assert_array_equal(x.numpy(), np.arange(12.0).reshape(6, 2))
    np.testing.assert_array_equal(y.numpy(), np.arange(6))


def test_arrays_give_a_dataset_of_pairs():
    x, y = np.zeros((7, 3), np.float32), np.arange(7)
    loader = data.DataLoader(x, y, batch_size=2)
    assert len(loader.dataset) == 7 and loader.dataset[3][1] == 3


def test_a_loader_without_targets_says_what_it_expects():
    with pytest.raises(TypeError, match=r"expects \(x, y\) arrays or a dataset"):
        data.DataLoader(np.zeros((4, 2)))

    class Broken(Squares):
        def __getitem__(self, index):
            return float(index)   # no target
    with pytest.raises(TypeError, match=r"dataset\[0\] must be a \(sample, target\) pair"):
        data.DataLoader(Broken())
