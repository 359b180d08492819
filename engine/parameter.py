"""Parameters, the flat buffers that hold them, and the store that packs a model's.

A model's parameters of one device and dtype live in one contiguous data buffer, and their
gradients in another (a ``FlatBuffer``); each Parameter's ``.data`` and gradient slot are
views into them. So an optimizer updates every parameter with one kernel over the flat
buffers, a gradient norm is one reduction, and ``model.to(device)`` is one copy per buffer.
A ``ParameterStore`` packs a model's parameters into one FlatBuffer per device and dtype.

The gradient-slot protocol of a packed parameter (the slot methods of
``engine.autograd.Value``, implemented by the FlatBuffer):

- a slot is *valid* (it holds the gradient: ``p.grad`` is a view of it) or *stale*
  (``p.grad`` is None);
- ``zero_grad`` (``p.grad = None``) marks a slot stale and launches nothing;
- a backward offers a stale slot to the op as the destination of that gradient (an op may
  write there directly) or copies into it, then marks it valid; into a valid slot it adds.

A Parameter not packed yet keeps its gradient in an array of its own, as any tensor.
"""
import numpy as np

from engine.tensor import Tensor
from ops.device import copy_into, device_of, to_device, to_host
from ops.elementwise import add_arrays
from ops.fill import fill
from ops.memory import empty


class _Values:
    """A Parameter's ``data`` as assigned: reads find the instance's own (this descriptor has
    no ``__get__``: no cost on the hot path); an assignment to a packed Parameter takes it
    out of its FlatBuffer first. The buffer's views are bound past it (``FlatBuffer._bind``);
    torch's ``p.data = values`` (a custom init, an EMA) gives the Parameter values of its
    own, and an optimizer stepping the buffer would no longer reach them."""

    def __set__(self, p, value):
        if isinstance(value, Tensor):   # torch's p.data is a tensor; the engine's an array
            value = value.data
        if p.__dict__.get("flat") is not None:
            p._unpack(value)
        p.__dict__["data"] = value


class Parameter(Tensor):
    """A Tensor that requires grad and that optimizers update in place."""
    data = _Values()

    def __init__(self, data):
        super().__init__(data, requires_grad=True)
        self.flat = None    # the FlatBuffer holding it, once packed
        self._slot = None   # its index in that buffer

    def __repr__(self):
        return "Parameter(" + super().__repr__()[len("tensor("):]

    def __getstate__(self):
        """What ``copy.deepcopy`` and ``pickle`` copy: a packed Parameter's values are a view
        of its FlatBuffer, which is copied along (``flat``) and binds the copy's views again
        (``FlatBuffer.__setstate__``); copied apart, the copy's values were an array of their
        own, so an optimizer of a deep-copied model moved a buffer its Parameters no longer
        read (it trained nothing) and its ``load_state_dict`` wrote nowhere they read."""
        state = self.__dict__.copy()
        if state.get("flat") is not None:
            del state["data"]
        return state

    def _unpack(self, value):
        """Leave the FlatBuffer before ``value`` becomes the values (``_Values``); the
        gradient stays when the shape does, as torch's ``.grad`` does."""
        grad = self.flat.slot_gradient(self._slot)
        self.__dict__["flat"] = self.__dict__["_slot"] = None
        same = grad is not None and tuple(np.shape(value)) == tuple(grad.shape)
        self._grad = to_device(grad, device_of(value)) if same else None
        self._bump_version()

    def _grad_array(self):
        if self.flat is None:
            return super()._grad_array()
        return self.flat.slot_gradient(self._slot)

    def _store_grad(self, data):
        if self.flat is None:
            super()._store_grad(data)
        else:
            self.flat.store_gradient(self._slot, data)

    def _accumulate_grad(self, g):
        if self.flat is None:
            super()._accumulate_grad(g)
        else:
            self.flat.accumulate_gradient(self._slot, g)

    def _grad_destination(self):
        return None if self.flat is None else self.flat.gradient_destination(self._slot)


def zero_grads(params, set_to_none=True):
    """torch's ``zero_grad`` over ``params``: forget each gradient (a packed one's slot is
    marked stale, no kernel), or with ``set_to_none=False`` write zeros into each gradient
    that exists (those that are None stay None). Zeros are a gradient: a parameter the next
    backward does not reach is still updated (momentum, weight decay), as in torch."""
    for p in params:
        if set_to_none:
            p.grad = None
            continue
        grad = p.grad
        if grad is not None:
            fill(grad.data, 0)   # in place: a packed gradient stays its buffer's slot


