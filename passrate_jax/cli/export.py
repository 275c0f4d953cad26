"""``passrate-jax export``: a run's checkpoint as a self-contained Hugging Face model directory.

    passrate-jax export --run-dir runs/default --out hf/default          # latest checkpoint
    python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained('hf/default')"

The directory holds ``config.json`` + ``model.safetensors`` (``passrate_jax.model.save_pretrained``:
Llama / Qwen2 / Qwen3 layouts whose transformers logits equal ours) and the tokenizer files: those of
the pretrained checkpoint the run started from, copied as they are, or for the built-in character
model a ``tokenizer.json`` written here for its vocabulary (one token per character, BOS added by the
post-processor as the trainer does), so ``AutoTokenizer`` loads it with the same ids.
"""

from __future__ import annotations

import json
import os
import shutil

# Tokenizer files of a pretrained checkpoint that travel with the export (whichever exist).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "added_tokens.json")
# CharTokenizer.apply_chat_template as Jinja, so the exported tokenizer renders chats the same way.
CHAR_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant: {% endif %}")


def restore_model(run_dir: str, step: int | None = None):
    """(config, step, model): the run's model (built from its saved config.yaml) holding the parameters
    of checkpoint ``step`` (default: the latest)."""
    from flax import nnx

    from passrate_jax.run.checkpoint import load_params
    from passrate_jax.run.config import load_config
    from passrate_jax.configlib import ConfigError
    from passrate_jax.model import create_model

    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        raise ConfigError(f"--run-dir {run_dir!r}: {path} does not exist; is it a run directory?")
    cfg = load_config(path)
    model = create_model(cfg.model, seed=cfg.seed)
    params = nnx.state(model)
    step = load_params(run_dir, params, step)
    nnx.update(model, params)
    return cfg, step, model


def write_char_tokenizer(directory: str) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` + ``generation_config.json`` for the built-in
    :class:`passrate_jax.text.tokenizer.CharTokenizer`: the same ids for every character and special token."""
    import tokenizers

    from passrate_jax.text.tokenizer import CharTokenizer

    char = CharTokenizer()
    vocab = {name: i for i, name in enumerate(char._SPECIAL_NAMES)}
    vocab.update({c: char.encode(c)[0] for c in char._CHARS})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    tok.add_special_tokens(list(char._SPECIAL_NAMES))
    bos = char._SPECIAL_NAMES[char.bos_id]
    tok.post_processor = tokenizers.processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                                  special_tokens=[(bos, char.bos_id)])
    tok.save(os.path.join(directory, "tokenizer.json"))
    names = dict(zip(("pad_token", "bos_token", "eos_token"), char._SPECIAL_NAMES))
    _write_json(directory, "tokenizer_config.json", {**names, "tokenizer_class": "PreTrainedTokenizerFast",
                                                     "model_max_length": 1 << 20, "chat_template": CHAR_CHAT_TEMPLATE})
    _write_json(directory, "generation_config.json", {"bos_token_id": char.bos_id, "eos_token_id": char.eos_id,
                                                      "pad_token_id": char.pad_id})


def _write_json(directory: str, name: str, data: dict) -> None:
    with open(os.path.join(directory, name), "w") as f:
        json.dump(data, f, indent=2)


def export(run_dir: str, out: str, step: int | None = None) -> int:
    """Write checkpoint ``step`` (default: the latest) of ``run_dir`` to ``out`` as a Hugging Face model
    directory; returns the step exported."""
    from passrate_jax.model import save_pretrained

    cfg, step, model = restore_model(run_dir, step)
    save_pretrained(model, out)  # folds LoRA adapters into the base weights: W + (alpha / r) A B
    if cfg.model.pretrained is None:
        write_char_tokenizer(out)
    else:
        for name in TOKENIZER_FILES:
            src = os.path.join(cfg.model.pretrained, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(out, name))
    return step


def add_subparser(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a run's checkpoint as a Hugging Face model directory "
                                             "(config.json, model.safetensors, tokenizer files)")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--out", required=True, help="output directory (created; files in it are overwritten)")
    p.set_defaults(func=run)


def run(args) -> int:
    step = export(args.run_dir, args.out, args.step)
    print(f"exported {args.run_dir} step {step} to {args.out}: load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained({args.out!r})")
    return 0
