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
being the function's globals; everything else is kept as written, but for one rewrite: a
``return A if C else B`` becomes ``if C: return A`` then ``return B``. Inlined into the CPU
convolution's loops, relu's conditional expression left a phi that Numba's SSA check reported
at every first compile (``NumbaIRAssumptionWarning: variable 'value_v77__vphi28_0_2.1' is
not in scope``, which asks the user to report it); the two returns compile to the same
vector loops (every code's value and derivative loop vectorises as before).

``kernels_of_code`` is the one way a kernel gets its code as a compile-time constant, on both
devices: a factory of the code builds the kernels, which hold the code as an int of their
closure (a literal to Numba), and the factory is memoised. Why this way, of the four the
kernels once used (measured on the 2-core CPU; the CUDA side is NVVM's folding of the same
constant):
- a constant, not a runtime argument: the relu epilogue of a 128x256 Dense, 32 us with the
  code a runtime value against 6 us folded; relu over 1M float32, 1.8 ms against 0.36;
- one code per kernel, not a runtime code that an ``if/elif`` in the kernel turns into a
  literal for each loop (the CPU convolution's way): that kernel typed and compiled a loop of
  every fused code: the cold compile of the CPU Conv2D forward and backward (relu, float32,
  a fresh cache) took 11.8-12.2 s of thread time against 9.9-10.1 s built for its one code,
  the same bits out (loaded 2-core machine, two runs each);
- an int in the closure, not a closed-over per-code device function: Numba's cache keys a
  closure kernel by its pickled closure values, where a dispatcher pickles with a fresh id in
  each process (no kernel would ever be found in the cache).
"""
import ast
import functools
import inspect
import operator
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


def _without_return_choice(statement):
    """``statement``, or for ``return A if C else B`` the statements ``if C: return A`` and
    ``return B`` (the module's notes say why), nested choices too."""
    value = getattr(statement, "value", None)
    if not (isinstance(statement, ast.Return) and isinstance(value, ast.IfExp)):
        return [statement]
    first = ast.If(test=value.test, body=_without_return_choice(
        ast.copy_location(ast.Return(value=value.body), statement)), orelse=[])
    return [ast.copy_location(first, statement),
            *_without_return_choice(ast.copy_location(ast.Return(value=value.orelse), statement))]


@functools.lru_cache(maxsize=None)
def pruned(function, code):
    """``function`` (plain Python, its first parameter the code) with the top-level ``if``
    statements that test the code decided for ``code``: a false one removed (its ``else``
    kept), a true one replaced by its body, and what follows a ``return`` dropped; a returned
    choice is made two returns (``_without_return_choice``). Compiled
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
    definition.body = [form for statement in kept for form in _without_return_choice(statement)]
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


def kernels_of_code(parameter):
    """Decorate a factory of kernels whose argument ``parameter`` is a pointwise code: the
    kernels it builds hold the code as a constant of their closure (the module's docstring
    says why), and one call per set of arguments builds them. The code is made a Python int
    (a NumPy integer in a closure is typed as a runtime int64, not a literal, and the CPU
    functions would compile every branch)."""
    def decorate(factory):
        position = list(inspect.signature(factory).parameters).index(parameter)
        memoised = functools.lru_cache(maxsize=None)(factory)

        @functools.wraps(factory)
        def kernels(*args, **kwargs):
            if parameter in kwargs:
                kwargs[parameter] = operator.index(kwargs[parameter])
            else:
                args = (*args[:position], operator.index(args[position]), *args[position + 1:])
            return memoised(*args, **kwargs)
        kernels.constant_code = parameter   # the mark of a factory of this mechanism
        return kernels
    return decorate
