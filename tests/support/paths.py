"""Where the repository is, for the tests that read its files or run commands in it."""
import pathlib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
