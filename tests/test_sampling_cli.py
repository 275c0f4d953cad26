"""``passrate-jax generate``: greedy output equals transformers' greedy ``generate`` on a tiny random
Qwen3 checkpoint with a word-level tokenizer, both built here."""

import argparse
import json
import shutil

from passrate_jax.cli import generate as generate_cli

EOS, PAD = 1, 0


def write_tokenizer(directory, vocab_size: int) -> list[str]:
    """A word-level tokenizer.json over ``<pad> </s> w2 .. w{V-1}`` plus its tokenizer_config.json."""
    import tokenizers

    words = ["<pad>", "</s>"] + [f"w{i}" for i in range(2, vocab_size)]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "<pad>"}))
    return words


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """Run ``generate`` in-process through its own subparser: (exit status, stdout, stderr)."""
    parser = argparse.ArgumentParser()
    generate_cli.add_subparser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["generate", *argv])
    code = args.func(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_greedy_equals_transformers_generate(hf_checkpoint, tmp_path, capsys):
    import torch

    source, hf_model = hf_checkpoint("qwen3")
    directory = tmp_path / "qwen3"
    shutil.copytree(source, directory)
    words = write_tokenizer(directory, hf_model.config.vocab_size)
    prompt_ids = [5, 17, 42, 8, 63, 21, 2, 77]
    prompt = " ".join(words[i] for i in prompt_ids)

    code, out, _ = run_cli(["--model", str(directory), "--prompt", prompt, "--temperature", "0",
                            "--max-new-tokens", "12", "--num-samples", "2", "--json"], capsys)
    assert code == 0
    samples = [json.loads(line) for line in out.strip().splitlines()]
    assert len(samples) == 2 and samples[0]["prompt_ids"] == prompt_ids

    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                                eos_token_id=EOS, pad_token_id=PAD)
    expected = ref[0, len(prompt_ids):].tolist()
    if EOS in expected:  # transformers pads after EOS only when other rows are still running
        expected = expected[: expected.index(EOS) + 1]
    for s in samples:
        assert s["token_ids"] == expected
        assert s["finish_reason"] == ("stop" if expected[-1] == EOS else "length")
        assert s["text"] == " ".join(words[i] for i in expected if i not in (EOS, PAD))
    assert len(set(expected)) > 1  # a real continuation, not one repeated token


def test_generate_rejects_bad_arguments_before_loading(tmp_path, capsys):
    code, _, err = run_cli(["--model", str(tmp_path / "missing"), "--prompt", "x", "--num-samples", "0"], capsys)
    assert code == 2 and "--num-samples = 0" in err
