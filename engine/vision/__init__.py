"""torchvision's MNIST-family data sets and their transforms, on the engine.

```python
from engine.vision import datasets
from engine.vision.transforms import ToTensor
training_data = datasets.MNIST(root="data", train=True, download=True, transform=ToTensor())
image, label = training_data[0]            # float32 Tensor [1, 28, 28] in [0, 1], int
```

``engine.data.DataLoader(training_data, batch_size=64)`` takes such a set whole (no
per-sample Python): ``datasets`` and ``transforms`` say how.
"""
from engine.vision import datasets, transforms  # noqa: F401
