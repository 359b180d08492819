"""The arguments of ``python -m engine.train``: its parser, and the answer to ``--help`` and
to arguments that do not parse, given before Numba is imported (``answer_at_once``).
Nothing here imports Numba."""
import argparse
import os
import sys

import optim
from engine.cli.failures import PROG, BadInput, report

# data.datasets.DATASETS and engine.models.MODELS (tests/test_models.py checks they agree):
# the help answered before Numba is imported names them
DATASETS = ("mnist", "fashion-mnist")
MODELS = ("mlp", "cnn")
OPTIMIZERS = tuple(sorted(optim.OPTIMIZERS))   # importing optim imports no Numba
SCHEDULES = ("cosine", "constant")


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line, like every other bad input (no usage dump)
        raise BadInput(f"{message} (see --help)")


def build_parser():
    parser = _Parser(prog=PROG, description="Train an MLP or a CNN on MNIST or Fashion-MNIST "
                     "with the Numba engine. Defaults: MNIST, MLP 784-256-128-10 ReLU, Adam "
                     "2e-3 with a cosine schedule, batch 128, 5 epochs (98.42% test accuracy "
                     "on the CPU).")
    add = parser.add_argument
    add("--dataset", default="mnist", help=f"{' or '.join(DATASETS)} (default mnist)")
    add("--model", default="mlp", help="mlp (Flatten, a ReLU Dense layer per --hidden width, "
        "Dense) or cnn (the network of engine/API.md: Conv2D 32 3x3 same relu, MaxPool2D 2, "
        "Conv2D 64 3x3 same relu, BatchNorm, AvgPool2D 2, Dense 128 relu, Dense; images as "
        "(1, height, width)) (default mlp)")
    add("--data-dir", metavar="DIR", help="folder of the four IDX files (mnist: default the "
        "copy shipped with the project; fashion-mnist: /usr/share/datasets/fashion-mnist)")
    add("--device", default="auto", help="cpu, cuda, or auto: cuda when a GPU is usable "
        "(default auto)")
    add("--epochs", type=int, default=5, help="total epochs, counting resumed ones (default 5)")
    add("--batch-size", type=int, default=128, help="training batch size; with --distributed "
        "the global batch, split evenly over the ranks (default 128)")
    add("--hidden", default="256,128", help="hidden layer widths of the mlp, comma-separated, "
        "each followed by ReLU (default 256,128)")
    add("--optimizer", default="adam", help=f"{', '.join(OPTIMIZERS)} (default adam)")
    add("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    add("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    add("--schedule", default="cosine", help="learning rate over the epochs: cosine (from "
        "--lr down to 0 at the last epoch) or constant (default cosine)")
    add("--weight-decay", type=float, default=0.0, help="L2 penalty added to the gradient "
        "(adamw: decoupled decay) (default 0)")
    add("--clip-norm", type=float, default=0.0, help="clip the global gradient norm to this "
        "(default 0: off)")
    add("--accumulate", type=int, default=1, metavar="K", help="sum the gradients of K batches "
        "into each optimizer step, each loss scaled by 1/K: the step of one K times larger "
        "batch (default 1)")
    add("--augment", metavar="LIST", help="augment the training images on their device, per "
        "sample: shift (by up to 2 pixels each way; shift=N for N), crop (a random crop of "
        "the image padded by 2; crop=N pads N), flip (left-right with probability 0.5), "
        "comma-separated (default none)")
    add("--seed", type=int, default=0, help="initialisation, shuffling and dropout (default 0)")
    add("--save", metavar="PATH", help="checkpoint (model, optimizer, epoch, history) written "
        "atomically after each epoch; nn.load(PATH) reads its model (default: the --resume "
        "file when resuming, else DATASET-MODEL.npz in the current folder, e.g. "
        "mnist-mlp.npz)")
    add("--no-save", action="store_true", help="write no checkpoint")
    add("--resume", metavar="PATH", help="continue from a --save checkpoint up to --epochs, "
        "with the checkpoint's optimizer settings, saving to PATH unless --save says otherwise")
    add("--plot", metavar="PATH", help="image of the per-step training loss and per-epoch "
        "accuracy, PNG unless PATH ends in another matplotlib format (needs matplotlib)")
    add("--log-json", metavar="PATH", help="append one JSON object per epoch")
    add("--tensorboard", metavar="DIR", help="write TensorBoard event files into DIR: the "
        "epoch metrics, the learning rate and the training loss as often as the progress bar "
        "reads it (needs tensorboardX: the formats extra)")
    add("--limit", type=int, metavar="N", help="use only the first N samples of each split "
        "(quick checks)")
    add("--threads", type=int, metavar="N", help="threads of the engine's CPU kernels (the "
        "split GEMMs and the convolutions' parallel loops; BLAS stays on one), set with "
        "engine.set_num_threads (default: the usable CPUs less those other processes keep "
        "busy, see engine.blas_threads)")
    add("--matmul-precision", default="highest", help="float32 GEMMs and convolutions on the GPU: highest (float32), high (TF32 tensor "
        "cores) or medium (bf16 tensor cores), float32 accumulation either way; "
        "engine.set_float32_matmul_precision (the CPU ignores it)")
    add("--early-stopping", type=int, metavar="PATIENCE", help="stop once the test loss has "
        "not improved for PATIENCE epochs; the model keeps its best epoch's weights (what "
        "--export-onnx writes; --save keeps the last epoch's state, to resume)")
    add("--export-onnx", metavar="PATH", help="write the trained model as ONNX after training "
        "(needs the onnx package: the onnx extra)")
    add("--distributed", action="store_true", help="data-parallel over the ranks of mpiexec "
        "-n N (MPI on the CPU, NCCL on GPUs; the distributed extra); only rank 0 prints and "
        "writes")
    add("--no-capture", action="store_true", help="run every training step eagerly instead of "
        "replaying a captured one (engine.capture)")
    add("--no-progress", action="store_true", help="no progress bar, metrics lines only")
    return parser


# engine.distributed.LAUNCHER_VARIABLES (tests/test_train.py checks they agree): that module
# imports Numba, which the early answer below must not wait for
LAUNCHERS = ("PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE")


def answer_at_once(argv):
    """``--help``, and arguments that do not parse, answered before Numba and numba.cuda are
    imported (1.6-7 s of the 2-core machine's time, against 0.1 s for this): exits with
    argparse's help, or status 2 and the one line of ``parse_arguments``. A command that
    names ``--distributed`` or runs under mpiexec takes the full path, where its ranks fail
    together (``fail_every_rank``)."""
    if any(name in os.environ for name in LAUNCHERS) or any(
            len(word) > 3 and "--distributed".startswith(word) for word in argv):
        return
    try:
        build_parser().parse_args(argv)
    except BadInput as error:
        report(error)
        sys.exit(2)
