"""The command-line report of an ONNX node-case harness (``python -m tests.engine.test_onnx_cases``
and its graph twin): each operator's outcome counts, the cases not matched (refusals with
``-v``), and the totals."""
import collections
import sys


def print_case_report(operators, run_operator):
    """``run_operator(operator)`` gives ``(Counter of outcomes, [(case, outcome, detail)])``."""
    total = collections.Counter()
    for operator in operators:
        counts, results = run_operator(operator)
        total.update(counts)
        print(f"{operator:20s} " + " ".join(f"{k}={v}" for k, v in sorted(counts.items())))
        for name, outcome, detail in results:
            if outcome != "matched" and (outcome != "refused" or "-v" in sys.argv):
                print(f"    {name}: {outcome}: {detail[:240]}")
    print(f"TOTAL {sum(total.values())} cases over {len(operators)} operators: " + ", ".join(
        f"{k} {v}" for k, v in sorted(total.items())))


def assert_none_wrong(operator, counts, results):
    """No case of ``operator`` gave a wrong output or crashed (a refusal names its reason)."""
    bad = [f"{name}: {outcome}: {detail}" for name, outcome, detail in results
           if outcome in ("wrong", "crashed")]
    assert not bad, f"{operator}: {dict(counts)}\n" + "\n".join(bad[:10])
