"""``FlatSlots``: the update unit of a parameter group that holds some of one FlatBuffer's
parameters.

A model's parameters live in one ``engine.parameter.FlatBuffer``; a group that holds all of
them is updated by one kernel over the buffer's arrays (the flat path of
``optim.optimizer``). The usual AdamW recipe splits them in two groups, decay on the
matrices and none on the vectors, which interleave in the buffer: each group then took the
per-parameter path, two launches a parameter (its step counts moved on, its update), 52 of
each for the GPT's CPU configuration (the eager ``opt.step()`` 1.64-1.68 ms against 0.43-0.48
for one group, two threads of the 2-core Xeon), 76 on the GPU one. A ``FlatSlots`` is such a
group's slots in the buffer as runs ``[start, stop)`` (adjacent slots merged): its update is
one kernel over the runs (``optim.rule.RuleKernels.kernel(kept, runs=True)``) on the
buffer's arrays and the optimizer's flat state buffers, which the groups of one buffer share
(each writes only its own slots).
"""
import numpy as np

from ops.device import to_device


class FlatSlots:
    """The slots of ``params`` (all in ``buffer``, not all of it) as runs of the buffer."""

    def __init__(self, buffer, params):
        self.buffer = buffer
        self.params = sorted(params, key=lambda p: p._slot)   # the buffer's order
        runs = []
        for p in self.params:
            start = buffer.offsets[p._slot]
            if runs and runs[-1][1] == start:
                runs[-1][1] = start + p.size
            else:
                runs.append([start, start + p.size])
        self._host_runs = np.array(runs, np.int64).reshape(-1, 2)
        self._runs = {}   # device -> the runs there

    def __repr__(self):
        return (f"FlatSlots({len(self.params)} of the buffer's {len(self.buffer.params)} "
                f"parameters, {len(self._host_runs)} runs)")

    def holds(self, buffer, params):
        """True when this is the unit of exactly ``params`` in ``buffer``."""
        return buffer is self.buffer and {id(p) for p in params} == {id(p) for p in self.params}

    def runs(self, device):
        """The (R, 2) int64 runs on ``device`` (copied there once)."""
        runs = self._runs.get(device)
        if runs is None:
            runs = self._runs[device] = to_device(self._host_runs, device)
        return runs

    def grads_valid(self):
        """True when every one of the group's gradient slots holds a gradient."""
        return all(self.buffer.slot_gradient(p._slot) is not None for p in self.params)


def shared_flat_buffer(params):
    """The FlatBuffer holding every parameter of ``params``, when one does, else None."""
    buffer = getattr(params[0], "flat", None) if params else None
    if buffer is None or any(getattr(p, "flat", None) is not buffer for p in params):
        return None
    return buffer
