# temporary: removed when ops/matmul.py, conv.py, batch_norm.py are rewritten (lead)
from ops.cuda import SIMULATOR, compute_capability, cuda, device_address, device_reshape, multiprocessor_count, set_dynamic_shared_bytes  # noqa: F401, E501
