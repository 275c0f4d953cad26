"""Evaluation statistics against brute-force enumeration: pass@k, the exact McNemar test, paired differences."""

import itertools

import numpy as np
import pytest

from passrate_jax.run.evaluate import mcnemar_exact_p, paired_difference, pass_at_k, summarise


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_success(n):
    for c in range(n + 1):
        samples = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            brute = np.mean([any(samples[i] for i in s) for s in subsets])
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)


@pytest.mark.parametrize("n", range(0, 11))
def test_mcnemar_exact_p_equals_enumeration_of_fair_coin_flips(n):
    # Under "no change" every discordant prompt goes either way with probability 1/2: the p-value is the
    # probability of a split at least as uneven as the one seen.
    outcomes = [sum(bits) for bits in itertools.product((0, 1), repeat=n)]
    for fixed in range(n + 1):
        broken = n - fixed
        brute = np.mean([abs(x - n / 2) >= abs(fixed - n / 2) for x in outcomes]) if n else 1.0
        assert mcnemar_exact_p(fixed, broken) == pytest.approx(brute, abs=1e-12), (fixed, broken)


def test_paired_difference_counts_fixed_and_broken_prompts_and_the_sampled_shift():
    levels = [1, 1, 2, 2, 2]
    before = summarise([1, 0, 0, 1, 0], levels, successes=[4, 0, 1, 2, 0], num_samples=4)
    after = summarise([1, 1, 1, 0, 0], levels, successes=[4, 2, 3, 1, 0], num_samples=4)
    assert before["sampled_accuracy"] == pytest.approx(7 / 20)
    rate = np.array([4, 0, 1, 2, 0]) / 4
    assert before["sampled_accuracy_se"] == pytest.approx(rate.std(ddof=1) / np.sqrt(5))
    assert after["sampled_accuracy_by_level"] == {1: pytest.approx(6 / 8), 2: pytest.approx(4 / 12)}
    diff = paired_difference(before, after)
    assert (diff["fixed"], diff["broken"]) == (2, 1)
    assert diff["accuracy"] == pytest.approx(0.2)
    assert diff["mcnemar_p"] == pytest.approx(1.0)  # 2 vs 1 is no evidence either way
    d = np.array([0, 2, 2, -1, 0]) / 4
    assert diff["sampled_accuracy"] == pytest.approx(d.mean())
    assert diff["sampled_accuracy_se"] == pytest.approx(d.std(ddof=1) / np.sqrt(5))
    with pytest.raises(ValueError, match="4 vs 5 prompts"):
        paired_difference(summarise([1, 0, 0, 1], levels[:4]), after)


def test_greedy_only_evaluations_compare_without_a_sampled_difference():
    diff = paired_difference(summarise([0] * 20, [1] * 20), summarise([1] * 20, [1] * 20))
    assert diff["fixed"] == 20 and diff["mcnemar_p"] == pytest.approx(2 / 2 ** 20)
    assert "sampled_accuracy" not in diff


def test_one_evaluation_asks_each_kind_for_greedy_and_sampled_success_counts():
    from passrate_jax.run.evaluate import evaluate
    from passrate_jax.sampling.config import SamplingConfig
    calls = []

    def count(n, cfg, seed):  # a kind of task: 3 prompts; greedy solves the first two, samples 1, 2, 3 of n
        calls.append((n, cfg.temperature, seed))
        return np.array([1, 1, 0]) if n == 1 else np.minimum([1, 2, 3], n)

    out = evaluate(count, [0, 1, 1], sampling=SamplingConfig(temperature=0.7), temperature=0.9, seed=5,
                   num_samples=4, ks=(1, 2))
    assert calls == [(1, 0.0, 5), (4, 0.9, 6)]  # greedy at temperature 0 with the seed, samples with seed + 1
    assert out["accuracy"] == 2 / 3 and out["accuracy_by_level"] == {0: 1.0, 1: 0.5}
    assert out["pass@1"] == pytest.approx(np.mean([1 / 4, 2 / 4, 3 / 4]))
    calls.clear()
    evaluate(count, [0, 1, 1], sampling=SamplingConfig(), temperature=1.0, num_samples=2, greedy=False)
    assert calls == [(2, 1.0, 1)]
    with pytest.raises(ValueError, match="nothing to evaluate"):
        evaluate(count, [0], sampling=SamplingConfig(), temperature=1.0, greedy=False)
