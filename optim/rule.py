"""An optimizer's update written once, per element and by name: ``RuleKernels``.

A *rule* is a plain function of one element's values that returns that element's new
values. Every parameter of the rule is a name, and the name says where its value comes from:

- ``param``, ``grad``, or one of the optimizer's state ``buffers``: this element's value of
  that array (a buffer the group does not keep now reads as 0 and is not written);
- one of the optimizer's ``hyper`` names: the group's value, read from the device array the
  step syncs from ``param_groups`` (``Optimizer._hyper_values``);
- ``t`` (the unit's step, from 1), ``first_step`` (1 on the first update of the state
  buffers, else 0: a buffer made later starts then), ``tiny`` (the dtype's smallest normal
  number) or ``one`` (1 in the dtype), from the device step counts and the dtype;
- a *derived* scalar: a function of the optimizer's ``derived`` tuple, named as its value,
  whose own parameters are any of the names above (or derived before it), computed once per
  launch in float64 (Adam's bias corrections).

The rule returns the new ``param`` and then the new value of each of ``buffers``, in their
declared order (the one positional convention; ``RuleKernels`` checks the count).

Scalars reach the rule cast to the parameter's dtype, so the rule's arithmetic is in that
dtype, as torch.optim's is (a literal such as ``1.0`` would make it float64: a rule takes
its constants as scalars). On the CPU the loop calls the rule on values only: no array
crosses an inlined call inside the loop, so the loop holds no reference counting and
vectorises (see ``_CPU_SOURCE``).

One kernel is generated per set of buffers the group keeps (SGD with and without its
momentum buffer), on first use: its arguments are ``(param, grad, *kept buffers, counts,
hyper, tiny)`` (``RuleKernels.arguments``).
"""
import ast
import hashlib
import inspect
import textwrap

import numpy as np
from numba import float64, njit

from ops.cuda import cuda
from ops.element_kernel import (run_blocks_grid, split_over_threads,
                                split_runs_over_threads, strided_blocks)
from ops.launch import CPU_KERNEL, Kernel
from ops.step_counter import BUFFER_UPDATES, SKIPPED, T
from ops.subnormals import flush_begin, flush_end
from ops.twin import twin

# the step counts' and the dtype's own scalars, computed first (float64)
_STANDARD_SCALARS = {"t": f"float64(counts[{T}])",
                 "first_step": f"1.0 if counts[{BUFFER_UPDATES}] == 1 else 0.0",
                 "tiny": "float64(tiny)", "one": "1.0"}

# Issue 48's cause (SGD, RMSprop and Adagrad 20-40x slower than Adam on the CPU): the
# element functions took the arrays and were inlined into the loop, and Numba increfs and
# decrefs the arrays an inlined call receives; where the element branches (SGD's momentum
# and first step, RMSprop's centered and momentum) its reference-count pruning gave up and
# left 2 NRT_incref and 2 NRT_decref calls (atomic) per element in the loop, which then
# could not vectorise: 235k float32 SGD elements took 2.3 ms. Here the rule takes and returns
# values only; tests/optim/test_rule.py checks every optimizer's compiled loop vectorises and
# increfs each array at most once (at the kernel's start).
_CPU_SOURCE = """
def {kernel}_cpu({arguments}):
    if counts[{skipped}] != 0:
        return
    mode = {flush_begin}
{scalars}
    dtype = param.dtype.type
{casts}
{loop}
{body}
    {flush_end}
"""
_CUDA_SOURCE = """
def {kernel}_cuda({arguments}):
    s = cuda.shared.array({count}, float64)
    if cuda.threadIdx.x == 0:
{shared_scalars}
{shared_stores}
    cuda.syncthreads()
    if counts[{skipped}] != 0:
        return
    dtype = param.dtype.type
{shared_casts}
{loop}
{body}
"""
# The element loops, and the indent of their body: over every element of the arrays, or
# (``runs``) over the elements of each [start, stop) row of ``runs``, which on CUDA takes a
# row of blocks (blockIdx.y). An unsigned index on the CPU: a signed one read from ``runs``
# may be negative for all Numba knows, and its wraparound test on every access kept the loop
# scalar
_LOOPS = {("cpu", False): (["for i in range(param.size):"], 8),
          ("cpu", True): (["for run in range(runs.shape[0]):",
                           "    for i in range(np.uint64(runs[run, 0]), np.uint64(runs[run, 1])):"],
                          12),
          ("cuda", False): (["for i in range(cuda.grid(1), param.size, cuda.gridsize(1)):"], 8),
          ("cuda", True): (["run = cuda.blockIdx.y",
                            "for i in range(runs[run, 0] + cuda.grid(1), runs[run, 1],",
                            "               cuda.gridDim.x * cuda.blockDim.x):"], 8)}
