"""Attention's composition in an imported graph as one engine op: the nodes
``MatMul(q, Transpose(k)) -> Mul by a number (or Div) -> [Add a mask] -> Softmax(-1) ->
MatMul(., v)`` (what the traced export writes for ``scaled_dot_product_attention``, and
torch's exporters for the like) become one ``engine.attention`` node of a ``GraphModel``,
run by ``engine.scaled_dot_product_attention``: one fused kernel per direction on CUDA and the
blocked loop on the CPU, no Tq x Tk score matrix kept for the backward. The numbers are the
composition's (within float rounding); an additive mask equal to the causal one
(``-inf`` above the diagonal of a square) becomes ``is_causal``. A chain whose intermediate
values something else reads too stays as it is."""
import numpy as np

from engine.onnx.import_ops import ATTENTION


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
