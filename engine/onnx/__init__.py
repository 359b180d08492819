"""``engine.onnx``: models as ONNX files, for onnxruntime and other ONNX engines.

    model.export_onnx("mlp.onnx")              # or engine.onnx.export(model, "mlp.onnx")
    session = onnxruntime.InferenceSession("mlp.onnx")
    logits, = session.run(None, {"input": images})   # float32 [batch, 28, 28] -> [batch, 10]

Any model (an ``nn.Model`` with residual blocks, several inputs, shared layers; a Sequential
too) exports from the ops its forward runs: ``export(model, path, example=x)`` runs the
forward once on ``x`` (a tuple for several inputs) and writes each op through its own ONNX
declaration (``ops.registry.Op.onnx``; ``engine.onnx.traced``), the graph's inputs
``input`` (or ``input_0``, ``input_1``, ...), its outputs ``output`` (``output_0``, ...), the
weights as initializers under their dotted names, the batch dimension open where only it
changes between traces on two batch sizes (else at the example's shapes). An op that
declares no ONNX node is a ValueError naming the op and the layer that ran it.

Without ``example``, a Sequential exports layer by layer (``engine.onnx.sequential``), with
the batch dimension open and the options below.

The graph has one input, ``input`` (``[batch, *model.input_shape]``, the batch dimension
open), and one output, ``output``; each layer becomes the ONNX operators that compute what
its forward pass computes in eval mode: ``Dense`` a ``Gemm`` (``x @ W + b``, ``W`` stored as
the engine holds it, ``(in, units)``) and its activation (``Relu``, ``LeakyRelu``,
``Sigmoid``, ``Tanh``, ``Gelu`` from opset 20 and its erf composition before,
``Softmax`` over the last axis), ``Activation`` that operator,
``Flatten`` a ``Flatten`` from axis 1, ``Dropout`` an ``Identity``; ``Conv2D`` a ``Conv``
(the weight in the layout both share, ``(filters, in / groups, kh, kw)``, the padding as
explicit ``pads``, so "same" with an even kernel keeps its extra row at the bottom) and its
activation, ``MaxPool2D`` a ``MaxPool``, ``AvgPool2D`` an ``AveragePool`` counting the
padded zeros, ``BatchNorm`` a ``BatchNormalization`` on its running statistics (eval
mode), ``Reshape`` a ``Reshape`` that keeps the batch dimension, ``Rescaling`` a ``Mul`` (and
an ``Add`` for an offset), ``Normalization`` a ``Sub`` and a ``Div``, ``Embedding`` a
``Gather`` of the table's rows (the graph's input then int64 token ids), ``LayerNorm`` a
``LayerNormalization`` over the last axis (opset 17 on); the importer reads those two back.
A model that starts
with ``Rescaling`` takes ``uint8`` input (raw images, as ``python -m engine.train``'s models
do), cast by a first ``Cast`` node. A layer without an
exporter here is a ValueError naming it.
The weights are the model's, in its dtype (float32 or float64), as initializers. With
``normalize=(mean, std)`` the graph starts with ``(input - mean) / std``, the
standardisation of ``data.DataLoader(normalize=...)``: a model trained on standardised
images (``python -m engine.train`` trains so) then takes images as the loader does before
it, scaled to [0, 1].

The model is built with the ``onnx`` package's helpers (an optional extra: ``pip install
-e '.[onnx]'``), checked by ``onnx.checker`` with shape inference, and written
through ``engine.archive.atomic_write``: a failed export leaves an older file as it was.

Import. ``load(path)`` (``nn.load`` on a ``.onnx`` path) reads such a chain back into a
``Sequential`` (``IMPORTERS``: what the export writes, ``MatMul`` with an ``Add``, and what
``torch.onnx.export`` writes for the equivalent torch network: a ``Reshape`` whose target a
shape computation beside the chain gives, evaluated with NumPy for two batch sizes;
weights in an external file beside the model). Each value of the chain feeds the next node
only: a branch is refused, as are operators and attributes without an engine equivalent,
each a ValueError naming the file and the node. A graph that is not a chain (a node that
combines two computed values: residual joins, attention's batched MatMul; several inputs or
outputs; an operator only a graph reads: Transpose, Where, Split, Slice, Concat, ...) is read
into a ``GraphModel`` (``engine.onnx.import_graph_reader``): layers where nodes hold weights,
engine functional ops for the rest (``engine.onnx.import_ops``; attention's composition as
one fused op, ``engine.onnx.import_fusion``); it trains, saves and loads. What is read
computes ONNX's numbers: a ``Div`` by a constant only where a Normalization (and a Rescaling
by -1 for a negative divisor) divides by it to the bit; ``auto_pad`` SAME_UPPER / SAME_LOWER
and explicit ``pads`` from the input's size, one-sided ones only where a symmetric padding
gives the same windows; the constant layers in the graph's float dtype; GELU's erf
composition (the export below opset 20, torch's exporter) as one GELU.
"""
import os

from engine import archive
from engine.onnx import traced
from engine.onnx.common import (ACTIVATIONS, DEFAULT_OPSET, GELU_OPSET, INPUT, MIN_OPSET,
                                OUTPUT)
from engine.onnx.import_ import IMPORTERS, OnnxImportError, from_onnx, load
from engine.onnx.import_graph import GraphModel
from engine.onnx.importers import OPERATOR_ACTIVATIONS
from engine.onnx.sequential import EXPORTERS
from engine.onnx.sequential import to_onnx as _sequential_onnx

__all__ = ["export", "to_onnx", "load", "from_onnx", "OnnxImportError", "IMPORTERS", "GraphModel",
           "EXPORTERS", "ACTIVATIONS", "OPERATOR_ACTIVATIONS", "DEFAULT_OPSET", "GELU_OPSET", "MIN_OPSET", "INPUT",
           "OUTPUT"]


def to_onnx(model, opset=None, normalize=None, example=None):
    """The ``onnx.ModelProto`` of ``model``, checked by ``onnx.checker`` (module docstring):
    traced from its forward on ``example``, or a Sequential's layers without one."""
    if example is None:
        if not isinstance(getattr(model, "layers", None), list):
            raise TypeError(f"engine.onnx.export takes an nn.Sequential model, got "
                            f"{type(model).__name__}, or any model with an input to trace its "
                            f"forward on: export(model, path, example=x) (a tuple for several "
                            f"inputs)")
        return _sequential_onnx(model, opset, normalize)
    if normalize is not None:
        raise ValueError("engine.onnx.export: normalize is a Sequential's option without an "
                         "example; standardise inside the model's forward instead")
    return traced.to_onnx(model, example, opset)


def export(model, path, opset=None, normalize=None, example=None):
    """Write ``model`` to ``path`` as ONNX with operator set ``opset`` (default
    ``DEFAULT_OPSET``): traced from its forward on ``example``, or, without one, a built
    ``nn.Sequential`` layer by layer, its input standardised first with ``normalize``
    (``(mean, std)``, or None); returns the ``onnx.ModelProto``. The file is written whole
    or not at all (``engine.archive.atomic_write``)."""
    proto = to_onnx(model, opset, normalize, example)
    with archive.atomic_write(os.fspath(path)) as file:
        file.write(proto.SerializeToString())
    return proto
