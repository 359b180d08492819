"""The content hash of a kernel's code: what the key of a shipped kernel is made from
(ops.cuda.shipped)."""
import functools

# the packages whose modules and functions are described by their contents, not their names
PROJECT_PACKAGES = ("ops", "optim", "engine", "data")
_fingerprints = {}        # id of a function or dispatcher -> (the object, its content hash)


def fingerprint(function):
    """A hash of what the code of ``function`` (a Python function or a ``@cuda.jit``
    dispatcher) is made from: its source; its compile options; and, recursively, the values of
    its closure cells and of the globals its code names (functions and dispatchers by their
    own fingerprint, the project's modules by the attributes the code names, other modules by
    name, constants by value). A value without a stable description (an object's default repr
    holds its address) gives a hash no other process reproduces: never a false match."""
    return _fingerprint(function, frozenset(), [False])


def _fingerprint(function, active, cyclic):
    """``fingerprint`` inside the descriptions of the functions in ``active`` (a function
    that reaches itself again is described by name there, and its hash, which then depends on
    where the walk began, is not kept: ``cyclic[0]`` says so)."""
    known = _fingerprints.get(id(function))
    if known is not None and known[0] is function:
        return known[1]
    python_function = getattr(function, "py_func", function)
    if id(python_function) in active:
        cyclic[0] = True
        return f"<recursive {python_function.__qualname__}>"
    import hashlib
    inner_cyclic = [False]
    text = _function_description(function, active | {id(python_function)}, inner_cyclic)
    digest = hashlib.sha256(text.encode()).hexdigest()
    if inner_cyclic[0]:
        cyclic[0] = True
    else:
        _fingerprints[id(function)] = (function, digest)
    return digest


@functools.lru_cache(maxsize=None)
def _source(code):
    """The dedented source of a code object (one per ``def``, shared by every closure made
    from it: the GEMM template's dozen device functions per tiling are read once)."""
    import inspect
    import textwrap
    try:
        return textwrap.dedent(inspect.getsource(code))
    except (OSError, TypeError):   # no source file: the bytecode stands for it
        return repr(code.co_code) + repr(code.co_consts)


def _function_description(function, active, cyclic):
    python_function = getattr(function, "py_func", function)
    code = python_function.__code__
    parts = [f"{python_function.__module__}.{python_function.__qualname__}", _source(code)]
    options = getattr(function, "targetoptions", None)
    if options is not None:   # not how it is cached or linked: numba-cuda sets lto where it
        # finds nvJitLink, which a CPU machine lacks; the code linked is the same
        parts.append(repr(sorted((key, repr(value)) for key, value in options.items()
                                 if key not in ("cache", "lto"))))
    for name, cell in zip(code.co_freevars, python_function.__closure__ or ()):
        parts.append(f"closure {name} = "
                     f"{_value_description(cell.cell_contents, active, cyclic)}")
    names = _code_names(code)
    module_globals = python_function.__globals__
    for name in sorted(names):
        if name in module_globals:
            value = module_globals[name]
            parts.append(f"global {name} = "
                         f"{_value_description(value, active, cyclic, names)}")
    return "\n".join(parts)


@functools.lru_cache(maxsize=None)
def _code_names(code):
    """Every global and attribute name the code and its nested code objects use."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if hasattr(constant, "co_names"):
            names |= _code_names(constant)
    return names


def _value_description(value, active, cyclic, names=()):
    import types
    if isinstance(value, types.ModuleType):
        if value.__name__.split(".")[0] not in PROJECT_PACKAGES:
            return f"module {value.__name__}"   # numba, math, numpy: their versions count
        attributes = [f"{name}: {_value_description(getattr(value, name), active, cyclic)}"
                      for name in sorted(names) if hasattr(value, name)]
        return f"module {value.__name__} {{{', '.join(attributes)}}}"
    if hasattr(value, "py_func") or (isinstance(value, types.FunctionType)
                                     and value.__module__.split(".")[0] in PROJECT_PACKAGES):
        return f"function {_fingerprint(value, active, cyclic)}"
    if isinstance(value, types.FunctionType):
        return f"function {value.__module__}.{value.__qualname__}"
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        inner = ", ".join(_value_description(item, active, cyclic) for item in value)
        return f"{type(value).__name__}({inner})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key!r}: {_value_description(item, active, cyclic)}"
                               for key, item in sorted(value.items(), key=repr)) + "}"
    if isinstance(value, type):
        return f"class {value.__module__}.{value.__qualname__}"
    return f"{type(value).__name__} {value!r}"
