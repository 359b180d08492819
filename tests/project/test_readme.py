"""README.md as a new user meets it: every ```python block runs as written on a CPU machine,
and every link it makes points at a file of the repository; the same for the documents it
links: the engine guide (engine/GUIDE.md), the kernels (ops/README.md) and the measurements
(bench/README.md). The API reference (engine/API.md) names only what exists.

The blocks run in one fresh interpreter (started without NUMBA_ENABLE_CUDASIM, as on a
CPU machine), in an empty folder, each in a namespace of its own: a block may use only what it
defines, as when it is pasted alone. One interpreter for all of them, not one each, because
each start pays for ``import engine`` and the kernel cache again.
"""
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from tests.support.paths import REPO_ROOT

README = REPO_ROOT / "README.md"
API_REFERENCE = REPO_ROOT / "engine" / "API.md"
READMES = (README, REPO_ROOT / "engine" / "GUIDE.md", REPO_ROOT / "ops" / "README.md",
           REPO_ROOT / "bench" / "README.md", API_REFERENCE)
CODE_SPAN = re.compile(r"`([^`]+)`")   # may wrap onto the next line
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
# a dotted public name as the reference writes it: engine.x.y, nn.X, optim.X, data.x
PUBLIC_NAME = re.compile(r"(?<![\w.])(engine|nn|optim|data)((?:\.[A-Za-z_]\w*)+)")
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
HEADING = re.compile(r"^#+ (.*)$", re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")

# Run after the Data block, in its namespace: the noise is clipped to the normalised pixel
# range, not to (0, 1), which would set 96.7% of normalised pixels to exactly 0 or 1.
DATA_BLOCK_CHECK = """
import numpy as np
pixels = next(iter(loader))[0].numpy()
low, high = (0 - MEAN) / STD, (1 - MEAN) / STD
assert low - 1e-6 <= pixels.min() and pixels.max() <= high + 1e-6, (pixels.min(), pixels.max())
at_zero_or_one = np.isin(pixels, np.float32([0, 1])).mean()
assert at_zero_or_one < 0.01, f"{at_zero_or_one:.1%} of the pixels are exactly 0 or 1"
assert pixels.std() > 0.5, pixels.std()   # normalised images, not a clipped blank
"""

RUNNER = """
import json, sys, traceback
blocks = json.load(open(sys.argv[1]))
failures = []
for code, check in blocks:
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(code, "<README block>", "exec"), namespace)
        if check:
            exec(compile(check, "<check of the README block>", "exec"), namespace)
        failures.append(None)
    except BaseException:
        failures.append(traceback.format_exc())
json.dump(failures, open(sys.argv[2], "w"))
"""


def _blocks():
    """``(code, heading, line)`` of every ```python block, in reading order (the line as
    ``FILE:LINE`` outside README.md)."""
    blocks = []
    for readme in READMES:
        text = readme.read_text()
        where = "" if readme == README else f"{readme.relative_to(REPO_ROOT)}:"
        for match in PYTHON_BLOCK.finditer(text):
            headings = HEADING.findall(text, 0, match.start())
            blocks.append((match.group(1), headings[-1] if headings else "top",
                           f"{where}{text.count(chr(10), 0, match.start()) + 1}"))
    return blocks


BLOCKS = _blocks()


def _check_for(code):
    return DATA_BLOCK_CHECK if "normalize=" in code and "data.DataLoader(" in code else ""


@pytest.fixture(scope="module")
def block_failures(tmp_path_factory):
    """One traceback (or None) per README block, from one CPU-only interpreter."""
    folder = tmp_path_factory.mktemp("readme")
    blocks_file, failures_file = folder / "blocks.json", folder / "failures.json"
    blocks_file.write_text(json.dumps([(code, _check_for(code)) for code, _, _ in BLOCKS]))
    environment = {name: value for name, value in os.environ.items()
                   if name != "NUMBA_ENABLE_CUDASIM"}
    result = subprocess.run([sys.executable, "-c", RUNNER, str(blocks_file), str(failures_file)],
                            cwd=folder, env=environment, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr
    return json.loads(failures_file.read_text())


def test_the_readme_has_its_python_blocks():
    assert len(BLOCKS) >= 9, [heading for _, heading, _ in BLOCKS]
    assert sum(bool(_check_for(code)) for code, _, _ in BLOCKS) == 1   # the Data example


@pytest.mark.parametrize("index", range(len(BLOCKS)),
                         ids=[f"line{line}-{heading}" for _, heading, line in BLOCKS])
def test_readme_block_runs_as_written(index, block_failures):
    code, heading, line = BLOCKS[index]
    for module, extra in (("torch", "torch"), ("onnxruntime", "test")):
        if f"import {module}" in code and importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module} (pip install '.[{extra}]')")
    assert block_failures[index] is None, (
        f"README line {line} ({heading}):\n{code}\n{block_failures[index]}")


@pytest.mark.parametrize("readme", READMES, ids=lambda path: str(path.relative_to(REPO_ROOT)))
def test_readme_links_point_into_the_repository(readme):
    links = [link for link in LINK.findall(readme.read_text())
             if "://" not in link and not link.startswith("#")]
    if readme == README:
        assert {"engine/API.md", "engine/GUIDE.md", "ops/README.md",
                "bench/README.md"} <= set(links)
    for link in links:
        target = (readme.parent / link.split("#")[0]).resolve()
        assert target.is_relative_to(REPO_ROOT) and target.exists(), f"{readme}: {link}"


def _resolve(root, attributes):
    """The object ``root.attributes[0]. ...``, importing submodules on the way
    (``engine.checkpoint``, ``engine.interop.torch``); AttributeError if one is missing."""
    value, path = root, root.__name__
    for attribute in attributes:
        path = f"{path}.{attribute}"
        if not hasattr(value, attribute) and isinstance(value, type(importlib)):
            try:
                importlib.import_module(path)
            except ModuleNotFoundError:
                pass
        value = getattr(value, attribute)
    return value


def _reference_names():
    """``(prefix, attributes, line)`` of every dotted engine name in engine/API.md's code."""
    text = FENCE.sub(lambda block: "\n" * block.group(0).count("\n"), API_REFERENCE.read_text())
    names = []
    for span in CODE_SPAN.finditer(text):
        for name in PUBLIC_NAME.finditer(span.group(1)):
            names.append((name.group(1), tuple(name.group(2).strip(".").split(".")),
                          text.count("\n", 0, span.start()) + 1))
    return names


def test_the_api_reference_names_only_what_exists():
    import engine
    from engine import data, nn, optim
    roots = {"engine": engine, "nn": nn, "optim": optim, "data": data}
    names = _reference_names()
    assert len(names) > 150, len(names)   # the reference covers the API, not a page of it
    missing = []
    for prefix, attributes, line in names:
        if (prefix == "nn" and attributes[0] in {**nn.TORCH_EQUIVALENTS, **nn.KERAS_EQUIVALENTS}
                and attributes[0] not in vars(nn)):
            # named as what the engine does not have: asking must name the equivalent
            with pytest.raises(AttributeError, match="equivalent"):
                getattr(nn, attributes[0])
            continue
        try:
            _resolve(roots[prefix], attributes)
        except AttributeError:
            missing.append(f"engine/API.md:{line}: {prefix}.{'.'.join(attributes)}")
    assert not missing, "\n".join(missing)
