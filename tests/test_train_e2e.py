"""End-to-end training runs on a tiny model: every allocation method with Prefix Sampling on and off,
(SIGKILL, Ctrl-C and resume: test_kill_resume.py), compile counts, bad config before compute.

The verifier is replaced by a deterministic pseudo-random one (a hash of the response) so that groups
are mixed and every path (abandon, confirm, pilot buffer, PS replay, update) runs on a model too
small to solve anything; the real verifiers are tested in test_tasks.py and test_data_*.py.
"""

import copy
import hashlib
import json
import os

import numpy as np
import pytest

from passrate_jax.run.config import load_config
from passrate_jax.run.metrics import read_jsonl
from passrate_jax.run.session import Session
from passrate_jax.run.train import NONDETERMINISTIC_METRICS, train

TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1", "model.num_heads=2",
        "model.num_kv_heads=1", "model.max_position_embeddings=128", "warm_start.enabled=false",
        "data.train_size=64", "data.eval_size=4", "data.level=1", "sampling.max_new_tokens=12",
        "sampling.row_buckets=[32]", "sampling.prefill_row_buckets=[16]", "sampling.context_buckets=[16]",
        "sampling.generation_buckets=[16]", "allocation.num_prompts=2", "allocation.group_size=4",
        "logging.tensorboard=false", "logging.progress_bar=false", "eval_every=2", "checkpoint.async_save=false"]


def hash_reward(records, texts):
    """1 for about half of all responses, decided by prompt and text alone (deterministic across processes)."""
    return np.asarray([hashlib.blake2b(f"{r.prompt}|{t}".encode(), digest_size=1).digest()[0] % 2
                       for r, t in zip(records, texts)], np.float32)


@pytest.fixture
def fake_verifier(monkeypatch):
    monkeypatch.setattr(Session, "score", lambda self, records, texts: hash_reward(records, texts))


@pytest.mark.parametrize("method, ps, selection", [
    ("uniform", False, "none"), ("uniform", True, "mopps"), ("ds", False, "none"), ("ds", True, "dps"),
    ("sara", False, "dps"), ("sara", True, "none"), ("pilot_commit", False, "mopps"), ("pilot_commit", True, "none"),
])
def test_every_method_trains(tmp_path, fake_verifier, method, ps, selection):
    # Pilot-Commit's pilot is a quarter of the group: 2 rollouts at N = 8 can land in the pilot band.
    size = ["allocation.group_size=8"] if method == "pilot_commit" else []
    cfg = load_config(None, TINY + size + ["steps=3", f"allocation.method={method}", f"prefix_sampling.enabled={ps}",
                                           f"allocation.selection.method={selection}"])
    summary = train(cfg, str(tmp_path), progress=False, log=lambda *a: None)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]  # step 0: the evaluation before training
    records = records[1:]
    assert all(r["rollouts_step"] > 0 for r in records)
    assert records[-1]["rollouts_total"] == sum(r["rollouts_step"] for r in records)
    assert "eval_accuracy" in records[1] and "eval_accuracy" in records[2]
    trained = [r for r in records if r["groups_trained"] > 0]
    assert trained, "no step trained on any group"
    assert all(np.isfinite(r["update/loss"]) for r in trained)
    assert all(0 <= r["useful_rollout_fraction"] <= 1 for r in records)
    if ps:
        assert "ps/ratio/1" in records[0]
    # Each distinct context's KV is computed once per step, however many rounds sample from it.
    assert all(r["prefill_tokens"] == r["context_tokens"] <= r["unshared_prefill_tokens"] for r in records)
    if method == "sara":  # its later rounds continue the same contexts: prefilling each round would cost more
        assert any(r["unshared_prefill_tokens"] > r["prefill_tokens"] for r in records)
    # Compilation counts do not grow once every bucket has been seen.
    assert records[-1]["compilations/update"] <= 2
    assert summary["step"] == 3


