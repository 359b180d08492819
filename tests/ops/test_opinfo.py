"""PyTorch's OpInfo samples as an outside oracle: every engine op with a torch counterpart runs
torch's own sample inputs (``torch.testing._internal.common_methods_invocations.op_db``,
float64, ``requires_grad=True``), and its forward and input gradients must equal torch's.

``ADAPTERS`` maps an OpInfo (its name, and variant where it has one) to the engine call that
computes the same thing, translating torch's argument names and conventions into the
engine's (``dim`` -> ``axis``; a reduction's empty ``dim``, torch's "all dims", -> None). An
argument the engine has no equivalent for is refused by the adapter with a ``Refused``
naming it, or by the engine with its own ValueError / TypeError / NotImplementedError. Each
sample ends as one of:

- ``matched``: the forward (shape, dtype kind, values) and every gradient equal torch's;
- ``refused``: a clear refusal as above, raised by a ``raise`` statement of the engine or of
  an adapter (never Python's own errors from inside, such as an AttributeError);
- ``wrong``: a number, shape or gradient differs from torch's;
- ``crashed``: anything else raised.

A ``wrong`` or ``crashed`` sample fails its op's test. Samples are made under a fixed seed;
a sample of more than ``MAX_ELEMENTS`` elements is skipped, and an op with more than
``MAX_SAMPLES`` samples runs a fixed draw of that many (the CPU budget: the whole file runs in about a
minute once Numba's cache is warm). ``python -m tests.ops.test_opinfo`` prints
the per-op counts.
"""
import collections
import os
import random
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("expecttest")   # torch.testing._internal imports it

import engine  # noqa: E402
from engine import losses  # noqa: E402
from tests.support.oracle_check import ENGINE_ROOTS, raised_on_purpose  # noqa: E402

MAX_ELEMENTS = 20_000
MAX_SAMPLES = 60   # an op with more (max_pool2d has 1440) runs a fixed draw of them
RTOL, ATOL = 1e-7, 1e-9   # float64 both sides; the sums' orders differ by a few ulps
# where a refusal may be raised: the engine's packages and this file (its adapters)
ROOTS = ENGINE_ROOTS + (os.path.abspath(__file__),)


class Refused(ValueError):
    """An argument of torch's that the engine's function has no equivalent for."""


def _refuse_unknown(name, kwargs, known):
    extra = sorted(set(kwargs) - set(known))
    if extra:
        given = ", ".join(f"{k}={_describe(kwargs[k])}" for k in extra)
        raise Refused(f"{name}: the engine's function takes no {', '.join(map(repr, extra))} "
                      f"argument (torch's sample gives {given})")


def _only_defaults(name, kwargs, **defaults):
    """Refuse a keyword whose value differs from the one the engine always computes with."""
    for key, default in defaults.items():
        if key in kwargs and kwargs[key] != default and not (
                default is None and kwargs[key] is None):
            raise Refused(f"{name}: the engine computes only {key}={default!r}, the sample "
                          f"gives {key}={_describe(kwargs[key])}")


# ------------------------------------------------------------------ adapters

def _binary(function, reflected=False, refuse=()):
    def adapter(x, *args, **kwargs):
        _only_defaults("binary", kwargs, alpha=1, rounding_mode=None)
        _refuse_unknown("binary", kwargs, ("alpha", "rounding_mode"))
        (other,) = args
        return function(other, x) if reflected else function(x, other)
    return adapter


def _unary(function, **keywords):
    """``function(x, **translated)``: ``keywords`` maps torch's names to the engine's
    (None: refused unless it has the value torch defaults to, given in ``defaults``)."""
    def adapter(x, *args, **kwargs):
        if args:
            raise Refused(f"{function.__name__}: positional arguments {args!r} beside the input")
        translated = {}
        for key, value in kwargs.items():
            if key == "inplace" and not value:
                continue
            if key not in keywords:
                raise Refused(f"{function.__name__}: the engine's function takes no {key!r} "
                              f"argument (the sample gives {key}={value!r})")
            translated[keywords[key]] = value
        return function(x, **translated)
    return adapter


def _dims(dim):
    """torch's ``dim`` of a reduction as the engine's ``axis``: an empty list or tuple means
    every dimension to torch (amax, amin, sum), None to the engine (NumPy's () reduces none)."""
    if isinstance(dim, (list, tuple)):
        return None if len(dim) == 0 else tuple(dim)
    return dim


