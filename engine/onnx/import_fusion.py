"""Imported graph nodes run as fewer engine ops with the composition's numbers.

Attention's composition as one engine op: the nodes
``MatMul(q, Transpose(k)) -> Mul by a number (or Div) -> [Add a mask] -> Softmax(-1) ->
MatMul(., v)`` (what the traced export writes for ``scaled_dot_product_attention``, and
torch's exporters for the like) become one ``engine.attention`` node of a ``GraphModel``,
run by ``engine.scaled_dot_product_attention``: one fused kernel per direction on CUDA and the
blocked loop on the CPU, no Tq x Tk score matrix kept for the backward. The numbers are the
composition's (within float rounding); an additive mask equal to the causal one
(``-inf`` above the diagonal of a square) becomes ``is_causal``. A chain whose intermediate
values something else reads too stays as it is.

A Dense layer's activation (the node after it, or after a reshape of its output, where
nothing else reads the product) runs in the layer's kernel, as ``engine.interop.sequential.fuse_activations`` does for a chain."""
import numpy as np

from engine.interop.sequential import FUSED
from engine.onnx.import_ops import ATTENTION
from engine.onnx.importers import OPERATOR_ACTIVATIONS

# what may stand between a Dense and its activation: the shape changes it commutes with
RESHAPES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity")


def _swaps_last_two(perm):
    perm = list(perm)
    return len(perm) >= 2 and perm[:-2] == list(range(len(perm) - 2)) and perm[-2:] == [
        len(perm) - 1, len(perm) - 2]


def _is_causal(mask):
    if mask is None or mask.ndim != 2 or mask.shape[0] != mask.shape[1] or mask.dtype.kind != "f":
        return False
    return np.array_equal(mask, np.triu(np.full(mask.shape, -np.inf, mask.dtype), 1))


def fuse_attention(entries, outputs, constant_of):
    """``entries`` (a GraphModel's node list) with each attention composition replaced by one
    ``ATTENTION`` node ``[q, k, v, mask or ""]`` (attributes ``scale``, ``causal``);
    ``outputs``: the graph's outputs; ``constant_of(name)``: the array a value not computed
    by a node holds (None for a computed one)."""
    producer = {value: entry for entry in entries for value in entry[3]}
    readers = {}
    for entry in entries:
        for value in entry[2]:
            readers[value] = readers.get(value, 0) + 1
    for value in outputs:
        readers[value] = readers.get(value, 0) + 1

    def only_reader(value, operator):
        entry = producer.get(value)
        found = entry is not None and entry[1] == operator and entry[5] is None
        return entry if found and readers.get(value, 0) == 1 else None

    def scalar(value):
        array = constant_of(value)
        return None if array is None or array.size != 1 else float(array.reshape(()))

    replaced, removed = {}, set()
    for entry in entries:
        if entry[1] != "MatMul" or entry[5] is not None:
            continue
        weights = only_reader(entry[2][0], "Softmax")
        if weights is None or weights[4].get("axis", -1) != -1:
            continue
        masked = only_reader(weights[2][0], "Add")
        mask, scaled = "", weights[2][0]
        if masked is not None:
            scaled_entry = [v for v in masked[2] if only_reader(v, "Mul") or only_reader(v, "Div")]
            if len(scaled_entry) != 1:
                continue
            scaled = scaled_entry[0]
            mask = next(v for v in masked[2] if v != scaled)
        scaling = only_reader(scaled, "Mul") or only_reader(scaled, "Div")
        if scaling is None:
            continue
        numbers = [scalar(value) for value in scaling[2]]
        product = [only_reader(v, "MatMul") for v, n in zip(scaling[2], numbers) if n is None]
        number = next((n for n in numbers if n is not None), None)
        if (number is None or len(product) != 1 or product[0] is None
                or (scaling[1] == "Div" and numbers[1] is None)):
            continue
        scores = product[0]
        transposed = only_reader(scores[2][1], "Transpose")
        if transposed is None or not _swaps_last_two(transposed[4].get("perm", ())):
            continue
        causal = _is_causal(constant_of(mask)) if mask else False
        scale = 1.0 / number if scaling[1] == "Div" else number
        replaced[id(entry)] = [entry[0], ATTENTION,
                               [scores[2][0], transposed[2][0], entry[2][1],
                                "" if causal else mask],
                               entry[3], {"scale": scale, "causal": causal}, None]
        removed.update(id(e) for e in (weights, masked, scaling, scores, transposed) if e)
    return [replaced.get(id(entry), entry) for entry in entries if id(entry) not in removed]


def fuse_dense_activations(entries, layers, outputs):
    """``entries`` with each activation node that alone reads a Dense layer's output (the
    layer run by that node only, without an activation) moved into the layer's config
    (``layers``: the layer descriptions, changed in place)."""
    readers, runs = {}, {}
    for entry in entries:
        for value in entry[2]:
            readers.setdefault(value, []).append(entry)
        if entry[5] is not None:
            runs[entry[5]] = runs.get(entry[5], 0) + 1
    removed = set()
    for entry in entries:
        index = entry[5]
        if index is None or layers[index]["class_name"] != "Dense" or runs[index] != 1 \
                or layers[index]["config"].get("activation") or entry[3][0] in outputs:
            continue
        last, found = entry, readers.get(entry[3][0], [])
        if len(found) == 1 and found[0][1] in RESHAPES and found[0][5] is None \
                and found[0][3][0] not in outputs:   # the export's Reshape back from 2-D rows
            last, found = found[0], readers.get(found[0][3][0], [])
        if len(found) != 1 or found[0][5] is not None or found[0][1] not in OPERATOR_ACTIVATIONS:
            continue
        activation, attributes = found[0], found[0][4]
        name = OPERATOR_ACTIVATIONS[activation[1]]
        if (name not in FUSED["Dense"] or attributes.get("alpha", 0.01) < 0
                or attributes.get("approximate", "none") != "none"
                or attributes.get("axis", -1) != -1):
            continue
        layers[index]["config"]["activation"] = name
        if name == "leaky_relu":
            layers[index]["config"]["alpha"] = attributes.get("alpha", 0.01)
        last[3] = list(activation[3])   # an elementwise function commutes with a reshape
        removed.add(id(activation))
    return [entry for entry in entries if id(entry) not in removed]
