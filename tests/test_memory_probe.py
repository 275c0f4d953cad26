"""launch/memory_probe.py on fake CPU devices: one JSON object, and the resident state really split."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_probe_json_shows_parameters_and_adamw_split_over_fsdp():
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    args = ["--config", "configs/default.yaml", "--json", "--prompt-tokens", "32", "mesh.data=1", "mesh.fsdp=4",
            "mesh.devices=4", "model.vocab_size=256", "model.hidden_size=128", "model.intermediate_size=256",
            "model.remat=full"]
    proc = subprocess.run([sys.executable, "launch/memory_probe.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["devices"] == 4 and out["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert out["peak_bytes_per_device"] == max(out["program_bytes_per_device"].values()) > 0
    # Parameters + AdamW moments that XLA holds per device are about a quarter of the model's (the
    # norm scales and scalar optimizer state stay replicated).
    analytic = out["analytic_bytes_per_device"]
    resident = analytic["parameters"] + analytic["adamw"]
    assert abs(out["xla_bytes_per_device"]["state"] - resident) < 0.1 * resident
    assert resident * 4 == 12 * out["parameters"]
