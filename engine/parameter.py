"""Parameters and the flat buffers that hold them.

A model's parameters of one device and dtype live in one contiguous data buffer, and their
gradients in another; each Parameter's ``.data`` and gradient slot are views into them. So
an optimizer updates every parameter with one kernel over the flat buffers, a gradient norm
is one reduction, ``model.to(device)`` is one copy, and ``zero_grad`` needs no kernel: it
marks the slots stale and the next backward overwrites them instead of accumulating.
"""
import numpy as np

from engine.tensor import Tensor
from ops.device import device_of, to_device
from ops.memory import empty


class Parameter(Tensor):
    """A Tensor that requires grad and that optimizers update in place."""

    def __init__(self, data):
        super().__init__(data, requires_grad=True)
        self.flat = None   # the FlatBuffer holding it, once packed

    def __repr__(self):
        return "Parameter(" + super().__repr__()[len("tensor("):]


class FlatBuffer:
    """One data buffer and one gradient buffer for ``params`` (all of one device and dtype).

    ``offsets[i]`` is where ``params[i]`` starts in both buffers."""

    def __init__(self, params):
        params = list(params)
        if not params:
            raise ValueError("FlatBuffer: no parameters to pack")
        devices = {p.device for p in params}
        dtypes = {p.dtype for p in params}
        if len(devices) > 1 or len(dtypes) > 1:
            raise ValueError(f"FlatBuffer: parameters must share one device and dtype, got "
                             f"{sorted(devices)} and {sorted(str(d) for d in dtypes)}")
        self.params = params
        self.offsets = list(np.cumsum([0] + [p.size for p in params[:-1]]))
        self.size = int(sum(p.size for p in params))
        host = np.empty(self.size, params[0].dtype)
        for p, offset in zip(params, self.offsets):
            host[offset:offset + p.size] = p.numpy().reshape(-1)
        self._bind(to_device(host, params[0].device), valid=False)

    @property
    def device(self):
        return device_of(self.data)

    @property
    def dtype(self):
        return np.dtype(self.data.dtype)

    def _bind(self, data, valid):
        self.data = data
        self.grad = empty(self.size, data.dtype, device_of(data))
        for p, offset in zip(self.params, self.offsets):
            p.data = data[offset:offset + p.size].reshape(p.shape)
            p._grad_buffer = self.grad[offset:offset + p.size].reshape(p.shape)
            p._grad_valid = valid
            p.flat = self

    def to(self, device):
        """Move both buffers in one copy each; parameters keep their identity."""
        if device == self.device:
            return self
        grads_valid = [p._grad_valid for p in self.params]
        old_grad = self.grad
        self._bind(to_device(self.data, device), valid=False)
        if all(grads_valid):
            self.grad = to_device(old_grad, device)
            for p, offset in zip(self.params, self.offsets):
                p._grad_buffer = self.grad[offset:offset + p.size].reshape(p.shape)
                p._grad_valid = True
        return self

    def grads_valid(self):
        """True when every parameter's gradient slot holds a gradient (none stale)."""
        return all(p._grad_valid for p in self.params)

    def invalidate_grads(self):
        """``zero_grad`` without a kernel: the next backward overwrites instead of adding."""
        for p in self.params:
            p._grad_valid = False
