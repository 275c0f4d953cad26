#!/usr/bin/env bash
# Train on a Cloud TPU slice: create the TPU VM(s), ship this repository to every worker, install it with
# JAX's TPU extra, run the same `passrate-jax train` on all workers (jax.distributed, one process per
# worker), stream their logs, and delete the slice at the end (also when a step fails or on Ctrl-C).
# Steps and prerequisites: launch/README.md.
#
#   launch/tpu_pod.sh --name rl-1p7b --zone us-west4-a --accelerator-type v5litepod-16 \
#       --config configs/qwen3_1p7b_tpu_v5e.yaml --run-dir gs://MY_BUCKET/runs/qwen3_1p7b \
#       --fetch Qwen/Qwen3-1.7B [key=value ...] [--dry-run]
#
# --dry-run prints every command, shell-quoted, in order, and runs none (gcloud need not be installed).
set -euo pipefail

usage() {
  cat <<'EOF'
usage: launch/tpu_pod.sh --name NAME --zone ZONE --accelerator-type TYPE --config FILE --run-dir DIR
                         [--project PROJECT] [--version RUNTIME] [--fetch MODEL_ID] [--setup CMD]...
                         [--python VERSION] [--ref GIT_REF] [--spot] [--reuse] [--keep] [--dry-run]
                         [key=value ...]

  --name NAME               TPU VM name: lowercase letters, digits and hyphens, starting with a letter
  --zone ZONE               a zone with quota for the accelerator, e.g. us-west4-a (v5e), us-east5-a (v5p)
  --project PROJECT         Google Cloud project (default: gcloud's configured project)
  --accelerator-type TYPE   v5litepod-N (N chips), v5p-N (N TensorCores = N/2 chips), v6e-N, v4-N
  --version RUNTIME         TPU VM software version (default from the type: v2-alpha-tpuv5-lite for v5e,
                            v2-alpha-tpuv5 for v5p, v2-alpha-tpuv6e for v6e, tpu-ubuntu2204-base for v4)
  --config FILE             preset, a path inside this repository (e.g. configs/qwen3_8b_tpu_v5p.yaml)
  --run-dir DIR             run directory that every worker sees: gs://BUCKET/PATH (rerun to resume)
  --fetch MODEL_ID          on every worker, download the checkpoint MODEL_ID (e.g. Qwen/Qwen3-1.7B) into
                            checkpoints/ and GSM8K into data/gsm8k/ (launch/fetch_assets.sh)
  --setup CMD               extra shell command run on every worker in the repository after the install
                            (repeatable), e.g. "gcloud storage cp -r gs://B/ckpt checkpoints/"
  --python VERSION          Python of the workers' virtual environment, installed with uv (default 3.12)
  --ref GIT_REF             commit to ship (default HEAD; uncommitted changes are not shipped)
  --spot                    create a Spot TPU VM
  --reuse                   the TPU VM exists already (from --keep): skip create, still install and train
  --keep                    do not delete the TPU VM at the end
  --dry-run                 print the commands instead of running them
  key=value                 config overrides passed to `passrate-jax train` on every worker
EOF
}

SCRIPT=tpu_pod.sh
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=launch/common.sh
source "$REPO/launch/common.sh"
NAME="" ZONE="" PROJECT="" ACCEL="" VERSION="" CONFIG="" RUN_DIR="" FETCH="" PYVER="3.12" REF="HEAD"
SPOT=0 REUSE=0 KEEP=0 DRY_RUN=0
SETUP=() OVERRIDES=()


while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) need_value "$@"; NAME="$2"; shift 2 ;;
    --zone) need_value "$@"; ZONE="$2"; shift 2 ;;
    --project) need_value "$@"; PROJECT="$2"; shift 2 ;;
    --accelerator-type) need_value "$@"; ACCEL="$2"; shift 2 ;;
    --version) need_value "$@"; VERSION="$2"; shift 2 ;;
    --config) need_value "$@"; CONFIG="$2"; shift 2 ;;
    --run-dir) need_value "$@"; RUN_DIR="$2"; shift 2 ;;
    --fetch) need_value "$@"; FETCH="$2"; shift 2 ;;
    --setup) need_value "$@"; SETUP+=("$2"); shift 2 ;;
    --python) need_value "$@"; PYVER="$2"; shift 2 ;;
    --ref) need_value "$@"; REF="$2"; shift 2 ;;
    --spot) SPOT=1; shift ;;
    --reuse) REUSE=1; shift ;;
    --keep) KEEP=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; OVERRIDES+=("$@"); break ;;
    -*) die "unknown option '$1' (see --help)" ;;
    *) OVERRIDES+=("$1"); shift ;;
  esac
done

# ---------------------------------------------------------------- validation
for pair in "--name:$NAME" "--zone:$ZONE" "--accelerator-type:$ACCEL" "--config:$CONFIG" "--run-dir:$RUN_DIR"; do
  [[ -n "${pair#*:}" ]] || die "${pair%%:*} is required (see --help)"
