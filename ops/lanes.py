"""Vectors of 16 lanes in compiled CPU loops: an LLVM vector type (``Lanes``) and the few
operations on it that the direct convolution (``ops.conv_direct_cpu``) and the max pool
(``ops.pool_cpu``) spell out, where Numba's LLVM vectorised the wrong loop or none: loads and
stores of 16 neighbouring elements, a scalar in every lane, a fused multiply-add, the even
and odd lanes of 32 values, each of 8 lanes twice, sums and products lane by lane, the
indices ``first + step·k``, the running maximum's select and a scatter's sum where an index
matches.
Loads and stores take no bounds or sign test: the caller keeps every lane inside its array.
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

LANES = 16               # one AVX-512 register of float32


class Lanes(types.Type):
    """``LANES`` values of ``dtype`` in one LLVM vector (float64, int64: two registers)."""
    def __init__(self, dtype):
        self.dtype = dtype
        super().__init__(name=f"Lanes{LANES}[{dtype}]")


@register_model(Lanes)
class _LanesModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        element = dmm.lookup(fe_type.dtype).get_value_type()
        super().__init__(dmm, fe_type, ir.VectorType(element, LANES))


def _address(context, builder, signature, args):
    """The address of ``array[index]`` (a 1-d contiguous array; no bounds or sign test)."""
    array = context.make_array(signature.args[0])(context, builder, args[0])
    index = context.cast(builder, args[1], signature.args[1], types.intp)
    return builder.gep(array.data, [index])


def _vector_pointer(context, builder, lanes, pointer):
    return builder.bitcast(pointer, context.get_value_type(lanes).as_pointer())


def _lane_numbers(step=1, first=0):
    """The constant ``[first, first + step, ...]``, ``LANES`` of them, as i32 (a shuffle's
    mask)."""
    return ir.Constant(ir.VectorType(ir.IntType(32), LANES),
                       [first + step * k for k in range(LANES)])


def _splat_value(builder, vector_type, value):
    one = builder.insert_element(ir.Constant(vector_type, ir.Undefined), value,
                                 ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, ir.Constant(vector_type, ir.Undefined),
                                  _lane_numbers(step=0))


@intrinsic
def load_lanes(typingctx, array, index):
    """``array[index:index + LANES]`` as lanes."""
    lanes = Lanes(array.dtype)

    def codegen(context, builder, signature, args):
        pointer = _vector_pointer(context, builder, lanes,
                                  _address(context, builder, signature, args))
        return builder.load(pointer, align=array.dtype.bitwidth // 8)
    return lanes(array, index), codegen


@intrinsic
def store_lanes(typingctx, array, index, value):
    """``array[index:index + LANES] = value``."""
    def codegen(context, builder, signature, args):
        pointer = _vector_pointer(context, builder, signature.args[2],
                                  _address(context, builder, signature, args))
        builder.store(args[2], pointer, align=array.dtype.bitwidth // 8)
        return context.get_dummy_value()
    return types.none(array, index, value), codegen


@intrinsic
def splat_lanes(typingctx, array, index):
    """``array[index]`` in every lane."""
    lanes = Lanes(array.dtype)

    def codegen(context, builder, signature, args):
        value = builder.load(_address(context, builder, signature, args))
        return _splat_value(builder, context.get_value_type(lanes), value)
    return lanes(array, index), codegen


@intrinsic
def fma_lanes(typingctx, a, b, c):
    """``a·b + c`` lane by lane, rounded once."""
    def codegen(context, builder, signature, args):
        vector_type = args[0].type
        suffix = f"v{LANES}f{vector_type.element.intrinsic_name[1:]}"
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vector_type, [vector_type] * 3), f"llvm.fma.{suffix}")
        return builder.call(fma, args)
    return c(a, b, c), codegen


@intrinsic
def broadcast_lanes(typingctx, value):
    """The scalar ``value`` in every lane."""
    lanes = Lanes(value)

    def codegen(context, builder, signature, args):
        return _splat_value(builder, context.get_value_type(lanes), args[0])
    return lanes(value), codegen


def _lane_by_lane(operation):
    """``a <operation> b`` lane by lane (an IR builder's method: ``fadd``, ``fmul``), each
    rounded on its own (no fused multiply-add)."""
    def arithmetic(typingctx, a, b):
        def codegen(context, builder, signature, args):
            return getattr(builder, operation)(args[0], args[1])
        return a(a, b), codegen
    return arithmetic


add_lanes = intrinsic(_lane_by_lane("fadd"))
add_lanes.__doc__ = "``a + b`` lane by lane."
mul_lanes = intrinsic(_lane_by_lane("fmul"))
mul_lanes.__doc__ = "``a · b`` lane by lane."


def _shuffled(first):
    """The lanes ``first, first + 2, ...`` of the 32 values ``low ++ high``."""
    def shuffle(typingctx, low, high):
        def codegen(context, builder, signature, args):
            return builder.shuffle_vector(args[0], args[1], _lane_numbers(2, first))
        return low(low, high), codegen
    return shuffle


even_lanes = intrinsic(_shuffled(0))
even_lanes.__doc__ = "Lanes 0, 2, ..., 30 of ``low ++ high`` (the even elements of 32)."
odd_lanes = intrinsic(_shuffled(1))
odd_lanes.__doc__ = "Lanes 1, 3, ..., 31 of ``low ++ high`` (the odd elements of 32)."


def _doubled(first):
    """The lanes ``first, first, first + 1, first + 1, ..., first + 7, first + 7``."""
    mask = ir.Constant(ir.VectorType(ir.IntType(32), LANES),
                       [first + k // 2 for k in range(LANES)])

    def shuffle(typingctx, lanes):
        def codegen(context, builder, signature, args):
            return builder.shuffle_vector(args[0], ir.Constant(args[0].type, ir.Undefined),
                                          mask)
        return lanes(lanes), codegen
    return shuffle


low_doubled = intrinsic(_doubled(0))
low_doubled.__doc__ = "Lanes 0, 0, 1, 1, ..., 7, 7 (each of the low 8 twice)."
high_doubled = intrinsic(_doubled(LANES // 2))
high_doubled.__doc__ = "Lanes 8, 8, 9, 9, ..., 15, 15 (each of the high 8 twice)."


@intrinsic
def index_lanes(typingctx, array, first, step):
    """``first + step·k`` in lane k, as lanes of the integer array ``array``'s dtype (the
    indices a store into it takes)."""
    lanes = Lanes(array.dtype)

    def codegen(context, builder, signature, args):
        vector_type = context.get_value_type(lanes)
        first_value, step_value = (context.cast(builder, value, kind, array.dtype)
                                   for value, kind in zip(args[1:], signature.args[1:]))
        numbers = ir.Constant(vector_type, list(range(LANES)))
        return builder.add(_splat_value(builder, vector_type, first_value),
                           builder.mul(_splat_value(builder, vector_type, step_value), numbers))
    return lanes(array, first, step), codegen


@intrinsic
def later_wins(typingctx, top, top_at, value, value_at):
    """The running maximum after ``value``, lane by lane: ``(value, value_at)`` where value
    is larger than ``top`` or NaN, else ``(top, top_at)`` (``ops.pool_cpu._take_larger``'s
    select)."""
    result = types.Tuple((top, top_at))

    def codegen(context, builder, signature, args):
        top_value, top_index, new_value, new_index = args
        wins = builder.or_(builder.fcmp_ordered(">", new_value, top_value),
                           builder.fcmp_unordered("uno", new_value, new_value))
        return context.make_tuple(builder, signature.return_type,
                                  [builder.select(wins, new_value, top_value),
                                   builder.select(wins, new_index, top_index)])
    return result(top, top_at, value, value_at), codegen


@intrinsic
def added_where_equal(typingctx, at, index, value):
    """``0 + value`` in the lanes where ``at == index``, else 0: what a zeroed element
    ``index`` holds once ``value`` is added to element ``at`` (a scatter's ``+=``, -0 to +0
    as there)."""
    def codegen(context, builder, signature, args):
        zero = ir.Constant(args[2].type, [0.0] * LANES)
        return builder.select(builder.icmp_signed("==", args[0], args[1]),
                              builder.fadd(zero, args[2]), zero)
    return value(at, index, value), codegen
