"""The shipped presets on their real paths, shortened by overrides only: no verifier is replaced.
(``configs/default.yaml`` as shipped, unshortened, is tests/test_as_shipped.py's; switched to SARA +
adaptive Prefix Sampling and shortened, it is tests/test_sharding_loop.py's one-device reference run.)

* ``configs/qwen3_gsm8k.yaml`` as written (bfloat16, chat template, ``\\boxed{}`` extraction, math-verify
  in its process pool, SARA + DPS + PS, ``rl.grad_accum = 64``) on a tiny random Qwen3 checkpoint and a
  word-level tokenizer built here. Overridden: the paths, the run length, the evaluation size and
  ``sampling.max_new_tokens`` (the tiny checkpoint has 512 positions, the preset asks for 512 new tokens).
"""

import json
import shutil

import numpy as np

from passrate_jax.run.config import load_config
from passrate_jax.run.metrics import read_jsonl
from passrate_jax.run.train import train

CHATML = ("{% for m in messages %}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endfor %}"
          "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def write_tokenizer(directory, vocab_size: int, answer_words=tuple(str(d) for d in range(10)),
                    unk: str = "w20") -> list[str]:
    """Word-level tokenizer over specials, ``answer_words`` (the digits) and filler words, with a
    ChatML-like template."""
    import tokenizers

    words = ["<pad>", "</s>", "<|im_start|>", "<|im_end|>", "user", "assistant", "####", *answer_words]
    words += [f"w{i}" for i in range(len(words), vocab_size)]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=unk))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "</s>", "pad_token": "<pad>", "chat_template": CHATML}))
    return words


SHORT = ["steps=2", "eval_every=2", "logging.tensorboard=false", "logging.progress_bar=false"]


def _boxed_tokenizer(directory, vocab_size):
    """Word-level tokenizer whose words include whole ``\\boxed{...}`` answers, some of them only
    math-verify can match (``\\sqrt{4}`` against 2, ``50\\%`` against 0.5), so a random model answers
    right now and then and some groups are mixed."""
    boxed = [f"\\boxed{{{d}}}" for d in range(4)] + ["\\boxed{\\sqrt{4}}", "\\boxed{50\\%}", "\\boxed{0.5}"]
    write_tokenizer(directory, vocab_size, answer_words=boxed + [str(d) for d in range(4)], unk="w30")


def test_qwen3_gsm8k_preset_as_written(hf_checkpoint, tmp_path):
    source, hf_model = hf_checkpoint("qwen3")
    model_dir = tmp_path / "qwen3"
    shutil.copytree(source, model_dir)
    _boxed_tokenizer(model_dir, hf_model.config.vocab_size)
    answers = ["0", "1", "2", "3", "0.5"]
    rows = [{"question": f"w{40 + i % 40} w{50 + i % 30} ?", "answer": f"w41 w42 #### {answers[i % 5]}"}
            for i in range(64)]
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config("configs/qwen3_gsm8k.yaml", SHORT + [
        f"model.pretrained={model_dir}", f"data.path={data}", f"data.eval_path={data}", "data.eval_size=8",
        "sampling.max_new_tokens=12"])
    assert (cfg.model.dtype, cfg.data.answer_extract, cfg.data.resolved_verifier) == ("bfloat16", "boxed", "math")
    assert (cfg.allocation.method, cfg.allocation.selection.method, cfg.prefix_sampling.enabled) == ("sara", "dps", True)
    assert cfg.rl.grad_accum == 64 and cfg.data.chat_template
    summary = train(cfg, str(tmp_path / "run"), progress=False, log=lambda *a: None)
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2] and summary["step"] == 2
    steps = records[1:]
    assert 0 < np.mean([r["train_accuracy"] for r in steps]) < 1
    assert sum(r["valid_groups"] for r in steps) > 0  # mixed groups: some right, some wrong
    trained = [r for r in steps if r["groups_trained"] > 0]
    assert trained and all(np.isfinite(r["update/loss"]) and r["update/tokens"] > 0 for r in trained)
    assert steps[-1]["verifier/verify/error"] == 0 and steps[-1]["verifier/verify/timeout"] == 0
