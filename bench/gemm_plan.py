"""The launches ``ops.gemm.plans.gemm_plan`` makes for one GEMM, with the rule's tiling or one
forced: what ``bench.tiling_sweep`` times and ``bench.gemm_sass`` disassembles."""
import contextlib

import numpy as np


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
