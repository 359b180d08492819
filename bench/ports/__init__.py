"""Programs from PyTorch's and Keras's tutorials ported to the engine (``*_original.txt`` are
the tutorials' code, for counting the changed lines: ``python -m bench.ports.count``)."""
