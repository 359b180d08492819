"""The progress bar's time left leaves out the epoch's first step (which compiles): "?" until
a second update, then the pace of the steps after the first."""
import io
import re
import time

from engine.callbacks import progress_bar


def _remaining(bar):
    return re.search(r"\[([^\]]*)\]", str(bar)).group(1)


def test_no_estimate_from_the_compiling_first_step():
    bar = progress_bar(300, 1, 1, file=io.StringIO())
    assert _remaining(bar) == "?"
    time.sleep(0.5)   # the first step: compiles
    bar.update(1)
    assert _remaining(bar) == "?"   # tqdm's own would say 299 * 0.5 s = 02:29
    for _ in range(10):   # the next ten: fast
        time.sleep(0.002)
        bar.update(1)
    minutes, seconds = map(int, _remaining(bar).split(":"))
    assert minutes * 60 + seconds <= 10   # about 289 * 0.002 s; not minutes
    bar.close()
