"""``Tensor``: an array on one device plus what autograd needs, and the creation functions.

Storage is a C-contiguous NumPy array on the CPU or a Numba device array on CUDA. Floating
tensors are float32 (the default) or float64; integer tensors exist for labels and bool
tensors for comparison results and masks; neither ever requires grad, and arithmetic refuses
them until they are cast (``x.astype(np.float32)``). What autograd needs
(``requires_grad``, ``grad``, ``backward``) is inherited from ``engine.autograd.Value``; all
math goes through ``engine.functional``, which runs registered ops. Both modules sit below
this one: neither imports it.

Comparisons are elementwise (``x == y`` is a bool tensor), so ``__hash__`` is set back to
identity, as torch does: tensors stay usable in sets and as dict keys.
"""
import numbers

import numpy as np

from engine import functional as F
from engine import sequence as S
from engine.autograd import Value
from engine.random import generator
from ops.cuda import (as_device_array, current_device_id, device_array_from_dlpack,
                               dlpack_capsule)
from ops.device import check_device, device_of, read_on_host, to_device, to_host
from ops.cast import BOOL, BYTE, cast, same_memory_as
from ops.fill import fill
from ops.indexing import assign
from ops.memory import empty
from ops.registry import FLOAT_DTYPES

INT_DTYPES = tuple(np.dtype(t) for t in (np.int64, np.int32, np.uint8))
COMPARABLE = (numbers.Number, np.ndarray, list, tuple)   # what ==, < and the others take


def check_dtype(dtype, where="tensor"):
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{where}: {dtype!r} is not a dtype") from None
    if dtype not in FLOAT_DTYPES + INT_DTYPES + (BOOL,):
        raise TypeError(f"{where}: dtype {dtype} is not supported; use float32 or float64 "
                        "(int64, int32 or uint8 for labels, bool for masks; neither requires "
                        "grad)")
    return dtype


def _with_pointwise_methods(cls):
    """``x.relu()``, ``x.exp()``, ``x.abs()``, ...: the parameter-free functions that
    ``engine.functional`` generates from ``ops.pointwise.TABLE``, bound as methods."""
    for name, function in F.POINTWISE.items():
        setattr(cls, name, function)
    return cls


def _operator_and_reflected(name, function):
    """``(__name__, __rname__)``: ``function(self, other)`` and ``function(other, self)``."""
    def operator(self, other):
        return function(self, other)

    def reflected(self, other):
        return function(other, self)

    operator.__name__, reflected.__name__ = f"__{name}__", f"__r{name}__"
    operator.__qualname__, reflected.__qualname__ = (f"Tensor.{operator.__name__}",
                                                     f"Tensor.{reflected.__name__}")
    return operator, reflected


def _comparison(name, function):
    """``__name__``: ``function(self, other)`` (a bool tensor) for a Tensor, number, array,
    list or tuple ``other``; NotImplemented for anything else, so it compares by identity."""
    def compare(self, other):
        if isinstance(other, (Tensor,) + COMPARABLE):
            return function(self, other)
        return NotImplemented
    compare.__name__ = f"__{name}__"
    compare.__qualname__ = f"Tensor.{compare.__name__}"
    return compare


# torch's tensor-type names, for ``x.type("torch.FloatTensor")``
_TORCH_TYPE_NAMES = {"torch.FloatTensor": np.float32, "torch.DoubleTensor": np.float64,
                     "torch.LongTensor": np.int64, "torch.IntTensor": np.int32,
                     "torch.ByteTensor": np.uint8, "torch.BoolTensor": np.bool_}


