# temporary: removed when ops/matmul.py, conv.py, batch_norm.py are rewritten (lead)
from ops.cuda.ptx import *  # noqa: F401, F403