def _reduction(method):
    def adapter(x, *args, **kwargs):
        _refuse_unknown(method, kwargs, ("dim", "keepdim"))
        dim = args[0] if args else kwargs.get("dim")
        keepdim = args[1] if len(args) > 1 else kwargs.get("keepdim", False)
        if len(args) > 2:
            raise Refused(f"{method}: positional arguments {args[2:]!r} (a dtype?)")
        return getattr(engine, method)(x, axis=_dims(dim), keepdims=keepdim)
    return adapter


def _arg_reduction(method):
    def adapter(x, *args, **kwargs):
        _refuse_unknown(method, kwargs, ("dim", "keepdim"))
        dim = args[0] if args else kwargs.get("dim")
        return getattr(engine, method)(x, axis=dim, keepdims=kwargs.get("keepdim", False))
    return adapter


def _softmax(method):
    def adapter(x, dim=None, *args, **kwargs):
        _only_defaults(method, kwargs, dtype=None)
        _refuse_unknown(method, kwargs, ("dtype", "dim"))
        return getattr(engine, method)(x, axis=kwargs.get("dim", dim))
    return adapter


def _clamp(x, low=None, high=None, **kwargs):
    _refuse_unknown("clamp", kwargs, ("min", "max"))
    return engine.clip(x, kwargs.get("min", low), kwargs.get("max", high))


def _where(x, condition, other, **kwargs):
    _refuse_unknown("where", kwargs, ())
    return engine.where(condition, x, other)


def _flatten(x, start_dim=0, end_dim=-1, **kwargs):
    _refuse_unknown("flatten", kwargs, ())
    if end_dim not in (-1, x.ndim - 1) and x.ndim:
        raise Refused(f"flatten: the engine flattens to the last axis (end_dim=-1), the "
                      f"sample gives end_dim={end_dim}")
    return engine.flatten(x, start_dim if x.ndim == 0 else start_dim % x.ndim)


def _shape_method(method):
    def adapter(x, *args, **kwargs):
        _refuse_unknown(method, kwargs, ("dim",))
        if "dim" in kwargs:
            args = args + (kwargs["dim"],)
        return getattr(x, method)(*args)
    return adapter


def _join(function):
    def adapter(tensors, *args, **kwargs):
        _refuse_unknown(function.__name__, kwargs, ("dim",))
        dim = args[0] if args else kwargs.get("dim", 0)
        return function(list(tensors), dim)
    return adapter


def _getitem(x, index, **kwargs):
    return x[index]


def _conv(function, rank):
    def adapter(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, **kwargs):
        _refuse_unknown(function.__name__, kwargs, ("bias", "stride", "padding", "dilation",
                                                   "groups"))
        bias = kwargs.get("bias", bias)
        stride, padding = kwargs.get("stride", stride), kwargs.get("padding", padding)
        dilation, groups = kwargs.get("dilation", dilation), kwargs.get("groups", groups)
        if x.ndim != rank + 2:
            raise Refused(f"{function.__name__}: an unbatched input of shape {x.shape} (the "
                          f"engine's takes (N, C, {'L' if rank == 1 else 'H, W'}))")
        return function(x, weight, bias, stride=stride, padding=padding, dilation=dilation,
                        groups=groups)
    return adapter


def _pool(function, **only):
    def adapter(x, kernel_size, stride=None, padding=0, *args, **kwargs):
        names = ("stride", "padding") + tuple(only)
        _refuse_unknown(function.__name__, kwargs, ("kernel_size",) + names)
        if args:
            raise Refused(f"{function.__name__}: positional arguments {args!r} beyond padding "
                          f"({', '.join(only)} keep torch's defaults in the engine)")
        _only_defaults(function.__name__, kwargs, **only)
        if x.ndim != 4:
            raise Refused(f"{function.__name__}: an unbatched input of shape {x.shape}")
        stride = kwargs.get("stride", stride)
        return function(x, kernel_size, stride=stride or None,
                        padding=kwargs.get("padding", padding))
    return adapter


def _batch_norm(x, running_mean, running_var, weight=None, bias=None, training=False,
                momentum=0.1, eps=1e-5, **kwargs):
    _refuse_unknown("batch_norm", kwargs, ("weight", "bias", "training", "momentum", "eps"))
    if x.ndim not in (2, 4):
        raise Refused(f"batch_norm: an input of shape {x.shape} (the engine's takes (N, C) "
                      "or (N, C, H, W))")
    return engine.batch_norm(x, running_mean, running_var, kwargs.get("weight", weight),
                             kwargs.get("bias", bias), kwargs.get("training", training),
                             kwargs.get("momentum", momentum), kwargs.get("eps", eps))


