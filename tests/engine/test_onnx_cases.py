"""ONNX's own operator test cases as an outside oracle for ``engine.onnx.load``.

For every operator the importer claims (``engine.onnx.IMPORTERS``), the node test cases of
the ``onnx`` package (``onnx.backend.test.case.node.<operator>``: each a one-node model, or
its function's expansion, with inputs and the expected outputs) are read with the engine and
run on their inputs. The importer reads a chain from one input with constant operands, so a
case's other inputs are stored in the model as initializers holding their test values (what
``Add(x, y)`` becomes is ``Add(x, constant)``). Each case ends as one of:

- ``matched``: the imported model's output (eval mode) equals ONNX's expected output within
  the case's own tolerance (ONNX's backend test uses the same);
- ``refused``: the import or the call raised a clear error, a ValueError / TypeError that an
  engine ``raise`` statement raised (the importer's name the file and the node), not the
  importer's "cannot be read" wrapper of an unexpected failure;
- ``wrong``: the output differs in shape or value;
- ``crashed``: anything else raised.

A wrong or crashed case fails its operator's test. ``python -m tests.engine.test_onnx_cases``
prints the per-operator counts.
"""
import collections
import copy
import importlib
import sys
import warnings

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

import engine  # noqa: E402
from engine import onnx as engine_onnx  # noqa: E402
from tests.support.onnx_case_report import assert_none_wrong, print_case_report  # noqa: E402
from tests.support.oracle_check import raised_on_purpose  # noqa: E402

# the onnx package's module of each operator's node cases
CASE_MODULES = {"Gemm": "gemm", "MatMul": "matmul", "Add": "add", "Conv": "conv",
                "MaxPool": "maxpool", "AveragePool": "averagepool",
                "BatchNormalization": "batch_normalization", "Flatten": "flatten",
                "Reshape": "reshape", "Dropout": "dropout", "Identity": "identity",
                "Cast": "cast", "Mul": "mul", "Sub": "sub", "Div": "div", "Gather": "gather",
                "LayerNormalization": "layernormalization",
                # the activations' operators (ops.pointwise.TABLE's, and Softmax)
                **{operator: operator.lower() for operator in engine_onnx.OPERATOR_ACTIVATIONS}}


def test_every_operator_the_importer_claims_has_its_cases():
    assert sorted(CASE_MODULES) == sorted(engine_onnx.IMPORTERS)


def node_cases(operator):
    """ONNX's test cases of ``operator`` (``TestCase``s: ``name``, ``model``, ``data_sets``,
    ``rtol``, ``atol``), made by importing its case module, whose classes record them."""
    from onnx.backend.test.case import node
    node._TargetOpType = None
    before = len(node._NodeTestCases)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the cases' own NumPy warnings (inf, nan on purpose)
        module = importlib.import_module(f"onnx.backend.test.case.node.{CASE_MODULES[operator]}")
    if not hasattr(module, "_engine_cases"):
        module._engine_cases = list(node._NodeTestCases[before:])
    return module._engine_cases


def _with_constant_operands(model, inputs):
    """``model`` with every graph input but the first stored as an initializer holding its
    test value; the first input's value."""
    model = copy.deepcopy(model)
    graph = model.graph
    names = [value.name for value in graph.input]
    for name, value in list(zip(names, inputs))[1:]:
        if isinstance(value, np.ndarray):
            graph.initializer.append(onnx.numpy_helper.from_array(value, name))
    kept = [value for value in graph.input if value.name not in
            {t.name for t in graph.initializer}]
    del graph.input[:]
    graph.input.extend(kept)
    return model, inputs[0] if inputs else None


def run_case(case):
    """``("matched" | "refused" | "wrong" | "crashed", detail)`` of one ONNX test case."""
    inputs, outputs = case.data_sets[0]
    try:
        model, x = _with_constant_operands(case.model, list(inputs))
        imported = engine_onnx.from_onnx(model, f"<{case.name}>").eval()
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{case.name}: the input is a {type(x).__name__}, not an array")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = imported(engine.tensor(x, dtype=x.dtype))
        # a graph of several outputs (LayerNormalization's Mean, InvStdDev) gives a tuple
        got = [value.numpy() for value in (got if isinstance(got, tuple) else (got,))]
    except Exception as error:
        # "cannot be read (...)": the importer's wrapper of an unexpected failure inside it,
        # meant for damaged files; on ONNX's own valid models it is a crash
        on_purpose = raised_on_purpose(error) and "cannot be read (" not in str(error)
        return "refused" if on_purpose else "crashed", f"{type(error).__name__}: {error}"
    if len(got) != len(outputs):
        return "wrong", f"{len(got)} outputs, ONNX's {len(outputs)}"
    for value, expected in zip(got, map(np.asarray, outputs)):
        if value.shape != expected.shape:
            return "wrong", f"shape {value.shape}, ONNX's {expected.shape}"
        if not np.allclose(value, expected, rtol=case.rtol, atol=case.atol, equal_nan=True):
            worst = np.nanmax(np.abs(value.astype(np.float64) - expected.astype(np.float64)))
            return "wrong", f"values differ from ONNX's by up to {worst:.3g}"
    return "matched", ""


def run_operator(operator):
    counts, results = collections.Counter(), []
    for case in node_cases(operator):
        outcome, detail = run_case(case)
        counts[outcome] += 1
        results.append((case.name, outcome, detail))
    return counts, results


@pytest.mark.parametrize("operator", sorted(CASE_MODULES))
def test_onnx_node_cases_match_or_are_refused(operator):
    counts, results = run_operator(operator)
    assert_none_wrong(operator, counts, results)
    assert sum(counts.values()), f"{operator}: the onnx package has no cases for it"


def main():
    print_case_report(sorted(CASE_MODULES), run_operator)


if __name__ == "__main__":
    sys.exit(main())
