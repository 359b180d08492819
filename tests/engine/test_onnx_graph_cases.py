"""ONNX's own operator test cases (``onnx.backend.test.case.node``) as an outside oracle for
the graph importer (``engine.onnx.import_graph_reader``): each case model of the operators it
runs as functional ops is read as it stands (every input a graph input; a one-node chain of a
layer's operator stays a Sequential, as ``test_onnx_cases.py`` checks it) and run on the
case's inputs. A case is ``matched`` (every output within the case's tolerance), ``refused``
(an error an engine ``raise`` raised on purpose; a GraphModel's forward names the node and
keeps the op's own error as the context, which is what is judged) or, failing the test,
``wrong`` or ``crashed``. ``python -m tests.engine.test_onnx_graph_cases`` prints the counts."""
import collections
import importlib
import re
import sys
import warnings

import numpy as np
import pytest

import engine
from engine import onnx as engine_onnx
from engine.onnx import import_ops
from tests.support.onnx_case_report import assert_none_wrong, print_case_report
from tests.support.oracle_check import raised_on_purpose

onnx = pytest.importorskip("onnx")

# the onnx package's case module of each operator the graph importer runs as functional ops
CASE_MODULES = {"MatMul": "matmul", "Gemm": "gemm", "Softmax": "softmax",
                "LayerNormalization": "layernormalization", "Gather": "gather",
                "Transpose": "transpose", "Where": "where", "Split": "split", "Slice": "slice",
                "Concat": "concat", "Reshape": "reshape", "Unsqueeze": "unsqueeze",
                "Squeeze": "squeeze", "Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div"}


def _node_cases(operator):
    from onnx.backend.test.case import node
    node._TargetOpType = None
    before = len(node._NodeTestCases)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = importlib.import_module(f"onnx.backend.test.case.node.{CASE_MODULES[operator]}")
    # recorded once per module, under the name test_onnx_cases.py gives them: a module
    # imported before (by that file, in this process) records no cases again
    if not hasattr(module, "_engine_cases"):
        module._engine_cases = list(node._NodeTestCases[before:])
    return module._engine_cases


def _innermost(error):
    """A GraphModel's forward names the node and keeps the op's error as the context."""
    while re.search(r"node '.*' \(\w+\): ", str(error)) and error.__context__ is not None:
        error = error.__context__
    return error


def _run_case(case):
    inputs, outputs = case.data_sets[0]
    try:
        loaded = engine_onnx.from_onnx(case.model, f"<{case.name}>").eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = loaded(*[engine.tensor(x, dtype=x.dtype) for x in inputs])
    except Exception as error:
        error = _innermost(error)
        on_purpose = raised_on_purpose(error) and "cannot be read (" not in str(error)
        return "refused" if on_purpose else "crashed", f"{type(error).__name__}: {error}"
    got = got if isinstance(got, tuple) else (got,)
    if len(got) != len(outputs):
        return "wrong", f"{len(got)} outputs, ONNX's {len(outputs)}"
    for value, expected in zip(got, outputs):
        value, expected = value.numpy(), np.asarray(expected)
        if value.shape != expected.shape or not np.allclose(
                value, expected, rtol=case.rtol, atol=case.atol, equal_nan=True):
            return "wrong", f"shape {value.shape} (ONNX's {expected.shape}) or values differ"
    return "matched", ""


def test_every_operator_checked_here_is_one_the_graph_importer_reads():
    assert set(CASE_MODULES) <= set(import_ops.SUPPORTED)


def _run_operator(operator):
    results = [(case.name, *_run_case(case)) for case in _node_cases(operator)]
    return collections.Counter(outcome for _, outcome, _ in results), results


@pytest.mark.parametrize("operator", sorted(CASE_MODULES))
def test_onnx_node_cases_of_the_graph_operators_match_or_are_refused(operator):
    counts, results = _run_operator(operator)
    assert_none_wrong(operator, counts, results)
    assert counts["matched"], f"{operator}: no case matched: {results[:3]}"


def main():
    print_case_report(sorted(CASE_MODULES), _run_operator)


if __name__ == "__main__":
    sys.exit(main())
