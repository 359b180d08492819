"""The character-level GPT: the engine against PyTorch on the same model, data and optimizer.

    python -m bench.gpt --device cpu [--steps 50] [--threads N] [--json results.json]
    python -m bench.gpt --device cpu --steps 2000 --eval-every 500    # the learning check
    python -m bench.gpt --device cuda --preset gpu --first-steps      # the cold first step

nanoGPT's architecture (``engine.gpt``; torch's side is the same network written with
``torch.nn``: token and position embeddings, pre-LayerNorm blocks of causal attention through
``scaled_dot_product_attention`` and a 4x GELU MLP, a head tied to the token embedding) on
Shakespeare (``data.shakespeare``, the first 90% to train, the rest to validate), AdamW
(lr 1e-3, betas 0.9/0.99, weight decay 0.1 on matrices only, as nanoGPT), gradient norm
clipped at 1.0. The CPU configuration is nanoGPT's (4 layers, 4 heads, 128 wide, block 64,
batch 12); ``--preset gpu`` its shakespeare-char one (6, 6, 384, block 256, batch 64,
dropout 0.2). Both frameworks draw their batches from the engine's ``SequenceLoader`` (the
same windows in the same order) and start from their own nanoGPT initialisation. After a
warm-up of ``--warmup`` steps each, timed blocks of ``--block`` steps alternate engine,
torch (eager), engine, torch, ...; ms/iteration is the median over blocks. On the CPU each
framework runs in a process of its own (``bench.framework_process``: one framework's idle
threads are not the other's neighbours) and each block starts on a settled machine
(``bench.harness.settle``), as the training benchmarks do. The validation
loss is the mean over ``--eval-batches`` fixed validation batches, after the same steps.
The engine's step is ``engine.capture``'d (its ``fit``'s step); torch's is eager, and with
``--compile`` also ``torch.compile``'d (when torch.compile works on the machine).
"""
import argparse
import math
import statistics
import time

import numpy as np

from bench.framework_process import open_side
from bench.harness import (FIRST_STEP_RUNS, GPT_BETAS, GPT_CLIP, GPT_LR, GPT_PRESETS,
                           GPT_WEIGHT_DECAY, compile_times, format_first_steps, gpt_corpus,
                           gpt_training, gpt_update, settle)
from bench.report import emit, require_device

# ------------------------------------------------------------------ the engine side

def engine_side(config, device, train_ids, val_ids, vocab, seed):
    import engine
    from engine import data, models
    from engine.step_capture import capture

    model, opt, loader = gpt_training(config, vocab, train_ids, device, seed)
    cursor = loader.epoch_cursor()
    cursor.start_epoch()
    parameters = model.parameters()

    @capture
    def step():
        return gpt_update(model, opt, parameters, *cursor.next_batch(config["batch_size"]))

    def run(steps):
        loss = step.repeat(steps)
        return float(loss.item())   # waits for the device

    def validate(batches):
        model.eval()
        val = data.SequenceLoader(val_ids, config["block_size"], config["batch_size"],
                                  seed=seed + 1, device=device)
        with engine.no_grad():
            losses = [models.gpt_loss(model(x), y).item() for x, y in
                      (val.batch(i) for i in range(batches))]
        model.train()
        return float(np.mean(losses))

    return run, validate, step


# ------------------------------------------------------------------ the torch side

def torch_side(config, device, train_ids, val_ids, vocab, seed, compiled):
    import torch
    import torch.nn as tnn
    import torch.nn.functional as F
    from engine import data

    torch.manual_seed(seed)
    n_embd, n_head, block = config["n_embd"], config["n_head"], config["block_size"]

    class Block(tnn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = tnn.LayerNorm(n_embd), tnn.LayerNorm(n_embd)
            self.c_attn, self.c_proj = tnn.Linear(n_embd, 3 * n_embd), tnn.Linear(n_embd, n_embd)
            self.c_fc, self.mlp_proj = tnn.Linear(n_embd, 4 * n_embd), tnn.Linear(4 * n_embd, n_embd)
            self.drop = tnn.Dropout(config["dropout"])

        def forward(self, x):
            n, t, c = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(n_embd, dim=2)
            q, k, v = (z.view(n, t, n_head, c // n_head).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=config["dropout"] if self.training else 0)
            x = x + self.drop(self.c_proj(y.transpose(1, 2).contiguous().view(n, t, c)))
            return x + self.drop(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)))))

    class GPT(tnn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = tnn.Embedding(vocab, n_embd), tnn.Embedding(block, n_embd)
            self.drop = tnn.Dropout(config["dropout"])
            self.h = tnn.ModuleList([Block() for _ in range(config["n_layer"])])
            self.ln_f = tnn.LayerNorm(n_embd)
            for name, p in self.named_parameters():   # nanoGPT's initialisation
                if name.endswith("bias") or "ln" in name:
                    continue
                std = 0.02 / math.sqrt(2 * config["n_layer"]) if name.endswith(
                    ("c_proj.weight", "mlp_proj.weight")) else 0.02
                tnn.init.normal_(p, 0.0, std)

        def forward(self, idx):
            t = idx.shape[1]
            x = self.drop(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))
            for block in self.h:
                x = block(x)
            return self.ln_f(x) @ self.wte.weight.T

    model = GPT().to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    keep = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": GPT_WEIGHT_DECAY},
                             {"params": keep, "weight_decay": 0.0}], lr=GPT_LR, betas=GPT_BETAS)
    loader = data.SequenceLoader(train_ids, block, config["batch_size"], seed=seed)
    batches = iter(range(10 ** 9))

    def train_step(x, y):
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, vocab), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GPT_CLIP)
        opt.step()
        return loss

    step_fn = torch.compile(train_step) if compiled else train_step

    def run(steps):
        for _ in range(steps):
            x, y = loader.batch(next(batches))
            loss = step_fn(torch.from_numpy(x.numpy()).to(device),
                           torch.from_numpy(y.numpy()).to(device))
        return float(loss.item())

    def validate(count):
        model.eval()
        val = data.SequenceLoader(val_ids, block, config["batch_size"], seed=seed + 1)
        with torch.no_grad():
            losses = []
            for i in range(count):
                x, y = val.batch(i)
                logits = model(torch.from_numpy(x.numpy()).to(device))
                losses.append(F.cross_entropy(logits.view(-1, vocab),
                                              torch.from_numpy(y.numpy()).to(device).view(-1)).item())
        model.train()
        return float(np.mean(losses))

    return run, validate


