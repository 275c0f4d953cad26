"""Higher or lower: find a hidden number; every guess is answered "higher", "lower" or "correct"."""
import re

from passrate_jax.envs.base import EnvTask, Transition, sample_task, stable_hash


class GuessEnv:
    name = "guess"
    levels = 2      # level 1: n in 0..9, level 2: n in 0..19
    max_turns = 5   # enough for a binary search at either level

    def sample(self, seed, split, index, level=None, max_level=0):
        """Task ``index`` of ``split``: a pure function of the arguments (sample_task draws, splits, levels)."""
        return sample_task(self.name, self.levels, self._draw, seed=seed, split=split, index=index,
                           level=level, max_level=max_level)

    def _draw(self, rng, level):
        top = 10 * level - 1
        target, lo, hi, solution = rng.randint(0, top), 0, top, []
        while True:  # the expert's actions (a binary search): what the warm start imitates
            guess = (lo + hi) // 2
            solution.append(f"guess {guess}")
            if guess == target:
                break
            lo, hi = (guess + 1, hi) if guess < target else (lo, guess - 1)
        prompt = f"game {rng.randint(0, 10 ** 6)}: find n in 0..{top}\n"
        return EnvTask(self.name, stable_hash(prompt), level, prompt, (target,), tuple(solution))

    def reset(self, task):
        return (), task.prompt.rstrip("\n")  # state: the guesses so far (immutable)

    def step(self, task, state, action):
        numbers = re.findall(r"\d{1,3}", action)  # the last number of the line is the guess
        if not numbers:
            return Transition(state, "err: say guess N", False, True)
        guess, target = int(numbers[-1]), task.spec[0]
        state = state + (guess,)
        if guess == target:
            return Transition(state, "correct", True, False)
        return Transition(state, "higher" if guess < target else "lower", False, False)

    def reward(self, task, state):
        return float(bool(state) and state[-1] == task.spec[0])

    def state_json(self, state):
        return list(state)