@_with_pointwise_methods
class Tensor(Value):
    __array_priority__ = 1000   # NumPy defers to our reflected operators
    __hash__ = object.__hash__   # by identity, as torch: == is elementwise, tensors stay keys

    def __init__(self, data, requires_grad=False):
        """Wraps ``data`` (a host or device array) without copying; ``engine.tensor`` copies."""
        self.data = data
        super().__init__(requires_grad)

    @staticmethod
    def _wrap(data, requires_grad=False):
        """A plain Tensor over ``data`` (also for a Parameter's results and gradients)."""
        return Tensor(data, requires_grad)

    def _operand(self, value, dtype=None):
        """``value`` as a tensor on this device, in ``dtype`` (default: this tensor's)."""
        if isinstance(value, Tensor):
            return value
        return tensor(value, dtype=self.dtype if dtype is None else dtype, device=self.device)

    # ----------------------------------------------------------- attributes
    shape = property(lambda self: tuple(self.data.shape))
    dtype = property(lambda self: np.dtype(self.data.dtype))
    device = property(lambda self: device_of(self.data))
    ndim = property(lambda self: len(self.data.shape))
    size = property(lambda self: _Size(self.data.size, self.data.shape))

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __iter__(self):
        """The sub-tensors along the first axis (``x[0]``, ``x[1]``, ...: views)."""
        if not self.shape:
            raise TypeError("iteration over a 0-d tensor")
        return (self[i] for i in range(self.shape[0]))

    # ----------------------------------------------------------- indexing (ops.indexing)
    def __getitem__(self, key):
        """Basic and advanced indexing as torch's: ints, slices, None, ..., integer arrays or
        tensors, bool masks. Differentiable; a result that is one contiguous block of this
        tensor (``x[0]``, ``x[2:5]``) shares its memory, every other result is a copy."""
        return F.index(self, key)

    def __setitem__(self, key, value):
        """Write ``value`` (a number or an array broadcasting to ``self[key]``, cast to this
        dtype) into the selection, in place; only on a tensor that does not require grad.
        The write bumps the version of this storage: a backward through an op that saved
        it (or a view of it) raises instead of using the new values."""
        if self.requires_grad:
            raise RuntimeError(
                "setitem: this tensor requires grad, and an in-place write would change values "
                "the tape may have saved for backward; build the new tensor with engine.where "
                "or engine.cat, or write outside autograd through x.detach()[key] = value "
                "(the same memory, e.g. to change a parameter between steps)")
        if isinstance(value, Tensor):
            if value.requires_grad:
                raise RuntimeError("setitem: the value requires grad, and an assignment is not "
                                   "recorded for autograd; assign value.detach(), or build "
                                   "the result with engine.where or engine.cat")
            value = value.data
        assign(self.data, F._storage_key(key), value)
        self._bump_version()

    def detach(self):
        """The same memory outside autograd; its in-place writes count in this tensor's
        version, as torch's."""
        return Tensor(self.data)._share_version(self)

    def requires_grad_(self, requires_grad=True):
        """Set ``requires_grad`` in place and return the tensor, as torch's (``x =
        engine.tensor(a).requires_grad_()``); a frozen Parameter (False) gets no gradient and
        no optimizer moves it. A tensor computed from others cannot stop requiring grad."""
        self.requires_grad = requires_grad
        return self

    # ----------------------------------------------------------- moving data
    def numpy(self):
        """The values as a host NumPy array (shares memory on the CPU, a copy from the GPU)."""
        return read_on_host(self.data, ".numpy()")

    def item(self):
        if self.size != 1:
            raise ValueError(f"item: only one-element tensors convert to a Python number, "
                             f"this one has shape {self.shape}")
        return read_on_host(self.data, ".item(), float(), int() or bool()").reshape(()).item()

    def __float__(self):
        return float(self._python_number("float"))

    def __int__(self):
        return int(self._python_number("int"))

    def __bool__(self):
        if self.size != 1:
            raise RuntimeError(f"bool(): the truth value of a tensor of shape {self.shape} "
                               "is ambiguous, only one-element tensors have one; reduce it "
                               "first, e.g. bool((x > 0).astype(np.float32).min())")
        return bool(self.item())

    def __index__(self):
        """A one-element integer tensor as a Python int, so it can index a list or slice
        (``classes[t.argmax()]``), as torch's."""
        if self.dtype.kind not in "iu" or self.size != 1:
            raise TypeError(f"only one-element integer tensors can be used as an index, this "
                            f"one has shape {self.shape} and dtype {self.dtype}")
        return int(self.item())

    def _python_number(self, name):
        if self.size != 1:
            raise ValueError(f"{name}(): only one-element tensors convert to a Python "
                             f"number, this one has shape {self.shape}")
        return self.item()

    def tolist(self):
        return self.numpy().tolist()

    def to(self, device=None, dtype=None):
        """This tensor on ``device`` (and/or as ``dtype``); ``self`` when nothing changes.
        ``x.to(np.float64)`` changes the dtype only, as torch's ``x.to(torch.float64)``.

        The dtype changes on this tensor's device, differentiably between float32 and
        float64 (``astype``); a move to another device gives a new leaf."""
        if device is not None and not isinstance(device, str):
            if dtype is not None:
                raise TypeError(f"to: got two dtypes ({device!r} and {dtype!r})")
            device, dtype = None, device
        device = self.device if device is None else check_device(device)
        dtype = self.dtype if dtype is None else check_dtype(dtype, "to")
        result = self if dtype == self.dtype else self.astype(dtype)
        if device == self.device:
            return result
        return Tensor(to_device(result.data, device),
                      requires_grad=result.requires_grad and result.is_leaf)

    def astype(self, dtype):
        """A copy as ``dtype`` on this device (NumPy's astype; differentiable between float32
        and float64). Floats become integers by truncation toward zero."""
        return F.astype(self, check_dtype(dtype, "astype"))

    def cpu(self):
        return self.to("cpu")

    def cuda(self):
        return self.to("cuda")

    def __repr__(self):
        body = np.array2string(self.numpy(), separator=", ", prefix="tensor(")
        extras = [f"dtype={self.dtype}"] if self.dtype != np.float32 else []
        if self.device != "cpu":
            extras.append(f"device='{self.device}'")
        if self.requires_grad:
            extras.append("requires_grad=True")
        return "tensor(" + ", ".join([body] + extras) + ")"

    # ----------------------------------------------------------- math (engine.functional)
    # a function of engine.functional bound as the method: ``x.sum(1)`` is ``F.sum(x, 1)``
    __add__, __radd__ = _operator_and_reflected("add", F.add)
    __sub__, __rsub__ = _operator_and_reflected("sub", F.sub)
    __mul__, __rmul__ = _operator_and_reflected("mul", F.mul)
    __truediv__, __rtruediv__ = _operator_and_reflected("truediv", F.div)
    __matmul__, __rmatmul__ = _operator_and_reflected("matmul", F.matmul)
    __pow__, __neg__ = F.pow, F.neg

    # comparisons are elementwise (bool tensors); anything else compares by identity
    __eq__, __ne__, __lt__, __le__, __gt__, __ge__ = (
        _comparison(name, getattr(F, name)) for name in ("eq", "ne", "lt", "le", "gt", "ge"))

    sum, mean, argmax, argmin = F.sum, F.mean, F.argmax, F.argmin

    def max(self, *args, **kwargs):
        """torch's and NumPy's max: ``x.max()`` the largest value, ``x.max(dim)`` /
        ``x.max(dim=d, keepdim=k)`` the named tuple (values, indices), ``x.max(axis=a,
        keepdims=k)`` NumPy's values, ``x.max(other)`` the elementwise maximum."""
        return S.extremum_method("max", self, args, kwargs)

    def min(self, *args, **kwargs):
        """The smallest values, as ``max`` reads its arguments."""
        return S.extremum_method("min", self, args, kwargs)

    clip = clamp = F.clip
    leaky_relu, gelu, softmax, log_softmax = F.leaky_relu, F.gelu, F.softmax, F.log_softmax

    def reshape(self, *shape):   # F.reshape's op_name is for its callers, not a method's
        return F.reshape(self, *shape)

    view, flatten, squeeze, unsqueeze = F.view, F.flatten, F.squeeze, F.unsqueeze
    transpose, permute = F.transpose, F.permute
    T = property(F.transpose)

    # ----------------------------------------------------------- sequence models' methods
    def masked_fill(self, mask, value):
        return S.masked_fill(self, mask, value)

    def split(self, split_size, dim=-1):
        return S.split(self, split_size, dim)

    def chunk(self, chunks, dim=-1):
        return S.chunk(self, chunks, dim)

    def tril(self, diagonal=0):
        return S.tril(self, diagonal)

    def triu(self, diagonal=0):
        return S.triu(self, diagonal)

    def topk(self, k, dim=-1, largest=True, sorted=True):
        return S.topk(self, k, dim, largest, sorted)

    # ----------------------------------------------------------- PyTorch's names
    def float(self):
        """As float32 (``self`` when it already is), as torch's ``x.float()``."""
        return self.to(np.float32)

    def double(self):
        """As float64 (``self`` when it already is)."""
        return self.to(np.float64)

    def long(self):
        """As int64 (``self`` when it already is): labels, indices; never differentiable."""
        return self.to(np.int64)

    def type(self, dtype=None):
        """Without an argument, the dtype's name (``"float32"``); with one, this tensor as that
        dtype (``x.type(engine.float64)``, or torch's names ``"torch.DoubleTensor"``)."""
        if dtype is None:
            return self.dtype.name
        return self.to(_TORCH_TYPE_NAMES.get(dtype, dtype))

    def clone(self):
        """A copy with its own memory; differentiable, as torch's (the gradient passes
        through unchanged)."""
        return F.astype(self, self.dtype)

    def zero_(self):
        """Fill with zeros in place (``x.grad.zero_()``); returns ``self``. Refused on a
        tensor that requires grad, as every in-place write is (see ``__setitem__``)."""
        self[...] = 0
        return self

    # ---------------------------------------------------------- exchange with other libraries
    # Other libraries read and write our storage in place through these protocols: no copy.
    # (Storage is always C-contiguous; engine.from_dlpack is the way in.)
    def __array__(self, dtype=None, copy=None):
        """NumPy's view of a CPU tensor: ``np.asarray(t)`` shares memory with ``t``."""
        if self.device != "cpu":
            raise TypeError(f"__array__: this tensor lives on {self.device} and NumPy can only "
                            "view host memory; copy it to the host with t.numpy()")
        read_on_host(self.data, "np.asarray()")
        if dtype is not None and np.dtype(dtype) != self.dtype:
            if copy is False:
                raise ValueError(f"__array__: viewing a {self.dtype} tensor as {np.dtype(dtype)} "
                                 "needs a copy, and copy=False was asked for")
            return self.data.astype(dtype)
        return self.data.copy() if copy else self.data

    @property
    def __cuda_array_interface__(self):
        """The CUDA Array Interface of a CUDA tensor (CuPy, PyTorch, Numba read it in place)."""
        if self.device != "cuda":
            raise AttributeError("__cuda_array_interface__: this tensor lives on the cpu; "
                                 "NumPy and PyTorch view it through __array__ / __dlpack__")
        return self.data.__cuda_array_interface__

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule over this tensor's memory (``torch.from_dlpack(t)``,
        ``np.from_dlpack(t)``)."""
        if self.device == "cpu":
            return self.data.__dlpack__(stream=stream, max_version=max_version,
                                        dl_device=dl_device, copy=copy)
        return dlpack_capsule(self.data, stream=stream, max_version=max_version,
                              dl_device=dl_device, copy=copy)

    def __dlpack_device__(self):
        if self.device == "cpu":
            return self.data.__dlpack_device__()
        return (DLPACK_CUDA, current_device_id())


# ------------------------------------------------------------------ creation

def tensor(data, dtype=None, device="cpu", requires_grad=False):
    """A new tensor holding a copy of ``data`` (array, nested list, number or Tensor)."""
    device = check_device(device)
    if isinstance(data, Tensor):
        dtype = check_dtype(dtype or data.dtype)
        if dtype == data.dtype:
            return Tensor(to_device(data.data, device), requires_grad)
        converted = cast(data.data, dtype)   # a new array, made on the source's device
        if data.device != device:
            converted = to_device(converted, device)
        return Tensor(converted, requires_grad)
    if not isinstance(data, (np.ndarray, list, tuple, numbers.Number)) and (
            hasattr(data, "__dlpack__") or hasattr(data, "__cuda_array_interface__")):
        data = from_dlpack(data).data   # torch/CuPy/Numba: keep its dtype and device, then copy
    if device_of(data) == "cuda":
        array = data
    else:
        array = np.asarray(data)
    if dtype is None:
        dtype = _default_dtype(array, data)
    dtype = check_dtype(dtype)
    if np.dtype(array.dtype) != dtype:
        array = to_host(array).astype(dtype)
    return Tensor(to_device(array, device), requires_grad)


def _default_dtype(array, data):
    """As torch.tensor: arrays keep a supported dtype, Python floats become float32 and
    Python ints int64; anything else (float16, bool, complex) is refused by name."""
    kind = np.dtype(array.dtype).kind
    if isinstance(data, np.ndarray) or device_of(data) == "cuda":
        return check_dtype(array.dtype)
    if kind in "iu":
        return np.int64
    if kind == "f":
        return np.float32
    return check_dtype(array.dtype)


def _shape(shape):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    if not all(isinstance(s, numbers.Integral) and s >= 0 for s in shape):
        raise ValueError(f"shape must be non-negative integers, got {shape}")
    return tuple(int(s) for s in shape)


def zeros(*shape, dtype=np.float32, device="cpu", requires_grad=False):
    return full(_shape(shape), 0, dtype, device, requires_grad)


def ones(*shape, dtype=np.float32, device="cpu", requires_grad=False):
    return full(_shape(shape), 1, dtype, device, requires_grad)


def full(shape, value, dtype=np.float32, device="cpu", requires_grad=False):
    dtype, device = check_dtype(dtype), check_device(device)
    if dtype == BOOL:   # filled as bytes: see ops.cast
        filled = fill(empty(_shape((shape,)), BYTE, device), bool(value))
        return Tensor(same_memory_as(filled, BOOL), requires_grad)
    return Tensor(fill(empty(_shape((shape,)), dtype, device), value), requires_grad)


def randn(*shape, seed=None, dtype=np.float32, device="cpu", requires_grad=False):
    """Standard normal samples from the engine's generator (``engine.manual_seed``)."""
    dtype = check_dtype(dtype)
    values = generator(seed).standard_normal(_shape(shape)).astype(dtype)
    return Tensor(to_device(values, check_device(device)), requires_grad)


