"""The command-line wing: the commands that parse arguments and wire the library together."""
