"""One framework's side of a training benchmark, in this process or in a process of its own.

A side is built by a module-level function ``build(*args) -> (methods, info)``: ``methods``
maps names (``"epoch"``, ``"test_accuracy"``, ...) to callables, ``info`` is what the run
needs from it at once (versions, an initial state). ``open_side`` builds it here
(``LocalSide``) or in a fresh interpreter (``FrameworkProcess``, multiprocessing's spawn),
and either answers ``side.call(name, *args)`` and ``side.info`` the same way.

On the CPU the benchmarks give each framework a process, as a user runs one: in one process,
PyTorch's OpenMP threads (spinning on after its epoch) and the engine's shared the two
cores, and the engine's load-following thread count fell back to one thread 6 times per
6000-sample CNN epoch, where ``engine.train --model cnn`` alone ran its step on two. The
benchmark's own process only alternates the sides' epochs (A B A B, so all see the same
machine state) while the idle sides wait on a pipe, asleep.
"""
import multiprocessing
import traceback


class LocalSide:
    """A side built in this process."""

    def __init__(self, label, build, *args):
        self.label = label
        self._methods, self.info = build(*args)

    def call(self, name, *args):
        return self._methods[name](*args)

    def close(self):
        self._methods = None


class FrameworkProcess:
    """A side built and run in a process of its own; building starts at once, ``info`` and
    ``call`` wait for it. A failure in the process raises here with its traceback."""

    def __init__(self, label, build, *args):
        context = multiprocessing.get_context("spawn")   # a fresh interpreter: no thread pool
        self.label = label
        self._connection, child_end = context.Pipe()
        self._process = context.Process(target=_serve, args=(child_end, build, args),
                                        name=f"bench {label}", daemon=True)
        self._process.start()
        child_end.close()
        self._info = None
        self._built = False

    @property
    def info(self):
        if not self._built:
            self._info, self._built = self._reply("building"), True
        return self._info

    def call(self, name, *args):
        self.info   # built first
        self._connection.send((name, args))
        return self._reply(name)

    def _reply(self, doing):
        try:
            succeeded, value = self._connection.recv()
        except EOFError:
            self._process.join()
            raise RuntimeError(f"bench: the {self.label} process ended (exit code "
                               f"{self._process.exitcode}) while {doing}") from None
        if not succeeded:
            raise RuntimeError(f"bench: the {self.label} process failed while {doing}:\n"
                               f"{value}")
        return value

    def close(self):
        if self._process.is_alive():
            try:
                self._connection.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout=30)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._connection.close()


def _serve(connection, build, args):
    """The process's loop: build the side, send its info, then answer each ``(name, args)``
    until ``None``."""
    try:
        methods, info = build(*args)
    except BaseException:
        connection.send((False, traceback.format_exc()))
        return
    connection.send((True, info))
    while (request := connection.recv()) is not None:
        name, call_args = request
        try:
            connection.send((True, methods[name](*call_args)))
        except BaseException:
            connection.send((False, traceback.format_exc()))


def open_side(separate, label, build, *args):
    """``build``'s side in a process of its own (``separate``) or in this one."""
    return (FrameworkProcess if separate else LocalSide)(label, build, *args)
