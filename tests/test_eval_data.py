"""``passrate-jax eval --data FILE|tfds:NAME``: a run evaluated on another prompt file (JSONL, Parquet) or
TFDS dataset, with a given reward; greedy accuracy, mean@n and pass@k (with standard errors) equal a
brute-force count over the answers scored."""

import itertools
import json
import textwrap

import numpy as np
import pytest

from passrate_jax.cli.main import main
from passrate_jax.run.config import dump_config, load_config
from passrate_jax.run.train import train
from tests.test_train_e2e import TINY as E2E_TINY

# The end-to-end tests' tiny run (same model and buffers, so the same compiled programs), smaller still.
TINY = [*E2E_TINY, "data.train_size=8", "data.eval_size=2", "sampling.max_new_tokens=10", "steps=1", "eval_every=1",
        "data.verify_workers=1"]

# Scores an answer by a hash of its text (about half are right) and logs every call, so the test can
# recount the evaluation from what was scored.
LOGGING_REWARD = '''
import hashlib, json, os

def coin(prompt, response, reference, **fields):
    reward = hashlib.blake2b((prompt + "|" + response).encode(), digest_size=1).digest()[0] % 2
    with open(os.environ["REWARD_LOG"], "a") as f:
        f.write(json.dumps([prompt, response, reward, fields["row"]]) + "\\n")
    return bool(reward)

def graded(prompt, response, reference, **fields):
    """A float reward: 0.45 where coin is right (a success at data.reward_threshold=0.4), 0.2 otherwise."""
    return 0.45 if coin(prompt, response, reference, **fields) else 0.2
'''


def brute_force_pass_at_k(successes: list[int], k: int) -> float:
    """Fraction of the k-subsets of one prompt's answers that hold a success, by enumeration."""
    subsets = list(itertools.combinations(successes, k))
    return sum(any(s) for s in subsets) / len(subsets)


def se(values) -> float:
    values = np.asarray(values, float)
    return values.std(ddof=1) / np.sqrt(len(values))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A trained run directory and the logging reward plugin, shared by the tests here."""
    tmp = tmp_path_factory.mktemp("eval_data")
    train(load_config(None, TINY), str(tmp / "run"), progress=False, log=lambda *a: None)
    (tmp / "coin.py").write_text(textwrap.dedent(LOGGING_REWARD))
    return tmp / "run", tmp / "coin.py"


def check_against_brute_force(result: dict, calls: list, prompts: list[str], n: int, ks) -> None:
    """``result`` (eval --json) against a recount of the logged reward ``calls``: one greedy call per
    prompt, then ``n`` sampled ones; each prompt's row field is its 1-based position."""
    assert result["heldout_prompts"] == len(prompts) and len(calls) == len(prompts) * (1 + n)
    assert {c[0] for c in calls} == set(prompts) and all(c[3] == prompts.index(c[0]) + 1 for c in calls)
    greedy = {c[0]: c[2] for c in calls[:len(prompts)]}  # the greedy pass scores every prompt first
    sampled = {p: [c[2] for c in calls[len(prompts):] if c[0] == p] for p in prompts}
    assert all(len(v) == n for v in sampled.values())
    correct = [greedy[p] for p in prompts]
    assert result["accuracy"] == pytest.approx(np.mean(correct))
    assert result["accuracy_se"] == pytest.approx(se(correct))
    rates = [np.mean(sampled[p]) for p in prompts]
    assert result[f"mean@{n}"] == pytest.approx(np.mean(rates))
    assert result["sampled_accuracy_se"] == pytest.approx(se(rates))
    for k in ks:
        per_prompt = [brute_force_pass_at_k(sampled[p], k) for p in prompts]
        assert result[f"pass@{k}"] == pytest.approx(np.mean(per_prompt))
        assert result[f"pass@{k}_se"] == pytest.approx(se(per_prompt))
    assert 0 < result[f"mean@{n}"] < 1, "a hash reward on varied answers gives mixed outcomes"


def test_eval_on_a_jsonl_file_matches_brute_force_pass_at_k(tmp_path, run, monkeypatch, capsys):
    run, plugin = run
    data = tmp_path / "other.jsonl"
    questions = [f"What is {i} times 7?" for i in range(7)]
    data.write_text("".join(json.dumps({"question": q, "target": 7 * i}) + "\n" for i, q in enumerate(questions)))
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("REWARD_LOG", str(log))
    n, ks = 4, (1, 2, 4)
    capsys.readouterr()
    assert main(["eval", "--run-dir", str(run), "--data", str(data), "--num-samples", str(n), "--k", "1,2,4",
                 "--limit", "6", "--json", "data.prompt_field=question", "data.answer_field=target",
                 f"data.reward_fn={plugin}:coin"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    check_against_brute_force(result, [json.loads(line) for line in log.read_text().splitlines()], questions[:6],
                              n, ks)

    # The same rows as Parquet: the same greedy answers and scores.
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "other.parquet")
    capsys.readouterr()
    assert main(["eval", "--run-dir", str(run), "--data", str(tmp_path / "other.parquet"), "--num-samples", "0",
                 "--limit", "6", "--json", "data.prompt_field=question", "data.answer_field=target",
                 f"data.reward_fn={plugin}:coin"]) == 0
    as_parquet = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert as_parquet["accuracy"] == result["accuracy"] and as_parquet["heldout_prompts"] == 6

    # Without --json: the same numbers, with their standard errors, as text.
    assert main(["eval", "--run-dir", str(run), "--data", str(data), "--num-samples", str(n), "--k", "2",
                 "--limit", "6", "data.prompt_field=question", "data.answer_field=target",
                 f"data.reward_fn={plugin}:coin"]) == 0
    out = capsys.readouterr().out
    assert f"greedy {data} accuracy {result['accuracy']:.4f} +- {result['accuracy_se']:.4f} on 6 prompts" in out
    assert f"pass@2: {result['pass@2']:.4f} +- {result['pass@2_se']:.4f}" in out
    assert "level" not in out  # a file has no difficulty levels to break the accuracy down by


def test_eval_on_a_tfds_dataset_matches_brute_force_pass_at_k(tmp_path, run, monkeypatch, capsys):
    """With a float reward: a prompt's answer succeeds iff its reward >= data.reward_threshold."""
    from passrate_jax.data.sources import Fields
    from passrate_jax.data.tfds_builtin import prepare_builtin, tfds_source

    run, plugin = run
    name = prepare_builtin(tmp_path / "tfds", "countdown", seed=5, train_size=4, test_size=7)
    prompts = [r.prompt for r in tfds_source(name, str(tmp_path / "tfds"), fields=Fields(id="prompt_id"),
                                             shuffle=False).heldout(5)]
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("REWARD_LOG", str(log))
    capsys.readouterr()
    assert main(["eval", "--run-dir", str(run), "--data", f"tfds:{name}", "--split", "test", "--limit", "5",
                 "--num-samples", "3", "--k", "1,3", "--json", f"data.tfds_data_dir={tmp_path / 'tfds'}",
                 f"data.reward_fn={plugin}:graded", "data.reward_threshold=0.4"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    check_against_brute_force(result, [json.loads(line) for line in log.read_text().splitlines()], prompts, 3, (1, 3))


def test_eval_data_that_does_not_exist_is_named(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text(dump_config(load_config(None)))
    assert main(["eval", "--run-dir", str(tmp_path), "--data", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl" in capsys.readouterr().err
