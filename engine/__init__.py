"""A Numba-JIT neural-net engine: Tensors, tape autograd, layers, losses.

``engine.optim`` and ``engine.data`` are the top-level ``optim`` and ``data`` packages,
imported on first use so that the engine core never depends on them. ``engine.__version__``
is the installed distribution's version (``numba-engine`` in setup.cfg), read on first use.

Importing ``engine`` sets the CPU GEMMs' BLAS threads to ``blas_threads.DEFAULT_THREADS``
(see ``engine.blas_threads``) and keeps the engine's top-level packages (``ops``, ``optim``,
``data``) from being shadowed by what sits in the current folder, where most ML projects
keep a ``data/`` directory:

- a folder of one of these names without ``__init__.py`` (an empty ``data/``) never wins over
  the engine's package. Python's own rule is that a regular package anywhere on ``sys.path``
  beats such a namespace folder, but an editable install's finder is asked only after the
  path, so the folder won there;
- ``python -m engine.<module>`` started outside the project does not search the current
  folder, which ``-m`` puts first on ``sys.path`` (``python -m pip`` does the same): the
  engine's own commands import nothing of the user's;
- a real module of one of these names that would be imported instead of ours (a script's
  own ``optim.py`` beside it) is an ImportError naming that file, raised by ``import engine``
  for ``ops`` and by ``engine.optim`` / ``engine.data`` for the other two; the file's code
  is not run.
"""
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OWN_PACKAGES = ("ops", "optim", "data")


class _OwnPackagesOverNamespaceFolders(importlib.abc.MetaPathFinder):
    """Finds ``ops``, ``optim`` and ``data`` beside ``engine`` when ``sys.path`` offers no
    regular module or package of that name (nothing, or only namespace folders)."""

    def find_spec(self, name, path=None, target=None):
        if path is not None or name not in _OWN_PACKAGES:
            return None
        found = importlib.machinery.PathFinder.find_spec(name)
        if found is not None and found.origin is not None:
            return None   # a regular module or package: Python's order decides
        package = os.path.join(_PROJECT_ROOT, name)
        return importlib.util.spec_from_file_location(
            name, os.path.join(package, "__init__.py"), submodule_search_locations=[package])


def _running_engine_module():
    """True while Python locates the module of ``python -m engine...``: ``sys.argv[0]`` is
    "-m" until the module is found, and ``sys.orig_argv`` names it."""
    if sys.argv[:1] != ["-m"]:
        return False
    arguments = sys.orig_argv[1:]
    for index, argument in enumerate(arguments):
        if argument.startswith("-m"):
            name = argument[2:] or (arguments[index + 1] if index + 1 < len(arguments) else "")
            return name == "engine" or name.startswith("engine.")
    return False


def _forget_current_folder_for_engine_commands():
    if getattr(sys.flags, "safe_path", False) or not _running_engine_module():
        return   # -P / PYTHONSAFEPATH: the current folder was never added
    current = os.getcwd()
    if sys.path and sys.path[0] in ("", current) and not os.path.samefile(current,
                                                                            _PROJECT_ROOT):
        del sys.path[0]


def _shadowing_file(name):
    """The file that ``import name`` gives instead of the engine's package, or None."""
    module = sys.modules.get(name)
    if module is not None:
        origin = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", [])),
                                                           None)
    else:
        spec = importlib.util.find_spec(name)
        origin = None if spec is None else spec.origin
    ours = os.path.join(_PROJECT_ROOT, name, "__init__.py")
    if origin is not None and os.path.exists(origin) and os.path.samefile(origin, ours):
        return None
    return origin or f"a module {name!r} without a file"


def _require_own(name):
    shadow = _shadowing_file(name)
    if shadow is not None:
        raise ImportError(f"engine: {shadow} shadows the engine's {name!r} package "
                          f"({os.path.join(_PROJECT_ROOT, name)}); rename it, or run from "
                          f"another folder")


