"""A function of a constant code, compiled for the CPU with only that code's branches.

``ops.pointwise.value(code, x, p)`` is a chain of ``if code == RELU: return ...``; the CPU
kernels call it with ``code`` a constant of their closure, which Numba types as a literal.
Inlined in Numba's IR (``njit(inline="always")``), every kernel typed and lowered all 18
branches again before LLVM removed the dead ones (Numba's branch pruning runs before its
inlining). ``cpu_of_constant_code(value)`` is the CPU form that kernels call instead: given a
literal code it inlines a copy of ``value`` whose other codes' ``if`` statements are removed
from the source (``pruned``), so a kernel types only the branch it runs. Measured (thread
CPU time, a Dense relu epilogue and its backward loop): 0.17 + 0.20 s of compile against
0.27 + 0.36, the loops as fast. A code that is not a constant gets the whole function.

Only top-level statements ``if code == NAME [or code == NAME ...]:`` are decided, the names
being the function's globals; everything else is kept as written.
"""
import ast
import functools
import inspect
import textwrap

from numba.core import types
from numba.extending import overload


def _code_test(test, parameter):
    """True for ``parameter == NAME`` or an ``or`` of them."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        return all(_code_test(value, parameter) for value in test.values)
    return (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Eq) and isinstance(test.left, ast.Name)
            and test.left.id == parameter and isinstance(test.comparators[0], ast.Name))


def _holds(test, code, names):
    if isinstance(test, ast.BoolOp):
        return any(_holds(value, code, names) for value in test.values)
    return names[test.comparators[0].id] == code


@functools.lru_cache(maxsize=None)
def pruned(function, code):
    """``function`` (plain Python, its first parameter the code) with the top-level ``if``
    statements that test the code decided for ``code``: a false one removed (its ``else``
    kept), a true one replaced by its body, and what follows a ``return`` dropped. Compiled
    with ``function``'s file, line numbers and globals, so errors point at its source."""
    parameter = next(iter(inspect.signature(function).parameters))
    module = ast.parse(textwrap.dedent(inspect.getsource(function)))
    definition = module.body[0]
    kept = []
    for statement in definition.body:
        if isinstance(statement, ast.If) and _code_test(statement.test, parameter):
            kept += (statement.body if _holds(statement.test, code, function.__globals__)
                     else statement.orelse)
        else:
            kept.append(statement)
        if kept and isinstance(kept[-1], ast.Return):
            break
    definition.body = kept
    definition.decorator_list = []
    ast.increment_lineno(module, function.__code__.co_firstlineno - 1)
    namespace = {}
    exec(compile(module, inspect.getsourcefile(function), "exec"), function.__globals__,
         namespace)
    return namespace[function.__name__]


def cpu_of_constant_code(function):
    """The CPU form of ``function(code, ...)`` for ``@njit`` kernels: inlined, with only the
    branches of ``code`` when the kernel passes a constant (``pruned``), whole otherwise.
    (An overload, not a dispatcher in each kernel's closure: Numba's cache keys a closure
    kernel by its pickled closure values, and a dispatcher pickles with a fresh id in each
    process, so the kernel would never be found in the cache.)"""
    def stub(*args):
        raise TypeError(f"{function.__qualname__}'s CPU form runs inside @njit kernels only")

    @functools.wraps(function)   # Numba checks that the typer's signature is function's
    def typer(code, *args):
        if isinstance(code, types.IntegerLiteral):
            return pruned(function, code.literal_value)
        return function

    overload(stub, inline="always", prefer_literal=True)(typer)
    stub.__name__ = stub.__qualname__ = f"{function.__name__}_cpu"
    return stub
