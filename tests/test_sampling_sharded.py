"""Sampler on 8 fake CPU devices: same tokens as on 1 device (prefix store, live rows, unrolled layers).

The device count is fixed when jax initialises, so the comparison runs in a subprocess started with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
"""

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import jax, numpy as np
from passrate_jax.run.config import MeshConfig
from passrate_jax.sampling import Context, Sampler
from passrate_jax.sharding import make_mesh
from test_sampling import CONTEXTS, EOS, GREEDY, SAMPLE, tiny_model

assert len(jax.devices()) == 8, jax.devices()
model = tiny_model()
meshes = {"1": make_mesh(MeshConfig(), jax.devices()[:1]), "data8": make_mesh(MeshConfig()),
          "2x2x2": make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))}
out = {}
for name, mesh in meshes.items():
    sampler = Sampler(model, GREEDY, eos_id=EOS, mesh=mesh)
    greedy = sampler.generate(CONTEXTS)
    row = {"greedy": greedy.tokens.tolist(), "greedy_lp": greedy.policy_logprobs.tolist(),
           "row_shards": sampler.row_shards,
           "param_spec": list(sampler.params["layers"]["mlp"]["up"].get_value().sharding.spec)}
    # a step's store over two calls, then one live turn: rows and stored contexts split over the mesh
    store = sampler.kv_store()
    sampler.generate(CONTEXTS[:2], store=store)
    stored, live = sampler.generate_live(CONTEXTS, live_len=40, store=store)
    nxt = [Context(live.tokens[p] + (5, 6, 7), context_id=p, max_new_tokens=4) for p in (0, 2, 5)]
    turn, _ = sampler.extend_live(live, [0, 2, 5], nxt)
    row.update(stored=stored.tokens.tolist(), turn=turn.tokens.tolist())
    if name != "2x2x2":  # sampled tokens on the pure data-parallel mesh too
        sampled = sampler.generate(CONTEXTS, cfg=SAMPLE, seed=9)
        row.update(sampled=sampled.tokens.tolist(), sampled_lp=sampled.logprobs.tolist())
    out[name] = row
# unrolled layers (KVCache.decode_form, layer weights sliced before the loop) on the split mesh
sampler = Sampler(tiny_model(scan_layers=False), GREEDY, eos_id=EOS, mesh=meshes["2x2x2"])
greedy = sampler.generate(CONTEXTS)
_, live = sampler.generate_live(CONTEXTS, live_len=40, store=sampler.kv_store())
nxt = [Context(live.tokens[p] + (5, 6, 7), context_id=p, max_new_tokens=4) for p in (0, 2, 5)]
out["2x2x2 unrolled"] = {"greedy": greedy.tokens.tolist(), "greedy_lp": greedy.policy_logprobs.tolist(),
                         "turn": sampler.extend_live(live, [0, 2, 5], nxt)[0].tokens.tolist()}
print("RESULT" + json.dumps(out))
"""


def test_eight_fake_devices_match_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, tests_dir], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    one = out["1"]
    assert out["data8"]["row_shards"] == 8 and out["2x2x2"]["row_shards"] == 4 and one["row_shards"] == 1
    assert out["2x2x2"]["param_spec"] == [None, "fsdp", "tensor"]  # the parameters really are split
    for name in ("data8", "2x2x2", "2x2x2 unrolled"):
        assert out[name]["greedy"] == one["greedy"] and out[name]["turn"] == one["turn"], name
        assert out[name].get("stored", one["greedy"]) == one["stored"] == one["greedy"], name
        assert max(abs(a - b) for ra, rb in zip(out[name]["greedy_lp"], one["greedy_lp"])
                   for a, b in zip(ra, rb)) < 1e-5
    assert out["data8"]["sampled"] == one["sampled"]
    assert max(abs(a - b) for ra, rb in zip(out["data8"]["sampled_lp"], one["sampled_lp"])
               for a, b in zip(ra, rb)) < 1e-5
