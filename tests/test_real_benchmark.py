"""benchmarks/real.py: the task's problems and the arithmetic of its table and claims, on hand-made numbers."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench  # noqa: E402
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
        row = {"step": step, "reward_mean": step / 100, "accuracy": step / 100, "response_len_mean": 50 - step,
               "truncated_frac": 0.5 / step,
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
    assert s["accuracy_start"] == pytest.approx(0.03) and s["accuracy_end"] == pytest.approx(0.18)  # steps 1-5, 16-20
    assert s["seconds_per_step"] == pytest.approx(40.5) and s["peak_memory_gb"] == pytest.approx(4116 / 1024)
    assert s["completions_per_step"] == 32 and s["final_step"] == 20


def test_dapo_is_read_over_every_completion_it_generated_not_the_groups_it_kept():
    rows = metrics([0.1, 0.5], [0.5, 0.0])
    for r in rows[1:]:                                    # 3 rounds of 32 a step; the kept groups' rate is higher
        r |= {"generation_rounds": 2 + r["step"] % 2, "sampled_accuracy": 0.1, "sampled_truncated_frac": 0.2}
    s = real.summarise(rows)
    assert s["completions_per_step"] == 32 * 2.5 and s["accuracy_end"] == pytest.approx(0.1)
    assert s["truncated_start"] == pytest.approx(0.2)


def test_t_is_student_s_at_the_two_sided_95_percent_level_and_2_3_5_seeds_an_arm_give_2_4_8_degrees():
    for df, t in ((1, 12.706), (2, 4.303), (4, 2.776), (8, 2.306)):
        assert bench.t_quantile(df) == pytest.approx(t, abs=5e-4)
    assert bench.t_quantile(3) == pytest.approx(3.182, abs=5e-4) and 2.776 < bench.t_quantile(3.5) < 3.182
    # Beyond the first bracket [0, 100]: at 1 degree of freedom (Cauchy's) the quantile is tan(pi (p - 1/2)), at 2
    # (2p - 1) / sqrt(2p (1 - p)).
    for p in (0.997, 0.9995):                                          # 106.1 and 636.6
        assert bench.t_quantile(1, p) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-6)
    assert bench.t_quantile(2, 0.99999) == pytest.approx(0.99998 / math.sqrt(2 * 0.99999 * 0.00001), rel=1e-6)  # 223.6
    # Equal spreads: Welch's degrees of freedom are k_A + k_B - 2.
    for seeds, df, t in ((2, 2, 4.303), (3, 4, 2.776), (5, 8, 2.306)):
        a = [0.5 + 0.01 * i for i in range(seeds)]
        d = bench.seeds_difference(a, [x - 0.1 for x in a])
        assert d.df == pytest.approx(df) and bench.t_quantile(d.df) == pytest.approx(t, abs=5e-4)


def test_standard_errors_over_seeds_and_over_held_out_problems_paired_or_not():
    # Seeds: variances 0.02 and 0.0002 over 2 seeds each: sqrt(0.01 + 0.0001) = 0.1005 at Welch's (0.01 + 0.0001)^2 /
    # (0.01^2 + 0.0001^2) = 1.02 degrees of freedom (unequal spreads: towards one arm's k - 1); one seed: none.
    assert bench.seeds_error([0.1, 0.3], [0.5, 0.52]) == (pytest.approx(0.1004988), pytest.approx(1.0199, abs=1e-4))
    assert bench.seeds_error([0.2, 0.4]) == (pytest.approx(0.1), 1) and bench.seeds_error([0.3]) == (math.inf, 0)
    assert bench.seeds_error([0.3, 0.3], [0.2, 0.2, 0.2]) == (0.0, 3)             # no spread at all
    # A held-out difference: over seeds, with the evaluation's own error beside it. Unpaired: 0.5 and 0.3 on 100
    # problems, sqrt(0.25 / 100 + 0.21 / 100) = 0.06782.
    d = bench.held_out_difference([(0.5, None), (0.5, None)], [(0.3, "0" * 100), (0.3, None)], 100)
    assert d == (pytest.approx(0.2), 0.0, 2, pytest.approx(0.0678233), False)
    # Paired (McNemar): 10 problems, A right on 6, B on 3; A alone on 4, B alone on 1: mean 0.3,
    # sqrt(4 + 1 - 3^2 / 10) / 10 = sqrt(4.1) / 10 = 0.20248. One run each: no error over seeds.
    d = bench.held_out_difference([(0.6, "1111110000")], [(0.3, "1100001000")], 10)
    assert d == (pytest.approx(0.3), math.inf, 0, pytest.approx(0.2024846), True)
    # Two seeds of A (shares 1, 0.5, 0.5, 0), one of B ("0011"): differences 1, 0.5, -0.5, -1, mean 0,
    # sqrt(1 + 0.25 + 0.25 + 1) / 4 = 0.39528.
    d = bench.held_out_difference([(0.75, "1110"), (0.25, "1000")], [(0.5, "0011")], 4)
    assert (d.value, d.df, d.paired) == (pytest.approx(0.0), 0, True) and d.evaluation == pytest.approx(0.3952847)
    # A record of another length (or a run without one) makes the evaluation's error unpaired.
    assert not bench.held_out_difference([(0.75, "1110")], [(0.5, "001")], 4).paired


def test_the_verdict_is_one_of_four_outcomes_and_exactly_t_standard_errors_is_within():
    t = bench.t_quantile(4)
    assert bench.verdict(bench.Difference(t * 0.1, 0.1, 4)) == "inconclusive"                  # `>`, not `>=`
    assert bench.verdict(bench.Difference(t * 0.1 + 1e-9, 0.1, 4)) == "holds here"
    assert bench.verdict(bench.Difference(-t * 0.1 - 1e-9, 0.1, 4)) == "does not hold here"
    assert bench.verdict(bench.Difference(0.0, 0.0, 2)) == "inconclusive"
    assert bench.verdict(bench.Difference(0.9, 0.1, 4), testable=False) == "not testable here"
    # 3 seeds an arm, each of variance 0.0025: sqrt(2 * 0.0025 / 3) = 0.0408 at 4 df, t 2.776: beyond from 0.1134.
    a = [0.50, 0.55, 0.60]
    assert bench.verdict(bench.seeds_difference(a, [x - 0.114 for x in a])) == "holds here"
    assert bench.verdict(bench.seeds_difference(a, [x - 0.113 for x in a])) == "inconclusive"
    assert bench.verdict(bench.seeds_difference(a, [x + 0.114 for x in a])) == "does not hold here"
    # One seed in an arm: no verdict however large the difference.
    assert bench.verdict(bench.seeds_difference([0.9], [0.1, 0.11])) == "inconclusive: needs seeds"
    assert bench.verdict(bench.seeds_difference([0.9])) == "inconclusive: needs seeds"
    assert bench.difference_text(bench.Difference(0.5, 0.25, 2)) == "+0.500 ± 0.250 (2.0 df, t 4.30)"
    assert bench.difference_text(bench.Difference(-0.6, 0.1, 8, 0.05, False)) == \
        "**-0.600 ± 0.100** (8.0 df, t 2.31; evaluation ± 0.050, unpaired)"
    assert bench.difference_text(bench.Difference(0.121, math.inf, 0, 0.029, True)) == \
        "+0.121 (one seed: no error over seeds; evaluation ± 0.029, paired)"
    assert real.standard_error(0.5, 100) == pytest.approx(0.05)
    assert real.mean_std([0.2, 0.4]) == "0.300 ± 0.141" and real.mean_std([0.25]) == "0.250"


def test_two_single_runs_get_no_verdict_however_far_apart_their_evaluation_says_they_are():
    # Built like bf16 against fp32, one seed each, at two steps: paired over 240 problems, the evaluation alone says
    # +0.121 +- 0.021 at one and -0.133 +- 0.022 at the other, each 5-6 of its errors from zero, on opposite sides.
    for a, b, value, evaluation in (("1" * 100 + "0" * 140, "1" * 71 + "0" * 169, 29 / 240, 0.0210),
                                    ("1" * 60 + "0" * 180, "1" * 92 + "0" * 148, -32 / 240, 0.0220)):
        d = bench.held_out_difference([(a.count("1") / 240, a)], [(b.count("1") / 240, b)], 240)
        assert d.paired and d.value == pytest.approx(value) and d.evaluation == pytest.approx(evaluation, abs=1e-4)
        assert abs(d.value) > 5 * d.evaluation and bench.verdict(d) == "inconclusive: needs seeds"


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
    (out / "eval_correct.jsonl").write_text("".join(json.dumps({"step": 10 * i, "correct": "01" * 120}) + "\n"
                                                    for i in range(4)))
    record = real.kept("grpo", 0)
    assert record == real.run_dir("grpo", 0, real.RECORDS) and real.read_metrics(record) == rows
    assert bench.final_correct(record, 30) == "01" * 120 and bench.final_correct(record, 40) is None
    assert bench.final_correct(tmp_path, 30) is None                   # a run recorded before: none
    (out / "metrics.jsonl").unlink()                                  # the runs folder is gone: the record stays
    assert real.kept("grpo", 0) == record
    # A seed beyond the default two (`--seeds 2`) is reported too, once finished.
    third = real.run_dir("grpo", 2, real.RUNS)
    third.mkdir(parents=True)
    (third / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (third / "wall_seconds").write_text("700.0\n")
    assert [seed for seed, _ in real.collect()["grpo"]] == [0, 2] and real.collect()["gspo"] == []


def test_seeds_are_seed_ids_as_in_compare_py_and_a_bad_one_is_refused_in_one_line(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(real, "run_all", lambda arms, seeds, threads, jobs: ran.append(seeds) or 0)
    monkeypatch.setattr(real, "report", lambda: None)
    for given in (["--seeds", "2"], ["--seeds", "1,0"], []):
        with pytest.raises(SystemExit) as stop:
            real.main(["--only", "grpo"] + given)
        assert stop.value.code == 0
    assert ran == [[2], [0, 1], None]                                   # None: each arm its own, arm_seeds
    assert real.arm_seeds("grpo bf16") == (0, 1, 2, 3, 4) and real.arm_seeds("ppo") == (0, 1, 2)
    assert real.arm_seeds("ppo bf16", [3]) == [3]
    for bad in ("1.5", "two", "-1", "", "0,,1"):
        with pytest.raises(SystemExit) as stop:
            real.main(["--only", "grpo", "--seeds", bad])
        err = capsys.readouterr().err.splitlines()
        assert stop.value.code == 2 and len(err) == 1
        assert err[0].endswith(f": --seeds {bad!r}: seed ids, comma-separated, each 0 or more (as 0,1,2)")
    assert len(ran) == 3


@pytest.mark.parametrize("precision, suffix", [("bf16", " bf16"), ("fp32", "")])
def test_a_plain_run_runs_every_loss_in_the_precision_dtype_auto_picks_here(precision, suffix, monkeypatch):
    arms = []
    monkeypatch.setattr(real, "precision_here", lambda: precision)
    monkeypatch.setattr(real, "run_all",
                        lambda a, seeds, threads, jobs: arms.extend(a) or layout.append((jobs, threads)))
    monkeypatch.setattr(real, "report", lambda: None)
    monkeypatch.setattr(real.os, "cpu_count", lambda: 8)
    layout = []
    with pytest.raises(SystemExit):
        real.main([])
    assert layout == [(2, 4)]                                 # two runs at a time, each on its half of the cores
    assert [label for label, _, _ in arms] == [loss + suffix for loss in
                                               ("grpo", "gspo", "dapo", "dapo seq-mean", "cispo", "sapo", "ppo")]
    assert all(flags[:2] == ["--dtype", precision] for _, _, flags in arms)
    monkeypatch.undo()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")     # no native bf16 in use
    assert real.precision_here() == "fp32" or torch.cuda.is_available()


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
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out, grpo = real.run_dir("grpo", 0), [arm for arm in real.ARMS if arm[0] == "grpo"]      # fp32
    assert real.run_all(grpo, [0], threads=2) == 1 and (out / "checkpoint.pt").exists()
    assert real.kept("grpo", 0) is None and "FAILED (exit -9" in capsys.readouterr().out
    (out / "wall_seconds").write_text("600.0\n")                          # as if the first piece took 10 min
    assert real.run_all(grpo, [0], threads=2) == 0 and not (out / "checkpoint.pt").exists()
    assert "  done in 10.0 min: grpo.py --model model.gguf" in capsys.readouterr().out
    assert 600 <= float((real.run_dir("grpo", 0, real.RECORDS) / "wall_seconds").read_text()) < 610
    machine = (real.run_dir("grpo", 0, real.RECORDS) / "machine").read_text()     # where, and in which dtype
    assert machine == f"2 threads of an {bench.cpu_name()} (fp32)\n"


def test_the_report_says_how_long_a_table_took_and_on_what(tmp_path, monkeypatch):
    monkeypatch.setattr(real, "RECORDS", tmp_path)
    two = "1 thread of an Intel Xeon Processor (bf16 autocast), 2 runs at a time"
    for seed, where, seconds in [(0, two, 1800), (1, two, 3600), (2, "2 threads of an AMD EPYC (bf16 autocast)", 1200)]:
        record = real.run_dir("grpo bf16", seed, tmp_path)
        record.mkdir(parents=True)
        (record / "machine").write_text(where + "\n")
        (record / "wall_seconds").write_text(f"{seconds}\n")
    # 1.5 h two at a time is 0.75 h of the Xeon's time, 0.33 h alone is the EPYC's: 1.08 h.
    assert real.took({"grpo bf16": [(s, []) for s in range(3)], "gspo bf16": []}, "bf16 autocast") == (
        "The table's 3 runs took 1.8 h of wall time summed over runs (1.5 h on 1 thread of an Intel Xeon Processor, "
        "2 runs at a time (2 runs); 0.3 h on 2 threads of an AMD EPYC (1 run)): about 1.1 h of the machines' time.")


def test_each_arm_runs_and_records_the_dtype_its_recorded_runs_ran_in(monkeypatch):
    asked = {label: common.parse_args(__import__(script[:-3]).Args, "", real.SETTING + flags).dtype
             for label, script, flags in real.ARMS + real.LR_ARMS}
    # Every loss in both precisions, each its own arm: bf16 autocast in those labelled so and the lr study (on a
    # GPU), fp32 in the others; never auto, which would choose by the machine at hand.
    bf16 = {label for label in asked if label.endswith(" bf16")}
    assert {label for label, d in asked.items() if d == "bf16"} == bf16 | {a for a, _, _ in real.LR_ARMS}
    assert {label[:-5] for label in bf16} == {label for label, d in asked.items() if d == "fp32"} - {"grpo lora"}
    assert set(asked.values()) == {"fp32", "bf16"} and len(bf16) == 7
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H200")
    assert real.machine(2, 4, real.ARMS[-1][2]) == "one NVIDIA H200 (fp32), 4 runs at a time"     # not bf16 there
    assert real.machine(2, 4, real.LR_ARMS[0][2]) == "one NVIDIA H200 (bf16 autocast), 4 runs at a time"


def run(final, clip=0.01, ev=None):
    """A run's rows ending at `final`, its clip fraction and its critic's explained variance (first, last quarter)."""
    rows = metrics([0.1, 0.2, 0.3, final], [0.2] * 4)
    for r in rows:
        if "step_time_s" in r:
            r["clip_frac"] = clip
            if ev:
                r |= {"explained_variance_q1": ev[0], "explained_variance_q4": ev[1]}
    return rows


def test_each_claim_gets_one_of_four_outcomes_by_the_rule_from_two_seeds_on(tmp_path, monkeypatch):
    monkeypatch.setattr(real, "RECORDS", tmp_path)                 # no per-problem records: unpaired
    monkeypatch.setattr(real, "HELD_OUT", 100)
    monkeypatch.setattr(real, "cpu_of", lambda label, seed: "X")   # every run on one CPU: it repeats the whole
    # Two seeds x and x + 0.02 (variance 0.0002) or x +- 0.02 (0.0008): equal spreads, 2 degrees of freedom, t 4.30.
    runs = {"grpo": [(0, run(0.40)), (1, run(0.42))],
            "grpo lora": [(0, run(0.50))],                                    # one seed: in no claim
            "gspo": [(0, run(0.41, clip=0.20)), (1, run(0.43, clip=0.20))],  # clips 20x, 0.01 above: inconclusive
            "dapo": [(0, run(0.58)), (1, run(0.62))],
            "dapo seq-mean": [(0, run(0.28)), (1, run(0.32))],                # 0.3 above, 10.6 SE: holds
            "ppo": [(0, run(0.20, ev=(0.50, 0.10))), (1, run(0.22, ev=(0.56, 0.18)))],
            "cispo": [(0, run(0.68, clip=0.001)), (1, run(0.72, clip=0.001))],   # 0.1 above dapo, 3.5 SE: within
            "sapo": [(0, run(0.40, clip=0.002)), (1, run(0.42, clip=0.002))]}
    a, d, e, f, h = real.claims(runs)
    # (a): first quarter 0.53 +- 0.03, 17.7 standard errors above 0 at 1 df (t 12.71). First minus last, of the same
    # runs, so seed by seed: 0.40 and 0.38, 0.39 +- 0.01 at 1 df (unpaired, sqrt(0.0018 / 2 + 0.0032 / 2) = 0.05).
    assert a.startswith("- (a) PPO's critic knows late positions worse: **holds here**: explained variance over the "
                        "first / last quarter of each completion 0.530 ± 0.042 / 0.140 ± 0.057, first minus last "
                        "**+0.390 ± 0.010** (1.0 df, t 12.71).")
    # PPO 0.21 against GRPO 0.41: 0.2 +- 0.014 over seeds; the evaluation alone on 100 problems:
    # sqrt(0.21 * 0.79 / 100 + 0.41 * 0.59 / 100) = 0.0639.
    assert a.endswith("PPO's held-out final 0.210 ± 0.014 (2 seeds) against GRPO's 0.410 ± 0.014 (2 seeds): "
                      "**-0.200 ± 0.014** (2.0 df, t 4.30; evaluation ± 0.064, unpaired): beyond t standard errors; "
                      "on one CPU: X -0.200 ± 0.014 (t 4.30, beyond).")
    # (d): 0.6 against 0.3, sqrt(0.0004 + 0.0004) = 0.028 over seeds; the evaluation sqrt(0.24 / 100 + 0.21 / 100).
    assert d.startswith("- (d) DAPO's token-level loss keeps long answers from being drowned out: **holds here**: "
                        "held-out final 0.600 ± 0.028 (2 seeds) against the per-sequence mean's 0.300 ± 0.028 (2 "
                        "seeds): **+0.300 ± 0.028** (2.0 df, t 4.30; evaluation ± 0.067, unpaired); on one CPU: X "
                        "+0.300 ± 0.028 (t 4.30, beyond).")
    assert "over the first 5 steps they averaged 47 ± 0 and 47 ± 0 tokens, 0.23 ± 0.00 and 0.23 ± 0.00" in d
    assert e.startswith("- (e) GSPO clips far more, yet converges at least as fast: **inconclusive**: it clips 0.2000 "
                        "± 0.0000 of tokens, GRPO 0.0100 ± 0.0000 (20×; far more: 10× or more); its held-out final "
                        "0.420 ± 0.014 (2 seeds) against GRPO's 0.410 ± 0.014 (2 seeds): +0.010 ± 0.014 (2.0 df, t "
                        "4.30; evaluation ± 0.070, unpaired)")
    # (f): 0.7 against 0.6, sqrt(0.0004 + 0.0004) = 0.028 over seeds: within t; the evaluation alone
    # sqrt(0.7 * 0.3 / 100 + 0.6 * 0.4 / 100) = 0.067.
    assert f == ("- (f) CISPO learns faster than DAPO at equal steps, keeping the gradient of the tokens DAPO's clip "
                 "drops: **inconclusive**: held-out final 0.700 ± 0.028 (2 seeds) against DAPO's 0.600 ± 0.028 (2 "
                 "seeds): +0.100 ± 0.028 (2.0 df, t 4.30; evaluation ± 0.067, unpaired); on one CPU: X +0.100 ± "
                 "0.028 (t 4.30, within); CISPO capped the weight of "
                 "0.0010 ± 0.0000 of its tokens (their gradient scaled, kept), DAPO's clip zeroed that of 0.0100 ± "
                 "0.0000.")
    # (h): no seed fell or ended 0.10 below its base (0.1 -> about 0.4): not testable, however the finals stand.
    assert h.startswith("- (h) SAPO is more stable than GRPO and GSPO: **not testable here**, as no seed of the three "
                        "fell or ended 0.10 below its base at this lr: held-out final 0.410 ± 0.014 (2 seeds) against "
                        "GRPO's 0.410 ± 0.014 (2 seeds) and GSPO's 0.420 ± 0.014 (2 seeds)")
    runs["gspo"] = [(0, run(0.10, clip=0.20)), (1, run(0.12, clip=0.20))]      # 0.3 below, 21 SE
    runs["grpo"] = [(0, metrics([0.2, 0.3, 0.1, 0.05], [0.2] * 4)), (1, metrics([0.2, 0.3, 0.1, 0.07], [0.2] * 4))]
    assert "**holds here**: held-out final 0.410 ± 0.014 (2 seeds) against GRPO's 0.060 ± 0.014" in \
        real.claims(runs)[4]                                                    # grpo fell: testable, both beyond t
    runs["grpo"] = [(0, run(0.40)), (1, run(0.42))]
    assert "**does not hold here**" in real.claims(runs)[2]
    runs["gspo"] = [(0, run(0.42, clip=0.05)), (1, run(0.42, clip=0.05))]      # level, but clips only 5x
    assert "**does not hold here**: it clips 0.0500 ± 0.0000 of tokens, GRPO 0.0100 ± 0.0000 (5×;" in \
        real.claims(runs)[2]
    runs["grpo"] = [(0, run(0.40, clip=0.0625)), (1, run(0.42, clip=0.0625))]
    runs["gspo"] = [(0, run(0.42, clip=0.625)), (1, run(0.42, clip=0.625))]    # exactly 10x is far more
    assert "**inconclusive**: it clips 0.6250 ± 0.0000 of tokens, GRPO 0.0625 ± 0.0000 (10×;" in real.claims(runs)[2]
    # 0.1 above, 3.5 standard errors over seeds (1.5 of the evaluation's): beyond two, within t = 4.30.
    runs["dapo"] = [(0, run(0.38)), (1, run(0.42))]
    assert "loss keeps long answers from being drowned out: **inconclusive**: held-out final 0.400 ± 0.028 (2 seeds) " \
           "against the per-sequence mean's 0.300 ± 0.028 (2 seeds): +0.100 ± 0.028 (2.0 df" in real.claims(runs)[1]
    # A critic whose first quarter is a little within t standard errors of 0 (0.12 +- 0.01, t 12.71) knows nothing:
    # not testable; a little beyond (0.13), testable.
    runs["ppo"] = [(0, run(0.30, ev=(0.11, 0.0))), (1, run(0.32, ev=(0.13, 0.0)))]
    assert real.claims(runs)[0].startswith("- (a) PPO's critic knows late positions worse: **not testable here**, as "
                                           "its critic explains nothing at any position")
    runs["ppo"] = [(0, run(0.30, ev=(0.12, 0.0))), (1, run(0.32, ev=(0.14, 0.0)))]
    assert "**holds here**" in real.claims(runs)[0]
    del runs["dapo seq-mean"]
    assert real.claims(runs)[1].endswith("needs dapo and dapo seq-mean with at least 2 seeds.")
    # The gain over the base, over seeds (the base is one model decoded greedily: a fixed value): 0.31 +- 0.01 at
    # 1 df, t 12.71; each seed's beside it with its evaluation's error, sqrt(0.1 * 0.9 / 100 + 0.4 * 0.6 / 100).
    assert real.gains("grpo", runs["grpo"]).startswith(
        "grpo: held-out gain over the base **+0.310 ± 0.010** (1.0 df, t 12.71) over 2 seeds; seed 0 +0.300 "
        "(evaluation ± 0.057, unpaired), seed 1 +0.320 (evaluation ± 0.058, unpaired); accuracy among finished")
    assert "gain over the base +0.400 (one seed: no error over seeds) over 1 seed; seed 0 +0.400" in \
        real.gains("grpo lora", runs["grpo lora"])


def record(label, seed, evals, correct=None, machine=None):
    """A run's record in real.RECORDS, as kept() leaves it: its rows, wall time, and if given the problems its
    evaluation at step 30 answered right and where it ran."""
    out = real.run_dir(label, seed, real.RECORDS)
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics(evals, [0.0] * len(evals))))
    (out / "wall_seconds").write_text("600.0\n")
    if correct:
        (out / "eval_correct.jsonl").write_text(json.dumps({"step": 0, "correct": "0" * len(correct)}) + "\n" +
                                                json.dumps({"step": 30, "correct": correct}) + "\n")
    if machine:
        (out / "machine").write_text(machine + "\n")


def test_arms_are_compared_over_seeds_with_the_evaluation_s_own_error_beside(tmp_path, monkeypatch):
    monkeypatch.setattr(real, "RECORDS", tmp_path)
    monkeypatch.setattr(real, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(real, "HELD_OUT", 10)
    record("grpo", 0, [0.0, 0.2, 0.4, 0.6], correct="1111110000", machine="2 threads of an AMD EPYC")   # no dtype
    record("grpo", 1, [0.0, 0.2, 0.4, 0.5], correct="1111100000")
    record("grpo lora", 0, [0.0, 0.2, 0.3, 0.4], correct="1111000000")             # one seed so far
    record("gspo", 0, [0.0, 0.1, 0.2, 0.3], correct="1100001000")
    record("gspo", 1, [0.0, 0.1, 0.2, 0.2], correct="1100000000")
    for seed, where in enumerate(["2 threads of an AMD EPYC (fp32)", "2 threads of an Intel(R) Xeon(R)", None]):
        record("dapo", seed, [0.0, 0.1, 0.2, 0.5], machine=where)                   # recorded before: no problems
    runs = real.collect()
    assert [seed for seed, _ in runs["dapo"]] == [0, 1, 2] and runs["ppo"] == []
    table = real.differences(runs)
    # One seed an arm: no verdict. The evaluation alone, paired: grpo's shares 1 (4 problems), 1, 0.5, lora's 1 (4),
    # 0, 0: differences 1 and 0.5, mean 0.15, sqrt(1.25 - 10 * 0.15^2) / 10 = 0.101.
    assert table[4] == "| grpo | grpo lora | 2 / 1 | +0.150 | — | — | — | needs seeds | 0.101, paired | — | — |"
    # 0.55 against 0.25, each arm of variance 0.005 over 2 seeds: sqrt(0.0025 + 0.0025) = 0.071 at 2 df, t 4.30: 0.304
    # to be beyond, so within; the evaluation alone (differences 1, 1, 1, 0.5, -0.5: mean 0.3, sqrt(3.5 - 0.9) / 10 =
    # 0.161) would have put it beyond two of its errors.
    # No CPU ran both arms twice (gspo's records name none): nothing on one CPU.
    assert table[2] == ("| grpo | gspo | 2 / 2 | +0.300 | 0.071 | 2.0 | 4.30 | within | 0.161, paired | no CPU ran "
                        "both arms at 2 seeds | — |")
    # Against three seeds of 0.5, no record: sqrt(0.0025 + 0) at 1 df; unpaired, sqrt(0.55 * 0.45 + 0.25) / sqrt(10).
    assert table[3].startswith("| grpo | dapo | 2 / 3 | +0.050 | 0.050 | 1.0 | 12.71 | within | 0.223, unpaired |")
    assert table[7] == "| dapo | grpo lora | 3 / 1 | +0.100 | — | — | — | needs seeds | 0.221, unpaired | — | — |"
    assert table[5].startswith("| gspo | dapo | 2 / 3 | -0.250 | 0.050 | 1.0 | 12.71 | within | 0.209, unpaired |")
    assert len(table) == 8
    rows = {line.split(" | ")[0][2:]: line for line in real.table(runs)[2:]}
    # A record from before the dtype was recorded reads as its arm's: the flags it ran with.
    assert rows["grpo"].endswith("| 2 threads of an AMD EPYC (fp32) (seed 0); not recorded (seed 1) |")
    assert rows["grpo lora"].startswith("| grpo lora | 1 | 0.000 → **0.400** (0.400) |")
    assert rows["dapo"].endswith("| 2 threads of an AMD EPYC (fp32) (seed 0); 2 threads of an Intel(R) Xeon(R) "
                                 "(fp32) (seed 1); not recorded (seed 2) |")
    assert rows["ppo"].startswith("| ppo | not run yet |")
    record("ppo", 0, [0.0, 0.1, 0.2, 1.0])
    record("ppo", 1, [0.0, 0.1, 0.2, 0.9])                   # 0.25 against 0.95: 0.7 +- 0.071, beyond 0.304
    # Beyond, but neither arm's records name a CPU: loss and CPU are not separated, no verdict.
    assert real.differences(real.collect())[7] == ("| gspo | ppo | 2 / 2 | -0.700 | 0.071 | 2.0 | 4.30 | **beyond** "
                                                    "| 0.153, unpaired | no CPU ran both arms at 2 seeds | CPU not "
                                                    "separated |")
    record("grpo bf16", 0, [0.0, 0.1, 0.2, 0.3])                  # the other precision: its own section, never mixed
    (name, (dtype, suffix, bf16)), (_, (_, _, fp32)) = real.sections(real.collect()).items()
    assert (name, dtype, suffix) == ("bf16", "bf16 autocast", " bf16") and "grpo bf16" not in fp32
    assert [len(s) for s in bf16.values()] == [1, 0, 0, 0, 0, 0, 0] and len(fp32["grpo"]) == 2


def test_a_difference_stands_only_where_it_holds_on_each_cpu_that_ran_both_arms_twice():
    D = bench.Difference
    beyond, within = D(0.3, 0.05, 2), D(0.1, 0.05, 2)           # t 4.30: 0.215 to be beyond
    assert real.standing(within, {}) == "within" and real.standing(D(0.3, float("inf"), 0), {}) == "within"
    assert real.standing(beyond, {}) == "CPU not separated"
    assert real.standing(beyond, {"X": beyond}) == "stands"
    assert real.standing(beyond, {"X": beyond, "Y": within}) == "not on Y"
    assert real.standing(beyond, {"X": D(-0.3, 0.05, 2)}) == "not on X"      # beyond, the other way


def test_the_bf16_arms_are_split_by_the_cpu_their_records_name(tmp_path, monkeypatch):
    monkeypatch.setattr(real, "RECORDS", tmp_path)
    monkeypatch.setattr(real, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(real, "HELD_OUT", 10)
    epyc, xeon = "2 threads of an AMD EPYC (bf16 autocast)", "1 thread of an Intel Xeon Processor (bf16 autocast), 2 " \
                                                             "runs at a time"
    for label, seed, final, where in [("grpo bf16", 0, 0.6, epyc), ("grpo bf16", 1, 0.5, epyc),
                                      ("grpo bf16", 2, 0.55, xeon), ("gspo bf16", 0, 0.1, epyc),
                                      ("gspo bf16", 1, 0.0, epyc), ("dapo bf16", 0, 1.0, xeon),
                                      ("dapo bf16", 1, 0.9, xeon)]:
        record(label, seed, [0.0, 0.1, 0.2, final], machine=where)
    record("sapo bf16", 0, [0.0, 0.1, 0.2, 0.3])                                  # no record of its machine
    assert [real.cpu_of("grpo bf16", s) for s in (0, 2)] == ["AMD EPYC", "Intel Xeon Processor"]
    assert real.cpu_of("sapo bf16", 0) is None
    monkeypatch.setattr(real, "machine_of", lambda label, seed: "one NVIDIA H200 (bf16 autocast), 4 runs at a time")
    assert real.cpu_of("grpo bf16", 0) == "NVIDIA H200"
    monkeypatch.undo()
    monkeypatch.setattr(real, "RECORDS", tmp_path)
    monkeypatch.setattr(real, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(real, "HELD_OUT", 10)
    runs = {label: seeds for label, seeds in real.sections(real.collect())["bf16"][2].items() if seeds}
    rows = real.cpu_rows(runs)
    assert rows[2] == ("| grpo bf16 | AMD EPYC | 0, 1 | 0.000 ± 0.000 → 0.550 ± 0.071 | 2 threads of an AMD EPYC "
                       "(bf16 autocast) (seeds 0, 1) |")
    assert rows[3] == ("| grpo bf16 | Intel Xeon Processor | 2 | 0.000 → 0.550 | 1 thread of an Intel Xeon Processor "
                       "(bf16 autocast), 2 runs at a time (seed 2) |")
    assert rows[-1] == "| sapo bf16 | not recorded | 0 | 0.000 → 0.300 | not recorded (seed 0) |"
    # On the AMD EPYC alone grpo 0.55 and gspo 0.05, each of variance 0.005 over 2 seeds: 0.5 ± 0.071 at 2 df (t 4.30,
    # 0.304 to be beyond). grpo's one Intel seed is no arm there; dapo ran on the Intel Xeon alone.
    on_epyc = real.within_cpus(runs, "grpo bf16", "gspo bf16")
    assert list(on_epyc) == ["AMD EPYC"] and on_epyc["AMD EPYC"].value == pytest.approx(0.5)
    assert on_epyc["AMD EPYC"].error == pytest.approx(0.0707, abs=1e-4) and on_epyc["AMD EPYC"].df == 2
    assert real.within_cpus(runs, "grpo bf16", "dapo bf16") == {}
    # Over every run: grpo 0.55 (3 seeds, variance 0.0025), gspo 0.05 and dapo 0.95 (2 seeds, 0.005):
    # sqrt(0.0025 / 3 + 0.005 / 2) = 0.0577 at (1 / 300)^2 / ((1 / 1200)^2 / 2 + (1 / 400)^2) = 1.68 df, t 5.19 (0.30
    # to be beyond); gspo against dapo 0.0707 at 2 df. All three beyond; only grpo - gspo has a CPU that ran both.
    assert real.tally(runs) == (
        "Each mark is one comparison's own, at 95%. This table makes 3 comparisons at once, with no correction for "
        "multiplicity: were every loss alike, about one in twenty would still read beyond. 3 are beyond t standard "
        "errors over every run, of 3: 1 stands, beyond on each CPU that ran both arms at 2 seeds or more too: grpo "
        "bf16 − gspo bf16 +0.500; 2 have no CPU that ran both arms at 2 seeds, so loss and CPU are not separated (no "
        "verdict): grpo bf16 − dapo bf16 -0.400, gspo bf16 − dapo bf16 -0.900.")
    table = real.differences(runs)
    assert table[2].endswith("| AMD EPYC +0.500 ± 0.071 (t 4.30, beyond) | **yes** |")
    assert table[3].endswith("| no CPU ran both arms at 2 seeds | CPU not separated |")
    # A claim read from such a difference is no verdict: CISPO 0.05 below DAPO's 0.95 on no shared CPU.
    runs["cispo bf16"], runs["dapo bf16"] = runs.pop("gspo bf16"), runs["dapo bf16"]
    monkeypatch.setattr(real, "cpu_of", lambda label, seed: "AMD EPYC" if label == "cispo bf16" else
                        "Intel Xeon Processor")
    f = real.claims(runs, " bf16")[3]
    assert f.startswith("- (f) CISPO learns faster than DAPO at equal steps, keeping the gradient of the tokens DAPO's "
                        "clip drops: **inconclusive: CPU not separated**: held-out final 0.050 ± 0.071 (2 seeds)")
    monkeypatch.setattr(real, "cpu_of", lambda label, seed: "AMD EPYC")           # both on one CPU: it stands
    assert "clip drops: **does not hold here**:" in real.claims(runs, " bf16")[3]


def test_a_remark_s_numbers_are_its_record_s():
    rows = real.read_metrics(real.run_dir("dapo seq-mean", 0, real.RECORDS))
    times = sorted(r["step_time_s"] for r in rows if "step_time_s" in r)
    slow = next(r["step"] for r in rows if r.get("step_time_s") == times[-1])
    text = real.REMARKS[("dapo seq-mean", 0)]
    assert f"beside its step {slow} ({times[-1]:.0f} s, the others {times[0]:.1f}-{times[-2]:.1f} s)" in text



def test_the_lr_study_runs_each_arm_at_k_times_the_lr_and_counts_falls_by_the_toys_criterion(tmp_path, monkeypatch):
    by_label = {label: (script, flags) for label, script, flags in real.LR_ARMS}
    assert len(by_label) == 16 and by_label["grpo lr x1"] == ("grpo.py", ["--dtype", "bf16", "--lr", "1e-05"])
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
        if label != "dapo lr x30":                                     # a run with no record of its machine
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
    assert "on one NVIDIA H200 (bf16 autocast), 4 runs at a time (5 runs); not recorded (1 run) (each run's" in table
    assert "The base (step 0) there: 0.200" in table
    assert ("| grpo | 0.450 ± 0.071 (best 0.450 ± 0.071); fell 0/2, ended below 0/2 | "
            "0.050 ± 0.050 (best 0.233 ± 0.058); fell 1/3, ended below 2/3 | — | — |") in table
    assert "| dapo | — | — | — | 1 stopped at step 10 |" in table
    assert real.breaks(runs).endswith(": grpo x3 (3 seeds); dapo x30 (1 seed: seen, not a verdict, which needs 2) "
                                      "(the table in *Where each breaks* below).")


def test_the_rule_is_stated_once_in_methods_md_and_the_results_link_there():
    root = Path(__file__).resolve().parent.parent
    methods = (root / "benchmarks" / "METHODS.md").read_text()
    assert "\n## Verdicts\n" in methods and "](../METHODS.md#verdicts)" in bench.RULE
    # The rule's defining sentence, once in all the project's words; the results files carry only the link.
    rule = "the difference the claim predicts is more than t standard errors from zero"
    texts = {path: " ".join(path.read_text().split()) for path in
             [*(root / "benchmarks").glob("*.md"), *(root / "benchmarks" / "results").glob("*.md"),
              *(root / "docs").glob("*.md"), root / "README.md"]}
    assert [path.name for path, text in texts.items() if rule in text] == ["METHODS.md"]
    assert " ".join(methods.split()).count(rule) == 1
    for name in ("real.md", "study.md", "long.md"):                # each written by its generator
        assert texts[root / "benchmarks" / "results" / name].count(bench.RULE) == 1, name
    assert "](../benchmarks/METHODS.md#verdicts)" in texts[root / "docs" / "long-answers.md"]
    # METHODS.md's t at 1, 2, 4 and 8 degrees of freedom are the rule's own.
    t = [f"{bench.t_quantile(df):.2f}" for df in (1, 2, 4, 8)]
    assert f"t is {t[0]} at 1 degree of freedom, {t[1]} at 2, {t[2]} at 4 and {t[3]} at 8." in " ".join(methods.split())


def test_a_plain_run_does_five_seeds_an_arm_ppo_three_and_the_lr_study_two(tmp_path, monkeypatch):
    todo = []
    for name, value in (("ARITHMETIC", tmp_path / "arithmetic.jsonl"), ("gguf_file", lambda: "model.gguf"),
                        ("kept", lambda label, seed: seed == 0 and label == "grpo bf16")):    # one run recorded
        monkeypatch.setattr(real, name, value)
    monkeypatch.setattr(real.bench, "run_all", lambda one, runs, jobs: todo.extend(runs) or 0)
    bf16 = [arm for arm in real.ARMS if arm[0] in ("grpo bf16", "ppo bf16")]
    real.run_all(bf16, None, threads=1)
    assert [(label, seed) for label, _, _, seed in todo] == [("ppo bf16", 0), ("grpo bf16", 1), ("ppo bf16", 1),
                                                             ("grpo bf16", 2), ("ppo bf16", 2), ("grpo bf16", 3),
                                                             ("grpo bf16", 4)]
    todo.clear()
    real.run_all(real.LR_ARMS, None, threads=1)                          # 16 arms, 2 seeds each
    assert len(todo) == 32 and {seed for *_, seed in todo} == {0, 1}
    todo.clear()
    real.run_all(bf16, [2], threads=1)                                   # asked: those seeds, ppo's too
    assert [(label, seed) for label, _, _, seed in todo] == [("grpo bf16", 2), ("ppo bf16", 2)]
