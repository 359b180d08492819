"""``python -m engine.train --model gpt --dataset shakespeare``: the character-level GPT of
``engine.gpt`` trained on the shipped plays (``data.shakespeare``), as nanoGPT's
``train.py`` trains its shakespeare_char model.

The text's first 90% trains, the rest validates. A ``data.SequenceLoader`` draws the batches
on the device from ``(--seed, step)``; ``fit``'s epochs are stretches of ``--eval-every``
steps, each ending with the validation loss (the mean over ``EVAL_BATCHES`` random
validation batches, as nanoGPT's ``estimate_loss``), a line and a checkpoint, so
``--resume`` continues bit for bit. AdamW decays the weight matrices and embeddings only
(nanoGPT's two parameter groups). The checkpoint's configuration carries the tokenizer's
characters, which ``python -m engine.generate`` reads."""
import types

from engine import data, optim
from engine.callbacks import Callback
from engine.cli.arguments import build_parser
from engine.cli.failures import BadInput
from engine.cli.resumed_checkpoint import read_resumed, restore_resumed
from engine.gpt import gpt_loss
from engine.models import build_gpt
from engine.random import manual_seed

GPT_DATASETS = ("shakespeare",)
PRESETS = {"cpu": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12,
                       dropout=0.0),
           "shakespeare-char": dict(n_layer=6, n_head=6, n_embd=384, block_size=256,
                                    batch_size=64, dropout=0.2)}
EVAL_BATCHES = 20    # nanoGPT's eval_iters for the CPU run
BETAS = (0.9, 0.99)  # nanoGPT's shakespeare_char beta2


def check_gpt_arguments(args):
    if args.preset not in PRESETS:
        raise BadInput(f"unknown --preset {args.preset!r}: expected one of {', '.join(PRESETS)}")
    for flag, value in (("--steps", args.steps), ("--eval-every", args.eval_every)):
        if value < 1:
            raise BadInput(f"{flag} must be a positive integer, got {value}")
    if args.steps % args.eval_every:
        raise BadInput(f"--steps {args.steps} is not a multiple of --eval-every "
                       f"{args.eval_every}: each stretch of steps ends with an evaluation")
    parser = build_parser()
    for flag in ("hidden", "augment", "distributed", "early_stopping", "export_onnx"):
        if getattr(args, flag) != parser.get_default(flag):   # given: the image models' flags
            raise BadInput(f"--{flag.replace('_', '-')}: not for --model gpt")
    if args.batch_size is None:
        args.batch_size = PRESETS[args.preset]["batch_size"]
    args.epochs = args.steps // args.eval_every   # fit's epochs: stretches of --eval-every


def prepare_gpt(args):
    """The GPT run's model, optimizer, loaders and checkpoint (``engine.cli.train.prepare``'s
    namespace)."""
    shape = dict(PRESETS[args.preset])
    shape.pop("batch_size")
    text = data.shakespeare.load()
    tokenizer = data.CharTokenizer(text)
    config = {"dataset": args.dataset, "model": "gpt", "optimizer": args.optimizer,
              "schedule": args.schedule, "preset": args.preset, "eval_every": args.eval_every,
              "tokenizer": tokenizer.get_config()}
    checkpoint = read_resumed(args, config)
    ids = tokenizer.encode(text)
    cut = int(0.9 * len(ids))
    manual_seed(args.seed)
    model = build_gpt(tokenizer.vocab_size, device=args.device, **shape)
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    _, class_name = optim.OPTIMIZERS[args.optimizer]
    groups = [{"params": matrices, "weight_decay": args.weight_decay},
              {"params": vectors, "weight_decay": 0.0}]
    betas = {"betas": BETAS} if args.optimizer in ("adam", "adamw") else {}
    optimizer = getattr(optim, class_name)(groups, lr=args.lr, **betas)
    start_epoch, history = restore_resumed(args, checkpoint, model, optimizer)
    train_loader = data.SequenceLoader(ids[:cut], shape["block_size"], args.batch_size,
                                       seed=args.seed, device=args.device,
                                       steps_per_epoch=args.eval_every)
    train_loader.epoch = start_epoch   # batches are keyed by (seed, step): resumes exactly
    val_loader = data.SequenceLoader(ids[cut:], shape["block_size"], args.batch_size,
                                     seed=args.seed + 1, device=args.device,
                                     steps_per_epoch=EVAL_BATCHES)
    parameters = sum(p.size for p in model.parameters())
    header = (f"shakespeare: {cut} train / {len(ids) - cut} validation characters, "
              f"{tokenizer.vocab_size} distinct; GPT {shape['n_layer']} layers, "
              f"{shape['n_head']} heads, {shape['n_embd']} wide, block {shape['block_size']} "
              f"({parameters} parameters); {args.optimizer} lr {args.lr:g}, batch "
              f"{args.batch_size}, {args.steps} steps, device {args.device}"
              + (f"; resuming after step {start_epoch * args.eval_every}" if start_epoch else ""))
    return types.SimpleNamespace(
        checkpoint=checkpoint, config=config, model=model, optimizer=optimizer,
        scheduler=None, start_epoch=start_epoch, history=history, ranks=1,
        train_loader=train_loader, test_loader=val_loader, loss_fn=gpt_loss,
        epochs=args.epochs, callbacks=[StepLine(args.eval_every, args.steps, tokens_per_step=
                                                args.batch_size * shape["block_size"])],
        prints_records=False, header=header)


class StepLine(Callback):
    """The GPT run's line per evaluation: ``step 250/2000  train loss 2.4531  val loss
    2.4872  31.2 s  5900 tokens/s``."""

    def __init__(self, every, steps, tokens_per_step):
        self.every, self.steps, self.tokens_per_step = every, steps, tokens_per_step

    def on_epoch_end(self, logs):
        tokens = self.tokens_per_step * self.every / logs["seconds"] if logs["seconds"] else 0
        print(f"step {logs['epoch'] * self.every}/{self.steps}  train loss "
              f"{_loss_text(logs['loss'])}  val loss {_loss_text(logs['test_loss'])}  "
              f"{logs['seconds']:.1f} s  {tokens:.0f} tokens/s", flush=True)


def _loss_text(value):
    """A loss to 4 places, "-" for none (no rows were read: the build's dry device)."""
    return "-" if value is None else f"{value:.4f}"
