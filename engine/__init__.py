"""A Numba-JIT neural-net engine: Tensors, tape autograd, layers, losses.

``engine.optim`` and ``engine.data`` are the top-level ``optim`` and ``data`` packages,
imported on first use so that the engine core never depends on them.
"""
import importlib

from engine import debug  # noqa: F401
from engine.autograd import (AnomalyError, detect_anomaly, enable_grad,  # noqa: F401
                             is_grad_enabled, no_grad, set_grad_enabled)
from engine.functional import (add, div, exp, flatten, leaky_relu, log, log_softmax,  # noqa: F401
                               matmul, max, mean, mul, neg, pow, relu, reshape, sigmoid,
                               softmax, sqrt, sub, sum, tanh, transpose)
from engine.gradcheck import GradcheckError, gradcheck  # noqa: F401
from engine.random import manual_seed  # noqa: F401
from engine.tensor import Tensor, from_dlpack, full, ones, randn, tensor, zeros  # noqa: F401
from ops.device import cuda_available  # noqa: F401

_LAZY_SUBMODULES = {"optim": "optim", "data": "data", "nn": "engine.nn",
                    "losses": "engine.losses", "init": "engine.init", "train": "engine.train",
                    "interop": "engine.interop"}


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        module = importlib.import_module(_LAZY_SUBMODULES[name])
        globals()[name] = module
        return module
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
