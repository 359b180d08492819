"""A CPU kernel's pace, measured: its seconds per unit of work (an element) from its own timed
whole calls, which decide how many blocks its later calls split into across the engine's
threads (``ops.cpu_threads``: blocks of ``MIN_BLOCK_SECONDS`` or more).

No constant pace is right for every kernel and machine: plain SGD's update is 5x cheaper an
element than Adam's, and LayerNorm's backward (dx and the parameter partials, 768 rows of
128) took 1.5 ns an element on the 2-core Xeon where its two kernels together had taken 0.68
on the 2-core EPYC. So a kernel runs whole, timed, until ``TIMED_CALLS`` whole calls after
its first (which compiles) give its fastest pace, and splits by that pace from then on.
"""
import time

TIMED_CALLS = 3   # whole calls timed, after the first, before a kernel may split


class Pace:
    """The pace of ``cpu``, a kernel over units of work. Calls of fewer than ``smallest``
    units run whole, untimed."""

    def __init__(self, cpu, smallest=1):
        self.cpu, self.smallest, self.seconds = cpu, smallest, []

    def per_unit(self, size):
        """The kernel's fastest seconds per unit for a call over ``size`` units to split by;
        None while unknown, and for a call that runs whole."""
        if size < self.smallest or len(self.seconds) <= TIMED_CALLS:
            return None
        return min(self.seconds[1:])

    def whole(self, size, args):
        """``cpu(*args)``, one call over all ``size`` units, timed while the pace is still
        unknown."""
        if size < self.smallest or len(self.seconds) > TIMED_CALLS:
            return self.cpu(*args)
        start = time.perf_counter()
        result = self.cpu(*args)
        self.seconds.append((time.perf_counter() - start) / size)
        return result
