"""``python -m engine.generate MODEL --prompt TEXT --tokens N``: sample from a GPT checkpoint
(the command lives in the CLI wing, ``engine.cli.generate``)."""
from engine.cli.generate import main

if __name__ == "__main__":
    main()