class _EngineNamesOfOwnPackages(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import engine.data`` / ``from engine.data import DataLoader`` (and ``engine.optim``,
    their submodules): the top-level packages under the names ``engine.data`` and
    ``engine.optim`` give, the same module objects (never a second copy)."""

    def find_spec(self, name, path=None, target=None):
        parts = name.split(".")
        if len(parts) < 2 or parts[0] != "engine" or parts[1] not in ("data", "optim"):
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        _require_own(spec.name.split(".")[1])
        module = importlib.import_module(spec.name[len("engine."):])
        spec.loader_state = module.__spec__   # the import system stamps the alias's spec on it
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state
        module.__loader__ = module.__spec__.loader


if not any(isinstance(finder, _OwnPackagesOverNamespaceFolders) for finder in sys.meta_path):
    sys.meta_path.insert(0, _OwnPackagesOverNamespaceFolders())
    sys.meta_path.insert(1, _EngineNamesOfOwnPackages())
_forget_current_folder_for_engine_commands()
_require_own("ops")

from engine.blas_threads import apply_default as _apply_default_blas_threads  # noqa: E402
from engine.blas_threads import get_num_threads, set_num_threads  # noqa: F401, E402

_apply_default_blas_threads()

# The public names, imported from their modules on first use: ``import engine`` itself
# imports neither Numba nor numba.cuda (1.2-1.9 s on the 2-core machine, numba.cuda most of
# it), so ``python -m engine.train --help`` answers at once. The first tensor pays Numba's;
# numba.cuda waits for the first CUDA use (ops.cuda).
_LAZY_NAMES = {
    "engine.autograd": ("AnomalyError", "detect_anomaly", "enable_grad", "is_grad_enabled",
                        "no_grad", "set_grad_enabled"),
    "engine.convolution": ("avg_pool2d", "batch_norm", "conv1d", "conv2d", "max_pool2d"),
    "engine.functional": ("abs", "add", "argmax", "argmin", "astype", "cat", "clamp", "clip",
                          "div", "eq", "exp", "flatten", "ge", "gelu", "gt", "le",
                          "leaky_relu", "log", "log_softmax", "lt", "matmul", "max", "mean",
                          "min", "mul", "ne", "maximum", "minimum",
                          "neg", "permute", "pow", "relu", "reshape", "sigmoid", "softmax",
                          "sqrt", "squeeze", "stack", "sub", "sum", "tanh", "transpose",
                          "unsqueeze", "view", "where"),
    "engine.gradcheck": ("GradcheckError", "gradcheck"),
    "engine.sequence": ("chunk", "embedding", "layer_norm", "masked_fill", "multinomial", "scaled_dot_product_attention", "split", "topk",
                        "tril", "triu"),
    "engine.random": ("manual_seed",),
    "engine.step_capture": ("capture",),
    "engine.tensor": ("Tensor", "arange", "from_dlpack", "from_numpy", "full", "ones", "rand",
                      "randn", "tensor", "zeros"),
    "ops.device": ("cuda_available",),
    "ops.matmul_precision": ("get_float32_matmul_precision", "set_float32_matmul_precision"),
    "ops.out_of_memory": ("OutOfMemoryError",),
}
_LAZY_SOURCE = {name: module for module, names in _LAZY_NAMES.items() for name in names}


class _EngineModule(type(sys)):
    """``engine`` as a module whose attribute ``tensor`` stays the function: importing the
    submodule ``engine.tensor`` (which any first use does) would otherwise set the attribute
    to the module, as Python does for every submodule. The module stays
    ``sys.modules["engine.tensor"]``."""

    def __setattr__(self, name, value):
        if name in _LAZY_SOURCE and isinstance(value, type(sys)):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _EngineModule

_LAZY_SUBMODULES = {"optim": "optim", "data": "data", "nn": "engine.nn",
                    "losses": "engine.losses", "init": "engine.init", "train": "engine.train",
                    "interop": "engine.interop", "callbacks": "engine.callbacks",
                    "onnx": "engine.onnx", "distributed": "engine.distributed",
                    "fit": "engine.fit", "vision": "engine.vision"}


# torch's dtype names (``engine.float32``, ``engine.long``) as the NumPy dtypes they mean
_DTYPE_NAMES = {"float32": "float32", "float": "float32", "float64": "float64",
                "double": "float64", "int64": "int64", "long": "int64", "int32": "int32",
                "int": "int32", "uint8": "uint8", "bool": "bool_"}


def __dir__():   # the lazy names too, for tab completion
    functional = sys.modules.get("engine.functional")
    generated = set(functional.POINTWISE) if functional is not None else set()
    return sorted(set(globals()) | set(_LAZY_SOURCE) | set(_LAZY_SUBMODULES) | generated
                  | set(_DTYPE_NAMES))


def __getattr__(name):
    if name in _LAZY_SOURCE:
        value = getattr(importlib.import_module(_LAZY_SOURCE[name]), name)
        globals()[name] = value
        return value
    if name in _LAZY_SUBMODULES:
        if name in _OWN_PACKAGES:
            _require_own(name)
        module = importlib.import_module(_LAZY_SUBMODULES[name])
        globals()[name] = module
        return module
    if name in _DTYPE_NAMES:
        import numpy
        return getattr(numpy, _DTYPE_NAMES[name])
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version
        try:
            globals()[name] = version("numba-engine")
        except PackageNotFoundError:   # a checkout on sys.path that pip never installed
            globals()[name] = "0+unknown"
        return globals()[name]
    if importlib.util.find_spec(f"engine.{name}") is not None:   # engine.debug, engine.autograd
        return importlib.import_module(f"engine.{name}")
    if not name.startswith("_"):   # a pointwise function generated from ops.pointwise.TABLE
        generated = importlib.import_module("engine.functional").POINTWISE
        if name in generated:
            globals()[name] = generated[name]
            return generated[name]
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
