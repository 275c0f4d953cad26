#!/usr/bin/env bash
# Download what the Qwen3 GSM8K presets read, into the paths they name (run from anywhere; paths are
# relative to the repository root):
#   checkpoints/<name>            Hugging Face checkpoint MODEL_ID (e.g. Qwen/Qwen3-1.7B -> checkpoints/Qwen3-1.7B)
#   data/gsm8k/train.jsonl, test.jsonl   GSM8K (openai/gsm8k, config "main"), {"question", "answer"} rows
#
#   launch/fetch_assets.sh Qwen/Qwen3-0.6B [MODEL_ID ...] [--no-data] [--dry-run]
#
# Needs the `hf` command (huggingface_hub, installed with the package's dependencies) and Python with
# pyarrow (a dependency too). Files already present are not downloaded again.
set -euo pipefail

die() { echo "fetch_assets.sh: $*" >&2; exit 2; }
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODELS=() DATA=1 DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --no-data) DATA=0 ;;
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option '$arg'" ;;
    */*) [[ "$arg" =~ ^[A-Za-z0-9._-]+/[A-Za-z0-9._-]+$ ]] || die "'$arg' is not a model id such as Qwen/Qwen3-1.7B"
         MODELS+=("$arg") ;;
    *) die "'$arg' is not a model id such as Qwen/Qwen3-1.7B" ;;
  esac
done
[[ ${#MODELS[@]} -gt 0 || $DATA == 1 ]] || die "nothing to fetch"

shq() {  # shell-quote one word for printing: bare when safe, else in single quotes
  if [[ -n "$1" && "$1" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then printf '%s' "$1"; else printf "'%s'" "${1//\'/\'\\\'\'}"; fi
}
run() {
  local out="" word
  for word in "$@"; do out+="$(shq "$word") "; done
  if [[ $DRY_RUN == 1 ]]; then echo "${out% }"; else "$@"; fi
}

PY="${PYTHON:-python3}"
HF="$(command -v hf || true)"
if [[ -z "$HF" && -x "$(dirname "$PY")/hf" ]]; then HF="$(dirname "$PY")/hf"; fi  # the venv's, when PYTHON is one
if [[ $DRY_RUN == 0 && -z "$HF" ]]; then
  die "the hf command is missing: pip install -U huggingface_hub (older releases call it huggingface-cli)"
fi
HF="${HF:-hf}"

cd "$REPO"
for model in "${MODELS[@]+"${MODELS[@]}"}"; do
  run "$HF" download "$model" --local-dir "checkpoints/${model#*/}" --exclude "*.pt" --exclude "*.bin"
done
if [[ $DATA == 1 ]]; then
  run "$HF" download openai/gsm8k --repo-type dataset --include "main/*" --local-dir data/gsm8k/hf
  run "$PY" launch/gsm8k_jsonl.py data/gsm8k/hf/main data/gsm8k
fi