def as_tensor(value, like):
    """``value`` as a Tensor on ``like``'s device and dtype (no copy when it already is one)."""
    if isinstance(value, Tensor):
        return value
    return tensor(value, dtype=like.dtype, device=like.device)


DLPACK_CUDA = 2   # DLPack's kDLCUDA device type


def from_dlpack(array, requires_grad=False):
    """A tensor sharing memory with ``array``, without a copy.

    ``array`` is anything exposing ``__dlpack__`` (PyTorch, CuPy, JAX, NumPy) or
    ``__cuda_array_interface__`` (Numba, CuPy, PyTorch on CUDA), or a Numba device array. It
    must be C-contiguous and float32/float64 (int64/int32/uint8 for labels). Writes through
    either side are seen by the other. A foreign CUDA array is wrapped here once, so kernels
    get a Numba device array and never pay the per-launch conversion of a foreign one.
    """
    if isinstance(array, Tensor):
        return Tensor(array.data, requires_grad)._share_version(array)
    if device_of(array) == "cuda":
        data = array
    elif hasattr(array, "__cuda_array_interface__"):
        data = as_device_array(array)
    elif not hasattr(array, "__dlpack__"):
        raise TypeError(f"from_dlpack: a {_type_name(array)} exposes neither __dlpack__ nor "
                        "__cuda_array_interface__; copy it with engine.tensor(...)")
    elif array.__dlpack_device__()[0] == DLPACK_CUDA:
        data = device_array_from_dlpack(array)
    else:
        data = np.from_dlpack(array)
    check_dtype(data.dtype, "from_dlpack")
    contiguous = data.is_c_contiguous() if device_of(data) == "cuda" else data.flags.c_contiguous
    if not contiguous:
        raise ValueError(f"from_dlpack: the {_type_name(array)} of shape {tuple(data.shape)} "
                         "is not C-contiguous and engine tensors are; make it contiguous first "
                         "(torch: x.contiguous()) or copy it with engine.tensor(...)")
    return Tensor(data, requires_grad)


