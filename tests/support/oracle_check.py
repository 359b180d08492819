"""What the outside-oracle tests (tests/ops/test_opinfo.py, tests/engine/test_onnx_cases.py)
count as a refusal rather than a crash."""
import linecache
import os
import sys

import engine

# where a refusal may be raised: the engine's packages (and a test's own adapters, added)
ENGINE_ROOTS = tuple(os.path.dirname(os.path.abspath(path)) + os.sep
                     for path in (engine.__file__, sys.modules["ops"].__file__))


def raised_on_purpose(error, roots=ENGINE_ROOTS):
    """True when ``error`` is a refusal: a ValueError, TypeError or NotImplementedError that a
    ``raise`` statement in ``roots`` (files, or folders ending in a separator) raised, not
    Python's own error from a line that was not meant to fail."""
    if not isinstance(error, (ValueError, TypeError, NotImplementedError)):
        return False
    frame = error.__traceback__
    while frame.tb_next is not None:
        frame = frame.tb_next
    filename = os.path.abspath(frame.tb_frame.f_code.co_filename)
    line = linecache.getline(filename, frame.tb_lineno).strip()
    return filename.startswith(roots) and line.startswith("raise")