# the generated kernels' own names, which no declared value may take
_RESERVED = {"i", "s", "dtype", "zero", "mode", "counts", "hyper", "rule", "cuda", "np",
             "float64", "flush_begin", "flush_end", "run", "runs"}
_CPU_FLAGS = dict(CPU_KERNEL, nogil=True, error_model="numpy")


class RuleKernels:
    """The kernels of ``rule`` (module doc) for an optimizer called ``name`` that keeps
    ``buffers`` and reads ``hyper`` and ``derived``; ``flush_subnormals`` runs the CPU loop
    with subnormal results flushed to zero (``ops.subnormals``)."""

    def __init__(self, name, rule, hyper, buffers, derived=(), flush_subnormals=False):
        self.name, self.rule = name, rule
        self.hyper, self.buffers = tuple(hyper), tuple(buffers)
        self.derived, self.flush_subnormals = tuple(derived), flush_subnormals
        self._kernels = {}
        arrays = ("param", "grad") + self.buffers
        known = set(arrays) | set(self.hyper) | set(_STANDARD_SCALARS)
        if (len(known) != len(arrays) + len(self.hyper) + len(_STANDARD_SCALARS)
                or known & _RESERVED):
            raise TypeError(f"{name}: a name is declared twice among the arrays {arrays}, "
                            f"the hyper-parameters {self.hyper} and {tuple(_STANDARD_SCALARS)}, "
                            f"or is one of the kernel's own {sorted(_RESERVED)}")
        for function in self.derived:
            if function.__name__ in known | _RESERVED:
                raise TypeError(f"{name}: derived scalar {function.__name__} has the name of "
                                "a declared value or of the kernel's own")
            unknown = [p for p in _parameters(function) if p not in known]
            if unknown:
                raise TypeError(f"{name}: derived scalar {function.__name__} reads {unknown}, "
                                f"which are not among {sorted(known)}")
            known.add(function.__name__)
        unknown = [p for p in _parameters(rule) if p not in known]
        if unknown:
            raise TypeError(f"{name}: the rule {rule.__name__} reads {unknown}, which are not "
                            f"declared (arrays {arrays}, hyper {self.hyper}, derived "
                            f"{tuple(f.__name__ for f in self.derived)}, or "
                            f"{tuple(_STANDARD_SCALARS)})")
        _check_returns(name, rule, 1 + len(self.buffers))
        self.scalars = [p for p in _parameters(rule) if p not in arrays]   # the rule's reads
        self._rule_cpu, self._rule_cuda = twin(rule)
        self._derived = [twin(function) for function in self.derived]

    def arguments(self, kept, runs=False):
        """The kernel's arguments for the buffers ``kept`` (a subset of ``buffers``), and
        ``runs`` last for a kernel over runs of the arrays' elements."""
        return ("param", "grad") + tuple(b for b in self.buffers if b in kept) + (
            "counts", "hyper", "tiny") + (("runs",) if runs else ())

    def kernel(self, kept, runs=False):
        """The ``ops.launch.Kernel`` for a group keeping the buffers ``kept``: over every
        element of its arrays, or with ``runs`` over the elements in the rows ``[start,
        stop)`` of an (R, 2) int64 array, its last argument (a group holding some of a
        FlatBuffer's parameters: one launch over their slots of the whole buffer)."""
        kept = tuple(b for b in self.buffers if b in kept)
        if (kept, runs) not in self._kernels:
            self._kernels[(kept, runs)] = self._make(kept, runs)
        return self._kernels[(kept, runs)]

    def _make(self, kept, runs):
        arguments = self.arguments(kept, runs)
        results = ", ".join(["new_param"] + [f"new_{b}" for b in self.buffers])
        reads = {"param": "param[i]", "grad": "grad[i]",
                 **{b: (f"{b}[i]" if b in kept else "zero") for b in self.buffers},
                 **{s: f"c_{s}" for s in self.scalars}}
        stores = [f"{b}[i] = new_{b}" for b in kept] + ["param[i] = new_param"]
        body = [f"{results} = rule({', '.join(reads[p] for p in _parameters(self.rule))})"]
        body += stores
        fields = dict(arguments=", ".join(arguments), skipped=SKIPPED,
                      count=max(1, len(self.scalars)))

        def loop_and_body(side):
            loop, depth = _LOOPS[(side, runs)]
            return dict(loop=_indent(loop, 4), body=_indent(body, depth))

        scalar_lines = self._scalar_lines()
        casts = [f"zero = dtype(0)"] + [f"c_{s} = dtype({s})" for s in self.scalars]
        cpu_source = _CPU_SOURCE.format(
            kernel=self.name, **fields, **loop_and_body("cpu"),
            flush_begin="flush_begin()" if self.flush_subnormals else "0",
            flush_end="flush_end(mode)" if self.flush_subnormals else "",
            scalars=_indent(scalar_lines, 4), casts=_indent(casts, 4))
        cuda_source = _CUDA_SOURCE.format(
            kernel=self.name, **fields, **loop_and_body("cuda"),
            shared_scalars=_indent(scalar_lines, 8),
            shared_stores=_indent([f"s[{k}] = {s}" for k, s in enumerate(self.scalars)], 8),
            shared_casts=_indent(["zero = dtype(0)"] + [f"c_{s} = dtype(s[{k}])" for k, s
                                                         in enumerate(self.scalars)], 4))
        digest = hashlib.sha1((cpu_source + cuda_source + repr(sorted(_CPU_FLAGS.items())))
                              .encode()).hexdigest()[:12]
        variant = "_".join(("",) + kept) if kept != self.buffers else ""
        variant += "_runs" if runs else ""
        cpu = _compiled(self.rule, cpu_source, f"{self.name}_cpu",
                        f"{self.name}{variant}_cpu_{digest}",
                        {"rule": self._rule_cpu, "flush_begin": flush_begin,
                         "flush_end": flush_end,
                         **{f.__name__ + "_of": pair[0]
                            for f, pair in zip(self.derived, self._derived)}})
        gpu = _compiled(self.rule, cuda_source, f"{self.name}_cuda",
                        f"{self.name}{variant}_cuda_{digest}",
                        {"rule": self._rule_cuda, "cuda": cuda,
                         **{f.__name__ + "_of": pair[1]
                            for f, pair in zip(self.derived, self._derived)}})
        compiled = njit(**_CPU_FLAGS)(cpu)
        if runs:
            return Kernel(self.name, split_runs_over_threads(compiled), cuda.jit(cache=True)(gpu),
                          run_blocks_grid())
        return Kernel(self.name, split_over_threads(compiled, 2 + len(kept)),
                      cuda.jit(cache=True)(gpu), strided_blocks(0))

    def _scalar_lines(self):
        """Source lines computing every scalar in float64: the step's, the hyper-parameters
        (from the device array), then the derived ones in their order."""
        lines = [f"{name} = {expression}" for name, expression in _STANDARD_SCALARS.items()]
        lines += [f"{name} = hyper[{k}]" for k, name in enumerate(self.hyper)]
        lines += [f"{f.__name__} = {f.__name__}_of({', '.join(_parameters(f))})"
                  for f in self.derived]
        return lines


def _parameters(function):
    return list(inspect.signature(function).parameters)


def _check_returns(name, rule, count):
    """Raise TypeError unless every ``return`` of ``rule`` gives ``count`` values."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(rule)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Return):
            got = len(node.value.elts) if isinstance(node.value, ast.Tuple) else 1
            if got != count:
                raise TypeError(f"{name}: the rule {rule.__name__} returns {got} value(s) at "
                                f"line {node.lineno}; it must return the new param and "
                                f"then each state buffer: {count}")


def _indent(lines, width):
    return "\n".join(" " * width + line for line in lines)


def _compiled(rule, source, name, qualname, names):
    """The function ``name`` of ``source``, compiled as if written at ``rule``'s line of its
    file (Numba's cache keys on, and goes stale with, the file that defines the arithmetic)
    and named ``qualname`` (a digest of the generated text: Numba's cache files and the
    shipped kernels' keys are named by it)."""
    namespace = {"np": np, "float64": float64, "__name__": rule.__module__, **names}
    line = rule.__code__.co_firstlineno
    exec(compile("\n" * (line - 1) + source, inspect.getfile(rule), "exec"), namespace)
    function = namespace[name]
    function.__qualname__ = qualname
    return function