done
[[ ${#NAME} -le 63 && "$NAME" =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] \
  || die "--name '$NAME': use lowercase letters, digits and hyphens, start with a letter, at most 63 characters"
[[ "$ZONE" =~ ^[a-z]+-[a-z]+[0-9]+-[a-z]$ ]] || die "--zone '$ZONE': expected a zone such as us-west4-a"
[[ -z "$PROJECT" || "$PROJECT" =~ ^[a-z][-a-z0-9]{4,28}[a-z0-9]$ ]] \
  || die "--project '$PROJECT': expected a project id such as my-project-123"
[[ "$ACCEL" =~ ^(v5litepod|v5p|v6e|v4)-([0-9]+)$ ]] \
  || die "--accelerator-type '$ACCEL': expected v5litepod-N, v5p-N, v6e-N or v4-N (e.g. v5litepod-16, v5p-32)"
FAMILY="${BASH_REMATCH[1]}" COUNT="${BASH_REMATCH[2]}"
case "$FAMILY" in  # JAX devices: one per chip (v5p and v4 count 2 TensorCores per chip in the type name)
  v5litepod) CHIPS=$COUNT; DEFAULT_VERSION=v2-alpha-tpuv5-lite ;;
  v6e) CHIPS=$COUNT; DEFAULT_VERSION=v2-alpha-tpuv6e ;;
  v5p) CHIPS=$((COUNT / 2)); DEFAULT_VERSION=v2-alpha-tpuv5 ;;
  v4) CHIPS=$((COUNT / 2)); DEFAULT_VERSION=tpu-ubuntu2204-base ;;
esac
if [[ "$FAMILY" == v5p || "$FAMILY" == v4 ]] && (( COUNT % 2 || COUNT < 8 )); then
  die "--accelerator-type '$ACCEL': $FAMILY-N counts TensorCores (2 per chip), N must be even and >= 8"
