"""Tensor-core instructions for CUDA kernels: one warp's TF32 and bf16 products (``mma.sync``),
the 16-byte global loads that feed a GEMM's and attention's shared tiles, the asynchronous
copies (``cp.async``) that fill them without passing through registers, the 8-byte stores of
the products' fragment pairs and the 16-byte stores of the float32 permute's copies.

numba-cuda has no tensor-core API. These are user intrinsics that emit inline PTX through
llvmlite's ``InlineAsm``, the extension route numba-cuda itself takes for its cache-hint loads
(``numba.cuda.cache_hints``); a ``cache=True`` kernel that calls them reloads from Numba's disk
cache like any other. They run on sm_80 and newer (the H200 is sm_90), not in the simulator.
Importing this module imports numba.cuda (its extension API), so only the kernel builders
that need it import it, on first use.

Fragments, per the PTX ISA ("Matrix fragments for mma.m16n8k8" and "...m16n8k16"): a warp's
lane is ``4·group + index`` (group = lane // 4 in 0..7, index = lane % 4 in 0..3); every lane
holds these elements of the row-major A (16xK), the column-major B (Kx8) and C = D (16x8):

- ``mma_tf32`` (K = 8), each operand register one TF32 value (``to_tf32``, or a float32
  from ``round_tf32``):
  a0 = A[group, index], a1 = A[group + 8, index], a2 = A[group, index + 4],
  a3 = A[group + 8, index + 4]; b0 = B[index, group], b1 = B[index + 4, group].
- ``mma_bf16`` (K = 16), each operand register two bf16 values (``pack_bf16``: the lower
  column or row index in the low half): a0 = A[group, 2·index : 2·index + 2],
  a1 = A[group + 8, 2·index : +2], a2 = A[group, 2·index + 8 : +2], a3 = A[group + 8,
  2·index + 8 : +2]; b0 = B[2·index : +2, group], b1 = B[2·index + 8 : +2, group].
- both: c0 = C[group, 2·index], c1 = C[group, 2·index + 1], c2 = C[group + 8, 2·index],
  c3 = C[group + 8, 2·index + 1]; the product accumulates in float32.

Every lane of the warp must call an ``mma`` together (``.sync.aligned``).
"""
from llvmlite import ir
from numba.cuda import types
from numba.cuda.extending import intrinsic

_FOUR_FLOATS = types.UniTuple(types.float32, 4)


def _asm(builder, result_type, operand_types, text, constraints, operands):
    function_type = ir.FunctionType(result_type, operand_types)
    return builder.call(ir.InlineAsm(function_type, text, constraints), operands)


@intrinsic
def to_tf32(typingctx, value):
    """float32 -> the TF32 value nearest to it (ties away from zero, ``cvt.rna``), as the bits
    of a float32 (10 mantissa bits kept) in a uint32: an operand register of ``mma_tf32``."""
    def codegen(context, builder, signature, args):
        return _asm(builder, ir.IntType(32), [ir.FloatType()], "cvt.rna.tf32.f32 $0, $1;",
                    "=r,f", args)
    return types.uint32(types.float32), codegen


@intrinsic
def round_tf32(typingctx, value):
    """float32 -> the TF32 value nearest to it (``cvt.rna``, as ``to_tf32``) as a float32: for
    values rounded once as they are stored (a GEMM's shared-memory tile), which ``mma_tf32``
    then takes as they are."""
    def codegen(context, builder, signature, args):
        bits = _asm(builder, ir.IntType(32), [ir.FloatType()], "cvt.rna.tf32.f32 $0, $1;",
                    "=r,f", args)
        return builder.bitcast(bits, ir.FloatType())
    return types.float32(types.float32), codegen


@intrinsic
def pack_bf16(typingctx, low, high):
    """Two float32 -> two bf16 (round to nearest even, ``cvt.rn.bf16x2``) in one uint32,
    ``low`` in the low half: an operand register of ``mma_bf16``."""
    def codegen(context, builder, signature, args):
        # cvt.rn.bf16x2.f32 d, a, b puts a in the upper half and b in the lower
        return _asm(builder, ir.IntType(32), [ir.FloatType(), ir.FloatType()],
                    "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", [args[1], args[0]])
    return types.uint32(types.float32, types.float32), codegen


