"""``passrate-jax generate``: sample completions of one prompt from a Hugging Face-format checkpoint.

    passrate-jax generate --model DIR --prompt "2+2=" --num-samples 4 --max-new-tokens 32 --temperature 0.7

DIR holds config.json, *.safetensors and tokenizer.json (no hub access). ``--temperature 0`` is greedy.
The prompt is prefilled once and its KV cache shared by all samples.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from passrate_jax.configlib import UserError, UserFileError


def add_subparser(subparsers) -> argparse.ArgumentParser:
    """Register the ``generate`` subcommand on an argparse ``subparsers`` object."""
    p = subparsers.add_parser("generate", help="sample completions of a prompt from a Hugging Face checkpoint")
    p.add_argument("--model", required=True, help="checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--num-samples", type=int, default=1, help="completions to sample (default 1)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="generation budget per sample (default 64)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; 0 = greedy (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 = off")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    p.add_argument("--json", action="store_true", help="print one JSON object per sample (ids, text, finish)")
    p.set_defaults(func=run)
    return p


def _check(args) -> str | None:
    if args.num_samples < 1:
        return f"--num-samples = {args.num_samples}: must be >= 1"
    if args.max_new_tokens < 1:
        return f"--max-new-tokens = {args.max_new_tokens}: must be >= 1"
    if args.temperature < 0:
        return f"--temperature = {args.temperature}: must be >= 0"
    if args.top_k < 0 or not 0 < args.top_p <= 1:
        return f"--top-k = {args.top_k}, --top-p = {args.top_p}: need top_k >= 0 and 0 < top_p <= 1"
    if not 0 <= args.seed < 2**31:
        return f"--seed = {args.seed}: must be in [0, 2**31)"
    return None


def check_model_dir(model: str) -> None:
    """UserFileError unless ``model`` is a Hugging Face checkpoint directory; a run directory gets the
    ``export`` command that makes one of it."""
    if not os.path.isdir(model):
        raise UserFileError(f"--model {model!r}: no such directory; give a checkpoint directory (config.json, "
                            "*.safetensors, tokenizer.json)")
    if os.path.isfile(os.path.join(model, "config.json")):
        return
    if os.path.isfile(os.path.join(model, "config.yaml")):
        out = os.path.join(model, "hf")
        raise UserFileError(f"--model {model!r} is a training run directory, not a checkpoint: export it first "
                            f"(passrate-jax export --run-dir {model} --out {out}) and pass --model {out}")
    raise UserFileError(f"--model {model!r}: not a Hugging Face checkpoint (no config.json); it needs config.json, "
                        "*.safetensors and tokenizer.json")


def run(args) -> int:
    """Load the checkpoint and tokenizer, sample, print the completions; returns the exit status."""
    error = _check(args)
    if error:  # printed here, not raised: callers of run() (tests, scripts) get the status without main()
        print(f"passrate-jax generate: error: {error}", file=sys.stderr)
        return 2
    check_model_dir(args.model)
    from passrate_jax.model import load_pretrained
    from passrate_jax.sampling import Context, Sampler, SamplingConfig
    from passrate_jax.sharding import make_mesh
    from passrate_jax.run.config import MeshConfig
    from passrate_jax.text.tokenizer import load_tokenizer

    tok = load_tokenizer(args.model)
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        ids = tok.encode(text)  # the template already writes any BOS token
    else:
        ids = tok.encode(args.prompt, add_bos=True)
    if not ids:
        raise UserError(f"--prompt {args.prompt!r}: encodes to no tokens; give a non-empty prompt")
    mesh = make_mesh(MeshConfig())
    model = load_pretrained(args.model, dtype=args.dtype, mesh=mesh)
    # Row buckets sized to the request: a one-off command gains nothing from padding to 64 rows.
    cfg = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                         max_new_tokens=args.max_new_tokens, stop_token_ids=tuple(getattr(tok, "stop_ids", ())),
                         row_buckets=(args.num_samples,), prefill_row_buckets=(1,))
    sampler = Sampler(model, cfg, eos_id=tok.eos_id, pad_id=tok.pad_id, mesh=mesh)
    result = sampler.generate([Context(ids, num_samples=args.num_samples)], seed=args.seed)
    for i in range(args.num_samples):
        completion = result.completion(i)
        text = tok.decode(completion)
        if args.json:
            print(json.dumps({"sample": i, "prompt_ids": list(ids), "token_ids": completion, "text": text,
                              "finish_reason": result.finish_reason[i]}))
        else:
            print(f"--- sample {i} ({result.finish_reason[i]}, {len(completion)} tokens) ---")
            print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``generate`` standalone (``python -m passrate_jax.cli.generate ...``)."""
    parser = argparse.ArgumentParser(prog="passrate-jax")
    add_subparser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:  # one line, as the passrate-jax command prints it
        print(f"passrate-jax generate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
