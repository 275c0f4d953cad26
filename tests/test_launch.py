"""launch/: the TPU pod and local GPU scripts print complete, correctly quoted command sequences under
--dry-run and reject bad arguments naming the value; the Qwen3 presets load, their meshes match the
machines they name, and the memory arithmetic in their headers matches the model shapes they state."""

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from passrate_jax.run.config import load_config

ROOT = pathlib.Path(__file__).parent.parent
CONFIGS = ROOT / "configs"

# Preset -> (the machine its header names, JAX devices of that machine, multi-host).
# v5litepod-N counts chips (one JAX device each); v5p-N counts TensorCores, 2 per chip (one JAX device).
MACHINE_PRESETS = {
    "qwen3_0p6b_gpu.yaml": ("one GPU", 1, False),
    "qwen3_1p7b_tpu_v5e.yaml": ("v5litepod-16", 16, True),
    "qwen3_8b_tpu_v5p.yaml": ("v5p-32", 16, True),
}

POD = ["--name", "rl-test", "--zone", "us-west4-a", "--accelerator-type", "v5litepod-16",
       "--config", "configs/qwen3_1p7b_tpu_v5e.yaml", "--run-dir", "gs://my-bucket/runs/q17"]


def script(name: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "launch" / name), *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHON": sys.executable, **(env or {})}, timeout=120)


def commands(out: str) -> list[list[str]]:
    """The printed command lines, split as the shell would."""
    return [shlex.split(line) for line in out.splitlines() if line.strip()]


def option(argv: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in argv if a.startswith(name + "="))


# ------------------------------------------------------------------ tpu_pod.sh


def test_tpu_pod_dry_run_prints_the_whole_sequence_in_order():
    overrides = ["steps=5", "data.system_prompt=You're a 'careful' solver"]
    res = script("tpu_pod.sh", *POD, "--project", "my-project-1", "--fetch", "Qwen/Qwen3-1.7B", *overrides,
                 "--dry-run")
    assert res.returncode == 0, res.stderr
    cmds = commands(res.stdout)
    gcloud = [c for c in cmds if c[0] == "gcloud"]
    verbs = [c[4] for c in gcloud]
    assert verbs == ["create", "scp", "ssh", "ssh", "ssh", "delete"], res.stdout

    archive = cmds[0]
    assert archive[:2] == ["git", "-C"] and "archive" in archive and archive[-1] == "HEAD"
    tarball = archive[archive.index("-o") + 1]

    create, scp, install, fetch, train, delete = gcloud
    assert create[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "rl-test"]
    assert option(create, "--accelerator-type") == "v5litepod-16"
    assert option(create, "--version") == "v2-alpha-tpuv5-lite"
    for c in gcloud:
        assert option(c, "--zone") == "us-west4-a" and option(c, "--project") == "my-project-1"
    assert scp[5:7] == [tarball, "rl-test:~/passrate-jax.tar.gz"] and "--worker=all" in scp
    for c in (install, fetch, train):
        assert c[4:6] == ["ssh", "rl-test"] and "--worker=all" in c
    remote_install = option(install, "--command")
    assert "tar -xzf $HOME/passrate-jax.tar.gz" in remote_install
    assert "pip install --quiet --upgrade 'jax[tpu]'" in remote_install
    assert remote_install.index("'jax[tpu]'") < remote_install.index("pip install --quiet -e .")
    assert "bash launch/fetch_assets.sh Qwen/Qwen3-1.7B" in option(fetch, "--command")

    remote_train = option(train, "--command")
    assert "| tee -a $HOME/passrate-train.log" in remote_train
    # The remote command line, split as the workers' shell will split it.
    argv = shlex.split(remote_train.split("passrate-jax train", 1)[1].split("2>&1")[0])
    assert argv == ["--config", "configs/qwen3_1p7b_tpu_v5e.yaml", "--run-dir", "gs://my-bucket/runs/q17",
                    "distributed.initialize=true", *overrides]
    assert delete[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "rl-test"] and "--quiet" in delete