def test_prefix_sampling_trains_only_the_continuation(tmp_path, fake_verifier, monkeypatch):
    """On the update's real batch (what the jitted step receives), every row of a Prefix Sampling
    re-rollout group holds prompt + replayed prefix + its continuation; the prompt and the replayed
    prefix carry no loss, the continuation does; and each group's advantages are GRPO's over its own
    rewards only (checked against NumPy), so a replay group is its own group, not its source's."""
    from passrate_jax.run import train as train_module
    seen, batches = [], []
    updater_call, make_batch = train_module.Updater.__call__, train_module.make_train_batch

    def spy_update(self, state, groups, step):
        # The trained groups' trajectories as the update reads them (the backend frees groups after it).
        kept = self.backend.store.groups
        seen.append([(self.backend.prompt_ids(kept[g.group_key].prompt), copy.deepcopy(kept[g.group_key]),
                      len(g.rewards)) for g in groups])
        return updater_call(self, state, groups, step)

    def spy_batch(*args, **kwargs):
        batches.append(make_batch(*args, **kwargs))
        return batches[-1]

    monkeypatch.setattr(train_module.Updater, "__call__", spy_update)
    monkeypatch.setattr(train_module, "make_train_batch", spy_batch)
    cfg = load_config(None, TINY + ["steps=4", "allocation.method=uniform", "prefix_sampling.enabled=true",
                                    "allocation.num_prompts=4"])
    train(cfg, str(tmp_path), progress=False, log=lambda *a: None)
    records = read_jsonl(tmp_path / "metrics.jsonl")[1:]
    assert sum(r["replay_groups"] for r in records) > 0 and len(seen) == len(batches) > 0
    replayed_rows = 0
    for groups, batch in zip(seen, batches):
        tokens, mask, adv = (np.asarray(x) for x in (batch.tokens, batch.loss_mask, batch.advantages))
        row = 0
        for prompt, group, size in groups:
            context = list(prompt) + group.prefix
            rewards = np.array([group.scores()[i] for i in range(size)], np.float64)
            std = rewards.std(ddof=1)
            want_adv = np.zeros(size) if std == 0 else (rewards - rewards.mean()) / (std + cfg.rl.advantage_eps)
            np.testing.assert_allclose(adv[row:row + size], want_adv, rtol=1e-5, atol=1e-6)
            for i in range(size):
                completion = group.trajectories[i]
                assert tokens[row, :len(context) + len(completion)].tolist() == context + completion
                assert mask[row].tolist() == ([0] * len(context) + [1] * len(completion)
                                              + [0] * (mask.shape[1] - len(context) - len(completion)))
                replayed_rows += bool(group.prefix)
                row += 1
        assert not mask[row:].any() and not adv[row:].any()  # padding rows
    assert replayed_rows > 0  # re-rollout groups were trained, with their prefix masked


def _comparable(records):
    return [{k: v for k, v in r.items() if k not in NONDETERMINISTIC_METRICS} for r in records]


