"""The command-line wing: the commands that parse arguments and wire the engine together."""
