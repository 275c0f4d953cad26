"""``passrate-jax export``: a trained run's checkpoint loads in transformers (model and tokenizer) with
logits equal to the trainer's, for the built-in character model and for a tiny Qwen3 checkpoint."""

import json
import os
import shutil

import numpy as np
from flax import nnx

from conftest import forward, torch_logits
from passrate_jax.cli.main import main
from passrate_jax.run.config import load_config
from passrate_jax.model import create_model
from passrate_jax.run.session import Session
from passrate_jax.text.tokenizer import CharTokenizer, load_tokenizer
from passrate_jax.run.train import train
from test_train_e2e import hash_reward
from test_presets_real import write_tokenizer

RUN = ["steps=1", "eval_every=1", "warm_start.enabled=false", "logging.tensorboard=false",
       "logging.progress_bar=false", "checkpoint.async_save=false", "allocation.num_prompts=2",
       "allocation.group_size=4", "data.eval_size=2", "sampling.max_new_tokens=8", "sampling.row_buckets=[8]",
       "sampling.prefill_row_buckets=[8]", "sampling.context_buckets=[32]", "sampling.generation_buckets=[8]"]
TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=2", "model.num_heads=2",
        "model.num_kv_heads=1", "model.max_position_embeddings=128", "data.train_size=8", "data.level=1"]


def trained(cfg, run_dir):
    """Train ``cfg`` in ``run_dir``; the final parameters as the model our forward pass runs."""
    summary = train(cfg, str(run_dir), progress=False, log=lambda *a: None)
    return nnx.merge(nnx.split(create_model(cfg.model, seed=cfg.seed))[0], summary["params"])


def test_export_of_the_builtin_model_is_self_contained_and_loads_in_transformers(tmp_path, capsys):
    import transformers

    cfg = load_config(None, RUN + TINY)
    ours = trained(cfg, tmp_path / "run")
    out = tmp_path / "hf"
    assert main(["export", "--run-dir", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert "step 1" in capsys.readouterr().out
    assert main(["export", "--run-dir", str(tmp_path / "run"), "--step", "7", "--out", str(tmp_path / "none")]) == 2
    assert f"--step 7: {str(tmp_path / 'run')!r} has checkpoints at steps [1]" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "12+30=\n1+0=1\n=> 42 ~!"
    ids = tokenizer(text).input_ids
    assert ids == CharTokenizer().encode(text, add_bos=True)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.eos_token_id == CharTokenizer.eos_id and tokenizer.pad_token_id == CharTokenizer.pad_id
    chat = [{"role": "user", "content": "1+1="}]
    assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        CharTokenizer().apply_chat_template(chat)
    tokens = np.asarray([ids, ids[::-1]])
    np.testing.assert_allclose(torch_logits(model, tokens), forward(ours, tokens), atol=1e-4)


def test_export_of_a_qwen3_run_loads_in_transformers_with_the_trained_weights(tmp_path, hf_checkpoint, monkeypatch):
    import transformers

    # Half the answers right whatever a random model writes, so the one step has mixed groups to learn from.
    monkeypatch.setattr(Session, "score", lambda self, records, texts: hash_reward(records, texts))

    source, hf_model = hf_checkpoint("qwen3")
    model_dir = tmp_path / "qwen3"
    shutil.copytree(source, model_dir)
    write_tokenizer(model_dir, hf_model.config.vocab_size)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"w{30 + i} 3 ?", "answer": str(i % 10)}) + "\n" for i in range(8)))
    cfg = load_config(None, RUN + [f"model.pretrained={model_dir}", "model.dtype=float32", "data.source=jsonl",
                                   f"data.path={data}", "data.answer_extract=last_number", "data.verifier=numeric",
                                   "allocation.method=uniform", "optimizer.learning_rate=0.01"])
    ours = trained(cfg, tmp_path / "run")
    out = tmp_path / "hf"
    assert main(["export", "--run-dir", str(tmp_path / "run"), "--step", "1", "--out", str(out)]) == 0
    source_ids = transformers.AutoTokenizer.from_pretrained(model_dir)("w30 3 ?").input_ids
    shutil.rmtree(model_dir)  # the export is self-contained: nothing refers back to the starting checkpoint
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported).__name__ == "Qwen3ForCausalLM"
    tokens = np.random.default_rng(0).integers(0, hf_model.config.vocab_size, (2, 9))
    np.testing.assert_allclose(torch_logits(exported, tokens), forward(ours, tokens), atol=1e-4)
    # Trained weights, not the starting checkpoint's; and the tokenizer travels with them.
    assert np.abs(torch_logits(exported, tokens) - torch_logits(hf_model, tokens)).max() > 1e-3
    assert transformers.AutoTokenizer.from_pretrained(out)("w30 3 ?").input_ids == source_ids
    assert load_tokenizer(str(out)).encode("w30 3 ?") == [30, 10, 20]  # ? is unknown: w20


def test_a_lora_run_with_a_kl_term_trains_adapters_only_and_exports_merged_weights(tmp_path, monkeypatch):
    """LoRA + ``rl.kl_coef``: the reference shares the base weights (the update must not donate them, or
    step 2 would read deleted arrays); the base stays as initialised; export folds the adapters in."""
    import transformers

    monkeypatch.setattr(Session, "score", lambda self, records, texts: hash_reward(records, texts))
    cfg = load_config(None, RUN + TINY + ["steps=2", "model.lora.rank=2", "model.lora.alpha=4", "rl.kl_coef=0.1",
                                          "optimizer.learning_rate=0.01"])
    ours = trained(cfg, tmp_path / "run")
    start = create_model(cfg.model, seed=cfg.seed)
    adapters = lambda m: nnx.to_flat_state(nnx.state(m, nnx.LoRAParam))  # noqa: E731
    base = lambda m: nnx.to_flat_state(nnx.state(m, nnx.Not(nnx.LoRAParam)))  # noqa: E731
    for (_, a), (_, b) in zip(base(ours), base(start)):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()))
    assert any(np.abs(np.asarray(a.get_value()) - np.asarray(b.get_value())).max() > 0
               for (_, a), (_, b) in zip(adapters(ours), adapters(start)))
    out = tmp_path / "hf"
    assert main(["export", "--run-dir", str(tmp_path / "run"), "--out", str(out)]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = np.asarray([CharTokenizer().encode("12+30=\n42", add_bos=True)])
    np.testing.assert_allclose(torch_logits(exported, tokens), forward(ours, tokens), atol=1e-4)
