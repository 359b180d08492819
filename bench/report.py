"""How a benchmark script ends: check the device it was asked for, print its table, and
write the same results as JSON when ``--json PATH`` was given."""
import json


def require_device(parser, device):
    from ops.device import cuda_available
    if device == "cuda" and not cuda_available():
        parser.error("--device cuda: no CUDA GPU is usable here")


def emit(result, table, json_path):
    print(table)
    if json_path:
        with open(json_path, "w") as file:
            json.dump(result, file, indent=2)
    return result
