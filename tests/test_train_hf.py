"""One training step end to end on a tiny random Qwen3 checkpoint with a tokenizer.json and a chat
template built here, reading a GSM8K-style JSONL file: HF tokenizer + chat template + JSONL source +
numeric / math-verify rewards + sampler + allocator + update, through ``passrate-jax train``."""

import json

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


def test_one_training_step_on_qwen3_gsm8k_jsonl(hf_checkpoint, tmp_path):
    import shutil
    source, hf_model = hf_checkpoint("qwen3")
    model_dir = tmp_path / "qwen3"
    shutil.copytree(source, model_dir)
    write_tokenizer(model_dir, hf_model.config.vocab_size)
    rows = [{"question": f"w{30 + i} w{40 + i} 3 w{50 + i} ?", "answer": f"w22 w23 #### {i % 10}"} for i in range(16)]
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # The reference is the number after ####; a response is scored on its last number, so a random model
    # that emits digits is right about one time in ten and groups of 8 are often mixed.
    cfg = load_config("configs/qwen3_gsm8k.yaml", [
        f"model.pretrained={model_dir}", "model.dtype=float32", f"data.path={data}", f"data.eval_path={data}",
        "data.template='{prompt}'", "data.answer_extract=last_number", "data.eval_size=4", "data.verify_workers=1",
        "steps=2", "eval_every=2", "allocation.method=uniform", "allocation.selection.method=none",
        "allocation.num_prompts=4", "allocation.group_size=8", "prefix_sampling.enabled=false", "rl.grad_accum=1",
        "sampling.max_new_tokens=8", "sampling.row_buckets=[32]", "sampling.prefill_row_buckets=[8]",
        "sampling.context_buckets=[32]", "sampling.generation_buckets=[8]", "logging.tensorboard=false",
        "logging.progress_bar=false", "checkpoint.async_save=false"])
    summary = train(cfg, str(tmp_path / "run"), progress=False, log=lambda *a: None)
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    steps = records[1:]
    assert all(r["rollouts_step"] == 32 for r in steps)
    assert 0 < np.mean([r["train_accuracy"] for r in steps]) < 1
    trained = [r for r in steps if r["valid_groups"] > 0]
    assert trained and all(np.isfinite(r["update/loss"]) and r["update/tokens"] > 0 for r in trained)
    assert steps[-1]["verifier/verify/error"] == 0 and steps[-1]["verifier/verify/timeout"] == 0
    assert "eval_accuracy" in steps[-1] and summary["step"] == 2
