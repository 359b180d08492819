"""The character-level GPT: nanoGPT's architecture from the engine's layers, trained by fit
(captured == eager), saved and loaded, sampled; and the two commands."""
import subprocess
import sys

import numpy as np
import pytest

import engine
from engine import data, models, nn, optim
from engine.checkpoint import read_checkpoint
from engine.fit import fit
from engine.gpt import GPT
from engine.train import main

TEXT = data.shakespeare.load()[:30000]


def _tiny(dropout=0.0):
    engine.manual_seed(0)
    tok = data.CharTokenizer(TEXT)
    return tok, models.build_gpt(tok.vocab_size, block_size=8, n_layer=2, n_head=2, n_embd=16,
                                 dropout=dropout)


def test_the_architecture_and_its_initialisation():
    tok, model = _tiny()
    names = [name for name, _ in model.named_parameters()]
    assert names[:2] == ["tokens.weight", "positions.weight"] and "head" not in " ".join(names)
    assert "blocks.1.attention.in_proj.weight" in names and "norm.weight" in names
    weights = model.state_dict()
    assert abs(weights["tokens.weight"].std() - 0.02) < 0.003   # nanoGPT's N(0, 0.02)
    assert abs(weights["blocks.0.proj.weight"].std() - 0.01) < 0.002   # 0.02 / sqrt(2 * 2)
    ids = engine.tensor(tok.encode(TEXT[:16]).reshape(2, 8))
    logits = model(ids)
    assert logits.shape == (2, 8, tok.vocab_size)
    # at the start every character is about as likely: the loss of the next characters is
    # about log(vocab)
    targets = engine.tensor(tok.encode(TEXT[1:17]).reshape(2, 8))
    loss = models.gpt_loss(logits, targets).item()
    assert abs(loss - np.log(tok.vocab_size)) < 0.25
    with pytest.raises(ValueError, match="longer than block_size 8"):
        model(engine.tensor(np.zeros((1, 9), np.int64)))


def test_fit_learns_and_the_captured_step_equals_the_eager_one():
    results = []
    for capture in (True, False):
        tok, model = _tiny(dropout=0.1)
        loader = data.SequenceLoader(tok.encode(TEXT), block_size=8, batch_size=4, seed=0,
                                     steps_per_epoch=15)
        opt = optim.AdamW(model.parameters(), lr=1e-2)
        history = fit(model, loader, opt, models.gpt_loss, 3, progress=False, verbose=False,
                      capture=capture)
        results.append(([r["loss"] for r in history], model.state_dict(), fit.last_eager_reason))
    (captured, weights, reason), (eager, eager_weights, _) = results
    assert reason is None and captured == eager and captured[-1] < captured[0] - 0.3
    for name, value in eager_weights.items():
        np.testing.assert_array_equal(weights[name], value, err_msg=name)


def test_save_load_and_generate(tmp_path):
    tok, model = _tiny()
    path = str(tmp_path / "gpt.npz")
    model.save(path)
    loaded = nn.load(path)
    assert isinstance(loaded, GPT) and loaded.get_config() == model.get_config()
    prompt = engine.tensor(tok.encode("ROMEO:"))[None]
    first = model.generate(prompt, max_new_tokens=12, temperature=0.8, top_k=5, seed=3)
    again = loaded.generate(prompt, max_new_tokens=12, temperature=0.8, top_k=5, seed=3)
    assert first.shape == (1, 18) and tok.decode(first[0]).startswith("ROMEO:")
    np.testing.assert_array_equal(first.numpy(), again.numpy())
    with pytest.raises(ValueError, match="temperature must be > 0"):
        model.generate(prompt, 3, temperature=0)


TINY = ["--model", "gpt", "--steps", "4", "--eval-every", "2", "--batch-size", "2",
        "--device", "cpu", "--no-progress"]


def test_the_command_trains_resumes_exactly_and_generates(tmp_path, capsys):
    straight, resumed = str(tmp_path / "straight.npz"), str(tmp_path / "resumed.npz")
    main(TINY + ["--save", straight])
    out = capsys.readouterr().out
    assert "shakespeare:" in out and "step 4/4  train loss" in out and "val loss" in out
    main(TINY + ["--steps", "2", "--save", resumed])
    main(TINY + ["--resume", resumed])
    a, b = read_checkpoint(straight)["model"], read_checkpoint(resumed)["model"]
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    sample = subprocess.run([sys.executable, "-m", "engine.generate", straight, "--prompt",
                             "ROMEO:", "--tokens", "20", "--seed", "1"],
                            capture_output=True, text=True, timeout=300)
    assert sample.returncode == 0, sample.stderr
    assert sample.stdout.startswith("ROMEO:") and len(sample.stdout.rstrip("\n")) >= 26


@pytest.mark.parametrize("flags, words", [
    (["--model", "gpt", "--dataset", "mnist"], "the gpt trains on text"),
    (["--model", "gpt", "--epochs", "3"], "--model gpt counts --steps"),
    (["--steps", "10"], "--steps: only for --model gpt"),
    (["--model", "gpt", "--steps", "10", "--eval-every", "3"], "not a multiple of --eval-every"),
    (["--model", "gpt", "--preset", "huge"], "unknown --preset 'huge'"),
])
def test_bad_gpt_flags_are_one_line(capsys, flags, words):
    with pytest.raises(SystemExit) as stop:
        main(flags + ["--no-save"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and words in err and len(err.strip().splitlines()) == 1


def test_generate_refuses_what_it_cannot_sample(tmp_path):
    plain = tmp_path / "mlp.npz"
    nn.Sequential([nn.Dense(2, input_shape=(3,))]).save(str(plain))
    done = subprocess.run([sys.executable, "-m", "engine.generate", str(plain)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "engine-generate: error:" in done.stderr


@pytest.mark.cuda
def test_a_captured_gpt_step_on_cuda_equals_the_eager_one():
    results = []
    for capture in (True, False):
        engine.manual_seed(0)
        model = models.build_gpt(11, block_size=4, n_layer=1, n_head=2, n_embd=4, dropout=0.1,
                                 device="cuda")
        loader = data.SequenceLoader(np.arange(40) % 11, block_size=4, batch_size=2, seed=0,
                                     device="cuda", steps_per_epoch=3)
        fit(model, loader, optim.AdamW(model.parameters(), lr=1e-2), models.gpt_loss, 1,
            progress=False, verbose=False, capture=capture)
        results.append(model.state_dict())
    for name, value in results[1].items():
        np.testing.assert_array_equal(results[0][name], value, err_msg=name)


def test_an_image_model_s_flag_is_refused_for_the_gpt(capsys):
    with pytest.raises(SystemExit):
        main(TINY + ["--hidden", "64", "--no-save"])
    assert "--hidden: not for --model gpt" in capsys.readouterr().err