def _load_floats(count):
    def typer(typingctx, array, offset):
        if not (isinstance(array, types.Array) and array.dtype == types.float32
                and array.layout == "C"):
            return None
        result_type = types.UniTuple(types.float32, count)

        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            index = context.cast(builder, args[1], signature.args[1], types.uint64)
            vector_type = ir.VectorType(ir.FloatType(), count)
            vector = builder.load(builder.bitcast(builder.gep(data, [index]),
                                                  vector_type.as_pointer()), align=4 * count)
            return context.make_tuple(builder, result_type,
                                      [builder.extract_element(vector,
                                                               ir.Constant(ir.IntType(32), i))
                                       for i in range(count)])
        return result_type(array, offset), codegen
    typer.__name__ = typer.__qualname__ = f"load_float{count}"
    typer.__doc__ = (f"``array``'s flat elements offset .. offset + {count - 1} (a C-contiguous "
                     f"float32 array, global or shared) in one {4 * count}-byte load: the "
                     f"address must be a multiple of {4 * count} (``address_of``).")
    return intrinsic(typer)


load_float4 = _load_floats(4)   # a GEMM's 16-byte global fetches
load_float2 = _load_floats(2)   # a bf16 fragment register's pair of k from a shared tile


def _store_floats(array, count):
    """The typing check and code generation of a ``count``-float store into ``array``."""
    if not (isinstance(array, types.Array) and array.dtype == types.float32
            and array.layout == "C"):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        index = context.cast(builder, args[1], signature.args[1], types.uint64)
        vector_type = ir.VectorType(ir.FloatType(), count)
        vector = ir.Constant(vector_type, ir.Undefined)
        for lane, (value, value_type) in enumerate(zip(args[2:], signature.args[2:])):
            vector = builder.insert_element(
                vector, context.cast(builder, value, value_type, types.float32),
                ir.Constant(ir.IntType(32), lane))
        builder.store(vector, builder.bitcast(builder.gep(data, [index]),
                                              vector_type.as_pointer()), align=4 * count)
        return context.get_dummy_value()
    return codegen


@intrinsic
def store_float2(typingctx, array, offset, low, high):
    """``array``'s flat elements offset, offset + 1 (a C-contiguous float32 array) = ``low``,
    ``high`` in one 8-byte store: the address must be a multiple of 8 (``address_of``)."""
    codegen = _store_floats(array, 2)
    return None if codegen is None else (types.void(array, offset, low, high), codegen)


@intrinsic
def store_float4(typingctx, array, offset, x0, x1, x2, x3):
    """``array``'s flat elements offset .. offset + 3 (a C-contiguous float32 array) = ``x0``
    .. ``x3`` in one 16-byte store: the address must be a multiple of 16 (``address_of``)."""
    codegen = _store_floats(array, 4)
    return None if codegen is None else (types.void(array, offset, x0, x1, x2, x3), codegen)


@intrinsic
def address_of(typingctx, array):
    """The address of ``array``'s first element, as a uint64."""
    if not isinstance(array, types.Array):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, ir.IntType(64))
    return types.uint64(array), codegen


