"""Data: IDX files, MNIST (shipped, offline), Fashion-MNIST, the DataLoader, synthetic sets,
augmentations, and text: Shakespeare (shipped), a character tokenizer, a sequence loader.

```python
from engine import data
(x_train, y_train), (x_test, y_test) = data.mnist.load()     # uint8 [N, 28, 28], uint8 [N]
loader = data.DataLoader(x_train, y_train, batch_size=128, shuffle=True, seed=0, device="cuda")
for xb, yb in loader: ...                                      # float32 in [0, 1], int64 labels
```
"""
from data import datasets, fashion_mnist, mnist, shakespeare  # noqa: F401
from data.idx import read_idx, write_idx  # noqa: F401
from data.loader import ArrayDataset, DataLoader  # noqa: F401
from data.loader import ArrayDataset as TensorDataset  # noqa: F401  (torch's name)
from data.sequence_loader import SequenceLoader  # noqa: F401
from data.synthetic import blobs, spirals, xor  # noqa: F401
from data.tokenizer import CharTokenizer  # noqa: F401
from data.transforms import (Compose, GaussianNoise, RandomCrop, RandomFlip,  # noqa: F401
                             RandomShift)
