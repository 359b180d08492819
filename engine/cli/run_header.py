"""The lines ``python -m engine.train`` starts a run with: the data, the network, its
parameter count, the optimizer and the device, and, on a first run, that the kernels are
being compiled."""
import glob
import os

import numpy as np

import ops
from engine.models import CNN_DESCRIPTION
from ops.device import SIMULATOR


def describe_device(device, simulator):
    """The device as the header names it: "cuda" in Numba's simulator says so."""
    if device == "cuda" and simulator:
        return ("cuda (Numba's CUDA simulator, as NUMBA_ENABLE_CUDASIM=1 asks: very slow, for "
                "tests only; unset it to train on the CPU or a GPU)")
    return device


def kernels_cached():
    """Whether Numba's cache holds the engine's compiled CPU kernels (a file of the Dense
    kernels', compiled at the first step of every model here): in NUMBA_CACHE_DIR, which
    ``ops.numba_cache`` sets to a user cache folder unless the user did, else in
    ``__pycache__`` beside ``ops/dense.py`` (a folder that could not be made)."""
    from numba import config
    folder = config.CACHE_DIR or os.path.join(os.path.dirname(os.path.abspath(ops.__file__)),
                                              "__pycache__")
    pattern = "**/dense.*.nbi" if config.CACHE_DIR else "dense.*.nbi"
    return bool(glob.glob(os.path.join(folder, pattern), recursive=True))


def print_header(args, setup):
    """The run as ``args`` ask for it and ``setup`` (``engine.cli.train.prepare``) built it."""
    if args.model == "gpt":
        print(setup.header, flush=True)
        _compile_notice()
        return
    model, optimizer, start_epoch = setup.model, setup.optimizer, setup.start_epoch
    x_shape = setup.data[0]
    if args.model == "cnn":
        layers = "x".join(map(str, (1,) + tuple(x_shape[1:])))
        description = f"CNN {layers}-{CNN_DESCRIPTION}-{setup.classes}"
    else:
        description = "MLP " + "-".join(str(w) for w in (int(np.prod(x_shape[1:])),)
                                        + args.hidden + (setup.classes,))
    n_parameters = sum(p.size for p in model.parameters())
    ranks = (f" ({args.batch_size // setup.ranks} per rank on {setup.ranks} ranks)"
             if args.distributed else "")
    group = optimizer.param_groups[0]
    lr = group.get("initial_lr", group["lr"])   # the peak: a schedule writes "lr"
    kept = (f" (the checkpoint's: a resumed run keeps its optimizer settings, so --lr "
            f"{args.lr:g} is not used)" if start_epoch and lr != args.lr else "")
    device = describe_device(args.device, SIMULATOR)
    print(f"{args.dataset}: {x_shape[0]} train / {setup.data[3][0]} test samples; "
          f"{description} ({n_parameters} parameters); {args.optimizer} lr {lr:g}{kept} "
          f"{args.schedule}, batch {args.batch_size}{ranks}, device {device}"
          + (f"; resuming after epoch {start_epoch}" if start_epoch else ""), flush=True)
    _compile_notice()


def _compile_notice():
    if not kernels_cached():
        print("compiling the engine's kernels (Numba JIT, the first run only): the first "
              "epoch takes a few seconds longer (2-5 s for the MLP on a 2-core machine); later "
              "runs read them from Numba's cache (NUMBA_CACHE_DIR, by default "
              "~/.cache/numba-engine/numba)", flush=True)