@intrinsic
def copy_async(typingctx, tile, tile_offset, array, offset, valid):
    """Start copying ``array``'s flat elements offset .. offset + 3 (float32, global memory,
    16-byte aligned) into ``tile``'s offset .. + 3 (a shared array, 16-byte aligned), or, when
    not ``valid``, zeros (``cp.async.cg`` with a source size of 0, which reads nothing). The
    copy lands after a later ``wait_copies`` that counts its group (``commit_copies``)."""
    if not all(isinstance(x, types.Array) and x.dtype == types.float32 for x in (tile, array)):
        return None

    def codegen(context, builder, signature, args):
        tile_type, _, array_type, _, _ = signature.args
        addresses = []
        for x, x_type, index, index_type in ((args[0], tile_type, args[1], signature.args[1]),
                                             (args[2], array_type, args[3], signature.args[3])):
            data = context.make_array(x_type)(context, builder, x).data
            element = builder.gep(data, [context.cast(builder, index, index_type, types.uint64)])
            addresses.append(builder.ptrtoint(element, ir.IntType(64)))
        size = builder.select(context.cast(builder, args[4], signature.args[4], types.boolean),
                              ir.Constant(ir.IntType(32), 16), ir.Constant(ir.IntType(32), 0))
        function_type = ir.FunctionType(ir.VoidType(), [ir.IntType(64), ir.IntType(64),
                                                        ir.IntType(32)])
        text = ("{ .reg .u64 s, g; cvta.to.shared.u64 s, $0; cvta.to.global.u64 g, $1; "
                "cp.async.cg.shared.global [s], [g], 16, $2; }")
        builder.call(ir.InlineAsm(function_type, text, "l,l,r,~{memory}", side_effect=True),
                     addresses + [size])
        return context.get_dummy_value()
    return types.void(tile, tile_offset, array, offset, valid), codegen


def _statement(name, text, doc):
    """An intrinsic of no arguments that issues the PTX ``text``, ordered with every memory
    access around it (a ``memory`` clobber: no shared load moves across it)."""
    def typer(typingctx):
        def codegen(context, builder, signature, args):
            builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}",
                                      side_effect=True), [])
            return context.get_dummy_value()
        return types.void(), codegen
    typer.__name__, typer.__qualname__, typer.__doc__ = name, name, doc
    return intrinsic(typer)


commit_copies = _statement("commit_copies", "cp.async.commit_group;", """Close the group of
the copies this thread started since the last one (``cp.async.commit_group``).""")
# wait_copies[n](): wait until at most n of this thread's copy groups are still in flight
wait_copies = tuple(_statement(f"wait_copies_{pending}", f"cp.async.wait_group {pending};",
                               f"Wait until at most {pending} of this thread's copy groups "
                               f"are in flight (``cp.async.wait_group``).")
                    for pending in range(4))


def _mma(name, shape_and_types, doc):
    text = (f"mma.sync.aligned.{shape_and_types} {{$0, $1, $2, $3}}, {{$4, $5, $6, $7}}, "
            f"{{$8, $9}}, {{$10, $11, $12, $13}};")
    constraints = "=f,=f,=f,=f," + ",".join(["r"] * 6 + ["f"] * 4)

    def typer(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        # an operand register is a uint32 (to_tf32, pack_bf16) or a float32 whose bits are
        # the operand (round_tf32's), passed as they are
        operand_types = tuple(types.float32 if t == types.float32 else types.uint32
                              for t in (a0, a1, a2, a3, b0, b1))

        def codegen(context, builder, signature, args):
            floats = ir.LiteralStructType([ir.FloatType()] * 4)
            operands = [builder.bitcast(arg, ir.IntType(32)) if t == types.float32 else arg
                        for arg, t in zip(args[:6], operand_types)] + list(args[6:])
            result = _asm(builder, floats, [ir.IntType(32)] * 6 + [ir.FloatType()] * 4, text,
                          constraints, operands)
            return context.make_tuple(builder, _FOUR_FLOATS,
                                      [builder.extract_value(result, i) for i in range(4)])
        return _FOUR_FLOATS(*(operand_types + (types.float32,) * 4)), codegen
    typer.__name__, typer.__qualname__, typer.__doc__ = name, name, doc
    return intrinsic(typer)


mma_tf32 = _mma("mma_tf32", "m16n8k8.row.col.f32.tf32.tf32.f32", """(a0, a1, a2, a3, b0, b1,
c0, c1, c2, c3) -> (d0, d1, d2, d3): D = A·B + C for one warp's 16x8x8 tile in TF32, float32
accumulation (fragments: the module doc).""")
mma_bf16 = _mma("mma_bf16", "m16n8k16.row.col.f32.bf16.bf16.f32", """(a0, a1, a2, a3, b0, b1,
c0, c1, c2, c3) -> (d0, d1, d2, d3): D = A·B + C for one warp's 16x8x16 tile in bf16, float32
accumulation (fragments: the module doc).""")
