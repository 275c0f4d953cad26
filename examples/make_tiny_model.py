"""Make a tiny "your own model" setup in seconds, on CPU, with no download: a random Qwen3 checkpoint
and its tokenizer written by ``transformers``, and a small GSM8K-format prompt file.

    python examples/make_tiny_model.py                 # writes tiny_qwen3/ and tiny_data/ here
    passrate-jax train --config tiny_own_model         # trains it for 100 steps on CPU (about a minute)

The checkpoint is what a real one is to passrate-jax (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json), only random and 80k parameters, so the same commands work with a real model:
point ``model.pretrained`` at its directory (and size the sampling and batch settings, see the
qwen3_gsm8k preset). The tokenizer has one token per character. The preset's reward function is
passrate_jax/data/example_rewards.py; yours is data.reward_fn=my_reward.py:reward.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string

SPECIAL = ["<pad>", "<bos>", "<eos>"]
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"
# Jinja chat template: what chat_template: true renders (the tiny preset uses plain prompts).
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def write_tokenizer(directory: str) -> int:
    """A character tokenizer as transformers saves one (tokenizer.json + tokenizer_config.json); returns its size."""
    import tokenizers
    import transformers

    vocab = {name: i for i, name in enumerate(SPECIAL + list(CHARS))}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                                eos_token="<eos>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(directory)
    return len(vocab)


def write_model(directory: str, vocab_size: int, seed: int) -> int:
    """A random Qwen3 (2 layers, hidden size 64) in safetensors; returns its parameter count."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
                                      eos_token_id=2, pad_token_id=0)
    model = transformers.Qwen3ForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def write_data(directory: str, seed: int, train: int = 64, test: int = 16) -> None:
    """Sums in GSM8K's format: ``question``, and ``answer`` with the reference after ``####``."""
    rng = random.Random(seed)
    os.makedirs(directory, exist_ok=True)
    for name, count in (("train", train), ("test", test)):
        with open(os.path.join(directory, f"{name}.jsonl"), "w") as f:
            for _ in range(count):
                a, b = rng.randint(1, 9), rng.randint(1, 9)
                row = {"question": f"{a}+{b}=", "answer": f"{a} plus {b} is {a + b}.\n#### {a + b}"}
                f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="directory to write tiny_qwen3/ and tiny_data/ in")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model_dir = os.path.join(args.out, "tiny_qwen3")
    os.makedirs(model_dir, exist_ok=True)
    vocab = write_tokenizer(model_dir)
    params = write_model(model_dir, vocab, args.seed)
    write_data(os.path.join(args.out, "tiny_data"), args.seed)
    print(f"wrote {model_dir} (random Qwen3, {params:,} parameters, {vocab}-token character tokenizer) and "
          f"{os.path.join(args.out, 'tiny_data')}/{{train,test}}.jsonl")
    print("train it: passrate-jax train --config tiny_own_model")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
