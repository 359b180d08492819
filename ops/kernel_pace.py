"""A CPU kernel's pace, measured: its seconds per unit of work (an element) from its own timed
whole calls, which decide how many blocks its later calls split into across the engine's
threads (``ops.cpu_threads``: blocks of ``MIN_BLOCK_SECONDS`` or more).

No constant pace is right for every kernel and machine: plain SGD's update is 5x cheaper an
element than Adam's, and LayerNorm's backward (dx and the parameter partials, 768 rows of
128) took 1.5 ns an element on the 2-core Xeon where its two kernels together had taken 0.68
on the 2-core EPYC. So a kernel runs whole, timed, until ``TIMED_CALLS`` whole calls after
its first (which compiles) give its fastest pace, and splits by that pace from then on, one
call in ``RETIME_EVERY`` running whole and timed again.
"""
import math
import time

TIMED_CALLS = 3   # whole calls timed, after the first, before a kernel may split
# Once the pace is known, one call in RETIME_EVERY still runs whole, timed, and the pace is the
# fastest of all: the first calls of a fresh process (its arrays' pages new, caches cold)
# made plain SGD over 235k split on the 2-core Xeon at 100 us a step where it ran whole at 52
# on one thread (`bench.optimizers`, each framework in a process of its own)
RETIME_EVERY = 64


class Pace:
    """The pace of ``cpu``, a kernel over units of work. Calls of fewer than ``smallest``
    units run whole, untimed."""

    def __init__(self, cpu, smallest=1):
        self.cpu, self.smallest = cpu, smallest
        self.timed = 0   # whole calls timed (the first, which compiles, gives no pace)
        self.fastest = math.inf   # seconds per unit
        self.calls = 0   # since the pace was known

    def per_unit(self, size):
        """The kernel's fastest seconds per unit for a call over ``size`` units to split by;
        None while unknown, for a call that runs whole, and for a call due to be timed."""
        if size < self.smallest or self.timed <= TIMED_CALLS:
            return None
        self.calls += 1
        return None if self.calls % RETIME_EVERY == 0 else self.fastest

    def whole(self, size, args):
        """``cpu(*args)``, one call over all ``size`` units, timed while the pace is still
        unknown and when a call is due to be timed."""
        if size < self.smallest or (self.timed > TIMED_CALLS and self.calls % RETIME_EVERY):
            return self.cpu(*args)
        start = time.perf_counter()
        result = self.cpu(*args)
        if self.timed:
            self.fastest = min(self.fastest, (time.perf_counter() - start) / size)
        self.timed += 1
        return result
