"""References for tensor-core products: the operands rounded in NumPy as the instructions
round them (TF32: 10 mantissa bits, ties away from zero; bf16: 7 bits, ties to even), so a
tensor-core GEMM must equal the float64 product of the rounded operands within float32
accumulation. Comparing against the unrounded product instead would need a tolerance of
about 2^-10 (TF32) or 2^-7 (bf16) of the terms' sum, too loose to catch a dropped term."""
import numpy as np


def round_tf32(x):
    bits = np.asarray(x, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def round_bf16(x):
    bits = np.asarray(x, np.float32).view(np.uint32)
    tie_to_even = (bits >> np.uint32(16)) & np.uint32(1)
    return ((bits + np.uint32(0x7FFF) + tie_to_even) & np.uint32(0xFFFF0000)).view(np.float32)


ROUNDING_OF_FORMAT = {"tf32": round_tf32, "bf16": round_bf16}


def assert_product_of_rounded(got, want, magnitude, k, what):
    """``got`` equals ``want`` (the float64 product of the rounded operands) within float32
    accumulation of k terms (``magnitude``: the product of the operands' absolute values)."""
    tolerance = 4e-7 * np.sqrt(k) * magnitude + 1e-30
    excess = np.abs(got - want) / tolerance
    assert excess.max() <= 1, (f"{what}: {np.unravel_index(excess.argmax(), excess.shape)} off "
                               f"by {excess.max():.1f}x float32 accumulation")