def _loss(function, **only):
    def adapter(x, target, *args, **kwargs):
        if args:
            raise Refused(f"{function.__name__}: positional arguments {args!r}")
        _refuse_unknown(function.__name__, kwargs, tuple(only))
        _only_defaults(function.__name__, kwargs, **only)
        return function(x, target)
    return adapter


def _cross_entropy(x, target, *args, **kwargs):
    if args:
        raise Refused(f"cross_entropy: positional arguments {args!r}")
    _refuse_unknown("cross_entropy", kwargs, ("weight", "reduction", "ignore_index",
                                              "label_smoothing"))
    _only_defaults("cross_entropy", kwargs, weight=None, ignore_index=-100)
    return losses.cross_entropy(x, target, label_smoothing=kwargs.get("label_smoothing", 0.0),
                                reduction=kwargs.get("reduction", "mean"))


def _embedding(weight, ids, padding_idx=None, *args, **kwargs):
    # torch's OpInfo takes the table as the input and the ids as its argument
    if args:
        raise Refused(f"embedding: positional arguments {args!r} beyond padding_idx")
    _refuse_unknown("embedding", kwargs, ("padding_idx", "max_norm", "norm_type",
                                          "scale_grad_by_freq", "sparse"))
    _only_defaults("embedding", kwargs, max_norm=None, norm_type=2.0,
                   scale_grad_by_freq=False, sparse=False)
    return engine.embedding(ids, weight, kwargs.get("padding_idx", padding_idx))


def _layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, **kwargs):
    _refuse_unknown("layer_norm", kwargs, ("weight", "bias", "eps"))
    return engine.layer_norm(x, normalized_shape, kwargs.get("weight", weight),
                             kwargs.get("bias", bias), kwargs.get("eps", eps))


def _triangle(function):
    def adapter(x, diagonal=0, **kwargs):
        _refuse_unknown(function.__name__, kwargs, ("diagonal",))
        return function(x, kwargs.get("diagonal", diagonal))
    return adapter


ADAPTERS = {
    ("add", ""): _binary(engine.add),
    ("sub", ""): _binary(engine.sub),
    ("rsub", ""): _binary(engine.sub, reflected=True),
    ("mul", ""): _binary(engine.mul),
    ("div", "no_rounding_mode"): _binary(engine.div),
    ("div", "trunc_rounding"): _binary(engine.div),
    ("div", "floor_rounding"): _binary(engine.div),
    ("true_divide", ""): _binary(engine.div),
    ("pow", ""): _binary(engine.pow),
    ("maximum", ""): _binary(lambda a, b: engine.maximum(a, b)),
    ("minimum", ""): _binary(lambda a, b: engine.minimum(a, b)),
    ("max", "binary"): _binary(lambda a, b: engine.max(a, b)),
    ("min", "binary"): _binary(lambda a, b: engine.min(a, b)),
    ("eq", ""): _binary(engine.eq), ("ne", ""): _binary(engine.ne),
    ("lt", ""): _binary(engine.lt), ("le", ""): _binary(engine.le),
    ("gt", ""): _binary(engine.gt), ("ge", ""): _binary(engine.ge),
    ("where", ""): _where,
    ("neg", ""): _unary(engine.neg), ("exp", ""): _unary(engine.exp),
    ("log", ""): _unary(engine.log), ("sqrt", ""): _unary(engine.sqrt),
    ("abs", ""): _unary(engine.abs), ("sigmoid", ""): _unary(engine.sigmoid),
    ("tanh", ""): _unary(engine.tanh),
    ("nn.functional.relu", ""): _unary(engine.relu, inplace="inplace"),
    ("nn.functional.silu", ""): _unary(engine.silu, inplace="inplace"),
    ("nn.functional.gelu", ""): _unary(engine.gelu, approximate="approximate"),
    ("nn.functional.leaky_relu", ""): _unary(engine.leaky_relu, negative_slope="alpha"),
    ("clamp", ""): _clamp,
    ("clamp_min", ""): lambda x, low, **kwargs: _clamp(x, low, None, **kwargs),
    ("clamp_max", ""): lambda x, high, **kwargs: _clamp(x, None, high, **kwargs),
    ("sum", ""): _reduction("sum"), ("mean", ""): _reduction("mean"),
    ("amax", ""): _reduction("max"), ("amin", ""): _reduction("min"),
    ("max", "reduction_no_dim"): _reduction("max"),
    ("min", "reduction_no_dim"): _reduction("min"),
    ("argmax", ""): _arg_reduction("argmax"), ("argmin", ""): _arg_reduction("argmin"),
    ("softmax", ""): _softmax("softmax"), ("log_softmax", ""): _softmax("log_softmax"),
    ("matmul", ""): _binary(engine.matmul), ("mm", ""): _binary(engine.matmul),
    ("bmm", ""): _binary(engine.matmul),
    ("reshape", ""): _shape_method("reshape"), ("view", ""): _shape_method("view"),
    ("flatten", ""): _flatten,
    ("squeeze", ""): _shape_method("squeeze"), ("squeeze", "multiple"): _shape_method("squeeze"),
    ("unsqueeze", ""): _shape_method("unsqueeze"), ("permute", ""): _shape_method("permute"),
    ("transpose", ""): _shape_method("transpose"),
    ("cat", ""): _join(engine.cat), ("stack", ""): _join(engine.stack),
    ("__getitem__", ""): _getitem,
    ("nn.functional.conv1d", ""): _conv(engine.conv1d, 1),
    ("nn.functional.conv2d", ""): _conv(engine.conv2d, 2),
    ("nn.functional.max_pool2d", ""): _pool(engine.max_pool2d, dilation=1, ceil_mode=False,
                                            return_indices=False),
    ("nn.functional.avg_pool2d", ""): _pool(engine.avg_pool2d, ceil_mode=False,
                                            count_include_pad=True, divisor_override=None),
    ("nn.functional.batch_norm", ""): _batch_norm,
    ("nn.functional.cross_entropy", ""): _cross_entropy,
    ("nn.functional.embedding", ""): _embedding,
    ("nn.functional.layer_norm", ""): _layer_norm,
    ("tril", ""): _triangle(engine.tril), ("triu", ""): _triangle(engine.triu),
    ("nn.functional.mse_loss", ""): _loss(losses.mse, reduction="mean"),
    ("nn.functional.binary_cross_entropy", ""): _loss(losses.binary_cross_entropy,
                                                      weight=None, reduction="mean"),
}


