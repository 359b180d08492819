"""A block of an ``@njit`` kernel handed to a split's worker as a call it makes from compiled
code, without the GIL: the element kernels' blocks (Adam, SGD, GELU, ...) start 2-3 us after the
hand-over instead of 20-22.

A worker that runs a Python call must take the GIL from the calling thread first, and on the
2-core EPYC VM (idle CPUs halt at once) the wake-up of a thread waiting for the GIL costs about
20 us (``ops.gemm.cblas`` measured it, and does this for NumPy's GEMM blocks). A dispatcher's
compiled overload is a native function, though, and its address is known
(``fndesc.llvm_func_name`` in its code library, loaded from Numba's cache or just compiled). So
a block ``kernel(*args)`` is handed over as a **record**, an int64 array:

    [trampoline address, the kernel's native address, status, the arguments' fields ...]

each array argument as its data pointer, shape and strides, each scalar as its bits. The
**trampoline** is a ``cfunc`` made once per argument-type signature (not per kernel: the
kernel's address comes in the record), about 30 ms to compile and never cached on disk, so
it can never call a stale kernel: it rebuilds the arrays from the record and calls the
native function with Numba's calling convention; the worker's compiled loop calls the
trampoline (``run``). The kernel's status (non-zero if it raised) lands in the record, and
the calling thread raises for it.

A call is described only where it is exactly the call Python would make: a dispatcher that
already has an overload for these argument types (the calling thread's own block compiled it),
which returns nothing, with arrays and int, float or bool scalars as arguments. Anything else
(``None``, tuples, a first call that still compiles) runs as a Python call.

A split that runs the same kernel on the same arrays call after call (an optimizer's update
of its flat buffers every step) keeps its blocks' records (``KeptBlocks``): making a record
took 6 us of Python on the 2-core Xeon (the arguments' kinds, the packing call), against
plain SGD's 17 us half of the update of 235k parameters.
"""
import weakref

import numpy as np
from llvmlite import ir
from numba import cfunc, literal_unroll, njit, types
from numba.core import cgutils
from numba.core.dispatcher import Dispatcher
from numba.extending import intrinsic, overload

TRAMPOLINE, KERNEL, STATUS = range(3)   # a record's fixed fields
_NUMBERS = (types.Integer, types.Float, types.Boolean)   # scalars, and arrays' elements
FIRST_ARGUMENT = 3
_I64 = ir.IntType(64)


def _argument_kind(value):
    """What decides ``value``'s Numba type, cheaply (``typeof`` takes 6 us an array)."""
    if isinstance(value, np.ndarray):
        flags = value.flags
        return (value.dtype, value.ndim, flags.c_contiguous, flags.f_contiguous,
                flags.writeable, flags.aligned)
    return type(value)


_plans = {}   # (kernel, argument kinds) -> (trampoline address, native address, size), or ()


def record(function, args):
    """The record of ``function(*args)`` for a worker's ``run``, or None where the call must
    run from Python (see the module's notes)."""
    if not isinstance(function, Dispatcher):
        return None
    key = (function, *map(_argument_kind, args))
    plan = _plans.get(key)
    if plan is None:
        plan = _plan(function, args)
        if plan is None:
            return None   # asked again next time: the call may compile its overload
        _plans[key] = plan
    if not plan:
        return None
    trampoline, native, size = plan
    fields = np.empty(size, np.int64)
    fields[TRAMPOLINE], fields[KERNEL], fields[STATUS] = trampoline, native, 0
    _pack(fields, *args)
    return fields


class Kept:
    """A record run again and again: a ``(Kept(...), ())`` pair is a call (``run_blocks``')
    that runs on this thread as ``kept()`` and that a worker runs from its record."""

    def __init__(self, fields, name):
        self.fields, self.address, self.__name__ = fields, fields.ctypes.data, name

    def __call__(self):
        self.fields[STATUS] = 0
        run(self.address)
        if failed(self.fields):
            raise RuntimeError(f"{self.__name__}: a block of a split raised; "
                               "engine.set_num_threads(1) runs it whole, which shows the error")


