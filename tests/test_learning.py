"""Real learning: the default task and settings, a few hundred steps, for each algorithm. Slow (~50 s each)."""
import pytest
from conftest import read_metrics

import dapo
import grpo
import gspo
import ppo


@pytest.mark.slow
@pytest.mark.parametrize("script, steps", [(grpo, 500), (gspo, 500), (dapo, 500), (ppo, 150)])
def test_learns_addition(tmp_path, script, steps):
    script.main(["--steps", str(steps), "--eval-every", "0", "--out", str(tmp_path)])
    rows = read_metrics(tmp_path)
    steps = [r for r in rows if r["step"] > 0]
    key = "sampled_accuracy" if "sampled_accuracy" in steps[0] else "accuracy"   # DAPO: all it generated
    first = sum(r[key] for r in steps[:50]) / 50
    last = sum(r[key] for r in steps[-50:]) / 50
    # Measured (seed 0): sampled accuracy ~0.33 over the first 50 steps, ~0.45 over the last 50
    # (PPO, 8 updates a step: ~0.35 -> ~0.47 in 150 steps); greedy eval 0.60 -> ~0.7.
    assert last > first + 0.08, (first, last)
    assert rows[-1]["eval_accuracy"] > rows[0]["eval_accuracy"] + 0.05
