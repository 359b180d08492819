"""NumPy float64 references that more than one test module checks an op against, and the
BatchNorm ``check_op`` case that BatchNorm and SyncBatchNorm share."""
import numpy as np

from engine.autograd import apply
from ops.batch_norm import BatchNormOp
from tests.support.op_check import Case

# the fused activations of Dense and Conv2D (and None, the identity)
ACTIVATIONS = [None, "relu", "leaky_relu", "sigmoid", "tanh"]


def np_activation(name, v, alpha=0.01):
    if name == "relu":
        return np.maximum(v, 0)
    if name == "leaky_relu":
        return np.where(v > 0, v, alpha * v)
    if name == "sigmoid":
        return 1 / (1 + np.exp(-v))
    if name == "tanh":
        return np.tanh(v)
    return v


def np_batch_norm(x, running_mean, running_var, weight=None, bias=None, training=False,
                  eps=1e-5):
    axes = (0,) + tuple(range(2, x.ndim))
    shape = (1, -1) + (1,) * (x.ndim - 2)
    if training:
        mean, var = x.mean(axis=axes), x.var(axis=axes)
    else:
        mean, var = running_mean, running_var
    y = (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps)
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return y


def batch_norm_case(x_shape, training, parameters=2, op=BatchNormOp, name="batch_norm",
                    **options):
    """x, the running statistics, then ``parameters`` of (weight, bias); ``op`` (BatchNorm or
    a variant with the same reference, such as SyncBatchNorm) gets ``options`` too."""
    channels = x_shape[1]

    def make(rng):
        arrays = [rng.uniform(-2, 3, size=x_shape), rng.uniform(-1, 1, size=channels),
                  rng.uniform(0.5, 2, size=channels)]
        return arrays + [rng.uniform(-2, 2, size=channels) for _ in range(parameters)]

    def fn(*tensors):
        return apply(op, *tensors, training=training, momentum=0.2, **options)

    def ref(*arrays):
        return np_batch_norm(*arrays, training=training)

    shapes = (x_shape, (channels,), (channels,)) + ((channels,),) * parameters
    return Case(name, shapes, fn, ref, make_inputs=make,
                grad=(True, False, False) + (True,) * parameters)
