#!/usr/bin/env bash
# Every accelerator measurement in one call of the device tool (docs/performance_device.md):
#   run(command="bash benchmarks/device.sh", timeout_s=540)
# Extra arguments go to benchmarks/device.py (e.g. --only sampler_rounds --budget 200, or --cpu here).
# Writes device.json, device.txt, device.log and nvidia_smi.txt under $OUT (default /tmp/device_out).
set -o pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/device_out}"
mkdir -p "$out"
# What the card is and how it is clocked before the run (read only: the card's settings stay as found).
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.max.sm,power.draw,temperature.gpu \
  --format=csv >"$out/nvidia_smi.txt" 2>&1 || echo "no nvidia-smi" >"$out/nvidia_smi.txt"
# JAX takes 75% of the card by default; the measurements run one at a time in this one process.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"${PYTHON:-python3}" benchmarks/device.py --out "$out" "$@" 2>&1 | tee "$out/device.log"