class KeptBlocks:
    """The blocks of a kernel's split, kept as ``Kept`` records from its second call alike to
    the next call that differs: a call alike has the same arrays (the same objects: an
    array's data, shape and strides never change), equal scalars and the same blocks. Only
    weak references to the arguments are held (a record is raw pointers, valid while its
    arrays live), and strongly the arrays made for the blocks themselves."""

    def __init__(self):
        # (the last call's arguments, its blocks, the kept calls or None, or False where a
        # block has no record, the arrays made for them): read once a call and replaced
        # whole, so records never pair with another thread's arguments
        self._held = None

    def calls(self, function, args, blocks_of, block_arguments):
        """The calls that run ``function(*args)`` in the blocks ``blocks_of(repeated)``
        gives (``repeated``: the arguments are the last call's, so the blocks may be kept):
        kept records on a call alike, else ``(function, arguments)`` pairs; None where
        ``blocks_of`` gives None (one plain call). ``block_arguments(blocks)`` gives each
        block's arguments and the arrays made for them, when they are needed."""
        held = self._held
        repeated = held is not None and _same(held[0], args)
        blocks = blocks_of(repeated)
        kept = None
        if not repeated:
            self._held = (tuple(weakref.ref(arg) if isinstance(arg, np.ndarray) else arg
                                for arg in args), blocks, None, ())
        elif blocks != held[1]:
            self._held = (held[0], blocks, None, ())
        elif blocks is not None:
            kept = held[2]
            if kept is None:   # the second call alike: keep its records
                arguments, own = block_arguments(blocks)
                records = [record(function, each) for each in arguments]
                name = getattr(function, "__name__", "a kernel")
                kept = False if any(fields is None for fields in records) else [
                    (Kept(fields, name), ()) for fields in records]
                self._held = (held[0], blocks, kept, own)
        if blocks is None:
            return None
        return kept or [(function, each) for each in block_arguments(blocks)[0]]


def _same(held, args):
    """Whether ``args`` are the arguments ``held`` (weak references to arrays, scalars)."""
    if len(held) != len(args):
        return False
    for kept, arg in zip(held, args):
        if not (kept is arg or (type(kept) is weakref.ref and kept() is arg)
                or (type(kept) is type(arg) and not isinstance(arg, np.ndarray)
                    and kept == arg)):
            return False
    return True


def failed(fields):
    """Whether the kernel a record described raised (its status)."""
    return fields[STATUS] != 0


def _plan(function, args):
    try:
        argument_types = tuple(function.typeof_pyval(value) for value in args)
    except (ValueError, TypeError):
        return None
    overload_ = function.overloads.get(argument_types)
    if overload_ is None:
        return None
    if overload_.signature.return_type != types.none \
            or not all(isinstance(t.dtype if isinstance(t, types.Array) else t, _NUMBERS)
                       for t in argument_types):
        return ()   # never describable
    native = overload_.library.get_pointer_to_function(overload_.fndesc.llvm_func_name)
    if not native:
        return ()
    size = FIRST_ARGUMENT + sum(1 + 2 * t.ndim if isinstance(t, types.Array) else 1
                                for t in argument_types)
    return _trampoline(argument_types), native, size


_trampolines = {}


def _trampoline(argument_types):
    """The address of the ``cfunc`` that calls a kernel of ``argument_types`` from a record."""
    if argument_types not in _trampolines:
        invoke = _invoker(argument_types)

        @cfunc(types.void(types.CPointer(types.int64)))
        def trampoline(fields):
            invoke(fields)

        _trampolines[argument_types] = trampoline   # kept: its address is its code's
    return _trampolines[argument_types].address


