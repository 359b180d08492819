"""The checkpoint ``python -m engine.train --resume PATH`` continues from: read and matched to
the run's configuration before the data is loaded, then restored into the model and the
optimizer the run built; each failure a ``BadInput`` that names the file and the mismatch."""
from engine.checkpoint import read_checkpoint, restore_checkpoint
from engine.cli.failures import BadInput


def read_resumed(args, config):
    """The ``--resume`` checkpoint, None without one; it must have been trained with
    ``config`` (the run's dataset, model, optimizer, schedule and hidden widths)."""
    if not args.resume:
        return None
    try:
        checkpoint = read_checkpoint(args.resume)
    except (OSError, ValueError) as error:
        raise BadInput(f"--resume {args.resume}: cannot read the checkpoint: {error}") from None
    # checkpoints from before --model hold an mlp and no "model" entry
    trained = {"model": "mlp", **checkpoint["config"]}
    if trained["model"] != args.model:
        raise BadInput(f"--resume {args.resume}: the checkpoint holds a --model "
                       f"{trained['model']} network, this run asks for --model {args.model}")
    if trained != config:
        raise BadInput(f"--resume {args.resume}: the checkpoint was trained with "
                       f"{checkpoint['config']}, this run asks for {config}")
    return checkpoint


def restore_resumed(args, checkpoint, model, optimizer):
    """``(start_epoch, history)``: ``(0, [])`` without a checkpoint, else the checkpoint's,
    with its weights and optimizer state restored (its hyper-parameters win over the
    flags); a checkpoint must leave epochs to train."""
    if checkpoint is None:
        return 0, []
    try:
        start_epoch, history = restore_checkpoint(checkpoint, model, optimizer)
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as error:
        raise BadInput(f"--resume {args.resume}: does not fit this model: {error}") from None
    if start_epoch >= args.epochs:
        raise BadInput(f"--resume {args.resume}: already trained for {start_epoch} epochs; "
                       f"ask for more with --epochs (now {args.epochs})")
    return start_epoch, history