fi
(( CHIPS >= 1 )) || die "--accelerator-type '$ACCEL': no chips"
VERSION="${VERSION:-$DEFAULT_VERSION}"
[[ "$VERSION" =~ ^[a-z0-9][-a-z0-9.]*$ ]] || die "--version '$VERSION': expected a runtime such as $DEFAULT_VERSION"
[[ "$PYVER" =~ ^3\.[0-9]+$ ]] || die "--python '$PYVER': expected a version such as 3.12"
[[ "$CONFIG" != /* && "$CONFIG" != *..* ]] || die "--config '$CONFIG': give a path inside the repository, e.g. configs/x.yaml"
[[ -f "$REPO/$CONFIG" ]] || die "--config '$CONFIG': no such file in $REPO"
[[ "$RUN_DIR" != *[[:space:]]* ]] || die "--run-dir '$RUN_DIR': no spaces please"
if [[ "$RUN_DIR" != gs://* ]]; then
  echo "tpu_pod.sh: warning: --run-dir '$RUN_DIR' is not a gs:// path; every worker must see the same directory" \
       "(shared file system) or checkpoints cannot be written or resumed" >&2
fi
for kv in "${OVERRIDES[@]+"${OVERRIDES[@]}"}"; do
  [[ "$kv" =~ ^[A-Za-z_][A-Za-z0-9_.]*=.* ]] || die "'$kv' is not a key=value config override"
done
[[ -z "$FETCH" || "$FETCH" =~ ^[A-Za-z0-9._-]+/[A-Za-z0-9._-]+$ ]] \
  || die "--fetch '$FETCH': expected a Hugging Face model id such as Qwen/Qwen3-1.7B"

# Check the preset locally before paying for a slice: it loads with the overrides, and the devices it is
# laid out for (mesh.devices) are the slice's JAX devices. Skipped when no Python here has the package.
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x "$REPO/.venv/bin/python" ]]; then PY="$REPO/.venv/bin/python"; else PY=python3; fi
fi
# One interpreter both looks for the package and checks (each start imports JAX: about 2 s). Exit status 3,
# or 127 (no such interpreter): no package here.
CHECKED=0
(cd "$REPO" && "$PY" - "$CONFIG" "$CHIPS" "$ACCEL" "${OVERRIDES[@]+"${OVERRIDES[@]}"}" <<'PYEOF') || CHECKED=$?
import math, sys
try:
    from passrate_jax.run.config import load_config
    from passrate_jax.configlib import ConfigError
except ImportError:
    sys.exit(3)
config, chips, accel, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
try:
    cfg = load_config(config, ["distributed.initialize=true", *overrides])
except ConfigError as e:
    sys.exit(f"tpu_pod.sh: {config}: config error: {e}")
m = cfg.mesh
if m.devices and m.devices != chips:
    sys.exit(f"tpu_pod.sh: mesh.devices = {m.devices} in {config}, but {accel} has {chips} JAX devices")
fixed = math.prod(s for s in (m.data, m.fsdp, m.tensor) if s != -1)
if chips % fixed or (-1 not in (m.data, m.fsdp, m.tensor) and fixed != chips):
    sys.exit(f"tpu_pod.sh: mesh (data, fsdp, tensor) = {(m.data, m.fsdp, m.tensor)} in {config} does not "
             f"fit the {chips} devices of {accel}")
PYEOF
if [[ $CHECKED == 3 || $CHECKED == 127 ]]; then
  echo "tpu_pod.sh: note: no Python with passrate_jax here ($PY); the preset is checked on the workers only" >&2
elif [[ $CHECKED != 0 ]]; then
  exit 2
fi

# ---------------------------------------------------------------- the commands
GC=(gcloud compute tpus tpu-vm)
WHERE=(--zone="$ZONE")
[[ -n "$PROJECT" ]] && WHERE+=(--project="$PROJECT")
TARBALL="${TMPDIR:-/tmp}/passrate-jax-$NAME.tar.gz"
# shellcheck disable=SC2016  # $HOME is the workers', expanded by their shell
REMOTE_DIR='$HOME/passrate-jax'
# shellcheck disable=SC2016
VENV='$HOME/passrate-venv'

# Install: unpack the tarball, make a venv with a uv-managed Python (the TPU VM images' system Python is
# older than the package needs), then JAX's TPU build and this package. The check only imports: touching
# the TPUs before jax.distributed.initialize would make the workers wait for each other.
INSTALL="set -euo pipefail; mkdir -p $REMOTE_DIR && tar -xzf \$HOME/passrate-jax.tar.gz -C $REMOTE_DIR && cd $REMOTE_DIR"
INSTALL+=" && (command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh)"
INSTALL+=" && export PATH=\$HOME/.local/bin:\$PATH && uv venv --seed --allow-existing --python $PYVER $VENV"
INSTALL+=" && $VENV/bin/pip install --quiet --upgrade 'jax[tpu]' gcsfs google-cloud-storage && $VENV/bin/pip install --quiet -e ."
INSTALL+=" && $VENV/bin/python -c 'import jax, passrate_jax; print(\"jax\", jax.__version__)'"

SETUP_CMDS=()
[[ -n "$FETCH" ]] && SETUP_CMDS+=("bash launch/fetch_assets.sh $FETCH")
SETUP_CMDS+=("${SETUP[@]+"${SETUP[@]}"}")

# Train: every worker runs the same command; each keeps its own log in ~/passrate-train.log and prefixes
# the streamed lines with its hostname.
TRAIN_ARGS="--config $(shq "$CONFIG") --run-dir $(shq "$RUN_DIR") distributed.initialize=true"
for kv in "${OVERRIDES[@]+"${OVERRIDES[@]}"}"; do TRAIN_ARGS+=" $(shq "$kv")"; done
TRAIN="set -o pipefail; cd $REMOTE_DIR && $VENV/bin/passrate-jax train $TRAIN_ARGS 2>&1"
TRAIN+=" | tee -a \$HOME/passrate-train.log | sed -u \"s/^/[\$(hostname)] /\""

CREATED=0
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [[ $CREATED == 1 && $KEEP == 0 ]]; then
    [[ $rc != 0 && $DRY_RUN == 0 ]] && echo "tpu_pod.sh: exit status $rc; deleting $NAME" >&2
    run "${GC[@]}" delete "$NAME" "${WHERE[@]}" --quiet || echo "tpu_pod.sh: delete failed; run it by hand" >&2
  elif [[ $CREATED == 1 && $DRY_RUN == 0 ]]; then
    echo "tpu_pod.sh: kept $NAME; delete it with: ${GC[*]} delete $NAME ${WHERE[*]} --quiet" >&2
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [[ $DRY_RUN == 0 ]]; then
  command -v gcloud >/dev/null || die "gcloud is not installed (https://cloud.google.com/sdk/docs/install)"
  if [[ -n "$(git -C "$REPO" status --porcelain --untracked-files=no 2>/dev/null)" && "$REF" == HEAD ]]; then
    echo "tpu_pod.sh: warning: uncommitted changes are not shipped (git archive $REF)" >&2
  fi
fi

run git -C "$REPO" archive --format=tar.gz -o "$TARBALL" "$REF"
if [[ $REUSE == 0 ]]; then
  CREATE=("${GC[@]}" create "$NAME" "${WHERE[@]}" --accelerator-type="$ACCEL" --version="$VERSION")
  [[ $SPOT == 1 ]] && CREATE+=(--spot)
  run "${CREATE[@]}"
fi
CREATED=1  # from here on a failure deletes the slice (unless --keep); a failed create leaves nothing to delete
run "${GC[@]}" scp "$TARBALL" "$NAME:~/passrate-jax.tar.gz" --worker=all "${WHERE[@]}"
run "${GC[@]}" ssh "$NAME" --worker=all "${WHERE[@]}" --command="$INSTALL"
for cmd in "${SETUP_CMDS[@]+"${SETUP_CMDS[@]}"}"; do
  run "${GC[@]}" ssh "$NAME" --worker=all "${WHERE[@]}" \
    --command="set -euo pipefail; cd $REMOTE_DIR && export PATH=$VENV/bin:\$PATH && $cmd"
done
run "${GC[@]}" ssh "$NAME" --worker=all "${WHERE[@]}" --command="$TRAIN"