def _invoker(argument_types):
    """An intrinsic calling the record's kernel (``argument_types``, returning nothing) with
    the arguments rebuilt from its fields, and storing the call's status."""
    @intrinsic
    def invoke(typingctx, fields):
        def codegen(context, builder, signature, llvm_args):
            # imported here, as Numba does at its first compile: at import it would register
            # overloads the numpy in use may lack (ops.cuda.runtime's notes on row_stack)
            from numba.np.arrayobj import populate_array
            (pointer,) = llvm_args

            def field(k):
                return builder.gep(pointer, [ir.Constant(_I64, k)])

            values, k = [], FIRST_ARGUMENT
            for t in argument_types:
                if isinstance(t, types.Array):
                    array = context.make_array(t)(context, builder)
                    element = context.get_data_type(t.dtype)
                    data = builder.inttoptr(builder.load(field(k)), element.as_pointer())
                    shape = [builder.load(field(k + 1 + d)) for d in range(t.ndim)]
                    strides = [builder.load(field(k + 1 + t.ndim + d)) for d in range(t.ndim)]
                    populate_array(array, data=data, shape=shape, strides=strides,
                                   itemsize=context.get_constant(
                                       types.intp, context.get_abi_sizeof(element)),
                                   meminfo=cgutils.get_null_value(array.meminfo.type))
                    values.append(array._getvalue())
                    k += 1 + 2 * t.ndim
                    continue
                value_type = context.get_value_type(t)
                if isinstance(t, types.Float):   # its bits, at the field's start (little end)
                    values.append(builder.load(builder.bitcast(field(k), value_type.as_pointer())))
                elif isinstance(t, types.Boolean):
                    values.append(builder.icmp_unsigned("!=", builder.load(field(k)),
                                                        ir.Constant(_I64, 0)))
                else:
                    values.append(builder.trunc(builder.load(field(k)), value_type)
                                  if value_type.width < 64 else builder.load(field(k)))
                k += 1
            call_conv = context.call_conv
            function_type = call_conv.get_function_type(types.none, argument_types)
            kernel = builder.inttoptr(builder.load(field(KERNEL)), function_type.as_pointer())
            result = cgutils.alloca_once(builder, call_conv.get_return_type(types.none).pointee)
            builder.store(cgutils.get_null_value(result.type.pointee), result)
            exception = cgutils.alloca_once(builder, function_type.args[1].pointee)
            packed = call_conv._get_arg_packer(argument_types).as_arguments(builder, values)
            status = builder.call(kernel, [result, exception, *packed])
            builder.store(builder.sext(status, _I64), field(STATUS))
            return context.get_dummy_value()
        return types.void(fields), codegen
    return invoke


@intrinsic
def _call_record(typingctx, address):
    """Call the trampoline of the record at ``address`` with the record."""
    def codegen(context, builder, signature, llvm_args):
        pointer = builder.inttoptr(llvm_args[0], _I64.as_pointer())
        trampoline_type = ir.FunctionType(ir.VoidType(), [_I64.as_pointer()])
        trampoline = builder.inttoptr(builder.load(pointer), trampoline_type.as_pointer())
        builder.call(trampoline, [pointer])
        return context.get_dummy_value()
    return types.void(address), codegen


@njit(cache=True, nogil=True)
def run(address):
    """Run the call the record at ``address`` describes (from compiled code or Python)."""
    _call_record(address)


@intrinsic
def _bits(typingctx, value):
    """A float's bits in an int64 (a float32's in its low half), an int or bool as int64."""
    def codegen(context, builder, signature, llvm_args):
        (x,) = llvm_args
        if isinstance(value, types.Float):
            x = builder.bitcast(x, ir.IntType(value.bitwidth))
        if x.type.width == 64:
            return x
        signed = isinstance(value, types.Integer) and value.signed
        return builder.sext(x, _I64) if signed else builder.zext(x, _I64)
    return types.int64(value), codegen


def _put(fields, k, value):
    """Write ``value``'s fields from ``fields[k]``: the next free index."""


@overload(_put, inline="always")
def _put_overload(fields, k, value):
    if isinstance(value, types.Array):
        def put_array(fields, k, value):
            fields[k] = value.ctypes.data
            for d in range(value.ndim):
                fields[k + 1 + d] = value.shape[d]
                fields[k + 1 + value.ndim + d] = value.strides[d]
            return k + 1 + 2 * value.ndim
        return put_array

    def put_scalar(fields, k, value):
        fields[k] = _bits(value)
        return k + 1
    return put_scalar


@njit(cache=True, nogil=True)
def _pack(fields, *args):
    k = FIRST_ARGUMENT
    for value in literal_unroll(args):
        k = _put(fields, k, value)
