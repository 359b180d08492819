"""Optimizers whose updates are kernels: SGD (momentum, Nesterov), Adam, AdamW, L2 weight
decay, gradient clipping and learning-rate schedules.

Each update rule is one ``@njit`` CPU kernel and one ``@cuda.jit`` kernel over flat buffers
(parameters, gradients, state). For parameters packed in one ``FlatBuffer`` (what
``engine.nn`` models do), ``step()`` is one launch per param group; ``zero_grad()`` is none.
"""
from optim import lr_scheduler  # noqa: F401
from optim.adam import Adam, AdamW  # noqa: F401
from optim.clip import clip_grad_norm_, clip_grad_value_  # noqa: F401
from optim.optimizer import Optimizer  # noqa: F401
from optim.rmsprop import RMSprop  # noqa: F401
from optim.sgd import SGD  # noqa: F401
