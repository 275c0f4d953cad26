"""GSM8K's Parquet files (the Hugging Face dataset openai/gsm8k, config "main") as the JSONL files the
Qwen3 presets read: one {"question", "answer"} object per line, the reference after "####" in the answer.

    python launch/gsm8k_jsonl.py data/gsm8k/hf/main data/gsm8k     # -> data/gsm8k/train.jsonl, test.jsonl
"""

import glob
import json
import os
import sys


def convert(parquet_dir: str, out_dir: str) -> dict[str, int]:
    import pyarrow.parquet as pq

    counts = {}
    os.makedirs(out_dir, exist_ok=True)
    for split in ("train", "test"):
        files = sorted(glob.glob(os.path.join(parquet_dir, f"{split}-*.parquet")))
        if not files:
            raise SystemExit(f"gsm8k_jsonl.py: no {split}-*.parquet in {parquet_dir}")
        rows = [r for path in files for r in pq.read_table(path, columns=["question", "answer"]).to_pylist()]
        with open(os.path.join(out_dir, f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        counts[split] = len(rows)
    return counts


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    for split, n in convert(sys.argv[1], sys.argv[2]).items():
        print(f"{sys.argv[2]}/{split}.jsonl: {n} rows")
