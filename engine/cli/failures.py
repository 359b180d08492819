"""How ``python -m engine.train`` fails: each failure is one line on stderr, never a
traceback, and a run stopped part way says what its checkpoint holds.

``BadInput`` (exit status 2) is the command's input: an argument, a path, the data, a
checkpoint that does not fit. ``OutputFailure`` and ``Diverged`` (status 1) happen during or
after training, ``Interrupted`` is Ctrl-C (status 130) or SIGTERM (``Terminated``, status 143,
raised where Ctrl-C would be while ``sigterm_interrupts`` holds). Nothing here imports Numba:
the help and the arguments that do not parse are answered before it is imported.
"""
import contextlib
import os
import signal
import sys
import threading

PROG = "engine-train"


class BadInput(Exception):
    """A problem with the command's input; reported as one line, exit status 2. In a
    distributed run ``shown`` says whether this rank prints it (every rank raises it, one
    prints), ``rank`` the rank it is about when only some ranks failed (else None)."""

    def __init__(self, message, shown=True, rank=None):
        super().__init__(message)
        self.shown, self.rank = shown, rank


class OutputFailure(Exception):
    """A write that failed during or after training; reported as one line, exit status 1."""


class Diverged(Exception):
    """The training loss turned non-finite (``TerminateOnNaN`` stopped training); reported
    as one line, exit status 1, on every rank alike (``shown`` on rank 0)."""

    def __init__(self, message, shown=True):
        super().__init__(message)
        self.shown = shown


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a batch system's time limit), raised in the main thread as Ctrl-C's
    ``KeyboardInterrupt`` is, so it stops the run at the same points and cleans up alike."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during training; the message says which epoch the checkpoint file
    holds, ``terminated`` whether it was SIGTERM."""

    def __init__(self, message, terminated=False):
        super().__init__(message)
        self.terminated = terminated


def _raise_terminated(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)   # a second SIGTERM ends the process at once
    raise Terminated()


@contextlib.contextmanager
def sigterm_interrupts():
    """While it holds, SIGTERM raises ``Terminated`` in the main thread (elsewhere, where no
    handler can be set, it keeps its default: the process ends)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def report_interrupt(interrupt):
    """Ctrl-C or SIGTERM as the command's one line on stderr; returns the exit status (130,
    or 143 for SIGTERM: 128 + the signal's number, as a shell reports a process it ended)."""
    terminated = isinstance(interrupt, Terminated) or getattr(interrupt, "terminated", False)
    print(f"{PROG}: " + ("terminated (SIGTERM)" if terminated else "interrupted")
          + (f"; {interrupt}" if str(interrupt) else ""), file=sys.stderr, flush=True)
    return 128 + signal.SIGTERM if terminated else 130


def report(error):
    """``error`` as the command's one line on stderr, on the ranks that show it."""
    if getattr(error, "shown", True):
        rank = getattr(error, "rank", None)
        print(("" if rank is None else f"rank {rank}: ") + f"{PROG}: error: {error}",
              file=sys.stderr, flush=True)


def describe_os_error(error):
    """An OSError in words, without the temporary file name a failed atomic write names."""
    return error.strerror or str(error)


def kept_after_interrupt(saved_epoch, saved_path, save_path):
    """What an interrupted run leaves the user, in words."""
    if saved_epoch is not None:
        return (f"{saved_path} holds epoch {saved_epoch} (resume with --resume {saved_path})")
    if save_path is None:
        return "nothing was saved (--no-save)"
    return f"no epoch finished, so {save_path} was not written"


def intact_after_failure(saved_epoch, saved_path, save_path):
    """What a failed write leaves the user, in words."""
    if saved_epoch is not None:
        return f"the checkpoint of epoch {saved_epoch} in {saved_path} is intact"
    if save_path and os.path.exists(save_path):
        return f"{save_path} is as it was before this run"
    return "no checkpoint was written" + ("" if save_path else " (--no-save)")