def test_tpu_pod_dry_run_needs_no_gcloud_and_options_change_the_sequence():
    no_gcloud = {"PATH": "/usr/bin:/bin"}  # gcloud is never looked up under --dry-run
    res = script("tpu_pod.sh", *POD, "--keep", "--spot", "--dry-run", env=no_gcloud)
    assert res.returncode == 0, res.stderr
    verbs = [c[4] for c in commands(res.stdout) if c[0] == "gcloud"]
    assert verbs == ["create", "scp", "ssh", "ssh"]  # --keep: no delete
    assert "--spot" in commands(res.stdout)[1]
    assert not any(option(c, "--zone") != "us-west4-a" for c in commands(res.stdout) if c[0] == "gcloud")

    res = script("tpu_pod.sh", *POD, "--reuse", "--dry-run")
    assert [c[4] for c in commands(res.stdout) if c[0] == "gcloud"] == ["scp", "ssh", "ssh", "delete"]

    v5p = ["--name", "rl-8b", "--zone", "us-east5-a", "--accelerator-type", "v5p-32",
           "--config", "configs/qwen3_8b_tpu_v5p.yaml", "--run-dir", "gs://b/r8", "--dry-run"]
    res = script("tpu_pod.sh", *v5p)
    assert res.returncode == 0, res.stderr
    create = next(c for c in commands(res.stdout) if c[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "create"])
    assert option(create, "--version") == "v2-alpha-tpuv5"
    assert not any(a.startswith("--project") for a in create)


@pytest.mark.parametrize("change, fragments", [
    ({"--accelerator-type": "v5e-16"}, ["'v5e-16'", "v5litepod-N"]),
    ({"--accelerator-type": "v5p-31"}, ["'v5p-31'", "TensorCores"]),
    ({"--name": "My_TPU"}, ["--name 'My_TPU'", "lowercase"]),
    ({"--zone": "us-west4"}, ["--zone 'us-west4'"]),
    ({"--project": "X"}, ["--project 'X'"]),
    ({"--config": "configs/nope.yaml"}, ["'configs/nope.yaml'", "no such file"]),
    ({"--run-dir": None}, ["--run-dir is required"]),
    # The preset is laid out for 16 devices; a v5litepod-32 has 32.
    ({"--accelerator-type": "v5litepod-32"}, ["mesh.devices = 16", "v5litepod-32 has 32 JAX devices"]),
    ({"--accelerator-type": "v5p-64"}, ["mesh.devices = 16", "v5p-64 has 32 JAX devices"]),
])
def test_tpu_pod_bad_arguments_fail_naming_the_value(change, fragments):
    args = list(POD)
    for flag, value in change.items():
        i = args.index(flag) if flag in args else len(args)
        args[i:i + 2] = [] if value is None else [flag, value]
    res = script("tpu_pod.sh", *args, "--dry-run")
    assert res.returncode == 2 and res.stdout == ""
    for fragment in fragments:
        assert fragment in res.stderr


def test_tpu_pod_bad_overrides_fail_before_any_command():
    res = script("tpu_pod.sh", *POD, "steps", "--dry-run")
    assert res.returncode == 2 and "'steps' is not a key=value config override" in res.stderr
    res = script("tpu_pod.sh", *POD, "allocation.method=sra", "--dry-run")
    assert res.returncode == 2 and "allocation.method = 'sra'" in res.stderr and res.stdout == ""
    res = script("tpu_pod.sh", *POD, "--bogus", "--dry-run")
    assert res.returncode == 2 and "unknown option '--bogus'" in res.stderr


def test_tpu_pod_without_the_package_here_notes_it_and_prints_the_sequence(tmp_path):
    """A laptop whose Python lacks the package (here: no site-packages, nor the checkout on the path) still
    prints the sequence, with a note that the preset is checked on the workers; so does one without Python."""
    bare = tmp_path / "python"
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "$@"\n')
    bare.chmod(0o755)
    for python in (str(bare), str(tmp_path / "missing")):
        res = script("tpu_pod.sh", *POD, "--dry-run", env={"PYTHON": python})
        assert res.returncode == 0, res.stderr
        assert "the preset is checked on the workers only" in res.stderr
        assert [c[4] for c in commands(res.stdout) if c[0] == "gcloud"] == ["create", "scp", "ssh", "ssh", "delete"]


# ------------------------------------------------------------------ local_gpu.sh