# ------------------------------------------------------------------ the run

def side_methods(framework, preset, device, seed, precision, threads):
    """``bench.framework_process``'s build of one side, ``framework`` "engine", "torch" or
    "torch.compile": ``block(count)`` runs ``count`` steps and returns ms a step (timed
    where they run), ``run`` and ``validate`` as the sides define them."""
    if framework == "engine":
        import engine as framework_module
    else:
        import torch as framework_module
    if precision != "highest":
        framework_module.set_float32_matmul_precision(precision)
    if threads:
        framework_module.set_num_threads(threads)
    config = GPT_PRESETS[preset]
    tok, train_ids, val_ids = gpt_corpus()
    if framework == "engine":
        run, validate = engine_side(config, device, train_ids, val_ids, tok.vocab_size,
                                    seed)[:2]
    else:
        run, validate = torch_side(config, device, train_ids, val_ids, tok.vocab_size, seed,
                                   framework == "torch.compile")

    def block(count):
        start = time.perf_counter()
        run(count)
        return (time.perf_counter() - start) / count * 1000

    return {"run": run, "block": block, "validate": validate}, None


def measure(device, preset, steps, warmup, block, eval_every, eval_batches, compiled, seed=0,
            precision="highest", threads=None):
    config = GPT_PRESETS[preset]
    names = ["engine", "torch"] + (["torch.compile"] if compiled else [])
    separate = device == "cpu"
    sides = {name: open_side(separate, name, side_methods, name, preset, device, seed,
                             precision, threads) for name in names}
    times = {name: [] for name in sides}
    losses = {name: [] for name in sides}
    done = {name: 0 for name in sides}
    try:
        for name, side in sides.items():
            side.call("run", warmup)
            done[name] = warmup
        while min(done.values()) < steps:
            for name, side in sides.items():
                count = min(block, steps - done[name])
                if separate:
                    settle()
                times[name].append(side.call("block", count))
                done[name] += count
                crossed = done[name] // eval_every > (done[name] - count) // eval_every \
                    if eval_every else False
                if eval_every and (crossed or done[name] == steps):
                    losses[name].append((done[name], side.call("validate", eval_batches)))
    finally:
        for side in sides.values():
            side.close()
    tokens = config["batch_size"] * config["block_size"]
    rows = {name: {"ms_per_iter": statistics.median(times[name]),
                   "tokens_per_s": tokens / statistics.median(times[name]) * 1000,
                   "val_loss": losses[name]} for name in sides}
    for name in rows:
        rows[name]["ratio_to_torch"] = rows[name]["ms_per_iter"] / rows["torch"]["ms_per_iter"]
    return {"device": device, "preset": preset, "steps": steps, "rows": rows,
            "separate_processes": separate}


def format_table(result):
    lines = [f"GPT ({result['preset']} configuration) on {result['device']}, {result['steps']} "
             "steps", "| | ms/iteration | tokens/s | vs torch | validation loss (step) |",
             "|---|---:|---:|---:|---|"]
    for name, row in result["rows"].items():
        val = ", ".join(f"{loss:.4f} ({step})" for step, loss in row["val_loss"]) or "-"
        lines.append(f"| {name} | {row['ms_per_iter']:.1f} | {row['tokens_per_s']:.0f} | "
                     f"{row['ratio_to_torch']:.2f}x | {val} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.gpt", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="cpu", choices=sorted(GPT_PRESETS))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--block", type=int, default=10, help="steps per timed block")
    parser.add_argument("--eval-every", type=int, default=0)
    parser.add_argument("--eval-batches", type=int, default=20)
    parser.add_argument("--compile", action="store_true", help="also torch.compile's step")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of both engine and torch (default: each its own "
                             "choice; 1 compares them fairly beside busy neighbours)")
    parser.add_argument("--precision", default="highest", choices=("highest", "high", "medium"),
                        help="float32 matmul precision of both engine and torch (torch's "
                             "names: high = TF32, medium = bf16 where the engine has it)")
    parser.add_argument("--first-steps", action="store_true",
                        help="instead: the engine's first two captured steps in fresh "
                             "processes, from an empty Numba cache (with the shipped kernels "
                             "on CUDA) and from the cache that run filled")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    require_device(parser, args.device)
    if args.first_steps:
        runs = compile_times(args.device, f"gpt:{args.preset}", FIRST_STEP_RUNS["cpu"])
        emit({"device": args.device, "preset": args.preset, "first_steps": runs},
             "\n".join(format_first_steps(runs)), args.json)
        return
    result = measure(args.device, args.preset, args.steps, args.warmup, args.block,
                     args.eval_every, args.eval_batches, args.compile,
                     precision=args.precision, threads=args.threads)
    emit(result, format_table(result), args.json)


if __name__ == "__main__":
    main()
