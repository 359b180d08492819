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


def pair(value):
    return (value, value) if isinstance(value, int) else tuple(value)


def _np_padding(padding, kernel, dilation):
    if padding == "valid":
        return (0, 0), (0, 0)
    if padding == "same":
        totals = [d * (k - 1) for d, k in zip(dilation, kernel)]
        return tuple((t // 2, t - t // 2) for t in totals)
    rows, columns = pair(padding)
    return (rows, rows), (columns, columns)


def np_conv2d(x, w, b=None, stride=1, padding=0, dilation=1, groups=1, activation=None,
              alpha=0.01):
    """The convolution as a sum over taps of the zero-padded input, sliced per tap."""
    (sh, sw), (dh, dw) = pair(stride), pair(dilation)
    rows, columns = _np_padding(padding, w.shape[2:], (dh, dw))
    padded = np.pad(x, ((0, 0), (0, 0), rows, columns))
    out_c, in_per_group, kh, kw = w.shape
    oh = (padded.shape[2] - dh * (kh - 1) - 1) // sh + 1
    ow = (padded.shape[3] - dw * (kw - 1) - 1) // sw + 1
    out = np.zeros((x.shape[0], out_c, oh, ow))
    per_group = out_c // groups
    for g in range(groups):
        channels = padded[:, g * in_per_group:(g + 1) * in_per_group]
        filters = w[g * per_group:(g + 1) * per_group]
        for i in range(kh):
            for j in range(kw):
                patch = channels[:, :, i * dh:i * dh + sh * (oh - 1) + 1:sh,
                                 j * dw:j * dw + sw * (ow - 1) + 1:sw]
                out[:, g * per_group:(g + 1) * per_group] += np.einsum(
                    "nchw,oc->nohw", patch, filters[:, :, i, j])
    if b is not None:
        out += b[None, :, None, None]
    return np_activation(activation, out, alpha)


def np_softmax(s):
    top = s.max(axis=-1, keepdims=True)
    e = np.exp(s - top)
    return e / e.sum(axis=-1, keepdims=True)


def np_attention(q, k, v, mask=None, causal=False, scale=None, keep=None):
    """Scaled dot-product attention as torch defines it (``keep``: dropout's kept factors)."""
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ np.swapaxes(k, -1, -2) * scale
    if mask is not None:
        s = s + (np.where(mask, 0.0, -np.inf) if mask.dtype == bool else mask)
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np_softmax(s)
    return (p if keep is None else p * keep) @ v
