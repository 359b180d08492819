"""The float32 matmul precision, PyTorch's setting by its names and meaning
(``torch.set_float32_matmul_precision``):

- ``"highest"`` (the default): float32 GEMMs and convolutions multiply in float32.
- ``"high"``: on a GPU with tensor cores (compute capability 8.0 and newer), they may
  multiply TF32 inputs (float32 rounded to 10 mantissa bits, ``cvt.rna``) with float32
  accumulation.
- ``"medium"``: they may multiply bf16 inputs (8 mantissa bits, round to nearest even) with
  float32 accumulation.

Results stay deterministic at every setting: each output element's sum runs in a fixed order.
On the CPU, in the CUDA simulator, for float64 and on GPUs without tensor cores the setting
changes nothing. It applies to the GEMMs planned after it is set; a captured step
(``engine.capture``, ``fit``) records again when it changes (``engine.step_capture``).
"""
PRECISIONS = ("highest", "high", "medium")
TENSOR_CORE_FORMATS = {"highest": None, "high": "tf32", "medium": "bf16"}

_precision = "highest"


def set_float32_matmul_precision(precision):
    """Set the precision float32 GEMMs and convolutions may use: "highest", "high" (TF32
    tensor cores) or "medium" (bf16 tensor cores), as torch's function of that name."""
    global _precision
    if precision not in PRECISIONS:
        raise ValueError(f"set_float32_matmul_precision: {precision!r} is not one of "
                         f"'highest' (float32), 'high' (TF32 tensor cores) or 'medium' (bf16 "
                         f"tensor cores)")
    _precision = precision


def get_float32_matmul_precision():
    """The precision float32 GEMMs and convolutions may use: "highest" unless set."""
    return _precision


def tensor_core_format():
    """``"tf32"``, ``"bf16"`` or None: the tensor-core input format the setting allows for
    float32 GEMMs (the GEMM plans check the dtype and the GPU)."""
    return TENSOR_CORE_FORMATS[_precision]