def _type_name(array):
    return f"{type(array).__module__}.{type(array).__qualname__}"



# ------------------------------------------------------------------ PyTorch's names

class _Size(int):
    """``x.size``: the element count (the engine's and NumPy's meaning), and, called, the
    shape as torch's ``x.size()`` (``x.size(dim)`` one extent)."""

    def __new__(cls, count, shape):
        size = super().__new__(cls, count)
        size.shape = tuple(int(s) for s in shape)
        return size

    def __call__(self, dim=None):
        if dim is None:
            return self.shape
        if not isinstance(dim, numbers.Integral) or not -len(self.shape) <= dim < len(self.shape):
            raise IndexError(f"size: dim {dim!r} is out of range for a tensor of "
                             f"{len(self.shape)} dimensions (shape {self.shape})")
        return self.shape[dim]


def arange(start, end=None, step=1, *, dtype=None, device="cpu", requires_grad=False):
    """``[start, end)`` in steps of ``step``, as torch's ``arange`` (``arange(n)`` is
    ``0 .. n - 1``): int64 when every bound is an int, else float32, unless ``dtype`` says."""
    if end is None:
        start, end = 0, start
    bounds = (start, end, step)
    if not all(isinstance(b, numbers.Real) and not isinstance(b, bool) for b in bounds):
        raise TypeError(f"arange: start, end and step must be numbers, got {bounds}")
    if step == 0:
        raise ValueError("arange: step must not be 0")
    if dtype is None:
        dtype = np.int64 if all(isinstance(b, numbers.Integral) for b in bounds) else np.float32
    dtype = check_dtype(dtype, "arange")
    values = np.arange(start, end, step, dtype=np.float64 if dtype.kind == "f" else None)
    return Tensor(to_device(values.astype(dtype), check_device(device)), requires_grad)


def rand(*shape, seed=None, dtype=np.float32, device="cpu", requires_grad=False):
    """Uniform samples in [0, 1) from the engine's generator (``engine.manual_seed``), as
    torch's ``rand``."""
    dtype = check_dtype(dtype, "rand")
    values = generator(seed).random(_shape(shape)).astype(dtype)
    return Tensor(to_device(values, check_device(device)), requires_grad)


def from_numpy(array, requires_grad=False):
    """A CPU tensor sharing memory with the NumPy ``array`` (writes through either are seen
    by the other), as torch's ``from_numpy``; ``engine.tensor(array)`` copies instead."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"from_numpy: expected a NumPy array, got {_type_name(array)}; "
                        "engine.tensor(...) takes lists and other arrays")
    check_dtype(array.dtype, "from_numpy")
    if not array.flags.c_contiguous:
        raise ValueError(f"from_numpy: the array of shape {array.shape} is not C-contiguous "
                         "and engine tensors are; pass np.ascontiguousarray(array) (a copy)")
    return Tensor(array, requires_grad)
