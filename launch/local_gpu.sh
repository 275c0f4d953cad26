#!/usr/bin/env bash
# Train on this machine's NVIDIA GPUs: one process sees every local GPU (mesh data=-1 spreads the batch
# over them; a preset's mesh.devices must equal the GPU count). For several machines, run this on each
# with --coordinator/--num-nodes/--node-rank (one process per machine). Steps: launch/README.md.
#
#   launch/local_gpu.sh --config configs/qwen3_0p6b_gpu.yaml [--install] [--fetch Qwen/Qwen3-0.6B] \
#       [--run-dir runs/qwen3_0p6b] [key=value ...] [--dry-run]
set -euo pipefail

usage() {
  cat <<'EOF'
usage: launch/local_gpu.sh --config FILE [--run-dir DIR] [--venv DIR] [--install] [--cuda 12|13]
                           [--fetch MODEL_ID] [--gpus LIST] [--mem-fraction F]
                           [--coordinator HOST:PORT --num-nodes N --node-rank I] [--dry-run] [key=value ...]

  --config FILE         preset (e.g. configs/qwen3_0p6b_gpu.yaml)
  --run-dir DIR         run directory (default: runs/<preset name>); rerun the same command to resume
  --venv DIR            virtual environment to use (default: .venv in the repository)
  --install             create the venv if needed and install JAX's CUDA build and this package into it
  --cuda 12|13          CUDA major version of the JAX build that --install installs (default 12)
  --fetch MODEL_ID      download the checkpoint (e.g. Qwen/Qwen3-0.6B) and GSM8K first (launch/fetch_assets.sh)
  --gpus LIST           use only these GPUs (CUDA_VISIBLE_DEVICES, e.g. 0,1)
  --mem-fraction F      XLA_PYTHON_CLIENT_MEM_FRACTION, the share of GPU memory JAX preallocates
                        (default 0.90; JAX's own default 0.75 leaves a fifth of the card unused)
  --coordinator HOST:PORT, --num-nodes N, --node-rank I
                        multi-node: the address of node 0 and this node's rank; sets
                        distributed.{initialize,coordinator_address,num_processes,process_id}
  --dry-run             print the commands instead of running them
  key=value             config overrides passed to `passrate-jax train`
EOF
}

SCRIPT=local_gpu.sh
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=launch/common.sh
source "$REPO/launch/common.sh"
CONFIG="" RUN_DIR="" VENV="$REPO/.venv" INSTALL=0 CUDA=12 FETCH="" GPUS="" MEM_FRACTION=0.90
COORD="" NUM_NODES="" NODE_RANK="" DRY_RUN=0
OVERRIDES=()


while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) need_value "$@"; CONFIG="$2"; shift 2 ;;
    --run-dir) need_value "$@"; RUN_DIR="$2"; shift 2 ;;
    --venv) need_value "$@"; VENV="$2"; shift 2 ;;
    --install) INSTALL=1; shift ;;
    --cuda) need_value "$@"; CUDA="$2"; shift 2 ;;
    --fetch) need_value "$@"; FETCH="$2"; shift 2 ;;
    --gpus) need_value "$@"; GPUS="$2"; shift 2 ;;
    --mem-fraction) need_value "$@"; MEM_FRACTION="$2"; shift 2 ;;
    --coordinator) need_value "$@"; COORD="$2"; shift 2 ;;
    --num-nodes) need_value "$@"; NUM_NODES="$2"; shift 2 ;;
    --node-rank) need_value "$@"; NODE_RANK="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; OVERRIDES+=("$@"); break ;;
    -*) die "unknown option '$1' (see --help)" ;;
    *) OVERRIDES+=("$1"); shift ;;
  esac
done

[[ -n "$CONFIG" ]] || die "--config is required (see --help)"
[[ -f "$CONFIG" || -f "$REPO/$CONFIG" ]] || die "--config '$CONFIG': no such file"
[[ "$CUDA" =~ ^(12|13)$ ]] || die "--cuda '$CUDA': expected 12 or 13"
# shellcheck disable=SC2015  # either test failing is the error
[[ "$MEM_FRACTION" =~ ^(0?\.[0-9]+|1(\.0*)?)$ ]] && awk "BEGIN{exit !($MEM_FRACTION > 0 && $MEM_FRACTION <= 1)}" \
  || die "--mem-fraction '$MEM_FRACTION': expected a number in (0, 1], e.g. 0.9"
[[ -z "$GPUS" || "$GPUS" =~ ^[0-9]+(,[0-9]+)*$ ]] || die "--gpus '$GPUS': expected a list such as 0,1"
[[ -z "$FETCH" || "$FETCH" =~ ^[A-Za-z0-9._-]+/[A-Za-z0-9._-]+$ ]] \
  || die "--fetch '$FETCH': expected a Hugging Face model id such as Qwen/Qwen3-0.6B"
