"""Debugging switches: poison mode and anomaly detection.

``poison()`` makes every uninitialised allocation NaN (the same as ``ENGINE_POISON=1``), so an
output element a kernel forgot to write shows up as NaN. Use it as a call or a ``with`` block.
"""
from engine.autograd import AnomalyError, detect_anomaly  # noqa: F401
from ops.memory import poison_enabled, set_poison


class poison:
    def __init__(self, enabled=True):
        self.prev = poison_enabled()
        set_poison(enabled)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        set_poison(self.prev)


def is_poisoned():
    return poison_enabled()
