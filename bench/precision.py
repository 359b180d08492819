"""``--matmul-precision`` of the training benchmarks: one float32 matmul precision for the
engine (``engine.set_float32_matmul_precision``) and PyTorch alike
(``torch.set_float32_matmul_precision``, and cuDNN's TF32 switch for the convolutions)."""
from ops.matmul_precision import PRECISIONS, get_float32_matmul_precision


def add_option(parser):
    parser.add_argument("--matmul-precision", choices=PRECISIONS, default="highest",
                        help="float32 GEMMs and convolutions on the GPU, for the engine and "
                             "PyTorch alike: highest (float32), high (TF32), medium (bf16)")


def set_for_engine(precision):
    import engine
    engine.set_float32_matmul_precision(precision)


def set_for_torch(torch):
    """PyTorch at the engine's precision: cuBLAS by torch's own setting of that name, cuDNN
    TF32 unless "highest"."""
    precision = get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    torch.backends.cudnn.allow_tf32 = precision != "highest"