for kv in "${OVERRIDES[@]+"${OVERRIDES[@]}"}"; do
  [[ "$kv" =~ ^[A-Za-z_][A-Za-z0-9_.]*=.* ]] || die "'$kv' is not a key=value config override"
done
MULTI=()
if [[ -n "$COORD$NUM_NODES$NODE_RANK" ]]; then
  [[ -n "$COORD" && -n "$NUM_NODES" && -n "$NODE_RANK" ]] \
    || die "multi-node needs all of --coordinator, --num-nodes and --node-rank"
  [[ "$COORD" =~ ^[A-Za-z0-9.-]+:[0-9]+$ ]] || die "--coordinator '$COORD': expected HOST:PORT, e.g. 10.0.0.2:1234"
  [[ "$NUM_NODES" =~ ^[1-9][0-9]*$ ]] || die "--num-nodes '$NUM_NODES': expected a positive integer"
  # shellcheck disable=SC2015
  [[ "$NODE_RANK" =~ ^[0-9]+$ ]] && (( NODE_RANK < NUM_NODES )) \
    || die "--node-rank '$NODE_RANK': expected 0 .. $((NUM_NODES - 1))"
  MULTI=(distributed.initialize=true "distributed.coordinator_address=$COORD"
         "distributed.num_processes=$NUM_NODES" "distributed.process_id=$NODE_RANK")
fi
NAME="$(basename "$CONFIG" .yaml)"
RUN_DIR="${RUN_DIR:-runs/$NAME}"
PY="$VENV/bin/python"

cd "$REPO"
if [[ $INSTALL == 1 ]]; then
  [[ -x "$PY" ]] || run python3 -m venv "$VENV"
  run "$VENV/bin/pip" install --upgrade pip
  run "$VENV/bin/pip" install --upgrade "jax[cuda$CUDA]"
  run "$VENV/bin/pip" install -e .
elif [[ $DRY_RUN == 0 && ! -x "$PY" ]]; then
  die "no Python in --venv '$VENV': pass --install, or create it with: python3 -m venv $VENV && $VENV/bin/pip install 'jax[cuda$CUDA]' -e ."
fi

# The GPUs this process will see.
if [[ $DRY_RUN == 1 ]]; then
  run nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
  NGPU=""
else
  command -v nvidia-smi >/dev/null || die "nvidia-smi not found: no NVIDIA driver on this machine"
  GPU_LIST="$(nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader)" || die "nvidia-smi failed"
  echo "$GPU_LIST" >&2
  if [[ -n "$GPUS" ]]; then NGPU=$(( $(tr -cd , <<<"$GPUS" | wc -c) + 1 )); else NGPU=$(grep -c . <<<"$GPU_LIST"); fi
  (( NGPU > 0 )) || die "nvidia-smi lists no GPU"
fi

# The preset must load with these overrides, and a preset laid out for a device count must get it.
if [[ $DRY_RUN == 0 || -x "$PY" ]]; then
  "$PY" - "$CONFIG" "${NGPU:-0}" "${NUM_NODES:-1}" "${MULTI[@]+"${MULTI[@]}"}" "${OVERRIDES[@]+"${OVERRIDES[@]}"}" <<'PYEOF' || exit 2
import sys
from passrate_jax.run.config import load_config
from passrate_jax.configlib import ConfigError
config, gpus, nodes, overrides = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
try:
    cfg = load_config(config, overrides)
except ConfigError as e:
    sys.exit(f"local_gpu.sh: {config}: config error: {e}")
if gpus and cfg.mesh.devices and cfg.mesh.devices != gpus * nodes:
    sys.exit(f"local_gpu.sh: mesh.devices = {cfg.mesh.devices} in {config}, but {nodes} node(s) x {gpus} GPU(s) "
             f"= {gpus * nodes} devices; pass --gpus, or override mesh.devices and the mesh axes")
PYEOF
fi

if [[ -n "$FETCH" ]]; then
  run env "PYTHON=$PY" bash launch/fetch_assets.sh "$FETCH"
fi

ENV=(env "XLA_PYTHON_CLIENT_MEM_FRACTION=$MEM_FRACTION")
[[ -n "$GPUS" ]] && ENV+=("CUDA_VISIBLE_DEVICES=$GPUS")
run "${ENV[@]}" "$VENV/bin/passrate-jax" train --config "$CONFIG" --run-dir "$RUN_DIR" \
  "${MULTI[@]+"${MULTI[@]}"}" "${OVERRIDES[@]+"${OVERRIDES[@]}"}"
