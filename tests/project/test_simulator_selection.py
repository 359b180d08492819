"""The simulator phase's selection: .ci/simulator_selection.py and what it wrote."""
import importlib.util
import re

from tests.support.paths import REPO_ROOT
from tests.support.simulator_repeats import simulator_repeats

SPEC = importlib.util.spec_from_file_location(
    "simulator_selection", REPO_ROOT / ".ci" / "simulator_selection.py")
selection = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(selection)


def test_a_test_is_dropped_only_when_the_kept_ones_reach_all_its_arcs():
    arcs = {"t.py::slow[cuda]": {("k", 1, 2), ("k", 2, 3)},
            "t.py::fast[cuda]": {("k", 1, 2), ("k", 2, 3)},
            "t.py::branch[cuda]": {("k", 1, 2), ("k", 2, 4)},
            "t.py::test_op[cuda-relu[(3,)]]": {("k", 1, 2)},
            "t.py::test_op[cuda-relu[(2, 5)]]": {("k", 1, 2)}}
    seconds = {"t.py::slow[cuda]": 50.0, "t.py::fast[cuda]": 5.0, "t.py::branch[cuda]": 40.0,
               "t.py::test_op[cuda-relu[(3,)]]": 3.0, "t.py::test_op[cuda-relu[(2, 5)]]": 9.0}
    dropped = selection.repeats(arcs, seconds)
    # the slow repeat goes, the only test of a branch and each op's cheapest case stay
    assert dropped == ["t.py::slow[cuda]", "t.py::test_op[cuda-relu[(2, 5)]]"]
    kept = set(arcs) - set(dropped)
    assert set().union(*(arcs[test] for test in kept)) == set().union(*arcs.values())


def test_quick_tests_stay_whatever_they_repeat():
    arcs = {"t.py::a[cuda]": {("k", 1, 2)}, "t.py::b[cuda]": {("k", 1, 2)}}
    seconds = {"t.py::a[cuda]": selection.MIN_SECONDS / 2, "t.py::b[cuda]": 0.1}
    assert selection.repeats(arcs, seconds) == []


def test_durations_sum_the_phases_of_pytest_s_report(tmp_path):
    log = tmp_path / "sim.log"
    log.write_text("==== slowest durations ====\n"
                   "12.50s call     tests/test_x.py::test_y[cuda-(1, 2)]\n"
                   "0.50s setup    tests/test_x.py::test_y[cuda-(1, 2)]\n"
                   "3.00s call     tests/test_x.py::test_z[cuda]\n")
    assert selection.durations(log) == {"tests/test_x.py::test_y[cuda-(1, 2)]": 13.0,
                                        "tests/test_x.py::test_z[cuda]": 3.0}


def test_every_listed_repeat_is_a_test_of_the_suite():
    """A renamed test falls out of the list (and back into the simulator): say so."""
    missing = []
    for test_id in sorted(simulator_repeats()):
        path, _, name = test_id.partition("::")
        function = re.match(r"(\w+)", name).group(1)
        source = (REPO_ROOT / path).read_text() if (REPO_ROOT / path).is_file() else ""
        if not re.search(rf"^def {function}\(", source, re.M):
            missing.append(test_id)
    assert not missing, f"tests/simulator_repeats.txt names tests that are gone: {missing}"


def test_failed_tests_stay_and_the_listing_in_use_is_tried_first(tmp_path):
    log = tmp_path / "sim.log"
    log.write_text("FAILED tests/t.py::gone[cuda-(2, 3)] - AssertionError: wrong\n"
                   "ERROR tests/t.py::broken[cuda]\n")
    failed = selection.failures(log)
    assert failed == {"tests/t.py::gone[cuda-(2, 3)]", "tests/t.py::broken[cuda]"}
    same = {("k", 1, 2)}
    # a failed test stopped before its other arcs: it stays, however slow
    arcs = {"tests/t.py::gone[cuda-(2, 3)]": same, "tests/t.py::slow[cuda]": same}
    seconds = {"tests/t.py::gone[cuda-(2, 3)]": 30.0, "tests/t.py::slow[cuda]": 20.0}
    assert selection.repeats(arcs, seconds, failed) == ["tests/t.py::slow[cuda]"]
    # of two tests reaching the same arcs, the listed one goes, not the slower one
    arcs = {"tests/t.py::slow[cuda]": same, "tests/t.py::listed[cuda]": same}
    seconds = {"tests/t.py::slow[cuda]": 20.0, "tests/t.py::listed[cuda]": 10.0}
    assert selection.repeats(arcs, seconds) == ["tests/t.py::slow[cuda]"]
    assert selection.repeats(arcs, seconds, listed={"tests/t.py::listed[cuda]"}) == [
        "tests/t.py::listed[cuda]"]