# the OpInfos whose every sample needs what the engine refuses: a Tensor exponent or bound
# (its pow and clip take numbers), a rounding mode
ONLY_REFUSED = {("pow", ""), ("clamp", ""), ("clamp_min", ""), ("clamp_max", ""),
                ("div", "trunc_rounding"), ("div", "floor_rounding")}


# ------------------------------------------------------------------ running a sample

def _to_engine(value, leaves):
    """A torch tensor (or a list, tuple, slice of them) as the engine's; the float tensors
    that require grad are collected in ``leaves`` as (torch tensor, engine tensor)."""
    if isinstance(value, torch.Tensor):
        array = value.detach().numpy().copy()
        requires = value.requires_grad and value.dtype.is_floating_point
        tensor = engine.tensor(array, dtype=array.dtype, requires_grad=requires)
        if requires:
            leaves.append((value, tensor))
        return tensor
    if isinstance(value, (list, tuple)):
        return type(value)(_to_engine(v, leaves) for v in value)
    if isinstance(value, slice):
        return slice(*(_to_engine(v, leaves) for v in (value.start, value.stop, value.step)))
    if isinstance(value, torch.dtype):
        return value   # the adapters refuse dtype arguments by name
    return value


def _elements(value):
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)):
        return sum(_elements(v) for v in value)
    return 0


def _compare(name, got, expected):
    got = got.numpy() if hasattr(got, "numpy") else np.asarray(got)
    expected = expected.detach().numpy()
    if got.shape != expected.shape:
        return f"{name}: shape {got.shape}, torch's {expected.shape}"
    if (got.dtype.kind == "b") != (expected.dtype.kind == "b") or (
            got.dtype.kind in "iu") != (expected.dtype.kind in "iu"):
        return f"{name}: dtype {got.dtype}, torch's {expected.dtype}"
    if not np.allclose(got, expected, rtol=RTOL, atol=ATOL, equal_nan=True):
        worst = np.nanmax(np.abs(got.astype(np.float64) - expected.astype(np.float64)))
        return f"{name}: values differ from torch's by up to {worst:.3g}"
    return None


