"""How a benchmark script begins and ends: its counts checked as argparse reads them, the
device it was asked for checked, its table printed and the same results written as JSON when
``--json PATH`` was given."""
import argparse
import json


def at_least(minimum):
    """An argparse ``type``: an int of at least ``minimum``, else argparse's usage error."""
    def parse(text):
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    parse.__name__ = "integer"   # argparse: "invalid integer value: 'x'"
    return parse


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