def test_local_gpu_dry_run():
    res = script("local_gpu.sh", "--config", "configs/qwen3_0p6b_gpu.yaml", "--install", "--fetch", "Qwen/Qwen3-0.6B",
                 "--gpus", "0", "steps=3", "--dry-run")
    assert res.returncode == 0, res.stderr
    cmds = commands(res.stdout)
    pip = [c for c in cmds if c[0].endswith("/pip")]
    assert [c[1:] for c in pip] == [["install", "--upgrade", "pip"], ["install", "--upgrade", "jax[cuda12]"],
                                    ["install", "-e", "."]]
    assert any(c[0] == "nvidia-smi" for c in cmds)
    assert any(c[-2:] == ["launch/fetch_assets.sh", "Qwen/Qwen3-0.6B"] for c in cmds)
    train = cmds[-1]
    assert train[0] == "env" and "XLA_PYTHON_CLIENT_MEM_FRACTION=0.90" in train and "CUDA_VISIBLE_DEVICES=0" in train
    i = next(i for i, a in enumerate(train) if a.endswith("/passrate-jax"))
    assert train[i + 1:] == ["train", "--config", "configs/qwen3_0p6b_gpu.yaml", "--run-dir", "runs/qwen3_0p6b_gpu",
                             "steps=3"]


def test_local_gpu_multi_node_sets_the_distributed_section():
    res = script("local_gpu.sh", "--config", "configs/qwen3_0p6b_gpu.yaml", "--coordinator", "10.0.0.2:1234",
                 "--num-nodes", "2", "--node-rank", "1", "mesh.devices=0", "--dry-run")
    assert res.returncode == 0, res.stderr
    train = commands(res.stdout)[-1]
    for kv in ("distributed.initialize=true", "distributed.coordinator_address=10.0.0.2:1234",
               "distributed.num_processes=2", "distributed.process_id=1"):
        assert kv in train
    cfg = load_config(CONFIGS / "qwen3_0p6b_gpu.yaml", train[train.index("runs/qwen3_0p6b_gpu") + 1:])
    assert cfg.distributed.process_id == 1 and cfg.distributed.num_processes == 2


@pytest.mark.parametrize("args, fragment", [
    (["--node-rank", "2", "--num-nodes", "2", "--coordinator", "h:1"], "--node-rank '2'"),
    (["--coordinator", "h:1"], "needs all of --coordinator, --num-nodes and --node-rank"),
    (["--coordinator", "nohost", "--num-nodes", "2", "--node-rank", "0"], "--coordinator 'nohost'"),
    (["--mem-fraction", "1.5"], "--mem-fraction '1.5'"),
    (["--cuda", "11"], "--cuda '11'"),
    (["--gpus", "a,b"], "--gpus 'a,b'"),
    (["notkv"], "'notkv' is not a key=value config override"),
    (["allocation.group_size=1"], "allocation.group_size = 1"),
])
def test_local_gpu_bad_arguments_fail_naming_the_value(args, fragment):
    res = script("local_gpu.sh", "--config", "configs/qwen3_0p6b_gpu.yaml", *args, "--dry-run")
    assert res.returncode == 2 and fragment in res.stderr


def test_fetch_assets_dry_run_and_conversion(tmp_path):
    res = script("fetch_assets.sh", "Qwen/Qwen3-8B", "--dry-run")
    assert res.returncode == 0, res.stderr
    cmds = commands(res.stdout)
    assert cmds[0][1:5] == ["download", "Qwen/Qwen3-8B", "--local-dir", "checkpoints/Qwen3-8B"]
    assert cmds[1][1:4] == ["download", "openai/gsm8k", "--repo-type"]
    # The parquet -> JSONL step, run on a two-row stand-in for the downloaded GSM8K files.
    import pyarrow as pa
    import pyarrow.parquet as pq
    main = tmp_path / "data" / "gsm8k" / "hf" / "main"
    main.mkdir(parents=True)
    for split in ("train", "test"):
        pq.write_table(pa.table({"question": ["1+1?", "2+2?"], "answer": ["so #### 2", "so #### 4"]}),
                       main / f"{split}-00000-of-00001.parquet")
    assert cmds[2][1:] == ["launch/gsm8k_jsonl.py", "data/gsm8k/hf/main", "data/gsm8k"]
    subprocess.run([sys.executable, str(ROOT / cmds[2][1]), *cmds[2][2:]], cwd=tmp_path, check=True,
                   capture_output=True)
    data = tmp_path / "data" / "gsm8k"
    cfg = load_config(CONFIGS / "qwen3_gsm8k.yaml", [f"data.path={data}/train.jsonl", f"data.eval_path={data}/test.jsonl"])
    from passrate_jax.data.configured import make_source
    source = make_source(cfg.data)
    assert sorted((r.prompt, r.answer) for r in source.take(2)) == [("1+1?", "2"), ("2+2?", "4")]
    assert script("fetch_assets.sh", "not-a-model").returncode == 2