def test_bad_config_fails_before_compute(tmp_path, capsys):
    from passrate_jax.cli.main import main
    assert main(["train", "--run-dir", str(tmp_path), "allocation.method=sarah"]) == 2
    assert "did you mean 'sara'" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_eval_cli_reproduces_final_eval(tmp_path, fake_verifier, capsys):
    """``passrate-jax eval`` on a finished run restores its last parameters: greedy held-out accuracy
    and the mean accuracy of sampled answers (here under the fake verifier) equal the run's own final
    evaluation."""
    from passrate_jax.cli.main import main
    cfg = load_config(None, TINY + ["steps=2", "allocation.method=uniform", "data.eval_size=8", "eval_samples=2"])
    train(cfg, str(tmp_path), progress=False, log=lambda *a: None)
    final = read_jsonl(tmp_path / "metrics.jsonl")[-1]
    capsys.readouterr()
    assert main(["eval", "--run-dir", str(tmp_path), "--num-samples", "2", "--k", "1,2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["step"] == 2 and result["heldout_prompts"] == 8
    assert result["accuracy"] == final["eval_accuracy"] and 0 < result["accuracy"] < 1
    assert 0 <= result["pass@1"] <= result["pass@2"] <= 1
    assert result["sampled_accuracy"] == result["pass@1"] == final["eval_sampled_accuracy"]
    assert result["sampled_accuracy_se"] == final["eval_sampled_accuracy_se"] > 0
    levels = {k.split("/")[-1] for k in final if k.startswith("eval_sampled_accuracy/level_")}
    assert levels and levels == {k.split("/")[-1] for k in final if k.startswith("eval_accuracy/level_")}


def test_eval_greedy_ends_skips_greedy_between_the_ends_and_changes_nothing_else(tmp_path, fake_verifier):
    """``eval_greedy=ends``: greedy accuracy at steps 0 and the last only; the sampled evaluation (its own
    seed) and training are the same as with greedy answers at every evaluation."""
    base = TINY + ["steps=4", "allocation.method=uniform", "data.eval_size=8", "eval_samples=2"]
    runs = {}
    for mode in ("every", "ends"):
        train(load_config(None, base + [f"eval_greedy={mode}"]), str(tmp_path / mode), progress=False,
              log=lambda *a: None)
        runs[mode] = {r["step"]: r for r in read_jsonl(tmp_path / mode / "metrics.jsonl")}
    every, ends = runs["every"], runs["ends"]
    assert sorted(every) == sorted(ends) == [0, 1, 2, 3, 4]
    assert all("eval_accuracy" in every[s] for s in (0, 2, 4))
    assert "eval_accuracy" in ends[0] and "eval_accuracy" in ends[4] and "eval_accuracy" not in ends[2]
    assert not any(k.startswith("eval_accuracy/") for k in ends[2])
    for s in (0, 2, 4):
        assert ends[s]["eval_sampled_accuracy"] == every[s]["eval_sampled_accuracy"]
        assert ends[s]["eval_sampled_accuracy_se"] == every[s]["eval_sampled_accuracy_se"]
    assert [ends[s]["update/loss"] for s in (1, 2, 3, 4)] == [every[s]["update/loss"] for s in (1, 2, 3, 4)]
    assert ends[4]["eval_accuracy"] == every[4]["eval_accuracy"]


def test_eval_vs_warm_start_pairs_the_starting_point_with_the_checkpoint(tmp_path, fake_verifier, capsys):
    """``eval --vs-warm-start`` re-evaluates the run's cached warm start: its greedy accuracy is the run's
    own step-0 evaluation, and the paired difference adds up."""
    from passrate_jax.cli.main import main
    cfg = load_config(None, TINY + ["steps=2", "allocation.method=uniform", "data.eval_size=16",
                                    "warm_start.enabled=true", "warm_start.steps=3", "warm_start.batch_size=4",
                                    "warm_start.max_len=96", f"warm_start.cache_dir={tmp_path / 'cache'}"])
    train(cfg, str(tmp_path / "run"), progress=False, log=lambda *a: None)
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    capsys.readouterr()
    assert main(["eval", "--run-dir", str(tmp_path / "run"), "--num-samples", "2", "--k", "1",
                 "--vs-warm-start", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    start, diff = result["warm_start"], result["warm_start"]["difference"]
    assert start["accuracy"] == records[0]["eval_accuracy"] and result["accuracy"] == records[-1]["eval_accuracy"]
    assert diff["accuracy"] == pytest.approx(result["accuracy"] - start["accuracy"])
    assert diff["fixed"] - diff["broken"] == round(16 * diff["accuracy"]) and 0 <= diff["mcnemar_p"] <= 1
    assert diff["sampled_accuracy"] == pytest.approx(result["sampled_accuracy"] - start["sampled_accuracy"])
    assert main(["eval", "--run-dir", str(tmp_path / "run"), "--num-samples", "2", "--k", "1",
                 "--vs-warm-start"]) == 0
    assert "prompts fixed" in capsys.readouterr().out


def test_non_finite_update_is_skipped_and_reported(tmp_path, fake_verifier, monkeypatch):
    """A batch whose loss is NaN leaves the parameters unchanged and is counted in the metrics."""
    import jax.numpy as jnp

    import passrate_jax.run.train as train_mod
    real = train_mod.make_train_batch

    def poisoned(*args, **kwargs):
        batch = real(*args, **kwargs)
        return batch.replace(advantages=jnp.full_like(batch.advantages, jnp.nan))
    monkeypatch.setattr(train_mod, "make_train_batch", poisoned)
    messages = []
    cfg = load_config(None, TINY + ["steps=2", "allocation.method=uniform"])
    summary = train(cfg, str(tmp_path), progress=False, log=messages.append)
    records = read_jsonl(tmp_path / "metrics.jsonl")[1:]
    trained = [r for r in records if r["groups_trained"] > 0]
    assert trained and all(r["update/skipped_steps"] == 1 for r in trained)
    assert records[-1]["update/total_skipped_steps"] == len(trained)
    assert any("update skipped" in m for m in messages)
    # Nothing was applied: the parameters are still the initial ones, bit for bit.
    import jax
    from flax import nnx

    from passrate_jax.model import create_model
    initial = nnx.state(create_model(cfg.model, seed=cfg.seed))
    assert summary["step"] == 2
    for a, b in zip(jax.tree.leaves(initial), jax.tree.leaves(summary["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_kl_to_the_starting_policy(tmp_path, fake_verifier):
    """With rl.kl_coef > 0 the update sees reference log-probs of the starting parameters: the KL is 0
    before the first update and positive once the policy has moved; the reference is checkpointed."""
    cfg = load_config(None, TINY + ["steps=3", "allocation.method=uniform", "rl.kl_coef=0.1",
                                    "optimizer.learning_rate=1e-2", "optimizer.warmup_steps=0"])
    train(cfg, str(tmp_path), progress=False, log=lambda *a: None)
    records = [r for r in read_jsonl(tmp_path / "metrics.jsonl")[1:] if r["groups_trained"] > 0]
    assert len(records) >= 2
    assert records[0]["update/kl"] == 0.0
    assert records[-1]["update/kl"] > 0.0
    from passrate_jax.run.checkpoint import RunCheckpointer
    ckpt = RunCheckpointer(tmp_path)
    state, _ = ckpt.restore_saved()
    ckpt.close()
    assert "ref_params" in state


def test_resume_refuses_a_different_config_but_extends_steps(tmp_path, fake_verifier):
    from passrate_jax.configlib import ConfigError
    cfg = load_config(None, TINY + ["steps=1", "allocation.method=uniform"])
    train(cfg, str(tmp_path), progress=False, log=lambda *a: None)
    other = load_config(None, TINY + ["steps=2", "allocation.method=sara", "allocation.group_size=8"])
    with pytest.raises(ConfigError) as err:
        train(other, str(tmp_path), progress=False, log=lambda *a: None)
    assert "allocation.method: 'uniform' -> 'sara'" in str(err.value)
    assert "allocation.group_size: 4 -> 8" in str(err.value)
    messages = []
    longer = load_config(None, TINY + ["steps=2", "allocation.method=uniform"])
    summary = train(longer, str(tmp_path), progress=False, log=messages.append)
    assert summary["step"] == 2 and any("resuming" in m for m in messages)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2]


def test_resume_accepts_keys_added_since_the_run_was_saved(tmp_path):
    import yaml

    from passrate_jax.run.config import dump_config
    from passrate_jax.run.train import resume_conflicts
    cfg = load_config(None, TINY)
    saved = yaml.safe_load(dump_config(cfg))
    del saved["data"]["verify_workers"]  # as if the option did not exist when the run was saved
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    assert resume_conflicts(cfg, str(tmp_path)) == []
    changed = load_config(None, TINY + ["data.verify_workers=3"])  # a non-default value still conflicts
    assert resume_conflicts(changed, str(tmp_path)) == ["data.verify_workers: None -> 3"]


def test_a_run_saved_in_round_mode_resumes_on_the_engine_but_not_with_another_method(tmp_path):
    """The engine became the default after runs were saved with ``sampling.engine: rounds``: how rollouts are
    decoded may change on resume; what is trained (the method, the sampling distribution) may not."""
    from passrate_jax.run.config import dump_config
    from passrate_jax.run.train import resume_conflicts
    (tmp_path / "config.yaml").write_text(dump_config(load_config(None, TINY + ["sampling.engine=rounds",
                                                                                "sampling.slots=16"])))
    assert resume_conflicts(load_config(None, TINY), str(tmp_path)) == []
    hotter = load_config(None, TINY + ["sampling.temperature=0.5"])
    assert resume_conflicts(hotter, str(tmp_path)) == ["sampling.temperature: 1.0 -> 0.5"]
