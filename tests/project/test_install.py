"""What installing the project gives: the set-up commands, the extras, the metadata, the files
a wheel carries, and top-level packages that a user's own folder does not shadow."""
import configparser
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
from packaging.requirements import Requirement

import engine
from tests.support.paths import REPO_ROOT

SETUP = configparser.ConfigParser()
SETUP.read(REPO_ROOT / "setup.cfg")
TINY_RUN = ["--epochs", "1", "--limit", "256", "--hidden", "8", "--device", "cpu",
            "--no-progress"]


def _requirements(text):
    return {requirement.name: requirement
            for requirement in map(Requirement, filter(None, text.strip().splitlines()))}


INSTALL_REQUIRES = _requirements(SETUP["options"]["install_requires"])
EXTRAS = {name: _requirements(text) for name, text in SETUP["options.extras_require"].items()}


def _readme_setup_commands():
    """The README's first two bash blocks, a command each: the install, the tests."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)
    assert all(len(block.strip().splitlines()) == 1 for block in blocks[:2]), blocks[:2]
    return [block.strip() for block in blocks[:2]]


def test_readme_starts_with_the_install_and_the_test_command_that_ci_runs():
    install, test = _readme_setup_commands()
    assert install.endswith('pip install -e . && .venv/bin/python -m engine.train')
    assert '".[test,torch,distributed]"' in test and "NUMBA_ENABLE_CUDASIM=1" in test
    ci_lines = (REPO_ROOT / ".ci" / "run").read_text().splitlines()
    assert test in ci_lines, "the last command of .ci/run must be the README's test command"
    assert ci_lines[-1] == test


def test_cuda_extra_brings_the_cuda_toolkit_of_the_tested_numba_cuda():
    required = EXTRAS["test"]["numba-cuda"]
    for extra, toolkit in (("cuda", "cu12"), ("cuda13", "cu13")):
        gpu = EXTRAS[extra]["numba-cuda"]
        assert gpu.extras == {toolkit} and gpu.specifier == required.specifier, gpu
    assert not required.extras   # CPU machines download no CUDA toolkit


def test_the_simulator_that_ci_runs_comes_with_the_test_install():
    assert "numba-cuda" in EXTRAS["test"]   # numba-cuda holds the simulator
    assert "numba-cuda" not in INSTALL_REQUIRES   # the CPU install needs none of CUDA
    assert "pytest" in EXTRAS["test"]


@pytest.mark.parametrize("extra", ["torch", "bench"])
def test_torch_extras_give_a_range_that_holds_the_tested_version(extra):
    specifier = EXTRAS[extra]["torch"].specifier
    assert not any(spec.operator in ("==", "===") for spec in specifier), specifier
    assert specifier.contains("2.11.0") and specifier.contains("2.13.0"), specifier
    try:
        installed = importlib.metadata.version("torch").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return
    assert specifier.contains(installed), (installed, str(specifier))


def test_blas_thread_control_is_a_dependency():
    assert "threadpoolctl" in INSTALL_REQUIRES


def test_version_comes_from_the_metadata_of_setup_cfg():
    assert engine.__version__ == SETUP["metadata"]["version"]
    assert engine.__version__ == importlib.metadata.version("numba-engine")


def test_wheel_carries_the_license_and_the_api_reference(tmp_path):
    """A wheel built from the sources has the license setup.cfg declares, engine/API.md and
    engine/GUIDE.md."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    for package in ("engine", "ops", "optim", "data"):
        shutil.copytree(REPO_ROOT / package, source / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    # with build isolation, as pip installs: the build gets the setuptools pyproject.toml asks for
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                             "-w", str(tmp_path), str(source)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    wheel, = tmp_path.glob("numba_engine-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    license_files = [name for name in names if name.endswith("LICENSE") and ".dist-info/" in name]
    assert license_files, names
    license_text = zipfile.ZipFile(wheel).read(license_files[0]).decode()
    assert "MIT License" in license_text
    metadata = zipfile.ZipFile(wheel).read(
        next(name for name in names if name.endswith(".dist-info/METADATA"))).decode()
    assert "License: MIT" in metadata.splitlines()
    assert {"engine/API.md", "engine/GUIDE.md"} <= set(names)   # the reference and the guide
    assert "Provides-Extra: cuda" in metadata and "Requires-Dist: threadpoolctl" in metadata


# ------------------------------------------------------------------ shadowing

def _cpu_environment():
    return {name: value for name, value in os.environ.items() if name != "NUMBA_ENABLE_CUDASIM"}


def _run_in(folder, *arguments):
    return subprocess.run([sys.executable, *arguments], cwd=folder, capture_output=True,
                          text=True, env=_cpu_environment(), timeout=300)


def test_training_command_ignores_a_data_folder_and_an_optim_module_in_the_current_folder(
        tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "optim.py").write_text("raise SystemExit('the user optim.py was imported')\n")
    result = _run_in(tmp_path, "-m", "engine.train", *TINY_RUN)
    assert result.returncode == 0, result.stderr
    assert "epoch 1/1" in result.stdout


def test_an_empty_data_folder_beside_a_script_does_not_hide_the_engine_data(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "script.py").write_text(
        "import engine\nimport data\nfrom engine import data as same\n"
        "assert data is same\nprint(data.mnist.__name__, data.DataLoader.__name__)\n")
    result = _run_in(tmp_path, "script.py")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["data.mnist", "DataLoader"]


@pytest.mark.parametrize("shadow, statement", [
    ("optim.py", "from engine import optim"),
    ("data/__init__.py", "import engine\nengine.data"),
    ("ops.py", "import engine"),
])
def test_a_module_shadowing_an_engine_package_is_named_in_one_line(tmp_path, shadow, statement):
    shadow_path = tmp_path / shadow
    shadow_path.parent.mkdir(exist_ok=True)
    shadow_path.write_text("raise SystemExit('the shadowing module ran')\n")
    (tmp_path / "script.py").write_text(statement + "\n")
    result = _run_in(tmp_path, "script.py")
    assert result.returncode == 1 and "the shadowing module ran" not in result.stderr
    package = shadow.split("/")[0].removesuffix(".py")
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line == (f"ImportError: engine: {shadow_path} shadows the engine's "
                         f"{package!r} package ({REPO_ROOT / package}); rename it, or run "
                         f"from another folder"), result.stderr
