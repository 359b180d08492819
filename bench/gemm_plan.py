"""The launches ``ops.gemm.plans.gemm_plan`` makes for one GEMM, with the rule's tiling or one
forced, and the GPT's Dense GEMMs as Dense passes them: what ``bench.tiling_sweep`` times and
``bench.gemm_sass`` disassembles."""
import contextlib

import numpy as np

GPT_ROWS = 64 * 256   # the GPU configuration's batch x block
GPT_DENSE = (("qkv", 384, 1152), ("proj", 384, 384), ("fc", 384, 1536), ("fc2", 1536, 384))


def dense_gemm(mode, rows, features, outputs, operand, empty):
    """``(m, n, k, trans_a, trans_b, args)`` of the ``mode`` GEMM (FORWARD, GRAD_A or GRAD_B)
    of a linear Dense layer of ``features`` -> ``outputs`` over ``rows`` rows, the launch
    arguments as Dense passes them: its inputs made by ``operand(*shape)``, its outputs by
    ``empty(*shape)``."""
    from ops.gemm.tilings import FORWARD, GRAD_A
    x, w, g = operand(rows, features), operand(features, outputs), operand(rows, outputs)
    y = operand(rows, outputs)   # the layer's output, which a linear layer's backward skips
    if mode == FORWARD:
        return (rows, outputs, features, False, False,
                (x, w, operand(outputs), empty(rows, outputs), 0.01))
    if mode == GRAD_A:
        return rows, features, outputs, False, True, (g, y, w, empty(rows, features), 0.01)
    return (features, outputs, rows, True, False,
            (x, g, y, empty(features, outputs), empty(outputs), 0.01))


@contextlib.contextmanager
def forced(tiling, split, shape):
    """Every GEMM plan inside of op(A) (m, k) @ op(B) (k, n), ``shape`` = (m, n, k), in
    ``tiling``'s format picks ``tiling`` in ``split`` K slices (the timer's busy product, at
    "highest", keeps its own)."""
    from ops.gemm import choices, plans
    chosen = plans.pick_config

    def pick_config(m, n, k, trans_a, trans_b, extra_rows=0, mma=None, **options):
        if (m, n, k) == shape and mma == tiling.mma:
            return choices.GemmConfig(tiling, split)
        return chosen(m, n, k, trans_a, trans_b, extra_rows, mma, **options)

    plans.pick_config = pick_config
    try:
        yield
    finally:
        plans.pick_config = chosen


def planned(mode, m, n, k, trans_a, trans_b, args, precision, tiling=None, split=1):
    """gemm_plan's launches at ``precision``, ``tiling`` in ``split`` slices forced, or the
    rule's where tiling is None; and the (tiling, split) they run."""
    from engine import set_float32_matmul_precision
    from ops.gemm import plans
    from ops.pointwise import IDENTITY
    picked = []
    set_float32_matmul_precision(precision)
    try:
        with forced(tiling, split, (m, n, k)) if tiling else contextlib.nullcontext():
            chosen = plans.pick_config

            def pick_config(*arguments, **options):
                picked.append(chosen(*arguments, **options))
                return picked[-1]
            plans.pick_config = pick_config
            try:
                launches = plans.gemm_plan(mode, m, n, k, np.float32, trans_a, trans_b,
                                           IDENTITY, args)
            finally:
                plans.pick_config = chosen
    finally:
        set_float32_matmul_precision("highest")
    return launches, picked[0]
