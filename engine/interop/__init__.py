"""Working with other libraries.

``engine.interop.torch``: hybrid models with PyTorch (an engine model inside torch autograd,
a torch module inside an engine computation) and whole ``nn.Sequential`` models converted
both ways (``from_sequential``, ``to_sequential``), imported on first use so that the engine
never needs torch. ``engine.interop.sequential`` builds the engine models that importers of
other formats read (ONNX's, torch's). Plain zero-copy array exchange lives on ``Tensor``
itself (``__array__``, ``__dlpack__``, ``__cuda_array_interface__``) and in
``engine.from_dlpack``.
"""
import importlib


def __getattr__(name):
    if name == "torch":
        module = importlib.import_module("engine.interop.torch")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'engine.interop' has no attribute {name!r}")
