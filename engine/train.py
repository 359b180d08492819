"""``python -m engine.train`` and ``from engine.train import fit, evaluate, Trainer``.

The command lives in the CLI wing, ``engine.cli.train`` (its arguments in
``engine.cli.arguments``); this module runs its ``main`` and re-exports what users import
from here: the training loop (``engine.fit``: ``fit``, ``evaluate``, ``Trainer``), the
checkpoint functions (``engine.checkpoint``) and the command's ``DATASETS`` and ``MODELS``.
``--help`` and arguments that do not parse are answered before Numba is imported.
"""
import sys

if __name__ == "__main__":
    from engine.cli.arguments import answer_at_once
    answer_at_once(sys.argv[1:])

from engine.checkpoint import (RECORD_KEYS, read_checkpoint,  # noqa: E402, F401
                               restore_checkpoint, save_checkpoint)
from engine.cli.arguments import DATASETS, MODELS  # noqa: E402, F401
from engine.cli.train import main  # noqa: E402
from engine.fit import Trainer, evaluate, fit  # noqa: E402, F401

if __name__ == "__main__":
    main()
