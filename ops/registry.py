"""The op contract and the registry that lets tests enumerate every op.

An op is a class with a CPU path (``forward_cpu``, built on ``@njit`` kernels) and a CUDA
path (``forward_cuda``, built on ``@cuda.jit`` kernels) and one ``backward`` that maps the
upstream gradient to input gradients by the chain rule. One instance is made per call: it
keeps what backward needs (and only that) on ``self``.
"""
from ops.device import device_of

REGISTRY = {}


class Op:
    name = None           # registry key, also used in error messages
    cpu_kernels = ()      # the @njit kernels this op runs
    cuda_kernels = ()     # the @cuda.jit kernels this op runs
    is_view = False       # a view runs no kernel (reshape); every other op needs both kinds

    def __init__(self, **params):
        self.params = params
        self.needs_input_grad = ()

    def forward(self, *inputs):
        """Dispatch on the device of the first array input; returns one output array."""
        device = next(device_of(x) for x in inputs if hasattr(x, "shape"))
        if device == "cuda":
            return self.forward_cuda(*inputs)
        return self.forward_cpu(*inputs)

    def forward_cpu(self, *inputs):
        raise NotImplementedError(f"{self.name}: no CPU forward")

    def forward_cuda(self, *inputs):
        raise NotImplementedError(f"{self.name}: no CUDA forward")

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
