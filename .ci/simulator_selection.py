"""Which CUDA tests the simulator phase can leave to real GPUs: tests/simulator_repeats.txt.

Numba's CUDA simulator runs a kernel as Python, one OS thread per CUDA thread, so coverage.py
sees every line and branch of every CUDA kernel it runs. Run the whole simulator phase once
with coverage by test and with per-test durations (the repeats listed now are run too when
``ENGINE_SIMULATE_ALL=1``):

    ENGINE_SIMULATE_ALL=1 NUMBA_ENABLE_CUDASIM=1 COVERAGE_FILE=sim.coverage \\
        python -m pytest -m cuda -n 2 --cov=ops --cov=optim --cov=data --cov=engine \\
        --cov-branch --cov-context=test --cov-report= --durations=0 > sim.log
    python .ci/simulator_selection.py sim.coverage sim.log tests/simulator_repeats.txt > new.txt
    mv new.txt tests/simulator_repeats.txt

Each test's arcs (line-to-line transitions, so branches too) in ``ops/``, ``optim/``,
``data/`` and ``engine/`` are read from the coverage database. Every op keeps its cheapest
``check_op`` case (``test_op[cuda-NAME...]``: the forward against NumPy, gradcheck, CPU
against CUDA, poison), and a test that took less than ``MIN_SECONDS`` is kept (it saves
little, and what it checks may be a value, NaN propagation say, that no arc shows), and so
is a test that failed in that run (it stopped before reaching all its arcs). Then, going
from the slowest test to the fastest, the tests of the listing given (the one in use) first,
a test is dropped when every arc it reaches is also reached by a test still kept: the
listing changes where the tests or the code changed, not with the run's timing noise. What is kept therefore reaches every arc the whole phase
reaches: the CUDA kernels' lines and branches, tile edges, and the host code around them
(capture on the simulator included). The listing ends with the totals. Needs coverage.py
and pytest-cov.
"""
import re
import sqlite3
import sys

SOURCES = ("/ops/", "/optim/", "/data/", "/engine/")
DURATION = re.compile(r"^\s*([\d.]+)s (?:setup|call|teardown)\s+(\S.*?)\s*$")
FAILURE = re.compile(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$")
OP_CASE = re.compile(r"::test_op\[cuda-([A-Za-z_0-9]+)")
MIN_SECONDS = 2.0   # in the run that recorded the coverage (2-core machine at load 12)


def test_arcs(coverage_file):
    """``{test id: {(file, from, to)}}`` from a coverage database recorded by test context
    (pytest-cov's contexts are ``ID|setup``, ``ID|run`` and ``ID|teardown``)."""
    database = sqlite3.connect(coverage_file)
    files = {file_id: path for file_id, path in database.execute("select id, path from file")
             if any(part in path for part in SOURCES)}
    contexts = dict(database.execute("select id, context from context"))
    arcs = {}
    for file_id, context_id, start, end in database.execute(
            "select file_id, context_id, fromno, tono from arc"):
        test = contexts[context_id].rpartition("|")[0]
        if file_id in files and test:
            arcs.setdefault(test, set()).add((files[file_id], start, end))
    return arcs


def durations(log):
    """``{test id: seconds}``: the sum of a test's phases in pytest's ``--durations=0``."""
    seconds = {}
    with open(log) as lines:
        for line in lines:
            match = DURATION.match(line)
            if match:
                seconds[match.group(2)] = seconds.get(match.group(2), 0.0) + float(match.group(1))
    return seconds


def failures(log):
    """The ids of the tests that pytest's short summary (``-rfE``) names as failed or errored."""
    with open(log) as lines:
        return {match.group(1) for match in map(FAILURE.match, lines) if match}


def pinned(arcs, seconds, failed=()):
    """The tests never dropped: each op's cheapest ``check_op`` case, the quick tests and the
    ``failed`` ones."""
    cheapest = {}
    for test in arcs:
        case = OP_CASE.search(test)
        if case and seconds.get(test, 0.0) < seconds.get(cheapest.get(case.group(1)), 1e300):
            cheapest[case.group(1)] = test
    return set(cheapest.values()) | set(failed) | {test for test in arcs
                                                   if seconds.get(test, 0.0) < MIN_SECONDS}


def repeats(arcs, seconds, failed=(), listed=()):
    """The tests to drop, those ``listed`` first, each group slowest first, such that the rest
    reach every arc of ``arcs``."""
    kept_always = pinned(arcs, seconds, failed)
    reached = {}
    for test_arcs_ in arcs.values():
        for arc in test_arcs_:
            reached[arc] = reached.get(arc, 0) + 1
    dropped = []
    for test in sorted(arcs, key=lambda name: (name not in listed, -seconds.get(name, 0.0))):
        if test not in kept_always and all(reached[arc] > 1 for arc in arcs[test]):
            for arc in arcs[test]:
                reached[arc] -= 1
            dropped.append(test)
    return dropped


def main(coverage_file, log, listing=None):
    arcs, seconds = test_arcs(coverage_file), durations(log)
    listed = set()
    if listing is not None:
        with open(listing) as lines:
            listed = {line.split("#")[0].strip() for line in lines} - {""}
    dropped = repeats(arcs, seconds, failures(log), listed)
    total = sum(seconds.get(test, 0.0) for test in arcs)
    saved = sum(seconds.get(test, 0.0) for test in dropped)
    print("# CUDA tests that the simulator phase (NUMBA_ENABLE_CUDASIM=1 pytest -m cuda) skips:")
    print("# every line and branch of ops/, optim/, data/ and engine/ that one of them reaches")
    print("# in the simulator, a simulator test left in reaches too (coverage.py, by test); every")
    print("# op keeps a check_op case. A real GPU (pytest -m cuda there) runs them all. Made by")
    print("# .ci/simulator_selection.py, which says how; the seconds are those of the run it read")
    print("# (with coverage, -n 2, on the shared 2-core machine; the commit gives its load).")
    for test in dropped:
        print(f"{test}  # {seconds.get(test, 0.0):.1f} s")
    kept = set(arcs) - set(dropped)
    arcs_reached = set().union(*arcs.values()) if arcs else set()
    assert set().union(*(arcs[test] for test in kept)) == arcs_reached   # what "left in" means
    arcs_reached = len(arcs_reached)
    print(f"# {len(dropped)} of {len(arcs)} tests, {saved:.0f} of {total:.0f} s of the run "
          f"read; {arcs_reached} arcs reached before and after")


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: python .ci/simulator_selection.py COVERAGE_FILE DURATIONS_LOG "
                 "[CURRENT_LISTING]")
    main(*sys.argv[1:])
