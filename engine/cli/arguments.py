"""The arguments of ``python -m engine.train``: its parser, and the answer to ``--help`` and
to arguments that do not parse, given before Numba is imported (``answer_at_once``).
Nothing here imports Numba."""
import argparse
import os
import sys

import optim
from engine.cli.failures import PROG, BadInput, report

# data.datasets.DATASETS and engine.models.MODELS (tests/engine/test_models.py checks they agree):
# the help answered before Numba is imported names them
DATASETS = ("mnist", "fashion-mnist", "shakespeare")
MODELS = ("mlp", "cnn", "gpt")
OPTIMIZERS = tuple(sorted(optim.OPTIMIZERS))   # importing optim imports no Numba
SCHEDULES = ("cosine", "constant")


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line, like every other bad input (no usage dump)
        raise BadInput(f"{message} (see --help)")


def build_parser():
    parser = _Parser(prog=PROG, description="Train an MLP or a CNN on MNIST or Fashion-MNIST, "
                     "or a character-level GPT on Shakespeare, with the Numba engine. "
                     "Defaults: MNIST, MLP 784-256-128-10 ReLU, Adam 2e-3 with a cosine "
                     "schedule, batch 128, 5 epochs (98.42% test accuracy on the CPU). "
                     "--model gpt --dataset shakespeare: nanoGPT's CPU configuration (4 "
                     "layers, 4 heads, 128 wide, block 64, batch 12), AdamW 1e-3 (betas 0.9, "
                     "0.99, weight decay 0.1 on the matrices), gradient norm clipped at 1, "
                     "2000 steps; --preset shakespeare-char for nanoGPT's GPU configuration.")
    add = parser.add_argument
    add("--dataset", help=f"{', '.join(DATASETS)} (default mnist; shakespeare with --model "
        "gpt)")
    add("--model", default="mlp", help="mlp (Flatten, a ReLU Dense layer per --hidden width, "
        "Dense), cnn (the network of engine/API.md: Conv2D 32 3x3 same relu, MaxPool2D 2, "
        "Conv2D 64 3x3 same relu, BatchNorm, AvgPool2D 2, Dense 128 relu, Dense; images as "
        "(1, height, width)) or gpt (nanoGPT's character model, engine.gpt) (default mlp)")
    add("--data-dir", metavar="DIR", help="folder of the four IDX files (mnist: default the "
        "copy shipped with the project; fashion-mnist: /usr/share/datasets/fashion-mnist)")
    add("--device", default="auto", help="cpu, cuda, or auto: cuda when a GPU is usable "
        "(default auto)")
    add("--epochs", type=int, help="total epochs, counting resumed ones (default 5; gpt: "
        "--steps)")
    add("--steps", type=int, help="gpt: total training steps, counting resumed ones "
        "(default 2000)")
    add("--eval-every", type=int, metavar="N", help="gpt: the validation loss every N steps, "
        "each time a checkpoint (default 250; it must divide --steps)")
    add("--preset", help="gpt: cpu (the default: 4 layers, 4 heads, 128 wide, block 64, batch "
        "12) or shakespeare-char (nanoGPT's GPU configuration: 6, 6, 384, block 256, batch "
        "64, dropout 0.2)")
    add("--batch-size", type=int, help="training batch size; with --distributed the global "
        "batch, split evenly over the ranks (default 128; gpt: the preset's)")
    add("--hidden", default="256,128", help="hidden layer widths of the mlp, comma-separated, "
        "each followed by ReLU (default 256,128)")
    add("--optimizer", help=f"{', '.join(OPTIMIZERS)} (default adam; gpt adamw)")
    add("--lr", type=float, help="peak learning rate (default 2e-3; gpt 1e-3)")
    add("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    add("--schedule", help="learning rate over the epochs: cosine (from --lr down to 0 at the "
        "last epoch) or constant (default cosine; gpt constant)")
    add("--weight-decay", type=float, help="L2 penalty added to the gradient (adamw: "
        "decoupled decay) (default 0; gpt 0.1, on the weight matrices)")
    add("--clip-norm", type=float, help="clip the global gradient norm to this (default 0: "
        "off; gpt 1)")
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


# the defaults that depend on the model: the image models', and the GPT's (nanoGPT's)
IMAGE_DEFAULTS = {"dataset": "mnist", "epochs": 5, "batch_size": 128, "optimizer": "adam",
                  "lr": 2e-3, "schedule": "cosine", "weight_decay": 0.0, "clip_norm": 0.0}
GPT_DEFAULTS = {"dataset": "shakespeare", "steps": 2000, "eval_every": 250, "preset": "cpu",
                "optimizer": "adamw", "lr": 1e-3, "schedule": "constant", "weight_decay": 0.1,
                "clip_norm": 1.0}
GPT_ONLY = ("steps", "eval_every", "preset")


def resolve_defaults(args):
    """Fill the flags left out with the defaults of ``args.model``; a flag that does not
    apply to the model is a ``BadInput``."""
    gpt = args.model == "gpt"
    if gpt and args.epochs is not None:
        raise BadInput("--epochs: --model gpt counts --steps (an evaluation and a checkpoint "
                       "every --eval-every steps)")
    for name in GPT_ONLY if not gpt else ():
        if getattr(args, name) is not None:
            raise BadInput(f"--{name.replace('_', '-')}: only for --model gpt")
    for name, value in (GPT_DEFAULTS if gpt else IMAGE_DEFAULTS).items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    return args


# engine.distributed.LAUNCHER_VARIABLES (tests/engine/test_train.py checks they agree): that module
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
