"""``python -m engine.generate MODEL --prompt TEXT --tokens N``: text from a character-level
GPT that ``python -m engine.train --model gpt`` saved (the checkpoint holds the model and
its tokenizer). Sampling is ``engine.gpt.GPT.generate``'s, on ``--device``; bad input is one
line and status 2."""
import argparse
import sys

from engine.cli.failures import BadInput

PROG = "engine-generate"


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise BadInput(f"{message} (see --help)")


def build_parser():
    parser = _Parser(prog="python -m engine.generate", description="Sample text from a GPT checkpoint of python -m "
                     "engine.train --model gpt.")
    add = parser.add_argument
    add("model", metavar="MODEL", help="the checkpoint (.npz) that --model gpt saved")
    add("--prompt", default="\n", help="the text the sample continues (default: a new line)")
    add("--tokens", type=int, default=500, help="characters to generate (default 500)")
    add("--temperature", type=float, default=0.8, help="logits divided by this before the "
        "softmax: lower is more conservative (default 0.8)")
    add("--top-k", type=int, default=200, help="draw from the k likeliest characters only "
        "(default 200: all of them for Shakespeare's 71)")
    add("--seed", type=int, default=0, help="the draws' seed (default 0)")
    add("--device", default="cpu", help="cpu, cuda or auto (default cpu)")
    return parser


def sample(args):
    import engine
    from engine.checkpoint import read_checkpoint
    from engine.gpt import GPT
    from engine.nn import load
    from ops.device import check_device
    from data import CharTokenizer

    if args.tokens < 0:
        raise BadInput(f"--tokens must be >= 0, got {args.tokens}")
    try:
        device = check_device(args.device)
    except (ValueError, RuntimeError) as error:
        raise BadInput(f"--device: {error}") from None
    try:
        config = read_checkpoint(args.model)["config"]
        model = load(args.model)
    except (OSError, ValueError) as error:
        raise BadInput(f"{args.model}: cannot read the model: {error}") from None
    if not isinstance(model, GPT) or "tokenizer" not in config:
        raise BadInput(f"{args.model}: not a GPT checkpoint of python -m engine.train --model "
                       "gpt (it holds no tokenizer)")
    tokenizer = CharTokenizer.from_config(config["tokenizer"])
    try:
        prompt = tokenizer.encode(args.prompt)
    except ValueError as error:
        raise BadInput(f"--prompt: {error}") from None
    if prompt.size == 0:
        raise BadInput("--prompt: give at least one character")
    model = model.to(device)
    try:
        out = model.generate(engine.tensor(prompt, device=device)[None], args.tokens,
                             temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    except ValueError as error:
        raise BadInput(str(error)) from None
    return tokenizer.decode(out[0])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        print(sample(build_parser().parse_args(argv)))
    except BadInput as error:
        print(f"{PROG}: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