# ------------------------------------------------------------------ presets


def resolved_mesh(mesh) -> tuple[int, int, int]:
    sizes = [mesh.data, mesh.fsdp, mesh.tensor]
    if -1 in sizes:
        known = 1
        for s in sizes:
            known *= s if s != -1 else 1
        sizes[sizes.index(-1)] = mesh.devices // known
    return tuple(sizes)


def header(path: pathlib.Path) -> str:
    lines = path.read_text().splitlines()
    return "\n".join(line for line in lines[: next(i for i, l in enumerate(lines) if not l.startswith("#"))])


def analytic_parameters(m) -> int:
    d, f, e = m.hidden_size, m.intermediate_size, m.resolved_head_dim
    attn = d * m.num_heads * e * 2 + d * m.num_kv_heads * e * 2 + (2 * e if m.qk_norm else 0)
    per_layer = attn + 3 * d * f + 2 * d
    return m.vocab_size * d * (1 if m.tie_embeddings else 2) + m.num_layers * per_layer + d


def number(text: str, label: str) -> float:
    match = re.search(rf"{label}\s*:?\s*([0-9][0-9,]*(?:\.[0-9]+)?)", text)
    assert match, f"no '{label}' figure in the header"
    return float(match.group(1).replace(",", ""))


@pytest.mark.parametrize("name", sorted(MACHINE_PRESETS))
def test_machine_presets_load_and_their_mesh_matches_the_machine(name):
    machine, devices, multi_host = MACHINE_PRESETS[name]
    path = CONFIGS / name
    cfg = load_config(path)
    assert machine in header(path)
    sizes = resolved_mesh(cfg.mesh)
    assert sizes[0] * sizes[1] * sizes[2] == cfg.mesh.devices == devices
    assert cfg.distributed.initialize is multi_host
    assert cfg.model.dtype == "bfloat16" and cfg.model.param_dtype == "float32"
    assert (cfg.allocation.method, cfg.allocation.selection.method, cfg.prefix_sampling.enabled) == ("sara", "dps", True)
    # The update batch splits into whole micro-batches over the data-parallel devices (train.py's rule).
    rows = cfg.allocation.num_prompts * cfg.allocation.group_size
    assert rows % (sizes[0] * sizes[1] * cfg.rl.minibatches * cfg.rl.grad_accum) == 0
    # Tensor parallelism needs the heads, kv heads, MLP and vocabulary to split evenly.
    m = cfg.model
    for dim in (m.num_heads, m.num_kv_heads, m.intermediate_size, m.vocab_size):
        assert dim % sizes[2] == 0
    if multi_host:  # the pod script accepts the preset for the slice its header names
        res = script("tpu_pod.sh", "--name", "t", "--zone", "us-east5-a", "--accelerator-type", machine,
                     "--config", f"configs/{name}", "--run-dir", "gs://b/r", "--dry-run")
        assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("name", sorted(MACHINE_PRESETS))
def test_memory_arithmetic_in_the_header_matches_the_model(name):
    from passrate_jax.cli.info import parameter_count
    path = CONFIGS / name
    cfg = load_config(path, ["model.pretrained=null"])
    text = header(path)
    counted = parameter_count(cfg.model)
    assert counted == analytic_parameters(cfg.model)
    assert abs(number(text, "parameters") - counted) <= 0.05 * counted
    m = cfg.model
    kv_per_token = 2 * m.num_layers * m.num_kv_heads * m.resolved_head_dim * 2  # bfloat16
    assert number(text, "KV cache per token") == kv_per_token
    sizes = resolved_mesh(cfg.mesh)
    shards = sizes[1] * sizes[2]
    # Parameters and the two AdamW moments, float32, per device.
    assert abs(number(text, "parameters \\+ AdamW per device") * 1e9 - 12 * counted / shards) <= 0.05 * 12 * counted / shards
    hbm = number(text, "HBM per device")
    peak = number(text, "peak per device")
    assert peak < hbm
