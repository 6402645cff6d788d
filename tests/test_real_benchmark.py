"""benchmarks/real.py: the task's problems and the arithmetic of its table and claims, on hand-made numbers."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import real  # noqa: E402

import common  # noqa: E402


def test_the_problems_are_distinct_in_either_order_and_the_same_every_time():
    rows = real.problems()
    assert rows == real.problems() and len(rows) == real.ROWS
    pairs = set()
    for row in rows:
        _, _, a, op, b = row["prompt"].rstrip("?").split()
        a, b = int(a), int(b)
        assert row["answer"] == (a + b if op == "+" else a * b) and (op == "+" or min(a, b) < 10)
        pairs.add((op, min(a, b), max(a, b)))
    assert len(pairs) == len(rows)                                 # 7 + 9 and 9 + 7 never both
    assert sum(r["prompt"].count("*") for r in rows) == 431                # 36%, as its docstring says


def test_the_scripts_hold_out_the_problems_real_py_scores_against():
    rows = [(r["prompt"], str(r["answer"])) for r in real.problems()]
    train, held_out = common.split_eval(rows, real.HELD_OUT)
    assert len(held_out) == real.HELD_OUT >= 200 and not {p for p, _ in train} & {p for p, _ in held_out}


def metrics(evals, truncated, step_time=30.0):
    """metrics.jsonl rows: evaluations (accuracy, truncated share) at steps 0, 10, 20, ...; steps 1..10 x (n - 1)."""
    out = [{"step": 0, "eval_accuracy": evals[0], "eval_truncated_frac": truncated[0]}]
    for step in range(1, 10 * (len(evals) - 1) + 1):
        row = {"step": step, "reward_mean": step / 100, "response_len_mean": 50 - step, "truncated_frac": 0.5 / step,
               "step_time_s": step_time + step, "peak_memory_mb": 4096 + step, "clip_frac": 0.01}
        if step % 10 == 0:
            row |= {"eval_accuracy": evals[step // 10], "eval_truncated_frac": truncated[step // 10]}
        out.append(row)
    return out


def test_a_runs_summary_splits_the_gain_into_form_and_arithmetic():
    s = real.summarise(metrics([0.1, 0.5, 0.4], [0.5, 0.0, 0.2]))
    assert (s["base"], s["final"], s["best"]) == (0.1, 0.4, 0.5)
    assert (s["finished_base"], s["finished_final"]) == (0.5, 0.8)
    assert s["among_finished_base"] == pytest.approx(0.2) and s["among_finished_final"] == pytest.approx(0.5)
    assert s["reward_start"] == pytest.approx(0.03) and s["reward_end"] == pytest.approx(0.18)   # steps 1-5, 16-20
    assert s["seconds_per_step"] == pytest.approx(40.5) and s["peak_memory_gb"] == pytest.approx(4116 / 1024)


def test_the_verdict_rule_and_the_standard_error():
    assert real.differ([0.5, 0.6], [0.3, 0.31])             # 0.245 apart, stds 0.071 and 0.007
    assert not real.differ([0.5, 0.7], [0.45, 0.5])         # 0.125 apart, std 0.141
    assert real.standard_error(0.5, 100) == pytest.approx(0.05)
    assert real.mean_std([0.2, 0.4]) == "0.300 ± 0.141" and real.mean_std([0.25]) == "0.250"


def test_a_finished_run_is_recorded_once_and_an_unfinished_one_not(tmp_path, monkeypatch):
    monkeypatch.setattr(real, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(real, "RECORDS", tmp_path / "records")
    out = real.run_dir("grpo", 0, real.RUNS)
    out.mkdir(parents=True)
    rows = metrics([0.1, 0.2, 0.3, 0.4], [0.2] * 4)                  # steps 0-30: real.STEPS
    (out / "wall_seconds").write_text("600.0\n")
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:-1]))    # stopped at step 29
    assert real.kept("grpo", 0) is None and not real.RECORDS.exists()
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = real.kept("grpo", 0)
    assert record == real.run_dir("grpo", 0, real.RECORDS) and real.read_metrics(record) == rows
    (out / "metrics.jsonl").unlink()                                  # the runs folder is gone: the record stays
    assert real.kept("grpo", 0) == record
    # A seed beyond the default two (`--seeds 2`) is reported too, once finished.
    third = real.run_dir("grpo", 2, real.RUNS)
    third.mkdir(parents=True)
    (third / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (third / "wall_seconds").write_text("700.0\n")
    assert [seed for seed, _ in real.collect()["grpo"]] == [0, 2] and real.collect()["gspo"] == []


def test_a_run_stopped_half_way_resumes_from_its_checkpoint_and_its_pieces_wall_times_add_up(tmp_path, monkeypatch,
                                                                                             capsys):
    for name, value in (("RUNS", tmp_path / "runs"), ("RECORDS", tmp_path / "records"),
                        ("ARITHMETIC", tmp_path / "arithmetic.jsonl"), ("gguf_file", lambda: "model.gguf")):
        monkeypatch.setattr(real, name, value)
    rows = metrics([0.1, 0.2, 0.3, 0.4], [0.2] * 4)

    def fake_run(cmd, cwd, env, stdout, stderr):           # killed after step 10 the first time, then to the end
        out, resumed = Path(cmd[-1]), cmd[-2] == "--resume"
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (rows if resumed else rows[:11])))
        (out / "checkpoint.pt").write_text("the weights")
        return subprocess.CompletedProcess(cmd, 0 if resumed else -9)
    monkeypatch.setattr(subprocess, "run", fake_run)
    out = real.run_dir("grpo", 0)
    assert real.run_all(real.ARMS[:1], [0], threads=2) == 1 and (out / "checkpoint.pt").exists()
    assert real.kept("grpo", 0) is None and "FAILED (exit -9" in capsys.readouterr().out
    (out / "wall_seconds").write_text("600.0\n")                          # as if the first piece took 10 min
    assert real.run_all(real.ARMS[:1], [0], threads=2) == 0 and not (out / "checkpoint.pt").exists()
    assert "  done in 10.0 min: grpo.py --model model.gguf" in capsys.readouterr().out
    assert 600 <= float((real.run_dir("grpo", 0, real.RECORDS) / "wall_seconds").read_text()) < 610


def test_each_claim_gets_its_verdict_by_the_rule_from_two_seeds_on():
    def run(final, clip=0.01, ev=None):
        rows = metrics([0.1, 0.2, 0.3, final], [0.2] * 4)
        for r in rows:
            if "step_time_s" in r:
                r["clip_frac"] = clip
                if ev:
                    r |= {"explained_variance_q1": ev[0], "explained_variance_q4": ev[1]}
        return rows
    runs = {"grpo": [(0, run(0.40)), (1, run(0.42))],
            "grpo lora": [(0, run(0.50))],                                    # one seed: in no claim
            "gspo": [(0, run(0.41, clip=0.20)), (1, run(0.43, clip=0.22))],  # clips 20x more, level: holds
            "dapo": [(0, run(0.50)), (1, run(0.52))],
            "dapo seq-mean": [(0, run(0.30)), (1, run(0.31))],                # token-level above: holds
            "ppo": [(0, run(0.30, ev=(0.2, 0.21))), (1, run(0.32, ev=(0.3, 0.29)))]}   # q1 and q4 level: does not
    a, d, e = real.claims(runs)
    assert a.startswith("- (a) PPO's critic knows late positions worse: **does not hold here**")
    assert "first / last quarter of each completion 0.250 ± 0.071 / 0.250 ± 0.057" in a
    assert "PPO's held-out final 0.310 ± 0.014 is below GRPO's 0.410 ± 0.014" in a
    assert "**holds here**: held-out final 0.510 ± 0.014, above the per-sequence mean's 0.305 ± 0.007" in d
    assert e.startswith("- (e) GSPO clips far more, yet converges at least as fast: **holds here**")
    assert "its held-out final 0.420 ± 0.014 is level with GRPO's 0.410 ± 0.014" in e
    runs["gspo"] = [(0, run(0.20, clip=0.20)), (1, run(0.21, clip=0.22))]      # clips more but ends below
    assert "**does not hold here**" in real.claims(runs)[2]
    del runs["dapo seq-mean"]
    assert real.claims(runs)[1].endswith("needs dapo and dapo seq-mean with at least 2 seeds.")


def test_the_lr_study_runs_each_arm_at_k_times_the_lr_and_counts_falls_by_the_toys_criterion(tmp_path, monkeypatch):
    by_label = {label: (script, flags) for label, script, flags in real.LR_ARMS}
    assert len(by_label) == 16 and by_label["grpo lr x1"] == ("grpo.py", ["--lr", "1e-05"])
    assert by_label["ppo lr x30"][1][-2:] == ["--lr", "0.0003"] and "--critic-lr" in by_label["ppo lr x30"][1]
    grpo = __import__("grpo")
    args = common.parse_args(grpo.Args, grpo.__doc__, real.SETTING + by_label["grpo lr x10"][1])
    assert args.lr == pytest.approx(1e-4)                              # the arm's --lr comes last, and wins
    monkeypatch.setattr(real, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(real, "RECORDS", tmp_path / "records")
    assert real.lr_table(real.collect(real.LR_ARMS))[0].startswith("Not run yet")

    def record(label, seed, evals, stop=None):
        out = real.run_dir(label, seed, real.RUNS)
        out.mkdir(parents=True)
        rows = metrics(evals, [0.2] * len(evals))
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / "wall_seconds").write_text("60.0\n")
        (out / "machine").write_text("one NVIDIA H200 (bf16 autocast), 4 runs at a time\n")
        (out / "log.txt").write_text("grpo: ...\nstopped: no group has a reward signal\n" if stop else "grpo: ...\n")
    record("grpo lr x1", 0, [0.2, 0.3, 0.4, 0.5])
    record("grpo lr x1", 1, [0.2, 0.3, 0.4, 0.4])
    record("grpo lr x3", 0, [0.2, 0.05, 0.09, 0.0])                   # fell at step 10 and stayed: fell
    record("grpo lr x3", 1, [0.2, 0.05, 0.3, 0.05])                   # came back, so not fell; ended below
    record("grpo lr x3", 2, [0.2, 0.1, 0.2, 0.1])                     # exactly 0.10 below: neither
    record("dapo lr x30", 0, [0.2, 0.0], stop=True)                   # stopped at step 10 on purpose
    runs = real.collect(real.LR_ARMS)
    assert real.kept("dapo lr x30", 0) and (real.run_dir("dapo lr x30", 0, real.RECORDS) / "stopped").exists()
    cells = real.lr_cells(runs)
    assert cells["grpo"][1] == ([0.5, 0.4], 0, 0, [], [0.5, 0.4])
    assert cells["grpo"][3][:4] == ([0.0, 0.05, 0.1], 1, 2, [])       # 0.2 -> 0.1 is not more than 0.10 below
    assert cells["dapo"] == {30: ([], 0, 0, [10], [])}
    table = "\n".join(real.lr_table(runs))
    assert "on one NVIDIA H200 (bf16 autocast), 4 runs at a time;" in table
    assert "The base (step 0) there: 0.200" in table
    assert ("| grpo | 0.450 ± 0.071 (best 0.450 ± 0.071); fell 0/2, ended below 0/2 | "
            "0.050 ± 0.050 (best 0.233 ± 0.058); fell 1/3, ended below 2/3 | — | — |") in table
    assert "| dapo | — | — | — | 1 stopped at step 10 |" in table
    assert real.breaks(runs).endswith(": grpo x3 (3 seeds); dapo x30 (1 seed) (the table in *Where each breaks* "
                                      "below).")
