"""Optimizers whose updates are kernels (every one ``OPTIMIZERS`` names, as torch.optim's),
gradient clipping and learning-rate schedules.

Each optimizer is a declaration (``optim.optimizer.Optimizer``'s doc): its update rule,
written once per element, becomes one ``@njit`` CPU kernel and one ``@cuda.jit`` kernel over
flat buffers (parameters, gradients, state) through ``optim.rule``. For parameters packed
in one ``FlatBuffer`` (what ``engine.nn`` models do), ``step()`` is one launch per param
group; ``zero_grad()`` is none.

The names are imported from their modules on first use: ``import optim`` imports no Numba,
so ``python -m engine.train --help`` lists ``OPTIMIZERS`` at once.
"""
import importlib

# every optimizer by the name ``python -m engine.train --optimizer`` takes: (module, class).
# A new optimizer is its module and one entry here; the command reads its choices from it.
OPTIMIZERS = {
    "adagrad": ("optim.adagrad", "Adagrad"),
    "adam": ("optim.adam", "Adam"),
    "adamax": ("optim.adamax", "Adamax"),
    "adamw": ("optim.adam", "AdamW"),
    "nadam": ("optim.nadam", "NAdam"),
    "rmsprop": ("optim.rmsprop", "RMSprop"),
    "sgd": ("optim.sgd", "SGD"),
}
_LAZY_SOURCE = {**{name: module for module, name in OPTIMIZERS.values()},
                "Optimizer": "optim.optimizer", "clip_grad_norm_": "optim.clip",
                "clip_grad_value_": "optim.clip"}
_SUBMODULES = ("lr_scheduler",)


def __getattr__(name):
    if name in _LAZY_SOURCE:
        value = getattr(importlib.import_module(_LAZY_SOURCE[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"optim.{name}")
    else:
        raise AttributeError(f"module 'optim' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SOURCE) | set(_SUBMODULES))