def run_sample(adapter, op, sample):
    """``("matched" | "refused" | "wrong" | "crashed", detail)`` of one sample."""
    leaves = []
    try:
        x = _to_engine(sample.input, leaves)
        args = _to_engine(tuple(sample.args), leaves)
        kwargs = {k: _to_engine(v, leaves) for k, v in sample.kwargs.items()}
        out = adapter(x, *args, **kwargs)
    except Exception as error:
        kind = "refused" if raised_on_purpose(error, ROOTS) else "crashed"
        return kind, f"{type(error).__name__}: {error}"
    expected = op(sample.input, *sample.args, **sample.kwargs)
    problem = _compare("forward", out, expected)
    if problem:
        return "wrong", problem
    differentiable = [(t, e) for t, e in leaves if t.requires_grad]
    if not (expected.requires_grad and out.requires_grad and differentiable):
        return "matched", ""
    upstream = torch.from_numpy(np.random.default_rng(0).standard_normal(expected.shape))
    torch_grads = torch.autograd.grad(expected, [t for t, _ in differentiable], upstream,
                                      allow_unused=True)
    try:
        out.backward(engine.tensor(upstream.numpy(), dtype=np.float64))
    except Exception as error:
        kind = "refused" if raised_on_purpose(error, ROOTS) else "crashed"
        return kind, f"backward: {type(error).__name__}: {error}"
    for k, ((leaf, tensor), torch_grad) in enumerate(zip(differentiable, torch_grads)):
        torch_grad = torch.zeros_like(leaf) if torch_grad is None else torch_grad
        grad = tensor.grad if tensor.grad is not None else np.zeros(tuple(leaf.shape))
        problem = _compare(f"gradient {k}", grad, torch_grad)
        if problem:
            return "wrong", problem
    return "matched", ""


def _describe(value):
    """A sample's (or an argument's) shapes and values, short."""
    if hasattr(value, "input"):
        return (f"input {_describe(value.input)}, args {_describe(list(value.args))}, "
                f"kwargs {_describe(dict(value.kwargs))}")
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype)[6:]}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_describe(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _op_infos():
    from torch.testing._internal.common_methods_invocations import op_db
    return {(op.name, op.variant_test_name): op for op in op_db}


def run_op(op, adapter):
    """``(Counter of outcomes, [(outcome, detail)] of the wrong and crashed samples)``."""
    counts, failures = collections.Counter(), []
    torch.manual_seed(0)
    samples = list(op.sample_inputs("cpu", torch.float64, requires_grad=True))
    if len(samples) > MAX_SAMPLES:   # a fixed draw: every k-th would follow the options' grid
        chosen = sorted(random.Random(0).sample(range(len(samples)), MAX_SAMPLES))
        counts["skipped (many)"] = len(samples) - MAX_SAMPLES
        samples = [samples[i] for i in chosen]
    for sample in samples:
        if _elements(sample.input) + _elements(list(sample.args)) > MAX_ELEMENTS:
            counts["skipped (large)"] += 1
            continue
        outcome, detail = run_sample(adapter, op, sample)
        counts[outcome] += 1
        if outcome in ("wrong", "crashed"):
            failures.append((outcome, f"{_describe(sample)}: {detail}"))
    return counts, failures


_OPS = None


def _ops():
    global _OPS
    if _OPS is None:
        _OPS = _op_infos()
    return _OPS


@pytest.mark.torch
@pytest.mark.parametrize("key", sorted(ADAPTERS), ids=lambda key: ".".join(filter(None, key)))
def test_opinfo_samples_match_torch_or_are_refused(key):
    op = _ops().get(key)
    assert op is not None, f"no OpInfo {key} in this torch's op_db"
    counts, failures = run_op(op, ADAPTERS[key])
    assert not failures, f"{key}: {dict(counts)}\n" + "\n".join(
        f"{outcome}: {detail}" for outcome, detail in failures[:10])
    if key not in ONLY_REFUSED:   # an adapter that refuses everything would test nothing
        assert counts["matched"], f"{key}: no sample matched ({dict(counts)})"


def main():
    total = collections.Counter()
    for key in sorted(ADAPTERS):
        op = _ops().get(key)
        if op is None:
            print(f"{key}: no OpInfo")
            continue
        counts, failures = run_op(op, ADAPTERS[key])
        total.update(counts)
        print(f"{'.'.join(filter(None, key)):32s} " + " ".join(
            f"{k}={v}" for k, v in sorted(counts.items())))
        for outcome, detail in failures[:3]:
            print(f"    {outcome}: {detail[:300]}")
    samples = sum(v for k, v in total.items() if not k.startswith("skipped"))
    print(f"TOTAL {samples} samples over {len(ADAPTERS)} ops: " + ", ".join(
        f"{k} {v}" for k, v in sorted(total.items())))


if __name__ == "__main__":
    sys.exit(main())
