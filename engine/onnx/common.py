"""What the ONNX export and import share: the onnx package, the opsets, the activations."""
import importlib

from ops import pointwise

DEFAULT_OPSET = 17
MIN_OPSET = 13   # Softmax over one axis (the engine's softmax(axis=-1)) from opset 13 on
INPUT, OUTPUT = "input", "output"
INSTALL_HINT = "pip install -e '.[onnx]'"
# the layers' pointwise activations (their ONNX operator in ops.pointwise.TABLE) and softmax
ACTIVATIONS = {**{entry.name: entry.onnx for entry in pointwise.TABLE if entry.activation},
               "softmax": "Softmax"}
PROBE_BATCHES = (2, 3)   # import: a Reshape target must follow the batch and fix the rest
# ONNX's Gelu operator; an older opset gets x * 0.5 * (1 + erf(x / sqrt 2))
GELU_OPSET = pointwise.BY_NAME["gelu"].onnx_opset


def _onnx():
    try:
        return importlib.import_module("onnx")
    except ImportError as error:
        raise ImportError(f"engine.onnx needs the onnx package ({error}); {INSTALL_HINT}") \
            from None



def checked_opset(onnx, opset):
    """``opset`` (None: ``DEFAULT_OPSET``), or a ValueError outside what export writes."""
    opset = DEFAULT_OPSET if opset is None else opset
    newest = onnx.defs.onnx_opset_version()
    if not isinstance(opset, int) or isinstance(opset, bool) or not MIN_OPSET <= opset <= newest:
        raise ValueError(f"engine.onnx.export: opset must be an integer from {MIN_OPSET} to "
                         f"{newest} (this onnx package's newest), got {opset!r}")
    return opset
