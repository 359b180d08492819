"""Text for language models: the shipped Shakespeare (verified), its builder, CharTokenizer,
and SequenceLoader's windows (a NumPy model of the draw, CPU == CUDA, iteration == the device
cursor, fit's captured step == eager)."""
import gzip

import numpy as np
import pytest

import engine
import optim
from data import CharTokenizer, SequenceLoader, shakespeare
from data.build_shakespeare import corpus
from data.sequence_loader import _ROW_MIX
from data.transforms import _GOLDEN, _mix64
from engine import nn
from engine.fit import fit
from engine.losses import cross_entropy

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def test_the_shipped_plays_in_tiny_shakespeare_form():
    text = shakespeare.load()
    assert len(text) == 4_525_556 and text.startswith("THESEUS:\nNow, fair Hippolyta")
    assert "ROMEO:\n" in text and "HAMLET:\n" in text
    assert not set("*_#[]\\") & set(text)   # no Markdown left
    train, val = shakespeare.split(text)
    assert train + val == text and len(train) == int(0.9 * len(text))


def test_a_changed_shipped_file_is_refused(tmp_path, monkeypatch):
    copy = tmp_path / "shakespeare.txt.gz"
    copy.write_bytes(gzip.compress(b"ROMEO:\nBut soft!\n"))
    monkeypatch.setattr(shakespeare, "SHIPPED", copy)
    with pytest.raises(ValueError, match="does not hold the shipped text"):
        shakespeare.load()
    assert shakespeare.load(copy) == "ROMEO:\nBut soft!\n"   # a file of one's own: as it is


def test_the_builder_keeps_speeches_and_drops_markup(tmp_path):
    play = tmp_path / "plays" / "tragedies" / "a-play.md"
    play.parent.mkdir(parents=True)
    play.write_text("# A Play\n\n## ACT I\n\n_Enter two Lords,\nwith Attendants_\n\n"
                    "**FIRST LORD**  \nHail, sir!  \n__\\[Aside]_ Who comes?  \n"
                    "*[He draws.]*\n\n**ALL**  \nWe come.\n\n_Exeunt_\n")
    assert corpus(tmp_path / "plays") == "FIRST LORD:\nHail, sir!\nWho comes?\n\nALL:\nWe come.\n\n"


def test_char_tokenizer_round_trip_and_errors():
    tok = CharTokenizer("hello world")
    assert tok.vocab_size == 8 and tok.chars == " dehlorw"
    ids = tok.encode("hello")
    assert ids.dtype == np.int64 and tok.decode(ids) == "hello"
    assert tok.decode(engine.tensor(ids)) == "hello"
    assert CharTokenizer.from_config(tok.get_config()).chars == tok.chars
    with pytest.raises(ValueError, match="character 'z' is not in the vocabulary of 8"):
        tok.encode("zebra")
    with pytest.raises(ValueError, match=r"id 9 is outside \[0, 8\)"):
        tok.decode([1, 9])
    with pytest.raises(TypeError, match="give the text"):
        CharTokenizer()


def _expected_batch(ids, loader, step):
    starts = ids.size - loader.block_size
    x = np.empty((loader.batch_size, loader.block_size), np.int64)
    y = np.empty_like(x)
    with np.errstate(over="ignore"):
        for row in range(loader.batch_size):
            z = _mix64(loader.seed_key + np.uint64(step) * np.uint64(_GOLDEN)
                       + np.uint64(row) * np.uint64(_ROW_MIX))
            start = int(z % np.uint64(starts))
            x[row], y[row] = ids[start:start + loader.block_size], ids[start + 1:start + loader.block_size + 1]
    return x, y


def test_windows_follow_the_draw_of_seed_and_step(device):
    ids = np.arange(1000, 1097)
    loader = SequenceLoader(ids, block_size=5, batch_size=3, seed=4, device=device,
                            steps_per_epoch=2)
    batches = [(x.numpy(), y.numpy()) for _ in range(2) for x, y in loader]
    assert len(batches) == 4
    for step, (x, y) in enumerate(batches):
        expected_x, expected_y = _expected_batch(ids, loader, step)
        np.testing.assert_array_equal(x, expected_x)
        np.testing.assert_array_equal(y, expected_y)
        np.testing.assert_array_equal(y[:, :-1], x[:, 1:])
    with engine.debug.poison():
        again = loader.batch(3)
    np.testing.assert_array_equal(again[0].numpy(), batches[3][0])


def test_the_cursor_gives_the_batches_of_iteration():
    ids = np.random.default_rng(0).integers(0, 50, size=300)
    iterated = SequenceLoader(ids, block_size=7, batch_size=4, seed=1, steps_per_epoch=3)
    expected = [x.numpy() for _ in range(2) for x, _ in iterated]
    cursor = SequenceLoader(ids, block_size=7, batch_size=4, seed=1,
                            steps_per_epoch=3).epoch_cursor()
    got = []
    for _ in range(2):
        for _, count in cursor.start_epoch():
            got.append(cursor.next_batch(count)[0].numpy())
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("arguments, words", [
    (dict(ids=np.arange(5), block_size=4), "5 ids hold no window of block_size 4"),
    (dict(ids=np.zeros((2, 9), np.int64), block_size=2), "1-D integer sequence"),
    (dict(ids=np.arange(50), block_size=0), "block_size must be an integer >= 1"),
    (dict(ids=np.arange(50), block_size=4, seed=-2), "seed must be a non-negative integer"),
])
def test_bad_arguments_are_named(arguments, words):
    with pytest.raises(ValueError, match=words):
        SequenceLoader(**arguments)


def test_fit_trains_a_token_model_captured_as_eager():
    ids = np.random.default_rng(2).integers(0, 6, size=400)
    results = []
    for capture in (True, False):
        engine.manual_seed(0)
        loader = SequenceLoader(ids, block_size=4, batch_size=5, seed=3, steps_per_epoch=6)
        model = nn.Sequential([nn.Dense(6, input_shape=(4,))])
        opt = optim.SGD(model.parameters(), lr=0.1)

        def loss_fn(logits, y):   # predict each window's last next token from its ids
            return cross_entropy(logits, y[:, -1])
        history = fit(model, _FloatIds(loader), opt, loss_fn, 2, progress=False,
                      verbose=False, capture=capture)
        results.append(([r["loss"] for r in history], model.state_dict(), fit.last_eager_reason))
    (captured, captured_weights, reason), (eager, eager_weights, _) = results
    assert reason is None and captured == eager
    for name, value in eager_weights.items():
        np.testing.assert_array_equal(captured_weights[name], value, err_msg=name)


class _FloatIds:
    """The loader's batches with x as float32 (a Dense layer's input), cursor included."""

    def __init__(self, loader):
        self.loader, self.batch_size, self.fetches_on_device = loader, loader.batch_size, True

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        return ((x.astype(np.float32), y) for x, y in self.loader)

    def epoch_cursor(self):
        inner = self.loader.epoch_cursor()
        outer = self

        class Cursor:
            loader, stride = outer, inner.stride

            def start_epoch(self):
                return inner.start_epoch()

            def next_batch(self, count):
                x, y = inner.next_batch(count)
                return x.astype(np.float32), y
        return Cursor()
