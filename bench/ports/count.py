"""How many lines each port changes against its tutorial: ``python -m bench.ports.count``."""
import difflib
import pathlib

HERE = pathlib.Path(__file__).parent
PORTS = {"pytorch_quickstart": "PyTorch Quickstart", "keras_convnet": "Keras Simple MNIST convnet"}


def changed_lines(name):
    """``(lines of the tutorial, lines the port replaced or removed, lines it added)``."""
    original = (HERE / f"{name}_original.txt").read_text().splitlines()
    port = (HERE / f"{name}.py").read_text().splitlines()
    removed = added = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, original, port).get_opcodes():
        if tag != "equal":
            removed, added = removed + i2 - i1, added + j2 - j1
    return len(original), removed, added


if __name__ == "__main__":
    for name, title in PORTS.items():
        total, removed, added = changed_lines(name)
        print(f"{title}: {removed} of {total} lines changed or removed, "
              f"{added} lines in their place")