class FlatBuffer:
    """One data buffer and one gradient buffer for ``params`` (all of one device and dtype).

    ``offsets[i]`` is where ``params[i]`` starts in both buffers; slot ``i`` is its part of
    ``grad``. Packing copies each parameter's values in and makes its ``.data`` a view."""

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
        # the views' shapes, also for binding a copy whose parameters have no values yet
        self._shapes = [p.shape for p in params]
        self.offsets = list(np.cumsum([0] + [p.size for p in params[:-1]]))
        self.size = int(sum(p.size for p in params))
        host = np.empty(self.size, params[0].dtype)
        for p, offset in zip(params, self.offsets):
            host[offset:offset + p.size] = p.numpy().reshape(-1)
        self._bind(to_device(host, params[0].device))

    def __getstate__(self):
        """Its arrays and parameters, without the views into them (``__setstate__`` makes
        the copy's parameters views of the copy's arrays again: ``Parameter.__getstate__``)."""
        state = self.__dict__.copy()
        del state["_slots"]
        return state

    def __setstate__(self, state):
        valid = state.pop("_valid")
        self.__dict__.update(state)
        self._bind(self.data, self.grad)
        self._valid = valid

    @property
    def device(self):
        return device_of(self.data)

    @property
    def dtype(self):
        return np.dtype(self.data.dtype)

    def _bind(self, data, grad=None):
        """Make ``data`` (and ``grad``: valid gradients, or None for a new stale buffer) the
        buffers, and every parameter's data and slot views into them."""
        self.data = data
        self.grad = empty(self.size, data.dtype, device_of(data)) if grad is None else grad
        self._slots = []
        for index, (p, offset, shape) in enumerate(zip(self.params, self.offsets,
                                                       self._shapes)):
            end = offset + int(np.prod(shape, dtype=np.int64))
            p.__dict__["data"] = data[offset:end].reshape(shape)   # past _Values: a view
            self._slots.append(self.grad[offset:end].reshape(shape))
            p.flat, p._slot = self, index
        self._valid = [grad is not None] * len(self.params)

    def to(self, device):
        """Move both buffers in one copy each; parameters keep their identity. The gradients
        move along when every slot is valid, else every slot is stale after the move."""
        if device == self.device:
            return self
        grad = to_device(self.grad, device) if self.grads_valid() else None
        self._bind(to_device(self.data, device), grad)
        return self

    # ----------------------------------------------------------- the gradient slots
    def slot_gradient(self, index):
        """Slot ``index`` when it holds a gradient, else None."""
        return self._slots[index] if self._valid[index] else None

    def store_gradient(self, index, data):
        """Copy ``data`` into slot ``index`` (valid), or mark it stale when ``data`` is None."""
        if data is not None:
            copy_into(self._slots[index], data)
        self._valid[index] = data is not None

    def accumulate_gradient(self, index, g):
        """Add ``g`` into slot ``index``; a stale slot is overwritten (unless ``g`` is the slot
        itself, written by the op through ``gradient_destination``)."""
        slot = self._slots[index]
        if self._valid[index]:
            add_arrays(slot, g, out=slot)
        else:
            if g is not slot:
                copy_into(slot, g)
            self._valid[index] = True

    def gradient_destination(self, index):
        """Slot ``index`` while it is stale (a backward rule may write its gradient there),
        else None."""
        return None if self._valid[index] else self._slots[index]

    def grads_valid(self):
        """True when every parameter's gradient slot holds a gradient (none stale)."""
        return all(self._valid)

    def invalidate_grads(self):
        """``zero_grad`` without a kernel: the next backward overwrites instead of adding."""
        self._valid = [False] * len(self.params)


class ParameterStore:
    """A model's parameters packed into FlatBuffers: one per (device, dtype), in the order
    those first appear in ``params``, each holding its parameters in ``params`` order.

    Iterating (and indexing) gives the FlatBuffers."""

    def __init__(self, params):
        groups = {}
        for p in params:
            groups.setdefault((p.device, p.dtype), []).append(p)
        self.buffers = [FlatBuffer(group) for group in groups.values()]

    def __iter__(self):
        return iter(self.buffers)

    def __len__(self):
        return len(self.buffers)

    def __getitem__(self, index):
        return self.buffers[index]

    def to(self, device):
        """Move every buffer to ``device``, one copy each."""
        for buffer in self.buffers:
            buffer.to(device)
        return self

    def stale(self):
        """Whether another store has packed some of its parameters since (a layer shared by
        two models, each called as a root): their values are no longer in this one's
        buffers, which ``host_values`` and ``load`` then go around."""
        return any(p.flat is not buffer for buffer in self.buffers for p in buffer.params)

    def host_values(self):
        """``{id(p): NumPy array}``: every parameter's values, one host copy per buffer (a
        parameter another store packed since: a copy of its own values)."""
        values = {}
        for buffer in self.buffers:
            host = to_device(buffer.data, "cpu")
            for p, offset in zip(buffer.params, buffer.offsets):
                values[id(p)] = (host[offset:offset + p.size].reshape(p.shape)
                                 if p.flat is buffer else to_device(p.data, "cpu"))
        return values

    def load(self, values):
        """Write ``values`` (``{id(p): array of p's shape}``, one for every parameter, cast to
        the buffer's dtype) into the buffers, one copy each. Each parameter is written in
        place, so its version moves on: a backward through a graph that saved one raises,
        as after torch's ``load_state_dict``."""
        for buffer in self.buffers:
            host = np.empty(buffer.size, buffer.dtype)
            for p, offset in zip(buffer.params, buffer.offsets):
                host[offset:offset + p.size] = values[id(p)].reshape(-1)
                if p.flat is not buffer:   # packed by another store since: where it reads
                    copy_into(p.data, host[offset:offset + p.size].reshape(p.shape))
                p._bump_version()
            copy_into(buffer.data, host)
