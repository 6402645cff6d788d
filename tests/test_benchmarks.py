"""benchmarks/compare.py and memory.py: the arithmetic behind their tables, on hand-made numbers."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import compare  # noqa: E402
import memory  # noqa: E402


def rows(accuracies, rounds=1, step_time=0.5):
    """metrics.jsonl rows: step 0 is the base's evaluation; steps 1..n with an evaluation every 2 steps."""
    out = [{"step": 0, "eval_accuracy": accuracies[0]}]
    for step in range(1, 2 * (len(accuracies) - 1) + 1):
        row = {"step": step, "step_time_s": step_time, "accuracy": 0.5, "truncated_frac": 0.1 / step,
               "response_len_mean": 4.0, "reward_mean": 0.4 + 0.01 * step, "entropy": 0.2,
               "clip_frac": 0.01 * step, "routing_drift": 0.02,
               "token_ratio_var": 0.001 * step, "grad_norm": 1.0, "peak_memory_mb": 300 + step}
        if rounds > 1:
            row |= {"generation_rounds": rounds, "sampled_accuracy": 0.25, "sampled_truncated_frac": 0.0}
        if step % 2 == 0:
            row["eval_accuracy"] = accuracies[step // 2]
        out.append(row)
    return out


def test_time_to_target_counts_training_seconds_up_to_the_first_crossing():
    s = compare.summarise(rows([0.4, 0.5, 0.7, 0.6]), target=0.55)   # evaluations at steps 0, 2, 4, 6
    assert s["base"] == 0.4 and s["final"] == 0.6
    assert s["steps_to_target"] == 4 and s["seconds_to_target"] == pytest.approx(2.0)   # 4 steps x 0.5 s
    assert compare.summarise(rows([0.4, 0.5]), target=0.9)["steps_to_target"] is None


def test_per_run_scalars():
    s = compare.summarise(rows([0.4, 0.5, 0.7, 0.6]))                 # 6 steps
    assert s["clip_frac"] == pytest.approx(0.035)                    # mean of 0.01 .. 0.06 over every step
    assert s["ratio_var_max"] == pytest.approx(0.006)
    assert s["peak_memory_mb"] == 306 and s["seconds_per_step"] == pytest.approx(0.5)
    assert s["truncated_end"] == pytest.approx(0.1 / 6)               # the last 10% of 6 steps: step 6
    assert s["steps_to_truncation_2pct"] == 6                         # 0.1/5 = 0.02 is not below 2%; 0.1/6 is
    assert s["completions_per_step"] == 128 and s["at_equal_completions"] == s["final"]


def test_dynamic_sampling_run_is_also_read_at_equal_generated_completions():
    # Two generation rounds a step: 6 steps generate as much as 12 one-round steps; at the one-round
    # budget of 6 x 128 completions the run had done 3 steps, and the last evaluation by then was step 2.
    s = compare.summarise(rows([0.4, 0.5, 0.7, 0.6], rounds=2))
    assert s["completions_per_step"] == 256
    assert s["at_equal_completions"] == 0.5 and s["final"] == 0.6
    assert s["sampled_accuracy_end"] == 0.25                           # DAPO's own rate, not the kept batch's


def test_mean_and_std_over_seeds():
    assert compare.mean_std([0.1, 0.3]) == "0.200 ± 0.141"            # sample std: sqrt(0.02 / 1)
    assert compare.mean_std([4, None, 6], "{:.0f}") == "5 ± 1 (2/3 seeds)"
    assert compare.mean_std([None, None]) == "never"
    assert compare.mean_std([0.5]) == "0.500"


def test_half_gap_target_is_base_plus_half_the_gap_to_the_best_mean_final():
    runs = {"a": [rows([0.4, 0.6]), rows([0.4, 0.8])], "b": [rows([0.4, 0.5]), rows([0.4, 0.5])]}
    lines, base, target = compare.table("stress", runs)
    assert base == pytest.approx(0.4) and target == pytest.approx(0.4 + (0.7 - 0.4) / 2)
    assert len(lines) == 4 and lines[2].startswith("| a | 2 | 0.700 ± 0.141 |")


def test_figure_shows_the_mean_and_std_over_seeds_with_a_stated_smoothing():
    runs = {"a": [rows([0.4, 0.5, 0.7, 0.6]), rows([0.4, 0.6, 0.6, 0.8])]}
    sampled, _, greedy, _ = compare.panels("main", runs)
    steps, means, stds = greedy["series"]["a"]                        # evaluations at steps 0, 2, 4, 6
    assert steps == [0, 2, 4, 6] and means == pytest.approx([0.4, 0.55, 0.65, 0.7])
    assert stds == pytest.approx([0.0, 0.1 / 2**0.5, 0.1 / 2**0.5, 0.2 / 2**0.5])
    assert greedy["ylim"] == (0, 1) and greedy["lines"] == (0.4,)     # from 0, the base dashed
    long = {"a": [rows([0.4] * 31)]}                                  # 60 steps: smoothed over 60 // 30 = 2
    assert compare.smoothing(long) == 2
    assert compare.panels("main", long)[0]["series"]["a"][1][:2] == [0.5, 0.5]


def test_hf_moe_figure_plots_the_partial_credit_reward_its_table_reports():
    runs = {"grpo": [rows([0.05, 0.1]), rows([0.05, 0.2])]}          # reward_mean 0.41, 0.42 at steps 1, 2
    assert compare.sampled_key("hf-moe") == "reward_end" and "reward_end" in compare.COLUMNS["hf-moe"]
    assert "sampled_accuracy_end" not in compare.COLUMNS["hf-moe"]
    top = compare.panels("hf-moe", runs)[0]
    assert "partial credit" in top["y"] and top["series"]["grpo"][1] == pytest.approx([0.41, 0.42])
    assert compare.summarise(runs["grpo"][0])["reward_end"] == pytest.approx(0.42)   # the table's cell, same key
    for name in ("stress", "fine"):                                   # elsewhere both show the sampled accuracy
        assert compare.sampled_key(name) == "sampled_accuracy_end" and "sampled_accuracy_end" in compare.COLUMNS[name]
        assert compare.panels(name, runs)[0]["series"]["grpo"][1] == pytest.approx([0.5, 0.5])


def test_length_figure_plots_truncation_and_length():
    runs = {"dapo": [rows([0.4, 0.5, 0.7])]}
    truncated, length, _, _ = compare.panels("length", runs)
    assert truncated["series"]["dapo"][1] == pytest.approx([0.1, 0.05, 0.1 / 3, 0.025])
    assert truncated["lines"] == (0.02,) and length["series"]["dapo"][1] == [4.0] * 4


def test_unknown_experiment_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        compare.main(["--only", "main,chess", "--report"])
    assert e.value.code == 2 and "unknown experiment chess" in capsys.readouterr().err


def test_memory_extrapolates_linearly_in_layers_and_in_experts():
    # Dense, 1-3 layers: 5 + 2 per layer gives 61 at 28 layers; with noise, the least-squares line
    # through 7, 10, 11 (slope 2, 28/3 at 2 layers) gives 28/3 + 4 at 4 layers.
    assert memory.extrapolate([(1, None, 7.0), (2, None, 9.0), (3, None, 11.0)], 28) == pytest.approx(61.0)
    assert memory.extrapolate([(1, None, 7.0), (2, None, 10.0), (3, None, 11.0)], 4) == pytest.approx(28 / 3 + 4)
    # MoE: with 8 experts 10 and 13 at 1 and 2 layers (151 at 48), with 16 experts 14 and 19 (249 at 48):
    # 98 more for 8 more experts, so 151 + 98 x 120 / 8 for 48 layers of 128 experts.
    moe = [(1, 8, 10.0), (2, 8, 13.0), (1, 16, 14.0), (2, 16, 19.0)]
    assert memory.extrapolate(moe, 48, 128) == pytest.approx(151 + 98 * 15)
    assert memory.extrapolate([(28, None, 5.0)], 28) == 5.0                   # --device cuda: full depth measured


def test_memory_fits_counts_the_cuda_context_and_keeps_a_tenth_of_the_card():
    GiB = 2**30
    assert memory.fits(21 * GiB) == "24 GB: yes, 40 GB: yes, 80 GB: yes"     # 21.5 GiB <= 0.9 x 24
    assert memory.fits(22 * GiB) == "24 GB: tight, 40 GB: yes, 80 GB: yes"   # 22.5 GiB: over 21.6, within 24
    assert memory.fits(40 * GiB) == "24 GB: no, 40 GB: no, 80 GB: yes"       # 40.5 GiB: over the card
