"""The op contract and the registry that lets tests enumerate every op.

An op is a class: one instance per call keeps what its backward needs (and only that) on
``self``. It declares

- its checks: every array input on one device (``host_inputs`` may come from the host),
  float inputs of one dtype (``same_dtype``), integer arrays only at ``integer_inputs``, and
  ``check(*inputs)`` for its shapes and parameters; ``op(*inputs)`` runs them, then
  ``forward``;
- ``kernels``: the ``ops.launch.Kernel`` pairs its forward and backward run (a test records
  the runs of every op's cases and proves the list exact);
- ``forward(*inputs)`` -> the output array, and ``backward(grad_out, grad_dst)`` -> one input
  gradient (or None) per input, from the upstream gradient by the chain rule. Both run their
  kernels through ``ops.dispatch.run``, which allocates and picks the device.
"""
import numpy as np

from ops.cuda import is_device_array
from ops.device import device_of

REGISTRY = {}
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class Op:
    name = None           # registry key, also used in error messages
    kernels = ()          # the Kernel pairs this op runs (forward and backward)
    is_view = False       # a view runs no kernel (reshape); every other op declares kernels
    integer_inputs = ()   # input positions that take integer arrays (class labels)
    host_inputs = ()      # input positions that may be host arrays beside device ones
    same_dtype = True     # the float inputs must share one dtype
    # ``onnx(self, graph, inputs)`` -> the name of the ONNX value computing this op's output
    # from ``inputs`` (the names of its inputs'), through ``graph``'s ``node``/``constant``
    # (engine.onnx's builder, duck-typed: ops import nothing of the engine); None: an op
    # that no ONNX export takes
    onnx = None

    def __init__(self, **params):
        self.params = params
        self.needs_input_grad = ()

    def __call__(self, *inputs):
        """The forward, after the declared checks (one pass over the inputs: this runs for
        every op of every step)."""
        on_device = dtype = None
        for position, x in enumerate(inputs):
            if position not in self.host_inputs:
                here = type(x) is not np.ndarray and is_device_array(x)
                if on_device is None:
                    on_device = here
                elif here != on_device:
                    self._refuse_devices(inputs)
            kind = x.dtype
            if position in self.integer_inputs:
                if kind.kind not in "iu":
                    raise TypeError(f"{self.name}: labels must be integers, got {kind}")
            elif kind is not dtype:
                if kind not in FLOAT_DTYPES:
                    raise TypeError(f"{self.name}: input {position} has dtype {kind}; "
                                    "expected float32 or float64")
                if dtype is not None and self.same_dtype and kind != dtype:
                    names = ", ".join(str(a.dtype) for i, a in enumerate(inputs)
                                      if i not in self.integer_inputs)
                    raise TypeError(f"{self.name}: inputs have different dtypes ({names}); "
                                    "cast one first")
                dtype = kind
        self.check(*inputs)
        return self.forward(*inputs)

    def _refuse_devices(self, inputs):
        shapes = ", ".join(f"{device_of(a)} {tuple(a.shape)}" for a in inputs)
        raise ValueError(f"{self.name}: inputs live on different devices ({shapes})")

    def check(self, *inputs):
        """Raise ValueError naming the op and the shapes when ``inputs`` do not fit (subclasses)."""

    def forward(self, *inputs):
        raise NotImplementedError(f"{self.name}: no forward")

    def backward(self, grad_out, grad_dst):
        """Input gradients (an array or None per input) from ``grad_out``.

        ``grad_dst`` holds, per input, a preallocated buffer the gradient may be written into
        (a parameter's slot in a flat gradient buffer), or None. An op that writes there
        returns that buffer; one that ignores it returns a fresh array and the tape copies.
        """
        raise NotImplementedError(f"{self.name}: no backward")


def register(cls):
    if not cls.name:
        raise ValueError(f"{cls.__name__}: an op needs a name to be registered")
    if cls.name in REGISTRY:
        raise ValueError(f"op {cls.name!r} is registered twice")
    REGISTRY[cls.name] = cls
    return cls
