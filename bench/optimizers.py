"""One optimizer step on the CPU, engine against torch.optim, for every optimizer.

    python -m bench.optimizers [--sizes 235146 669706] [--threads 1 2] [--steps 1000]
                               [--json results.json]

For each size (float32 parameters: 235,146 are the reference MLP's 784-256-128-10, 669,706 a
784-512-512-10 one), thread count and optimizer, the engine's ``opt.step()`` over its
parameters in one ``FlatBuffer`` (the flat path: one update kernel, as a model's) and
``torch.optim``'s over one tensor of the same size, with the same hyper-parameters and the
same gradient, are timed step by step. Each framework runs in a process of its own
(``bench.framework_process``), as a user runs one, and the two alternate blocks of
``BLOCK_STEPS`` steps, each block once the other's threads sleep (``bench.harness.settle``),
so a busy neighbour slows both alike. (In one process, alternating step by step, PyTorch's
OpenMP threads still spun after its step while the engine's split worker ran: the engine's
SGD over 669k parameters at 2 threads took 132 us against 62-74 alone.) The table gives each
side's median microseconds a step and their ratio (engine over torch: below 1 the engine is
faster). ``engine.set_num_threads`` and ``torch.set_num_threads`` both get the thread count.
An optimizer the engine lacks (an older checkout) is left out of the table.
"""
import argparse
import statistics
import time

import numpy as np

from bench.framework_process import open_side
from bench.harness import settle
from bench.report import emit

# name -> (engine class name, keyword arguments shared by the engine and torch)
OPTIMIZERS = {
    "SGD": ("SGD", dict(lr=0.01)),
    "SGD momentum": ("SGD", dict(lr=0.01, momentum=0.9)),
    "RMSprop": ("RMSprop", dict(lr=0.01)),
    "Adagrad": ("Adagrad", dict(lr=0.01)),
    "Adam": ("Adam", dict(lr=1e-3)),
    "AdamW": ("AdamW", dict(lr=1e-3)),
    "Adam amsgrad": ("Adam", dict(lr=1e-3, amsgrad=True)),
    "NAdam": ("NAdam", dict(lr=2e-3)),
    "Adamax": ("Adamax", dict(lr=2e-3)),
}
SIZES = (235146, 669706)
# steps a side runs before the other's turn: the first 2-3 after the settled pause take 2-6x
# longer on the 2-core EPYC (caches and clocks cold), on either side and thread count; and on
# the 2-core Xeon torch's SGD step over 235k on 2 threads settled at 38-40 us only after more
# than 50 steps (blocks of 50: 54-67 us, the ratio 1.21-1.44x; of 500: 38-40, 1.88-1.95x)
BLOCK_STEPS = 250


def _engine_step(class_name, options, values, gradient):
    """The engine's step over ``values`` in one FlatBuffer, or None where the engine lacks
    the optimizer or the option."""
    import engine
    import optim
    from engine.parameter import FlatBuffer, Parameter
    cls = getattr(optim, class_name, None)
    if cls is None:
        return None
    params = [Parameter(values.copy())]
    FlatBuffer(params)
    try:
        opt = cls(params, **options)
    except TypeError:   # an option this checkout does not take (amsgrad before it)
        return None
    params[0].grad = engine.tensor(gradient)
    return opt.step


def _torch_step(class_name, options, values, gradient):
    import torch
    param = torch.tensor(values.copy(), requires_grad=True)
    param.grad = torch.tensor(gradient)
    return getattr(torch.optim, class_name)([param], **options).step


def side_methods(framework):
    """``bench.framework_process``'s build of one side (``"engine"`` or ``"torch"``):
    ``steps(size, threads, name, count)`` runs ``count`` steps of optimizer ``name`` over
    ``size`` parameters on ``threads`` threads and returns each step's seconds (None where the
    engine lacks it); an optimizer is made, and warmed up, at its first block."""
    if framework == "engine":
        import engine as module
        make = _engine_step
    else:
        import torch as module
        make = _torch_step
    made = {}

    def steps(size, threads, name, count):
        module.set_num_threads(threads)
        if (size, name) not in made:
            rng = np.random.default_rng(0)
            values = rng.standard_normal(size).astype(np.float32)
            gradient = (rng.standard_normal(size) * 1e-2).astype(np.float32)
            made[size, name] = step = make(*OPTIMIZERS[name], values, gradient)
            for _ in range(5 if step else 0):   # compile (or load the cache), make the state
                step()
        step = made[size, name]
        if step is None:
            return None
        seconds = []
        for _ in range(count):
            start = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - start)
        return seconds

    return {"steps": steps}, None


def _alternating(sides, size, threads, name, steps):
    """Each side's seconds a step, ``steps`` of them in alternating blocks; None where the
    engine lacks the optimizer."""
    times = {label: [] for label in sides}
    while len(times["engine"]) < steps:
        for label, side in sides.items():
            settle()
            block = side.call("steps", size, threads, name,
                              min(BLOCK_STEPS, steps - len(times[label])))
            if block is None:
                return None
            times[label] += block
    return times


def measure(sides, size, threads, steps, names):
    """{optimizer name: (engine median us, torch median us)} at ``size`` and ``threads``."""
    result = {}
    for name in names:
        times = _alternating(sides, size, threads, name, steps)
        if times is not None:
            result[name] = tuple(statistics.median(times[label]) * 1e6
                                 for label in ("engine", "torch"))
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS),
                        choices=list(OPTIMIZERS), metavar="NAME")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = []
    sides = {label: open_side(True, label, side_methods, label) for label in ("engine", "torch")}
    try:
        for threads in args.threads:
            for size in args.sizes:
                for name, (ours, theirs) in measure(sides, size, threads, args.steps,
                                                    args.optimizers).items():
                    rows.append(dict(optimizer=name, parameters=size, threads=threads,
                                     engine_us=ours, torch_us=theirs, ratio=ours / theirs))
    finally:
        for side in sides.values():
            side.close()
    table = ["| optimizer | parameters | threads | engine, us | torch, us | engine / torch |",
             "|---|---:|---:|---:|---:|---:|"]
    table += [f"| {r['optimizer']} | {r['parameters']:,} | {r['threads']} | "
              f"{r['engine_us']:.0f} | {r['torch_us']:.0f} | {r['ratio']:.2f} |" for r in rows]
    return emit({"steps": args.steps, "results": rows}, "\n".join(table), args.json)


if __name__ == "__main__":
    main()
