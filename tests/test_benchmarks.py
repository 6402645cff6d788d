"""benchmarks/compare.py and memory.py: the arithmetic behind their tables, on hand-made numbers."""
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench  # noqa: E402
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


def test_the_cpu_is_named_without_trademark_signs(tmp_path, monkeypatch):
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R)  Processor\nflags\t: fpu\n")
    monkeypatch.setattr(bench, "Path", lambda _: tmp_path / "cpuinfo")
    assert bench.cpu_name() == "Intel Xeon Processor"
    monkeypatch.setattr(bench, "Path", lambda _: tmp_path / "absent")
    assert bench.cpu_name() == "a CPU"


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


def test_seeds_are_seed_ids_as_in_real_py(tmp_path, monkeypatch):
    # --seeds 0 is seed 0 alone, 2,4 seeds 2 and 4; unset, the study's three (two with --quick). The report reads
    # the study's seeds and any others run.
    monkeypatch.setattr(compare, "RUNS", tmp_path)
    monkeypatch.setattr(compare.bench, "require", lambda *a: None)
    ran, reported = [], []
    monkeypatch.setattr(compare.bench, "run_all", lambda launch, todo, jobs: ran.append(
        sorted({int(flags[flags.index("--seed") + 1]) for _, flags, _, _ in todo})) or 0)
    monkeypatch.setattr(compare, "report", lambda seeds, quick: reported.append(list(seeds)))
    for given in (["--seeds", "0"], ["--seeds", "4,2"], [], ["--quick"]):
        compare.main(["--only", "main"] + given)
    assert ran == [[0], [2, 4], [0, 1, 2], [0, 1]]
    assert reported == [[0, 1, 2], [0, 1, 2, 4], [0, 1, 2], [0, 1, 2]]


@pytest.mark.parametrize("bad", ["1.5", "two", "-1", "", "0,,1"])
def test_a_bad_seeds_value_is_refused_in_one_line(bad, monkeypatch, capsys):
    monkeypatch.setattr(compare, "run_all", lambda *a: pytest.fail("ran with a bad --seeds"))
    with pytest.raises(SystemExit) as stop:
        compare.main(["--only", "main", "--seeds", bad])
    err = capsys.readouterr().err.splitlines()
    assert stop.value.code == 2 and len(err) == 1
    assert err[0].endswith(f": --seeds {bad!r}: seed ids, comma-separated, each 0 or more (as 0,1,2)")


def test_memory_extrapolates_along_the_line_through_one_and_two_layers():
    # One layer's measurement + (L - 1) x the per-layer slope: 7 at 1 layer, 9 at 2, so 7 + 27 x 2 at 28 layers.
    assert memory.line_through(7.0, 9.0, 28) == 61.0
    dense = {(1, None): {"a": 7.0}, (2, None): {"a": 9.0}, (4, None): {"a": 100.0}}   # 4 layers: the check only
    assert memory.estimate(dense, "a", 28) == 61.0 and memory.estimate(dense, "a", 4) == 100.0
    # MoE: with 8 experts 10 and 13 at 1 and 2 layers (10 + 47 x 3 = 151 at 48), with 16 experts 14 and 19
    # (14 + 47 x 5 = 249): 98 more for 8 more experts, so 151 + 98 x 120 / 8 for 48 layers of 128 experts.
    moe = {(1, 8): {"c": 10.0}, (2, 8): {"c": 13.0}, (1, 16): {"c": 14.0}, (2, 16): {"c": 19.0}}
    assert memory.estimate(moe, "c", 48, 128) == pytest.approx(151 + 98 * 15)
    assert memory.estimate({(28, None): {"a": 5.0}}, "a", 28) == 5.0          # --device cuda: full depth measured


def test_memory_cards_are_in_gib_and_fits_keeps_a_tenth_of_the_card_and_the_cuda_context():
    assert [round(size, 2) for size in memory.CARDS.values()] == [22.35, 37.25, 74.51, 131.32]   # 24e9 / 2^30, ...
    # 24 GB: 90% is 20.12 GiB; with the 0.5 GiB context a peak of 19.6 fits in it, 19.7 only in the card, 21.9 not.
    assert memory.fits(19.6) == "24 GB: yes, 40 GB: yes, 80 GB: yes, 141 GB: yes"
    assert memory.fits(19.7) == "24 GB: tight, 40 GB: yes, 80 GB: yes, 141 GB: yes"
    assert memory.fits(21.9) == "24 GB: no, 40 GB: yes, 80 GB: yes, 141 GB: yes"
    assert memory.fits(33.1) == "24 GB: no, 40 GB: tight, 80 GB: yes, 141 GB: yes"   # 33.6 > 0.9 x 37.25 = 33.53
    assert memory.fits(66.5) == "24 GB: no, 40 GB: no, 80 GB: yes, 141 GB: yes"      # 67.0 <= 0.9 x 74.51 = 67.06
    assert memory.fits(74.1) == "24 GB: no, 40 GB: no, 80 GB: no, 141 GB: yes"       # 74.6 > 74.51: not even tight
    # 141 GB (the H200): 131.32 GiB, 90% 118.18; 117.6 + 0.5 fits in that, 117.7 + 0.5 only in the card, 130.9 not.
    assert memory.fits(117.6).endswith("141 GB: yes") and memory.fits(117.7).endswith("141 GB: tight")
    assert memory.fits(130.8).endswith("141 GB: tight") and memory.fits(130.9).endswith("141 GB: no")


def test_memory_script_peaks_add_what_each_script_holds_to_the_largest_phase():
    # (a) 16 GiB for 2^30 parameters, a critic of half as many; phases: generation 5, (b) 2, (c) 10.
    peaks = memory.script_peaks(16.0, 5.0, 2.0, 10.0, 2**30, 2**29)
    assert peaks["grpo.py"] == 26.0                                          # 16 + 10
    assert peaks["grpo.py --beta 0.04"] == 30.0                              # + the reference's fp32 weights, 4
    assert peaks["ppo.py"] == 38.0                                           # + the critic's 8 + the reference's 4
    # dapo.py: + 5 rounds x 64 completions x (662 x 16 + 512 x 8 + 1) bytes of token ids, masks and entropies.
    assert peaks["dapo.py"] - peaks["grpo.py"] == pytest.approx(5 * 64 * 14689 / 2**30)
    assert memory.script_peaks(16.0, 5.0, 2.0, 3.0, 2**30, 2**29)["grpo.py"] == 21.0   # generation is the largest
    moe = memory.script_peaks(16.0, 5.0, 2.0, 10.0, 2**30, 2**29, routing=0.5)   # an MoE's recorded experts
    assert [moe[s] - peaks[s] for s in peaks] == [0.5] * 4
    # LoRA: (a) 3 GiB (a bf16 base and its adapters); the reference is the policy with its adapters off, no copy, and
    # the critic trains 2^26 parameters of its own (adapters and value head) at 16 B each: 1 GiB, on the shared base.
    lora = memory.script_peaks(3.0, 5.0, 2.0, 10.0, 2**30, 2**26, lora=True)
    assert lora["grpo.py"] == 13.0 and lora["grpo.py --beta 0.04"] == 13.0 and lora["ppo.py"] == 14.0


def test_memory_critic_has_the_policy_trunk_and_a_scalar_head():
    from transformers import AutoModelForCausalLM
    for tied in (True, False):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(memory.config(
                "Qwen3-0.6B", 1, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                head_dim=8, tie_word_embeddings=tied))
            policy, critic = memory.n_params(model), memory.n_params(memory.ppo.make_critic(model))
        # Tied: the embedding stays as the critic's input, + a 16 -> 1 head; untied: the 151,936 x 16 head goes.
        assert critic - policy == (17 if tied else 17 - 151936 * 16)


def test_memory_points_are_kept_and_measured_only_when_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "POINTS_DIR", tmp_path)
    taken = []
    take = lambda: taken.append(1) or {"a": len(taken)}
    assert memory.point("x", take, False, False) is None                     # missing, nothing measured
    assert memory.point("x", take, True, False)["a"] == 1                    # measured and kept
    assert memory.point("x", take, True, False)["a"] == 1 and len(taken) == 1    # kept: not measured again
    assert memory.point("x", take, False, True)["a"] == 1                    # --rerun of another part: kept
    assert memory.point("x", take, True, True)["a"] == 2                     # --rerun: measured again
    assert memory.point("y", lambda: {"error": "boom"}, True, False) == {"error": "boom"}
    assert sorted(f.name for f in tmp_path.iterdir()) == ["x.json"]          # a failure is not kept


def test_memory_on_a_cpu_records_the_kv_cache_in_the_dtypes_cuda_computes_in(monkeypatch):
    # A tiny Qwen3 of the real width's shape, 4 sequences of 8 + 8 tokens, through the whole measurement on this CPU.
    monkeypatch.setattr(memory, "MODELS", {"tiny": dict(hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                                        num_key_value_heads=1, tie_word_embeddings=True)})
    monkeypatch.setattr(memory, "VOCAB", 40)
    monkeypatch.setattr(memory, "PAD", 38)
    monkeypatch.setattr(memory, "EOS", 39)
    monkeypatch.setattr(memory, "WORLD", dataclasses.replace(memory.WORLD, pad_id=38, eos_ids=(39,), max_new_tokens=8))
    for name, value in (("PROMPT", 8), ("COMPLETION", 8), ("COMPLETIONS", 4), ("MINIBATCHES", 2)):
        monkeypatch.setattr(memory, name, value)
    monkeypatch.setattr(memory.common, "autocast", memory.common.autocast)          # whatever measure does to it
    point = memory.measure("tiny", 1, None, "cpu")
    # Under bf16 autocast: values in bf16 (2 bytes), keys in fp32 after the rotary embedding (4): the committed points'
    # 6, which a GPU's run measures; fp32 would be 8.
    assert point["kv_bytes"] == 6
    assert {json.loads(f.read_text())["kv_bytes"] for f in memory.POINTS_DIR.glob("*-layers*.json")
            if not f.stem.endswith("-lora")} == {6}


def test_memory_unknown_part_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        memory.main(["--only", "table,chess", "--report"])
    assert e.value.code == 2 and "unknown part chess" in capsys.readouterr().err


def test_a_run_fell_when_it_dropped_more_than_a_tenth_below_its_base_and_stayed_there():
    evals = lambda *accs: list(enumerate(accs))                  # [(step, accuracy)], the base first
    assert compare.fell(evals(0.40, 0.35, 0.25, 0.20, 0.29))     # below 0.30 from step 2 to the end
    assert not compare.fell(evals(0.40, 0.25, 0.31, 0.20))       # came back to 0.31 once: did not stay
    assert not compare.fell(evals(0.40, 0.35, 0.30, 0.31))       # 0.30 is exactly 0.10 below: not more
    assert compare.fell(evals(0.40, 0.50, 0.29))                 # a fall at the last evaluation counts
    assert not compare.fell(evals(0.40, 0.60, 0.80))
    # Ended below, beside the criterion: only the last evaluation counts.
    assert compare.ended_below(evals(0.40, 0.25, 0.31, 0.20)) and not compare.fell(evals(0.40, 0.25, 0.31, 0.20))
    assert not compare.ended_below(evals(0.40, 0.20, 0.31)) and not compare.ended_below(evals(0.40, 0.35, 0.45))
    # Exactly 0.10 below is not more than 0.10 below, whichever way the float subtraction rounds.
    assert not any(compare.ended_below(evals(base, base - 0.1 + 1e-12 * k)) for base in (0.4, 0.418, 0.435, 0.375)
                   for k in (-1, 0, 1))


def test_lr_table_reports_final_accuracy_and_fallen_seeds_per_arm_model_and_multiple():
    run = lambda *accs: [{"step": 0, "eval_accuracy": accs[0]}] + [{"step": i, "eval_accuracy": a, "accuracy": 0.3}
                                                                    for i, a in enumerate(accs[1:], 1)]
    runs = {"grpo lr x1 toy MoE": [run(0.4, 0.5, 0.6), run(0.4, 0.5, 0.8)],          # finals 0.6, 0.8
            "grpo lr x3 toy MoE": [run(0.4, 0.2, 0.1), run(0.4, 0.5, 0.5)],          # the first fell
            "dapo lr x30 fine toy": [run(0.2, 0.0, 0.0), run(0.2)[:1] + [{"step": 3, "accuracy": 0.5,
                                                                          "sampled_accuracy": 0.0}]]}
    runs["dapo lr x30 fine toy"][1][-1]["stopped"] = True                             # as collect() marks it
    results, bases = compare.lr_results(runs)
    assert results[("toy MoE", "grpo")] == {1: ([0.6, 0.8], 0, [], 0), 3: ([0.1, 0.5], 1, [], 1)}
    assert results[("fine toy", "dapo")] == {30: ([0.0], 1, [(3, 0.0)], 1)}         # the policy's own samples
    assert bases == {"toy MoE": 0.4, "fine toy": 0.2}
    lines = compare.lr_table(runs)
    assert lines[0] == "| model | run | lr x1 (0.0001) | lr x3 (0.0003) | lr x10 (0.001) | lr x30 (0.003) |"
    assert lines[2] == ("| toy MoE (base 0.400) | grpo | 0.700 ± 0.141, 0/2 fell, 0/2 ended below | 0.300 ± 0.283, "
                        "1/2 fell, 1/2 ended below | — | — |")
    assert lines[3] == ("| fine toy (base 0.200) | dapo | — | — | — | 0.000, 1/1 fell, 1/1 ended below; 1 stopped at "
                        "step 3 (sampled acc 0.00) |")
    assert compare.lr_cell([], 0, [(2, 0.0), (5, 0.01)]) == "2 stopped at step 2/5 (sampled acc 0.00/0.01)"


def test_lr_experiment_scales_every_scripts_own_default_lr_alike():
    import common
    def toy_lr(script):                                # a toy run's --lr, once the scripts' checks have set it
        args = compare.importlib.import_module(script[:-3]).Args()
        common.check_common_args(args, min_group_size=1)               # ppo samples 1 a prompt
        return args.lr
    assert {toy_lr(script) for _, script, _ in compare.ARMS} == {compare.DEFAULT_LR}
    runs = compare.EXPERIMENTS["lr"][3]
    assert len(runs) == len(compare.ARMS) * len(compare.LR_TIMES) * len(compare.MODELS) == 40
    label, script, flags = runs[-1]
    assert label == "dapo lr x30 fine toy" and script == "dapo.py" and flags == ["--lr", "0.003"] + compare.FINE


def test_report_keeps_the_tables_of_experiments_whose_runs_are_not_here(tmp_path, monkeypatch):
    monkeypatch.setattr(compare, "RESULTS", tmp_path)
    monkeypatch.setattr(compare, "RUNS", tmp_path / "runs")
    (tmp_path / "study.md").write_text("# Study results\n\nintro\n\n## main: `--task add`, 600 steps\n\n| a |\n"
                                       "## stress: x\n\n| b |")                 # no blank line after either table
    compare.report(range(3), quick=False)
    text = (tmp_path / "study.md").read_text()
    assert "## main: `--task add`, 600 steps\n\n| a |\n\n## stress: x\n\n| b |\n" in text


def test_a_kept_table_and_long_md_link_to_the_rule_instead_of_copying_it(tmp_path, monkeypatch):
    monkeypatch.setattr(compare, "RESULTS", tmp_path)
    monkeypatch.setattr(compare, "RUNS", tmp_path / "runs")
    copied = ("**Verdicts.** A claim's verdict is one of four outcomes. *Holds here*: ... `sqrt(sum (d_i - mean)^2) / "
              "n`; else *unpaired*, `sqrt(p_A (1 - p_A) / n + p_B (1 - p_B) / n)`.")
    old_losses = compare.LOSSES_TEXT[:90] + " (the verdicts below; bench.RULE, as in long.md): older words."
    (tmp_path / "study.md").write_text(f"# Study results\n\n## losses: x\n\n| a |\n\n{old_losses}\n\n"
                                       f"{copied} Here n = 500 held-out problems.\n\n- (f) kept.\n")
    (tmp_path / "long.md").write_text(f"# Long answers\n\n## Verdicts\n\n{copied} Here n = 200 held-out problems.\n"
                                      "\nVERDICTS' text\n")
    compare.report(range(3), quick=False)
    study = (tmp_path / "study.md").read_text()
    assert f"## losses: x\n\n| a |\n\n{compare.LOSSES_TEXT}\n\n{bench.RULE} Here n = 500 held-out problems.\n\n" \
           "- (f) kept." in study
    assert "](../METHODS.md#the-toy-study)" in study.split("\n## ")[0]          # the header says where the method is
    assert (tmp_path / "long.md").read_text() == (f"# Long answers\n\n## Verdicts\n\n{bench.RULE} Here n = 200 "
                                                  "held-out problems.\n\nVERDICTS' text\n")
    assert "bench.RULE" not in compare.LOSSES_TEXT and "four outcomes." not in study


def test_defaults_runs_start_from_an_empty_cache_and_record_their_whole_wall_time(tmp_path, monkeypatch):
    seen = {}
    def fake_run(cmd, cwd, env, stdout, stderr):
        seen["cache"] = env["RL_CACHE_DIR"]
        if env["RL_CACHE_DIR"].startswith(str(tmp_path)):                       # never touch the suite's own cache
            Path(env["RL_CACHE_DIR"]).mkdir(exist_ok=True)                    # where the run would cache its base
        return subprocess.CompletedProcess(cmd, 0)
    monkeypatch.setattr(subprocess, "run", fake_run)
    out = tmp_path / "defaults" / "grpo" / "seed0"
    assert compare.launch(("grpo.py", [], out, 2)) == 0
    assert seen["cache"] == str(out / "cache") and not (out / "cache").exists()  # its own, emptied after
    assert 0 <= float((out / "wall_seconds").read_text()) < 5
    compare.launch(("grpo.py", [], tmp_path / "main" / "grpo" / "seed0", 1))
    assert seen["cache"] != str(tmp_path / "main" / "grpo" / "seed0" / "cache")  # only defaults


def test_report_reads_only_finished_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(compare, "RUNS", tmp_path)
    for seed, last in ((0, 150), (1, 40)):                          # seed 1 was cut short at step 40
        out = compare.run_dir("lr", "grpo lr x3 toy MoE", seed, False)
        out.mkdir(parents=True)
        (out / "metrics.jsonl").write_text('{"step": 0, "eval_accuracy": 0.4}\n'
                                           f'{{"step": {last}, "eval_accuracy": 0.2, "accuracy": 0.1}}\n')
    assert [rs[-1]["step"] for rs in compare.collect("lr", range(3), False)["grpo lr x3 toy MoE"]] == [150]


def test_long_experiment_runs_every_arm_at_every_length_on_both_toys_plus_dapo_s_mean_and_the_stressed_runs():
    runs = compare.EXPERIMENTS["long"][3]
    assert compare.LENGTHS == {"toy MoE": (2, 10, 24), "fine toy": (2, 10)}              # the fine toy stops at 44
    assert len(runs) == len(compare.ARMS) * (3 + 2) + 3 + 2 + 3 == 33
    parts = {label: compare.LONG[label] for label, _, _ in runs}
    assert {tokens for _, tokens, _, _ in parts.values()} == {12, 44, 100}               # 4 x length + 4
    label, script, flags = runs[0]
    assert (label, script, flags) == ("ppo, 12 tokens, toy MoE", "ppo.py", ["--chain-length", "2"])
    assert compare.run_flags("long", flags, False) == ["--task", "chain", "--eval-size", "200", "--chain-length",
                                                       "2", "--steps", "150", "--eval-every", "12", "--save-every",
                                                       "0"]
    label, script, flags = runs[-1]
    assert parts[label] == ("gspo", 44, "fine toy", "stressed") and script == "gspo.py"
    assert flags == ["--chain-length", "10"] + compare.FINE + compare.STRESSED
    assert ("dapo, sequence mean, 8-100 tokens, toy MoE, mixed lengths", "dapo.py",
            ["--no-token-level-loss", "--chain-length", "24", "--task", "chains"]) in runs     # after --task chain
    assert ("grpo, 44 tokens, dense toy", "grpo.py", ["--chain-length", "10", "--n-experts", "1"]) in runs


def long_rows(accuracies, ev=None, ratio_var=0.01):
    out = rows(accuracies)
    for r in out[1:]:
        r |= {"token_ratio_var_q1": ratio_var / 2, "token_ratio_var_q4": ratio_var * 2, "routing_drift_q1": 0.01,
              "routing_drift_q4": 0.03, "clip_frac_q1": 0.001, "clip_frac_q4": 0.004, "token_ratio_var": ratio_var}
        r |= {"explained_variance_q1": ev[0], "explained_variance_q4": ev[1]} if ev else {}
    out[-1]["wall_seconds"] = 1800.0
    return out


def without_figures(monkeypatch):
    """The long report's figures need matplotlib (benchmarks/requirements.txt), which the suite does not install:
    record which files it would draw instead."""
    drawn = []
    monkeypatch.setattr(compare, "long_figure", lambda runs, path: drawn.append(path.name))
    monkeypatch.setattr(compare, "long_claims_figure", lambda runs, path: drawn.append(path.name))
    return drawn


def test_long_report_gives_one_table_per_model_and_length_the_criterion_and_every_command(tmp_path, monkeypatch):
    runs = {label: [] for label, _, _ in compare.EXPERIMENTS["long"][3]}
    runs["ppo, 12 tokens, toy MoE"] = [long_rows([0.4, 0.5, 0.6], ev=(0.5, 0.1)), long_rows([0.4, 0.5, 0.7],
                                                                                          ev=(0.7, 0.3))]
    runs["grpo, 12 tokens, toy MoE"] = [long_rows([0.4, 0.25, 0.2]), long_rows([0.4, 0.2, 0.45])]  # one fell
    runs["grpo + replay, 12 tokens, toy MoE"] = [long_rows([0.4, 0.25, 0.35, 0.25])]  # ended below, did not fall
    runs["grpo, 100 tokens, toy MoE"] = [long_rows([0.3, 0.3, 0.4], ratio_var=0.5)]
    runs["gspo, 44 tokens, fine toy, stressed"] = [long_rows([0.5, 0.4, 0.3]), long_rows([0.5, 0.3, 0.2])]
    runs["gspo, 44 tokens, fine toy, stressed"][1][-1]["stopped"] = True        # fell too, but stopped: apart
    for seeds in runs.values():
        for seed, rs in enumerate(seeds):
            rs[-1]["seed"] = seed                                                 # as collect() marks them
    monkeypatch.setattr(compare, "RUNS", tmp_path)
    compare.elapsed_file("long", False).write_text("50.0 min, 60 runs, 2 at a time on 1 thread(s) each: long\n")
    drawn = without_figures(monkeypatch)
    compare.long_report(runs, False, tmp_path)
    assert drawn == ["long.png", "long-claims.png"]
    text = (tmp_path / "long.md").read_text()
    sections = text.split("\n## ")
    assert [s.split("\n")[0] for s in sections[1:4]] == ["toy MoE, 12 tokens", "toy MoE, 100 tokens",
                                                         "fine toy, 44 tokens, stressed"]
    assert "8 runs (of 66 planned: the others have not run yet) of 150 steps" in text
    assert "240 min of run time" in text and "about 120 min on 2 cores" in text
    assert "elapsed.txt): 50.0 min, 60 runs" in text and "seeds 0, 1." in text
    assert "more than 0.10 below its base" in text
    table = sections[1].split("\n")
    columns = table[4].split(" | ")
    assert columns[:5] == ["| run", "seeds", "final eval acc", "seeds that fell", "seeds that ended 0.10 below"]
    ppo, grpo = table[6].split(" | "), table[7].split(" | ")
    assert ppo[:5] == ["| ppo", "2", "0.650 ± 0.071", "0/2", "0/2"]
    assert grpo[:5] == ["| grpo", "2", "0.325 ± 0.177", "1/2", "1/2"]
    assert table[8].split(" | ")[:5] == ["| grpo + replay", "1", "0.250", "0/1", "1/1"]
    ev = columns.index("critic explained variance, first quarter")
    assert ppo[ev:ev + 2] == ["0.600 ± 0.141", "0.200 ± 0.141"] and grpo[ev] == "—"
    assert ("| gspo, 44 tokens, fine toy, stressed | `python gspo.py --task chain --eval-size 200 --chain-length 10 "
            "--n-layers 4 --n-experts 64 --top-k 8 --expert-hidden 16 --minibatches 8 --steps 150 --eval-every 12 "
            "--save-every 0` |") in text
    stressed = sections[3].split("\n")
    assert "no run ended above the base" in stressed[2]
    gspo = stressed[6].split(" | ")
    assert gspo[:5] == ["| gspo", "2", "0.250 ± 0.071", "1/2, 1 stopped", "1/2"]
    assert gspo[columns.index("steps to half-gap")] == "—"                           # no target to reach
    claims = text.split("## The claims, quantity by length")[1]
    assert "| claim | quantity | model | run | 12 tokens | 100 tokens |" in claims     # unstressed lengths only
    assert "| (a) | PPO's critic: explained variance, last quarter | toy MoE | ppo | 0.200 ± 0.141 | — |" in claims
    assert "| (b) | token-ratio variance, mean over steps | toy MoE | grpo | 0.01 ± 0 | 0.5 |" in claims
    assert "| (c) | seeds that fell | toy MoE | grpo | 1/2 | 0/1 |" in claims
    assert "| (c) | seeds that ended 0.10 below | toy MoE | grpo + replay | 1/1 | — |" in claims
    points = compare.long_points(runs, "ratio_var_mean")
    assert points[("grpo", "toy MoE")] == [(12, pytest.approx(0.01), 0.0), (100, pytest.approx(0.5), 0.0)]
    assert ("gspo", "fine toy") not in points                                       # stressed runs apart


@pytest.mark.slow
def test_long_quick_form_runs_the_scripts_and_reports(tmp_path, monkeypatch):
    """Three of the quick form's runs for real (2 totals a chain: 12 tokens, the base the learning tests share;
    chains of 1 and 2 mixed), one seed, then long.md from them."""
    monkeypatch.setattr(compare, "RUNS", tmp_path)
    picked = [run for run in compare.QUICK_RUNS["long"] if run[0] in (
        "ppo, 12 tokens, toy MoE", "grpo, 12 tokens, toy MoE",
        "dapo, sequence mean, 8-12 tokens, toy MoE, mixed lengths")]
    monkeypatch.setitem(compare.QUICK_RUNS, "long", picked)
    assert compare.run_all(["long"], [0], quick=True, jobs=2, threads=1, rerun=False) == 0
    runs = compare.collect("long", [0], quick=True)
    ppo = [r for r in runs["ppo, 12 tokens, toy MoE"][0] if "step_time_s" in r]
    assert len(ppo) == 6 and all(r["response_len_mean"] > 8 for r in ppo)          # 12 tokens at the base
    assert {"explained_variance_q1", "explained_variance_q4", "token_ratio_var_q4", "clip_frac_q1"} <= ppo[0].keys()
    drawn = without_figures(monkeypatch)
    compare.long_report(runs, True, tmp_path)
    assert drawn == ["long.png", "long-claims.png"]
    text = (tmp_path / "long.md").read_text()
    assert "## toy MoE, 12 tokens" in text and "| ppo | 1 |" in text and "| grpo | 1 |" in text
    mixed = [r for r in runs["dapo, sequence mean, 8-12 tokens, toy MoE, mixed lengths"][0] if "step_time_s" in r]
    assert 8 < sum(r["response_len_mean"] for r in mixed) / len(mixed) < 12            # lengths 8 and 12 mixed
    assert "## toy MoE, 8-12 tokens, mixed lengths" in text and "| dapo, sequence mean | 1 |" in text


def test_bases_unknown_base_is_refused(capsys):
    import bases
    with pytest.raises(SystemExit) as stop:
        bases.main(["--only", "chain 7"])
    assert stop.value.code == 2 and "unknown base chain 7" in capsys.readouterr().err
    lengths = set(compare.LENGTHS["toy MoE"])                                       # the long experiment's
    assert {bases.BASES[f"chain {n}"][1] for n in lengths} == lengths


def test_bases_gives_each_base_its_completion_tokens_as_its_task_makes_them():
    import bases
    # add: '0' to '198' and EOS; progression: 1 to 8 terms of 2 digits; chain: 4 x length + 4; chains: 1 to 24.
    assert [bases.tokens(label) for label in ("add", "progression", "chain 2", "chain 24", "chains 24")] == \
        ["2-4", "3-24", "12", "100", "8-100"]


def test_bases_keeps_the_rows_it_did_not_measure_again(tmp_path, monkeypatch):
    import bases
    monkeypatch.setattr(bases, "RESULTS", tmp_path)
    trials = iter([(0.40, 30.0), (0.42, 31.0), (0.41, 29.0), (0.40, 20.0)] * 2)
    monkeypatch.setattr(bases, "build", lambda task, length, model, seed, threads: next(trials))
    bases.main(["--only", "chain 10"])
    (tmp_path / "bases.md").write_text((tmp_path / "bases.md").read_text() + "| add | 3-4 | old row |\n")
    bases.main(["--only", "chain 2"])
    rows = [line for line in (tmp_path / "bases.md").read_text().splitlines() if line.startswith("| ")][2:]
    assert rows == ["| add | 2-4 | old row |",                   # in BASES' order, its tokens from the code
                    "| chain 2 | 12 | 0.400 | 0.420 | 0.410 | 0.400 | 0.020 | 30 / 20 |",
                    "| chain 10 | 44 | 0.400 | 0.420 | 0.410 | 0.400 | 0.020 | 30 / 20 |"]


def lrun(final, base=0.4, ev=None, ratio_var=0.01, clip=0.01, correct=None):
    """A long-experiment run from `base` to `final` (one evaluation between), its clip fraction, and the problems its
    last evaluation answered right, as collect() marks them."""
    rs = long_rows([base, base, final], ev, ratio_var)
    for r in rs[1:]:
        r["clip_frac"] = clip
    rs[-1]["correct"] = correct
    return rs


def test_long_verdicts_give_each_claim_one_of_four_outcomes_per_model_by_the_rule():
    assert compare.held_out("long", False) == 200 and compare.held_out("long", True) == 100
    runs = {label: [] for label, _, _ in compare.EXPERIMENTS["long"][3]}
    # Two seeds of finals x and x + 0.02 have a variance of 0.0002: 0.0001 in a difference's squared error.
    runs |= {"ppo, 12 tokens, toy MoE": [lrun(0.70), lrun(0.72)],
             # first quarter 0.5 +- 0.25 over 2 seeds: 2 standard errors above 0, within t (12.71 at 1 df): not testable
             "ppo, 100 tokens, toy MoE": [lrun(0.40, ev=(0.25, 0.0)), lrun(0.42, ev=(0.75, 0.0))],
             "grpo, 12 tokens, toy MoE": [lrun(0.50), lrun(0.52)],
             "grpo, 100 tokens, toy MoE": [lrun(0.41, ratio_var=v) for v in (0.5, 0.6, 0.7)],
             "grpo + replay, 12 tokens, toy MoE": [lrun(0.5, ratio_var=0.001)] * 2,
             "grpo + replay, 100 tokens, toy MoE": [lrun(0.40, ratio_var=0.001), lrun(0.42, ratio_var=0.001)],
             "gspo, 12 tokens, toy MoE": [lrun(x, ratio_var=0.001, clip=0.2) for x in (0.50, 0.52)],
             "gspo, 100 tokens, toy MoE": [lrun(x, ratio_var=0.001, clip=0.2) for x in (0.40, 0.42)],
             "ppo, 44 tokens, fine toy": [lrun(0.5, ev=(0.50, 0.10)), lrun(0.5, ev=(0.56, 0.18))],
             "grpo, 44 tokens, fine toy, stressed": [lrun(0.20), lrun(0.22)],         # ended 0.2 below its base
             "grpo + replay, 44 tokens, fine toy, stressed": [lrun(0.40), lrun(0.42)],
             "gspo, 44 tokens, fine toy, stressed": [lrun(0.40), lrun(0.42)],
             "dapo, 8-100 tokens, toy MoE, mixed lengths": [lrun(0.6, correct="1" * 120 + "0" * 80)],
             "dapo, sequence mean, 8-100 tokens, toy MoE, mixed lengths": [lrun(0.5, correct="1" * 100 + "0" * 100)]}
    a, lead, b, c, d, e = compare.long_verdicts(runs, 200)
    # Fine toy: first quarter 0.53 +- 0.03 (1 df: above 0 by 17.7 standard errors, t 12.71); first minus last, of
    # the same runs, so seed by seed: 0.40 and 0.38, 0.39 +- 0.01 at 1 df (unpaired it would be +- 0.05 at 1.9 df).
    assert a == ("- (a) PPO's critic knows late positions worse: toy MoE: **not testable here** (at 100 tokens, first "
                 "/ last quarter 0.500 ± 0.354 / 0.000 ± 0.000: +0.500 ± 0.250 (1.0 df, t 12.71)); fine toy: **holds "
                 "here** (at 44 tokens, first / last quarter 0.530 ± 0.042 / 0.140 ± 0.057: **+0.390 ± 0.010** (1.0 "
                 "df, t 12.71)).")
    # The lead: (0.71 - 0.51) - (0.41 - 0.41) from four arms' means, three with 0.0001 each, GRPO's at 100 tokens
    # none: sqrt(0.0003) = 0.017 at 0.0003^2 / (3 * 0.0001^2) = 3 df. The evaluation alone: sqrt(0.71 * 0.29 / 200 +
    # 0.51 * 0.49 / 200) = 0.0477 at 12 tokens, sqrt(2 * 0.41 * 0.59 / 200) = 0.0492 at 100, together 0.0685.
    assert lead == ("- (a) PPO's lead over GRPO shrinks or reverses with length: toy MoE: **holds here** (PPO − GRPO "
                    "+0.200 at 12 tokens, +0.000 at 100: **+0.200 ± 0.017** (3.0 df, t 3.18; evaluation ± 0.069, "
                    "unpaired)).")
    # GRPO's token-ratio variance 0.01 -> 0.6 +- sqrt(0.01 / 3) = 0.058 at 2 df (two significant digits: a variance
    # can be small); replay and GSPO stay level.
    assert b == ("- (b) token-ratio variance grows with length on MoE models; replay or GSPO remove the growth: toy "
                 "MoE: **holds here** (12 → 100 tokens: grpo **+0.59 ± 0.058** (2.0 df, t 4.30), grpo + replay +0 ± 0 "
                 "(2.0 df, t 4.30), gspo +0 ± 0 (2.0 df, t 4.30)).")
    # Nothing fell or ended below at 100 tokens: not testable. Stressed, GRPO ended 0.2 below its base and the others
    # did not: 0.2 +- 0.014 at 2 df; the evaluation alone sqrt(0.41 * 0.59 / 200 + 0.21 * 0.79 / 200) = 0.045.
    assert c == ("- (c) at length GRPO without replay is less stable than with replay and than GSPO: toy MoE, 100 "
                 "tokens: **not testable here** (replay − GRPO +0.000 ± 0.010 (1.0 df, t 12.71; evaluation ± 0.049, "
                 "unpaired); GSPO − GRPO +0.000 ± 0.010 (1.0 df, t 12.71; evaluation ± 0.049, unpaired)); fine toy, "
                 "44 tokens, stressed: **holds here** (replay − GRPO **+0.200 ± 0.014** (2.0 df, t 4.30; evaluation ± "
                 "0.045, unpaired); GSPO − GRPO **+0.200 ± 0.014** (2.0 df, t 4.30; evaluation ± 0.045, unpaired)).")
    # One run an arm: no verdict, however far beyond its evaluation's error the difference is (paired: the token-level
    # loss alone right on 20 of 200 problems, 0.1 +- sqrt(20 - 20^2 / 200) / 200 = 0.021).
    assert d == ("- (d) DAPO's token-level loss keeps long answers from being drowned out: toy MoE, 8-100 tokens, "
                 "mixed lengths: **inconclusive: needs seeds** (token-level − per-sequence mean +0.100 (one seed: no "
                 "error over seeds; evaluation ± 0.021, paired)).")
    assert e == ("- (e) GSPO clips far more, yet converges at least as fast: toy MoE: **inconclusive** (clip fraction "
                 "GSPO / GRPO and GSPO − GRPO: 12 tokens 20×, +0.000 ± 0.014 (2.0 df, t 4.30; evaluation ± 0.050, "
                 "unpaired); 100 tokens 20×, +0.000 ± 0.010 (1.0 df, t 12.71; evaluation ± 0.049, unpaired)).")
    # A second seed each, with its record: shares of A right 1 (100 problems), 1 (4), 1 (16), 0.5 (4), B's 1, 0.5, 0,
    # 0: differences 0.5 on 8 problems and 1 on 16, mean 0.1, sqrt(18 - 200 * 0.1^2) / 200 = 0.020.
    runs["dapo, 8-100 tokens, toy MoE, mixed lengths"].append(lrun(0.62, correct="1" * 124 + "0" * 76))
    runs["dapo, sequence mean, 8-100 tokens, toy MoE, mixed lengths"].append(lrun(0.52, correct="1" * 104 + "0" * 96))
    assert compare.long_verdicts(runs, 200)[4].endswith("mixed lengths: **holds here** (token-level − per-sequence "
                                                        "mean **+0.100 ± 0.014** (2.0 df, t 4.30; evaluation ± 0.020, "
                                                        "paired)).")
    runs["grpo + replay, 100 tokens, toy MoE"] = [lrun(0.4, ratio_var=v) for v in (0.3, 0.4, 0.5)]   # grows too
    runs["gspo, 12 tokens, toy MoE"] = [lrun(0.5, ratio_var=0.001, clip=0.05)] * 2       # clips only 5x at 12
    _, _, b, _, _, e = compare.long_verdicts(runs, 200)
    assert "toy MoE: **does not hold here** (12 → 100 tokens: grpo **+0.59 ± 0.058** (2.0 df, t 4.30), grpo + " \
           "replay **+0.4 ± 0.058**" in b
    assert "toy MoE: **does not hold here** (clip fraction GSPO / GRPO and GSPO − GRPO: 12 tokens 5×" in e
    runs["grpo, 12 tokens, toy MoE"] = [lrun(0.5, clip=0.0625)] * 2
    runs["gspo, 12 tokens, toy MoE"] = [lrun(0.5, clip=0.625)] * 2                     # exactly 10x is far more
    assert "toy MoE: **inconclusive** (clip fraction GSPO / GRPO and GSPO − GRPO: 12 tokens 10×" in \
        compare.long_verdicts(runs, 200)[5]
    runs["gspo, 44 tokens, fine toy, stressed"] = [lrun(0.40)]                            # one seed: that part
    assert "stressed: **inconclusive: needs seeds** (replay − GRPO **+0.200 ± 0.014**" in compare.long_verdicts(runs,
                                                                                                            200)[3]
    runs["ppo, 100 tokens, toy MoE"] = runs["ppo, 100 tokens, toy MoE"][:1]                # one seed: no verdict
    del runs["ppo, 44 tokens, fine toy"]
    assert compare.long_verdicts(runs, 200)[0] == ("- (a) PPO's critic knows late positions worse: no verdict: its "
                                                   "runs are not here (2 seeds an arm at least).")


def test_a_claim_made_of_parts_holds_when_all_do_and_fails_when_any_does():
    assert compare.combined(["holds here", "holds here"]) == "holds here"
    assert compare.combined(["holds here", "inconclusive"]) == "inconclusive"
    assert compare.combined(["inconclusive", "does not hold here", "holds here"]) == "does not hold here"
    assert compare.combined(["not testable here"] * 2) == "not testable here"
    assert compare.combined(["holds here", "inconclusive: needs seeds"]) == "inconclusive: needs seeds"
    assert compare.combined(["does not hold here", "inconclusive: needs seeds"]) == "does not hold here"


def test_compare_checks_for_matplotlib_before_any_run(monkeypatch, capsys):
    real_find_spec = compare.bench.importlib.util.find_spec
    monkeypatch.setattr(compare.bench.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    monkeypatch.setattr(compare, "run_all", lambda *a: pytest.fail("ran without matplotlib"))
    with pytest.raises(SystemExit) as stop:
        compare.main(["--only", "lr"])
    err = capsys.readouterr().err.splitlines()
    assert stop.value.code == 2 and len(err) == 1 and "needs matplotlib" in err[0]
    assert "pip install -r benchmarks/requirements.txt" in err[0]


def spread_record(cpu, kernels, arm, seed, final, curve=None, steps=2400):
    return {"cpu": cpu, "kernels": kernels, "capability": kernels.upper(), "arm": arm, "seed": seed, "base": 0.4,
            "final": final, "sampled_start": 0.2, "sampled_end": 0.6, "steps": steps, "train_seconds": 1.0,
            "wall_seconds": 2.0} | ({"curve": curve} if curve else {})


def spread_report(tmp_path, monkeypatch, records):
    """spread.md as spread.report writes it from these records."""
    import spread
    (tmp_path / "spread.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    monkeypatch.setattr(spread, "RECORDS", tmp_path / "spread.jsonl")
    monkeypatch.setattr(spread, "RESULTS", tmp_path)
    spread.report()
    return (tmp_path / "spread.md").read_text()


def test_spread_reports_each_script_cpu_and_kernel_set_over_its_seeds(tmp_path, monkeypatch):
    import spread
    records = [spread_record("X", k, "grpo", seed, final, steps=10)
               for k, seed, final in [("own", 0, 0.7), ("own", 1, 0.6), ("avx2", 0, 0.5)]]
    text = spread_report(tmp_path, monkeypatch, records)
    # own: mean 0.65, std sqrt(0.005) = 0.0707; avx2 one run; all three, pooled on CPU X: mean 0.6, std 0.1
    assert "| grpo | X | own (OWN) | 0,1 | 0.400 ± 0.000 (0.400-0.400) | 0.650 ± 0.071 (0.600-0.700) |" in text
    assert "| grpo | X | avx2 (AVX2) | 0 | 0.400 | 0.500 | 0.600 | 0.100 |" in text
    assert "| grpo on X: seeds 0,1, own and avx2 kernels | 3 | 0.600 ± 0.100 (0.500-0.700) |" in text
    assert "every CPU above" not in text                                     # one CPU: no line over CPUs
    assert spread.key(records[0]) == ("X", "own", "grpo", 0)
    assert spread.kernels_env("own") == {} and spread.kernels_env("avx2") == {"ATEN_CPU_CAPABILITY": "avx2"}


def test_spread_pools_each_cpus_runs_of_a_script_over_seeds_and_kernel_sets(tmp_path, monkeypatch):
    records = [spread_record("X", "own", "grpo", 0, 0.7), spread_record("X", "avx2", "grpo", 1, 0.6),
               spread_record("Y", "own", "grpo", 0, 0.5), spread_record("Y", "own", "gspo", 0, 0.9)]
    text = spread_report(tmp_path, monkeypatch, records)
    # X: 0.7 and 0.6, mean 0.65, std sqrt(0.005) = 0.0707; Y has one grpo run: no line; both CPUs: 0.6 ± 0.1.
    assert "| grpo on X: seeds 0,1, own and avx2 kernels | 2 | 0.650 ± 0.071 (0.600-0.700) |" in text
    assert "| grpo on every CPU above | 3 | 0.600 ± 0.100 (0.500-0.700) |" in text
    assert "grpo on Y" not in text and "gspo on" not in text


def test_the_late_swing_is_the_change_between_consecutive_evaluations_from_step_1800():
    import spread
    curve = [[1700, 0.2], [1750, 0.9], [1800, 0.6], [1850, 0.5], [1900, 0.75], [1950, 0.7]]
    # From 1800: |0.5 - 0.6| 0.10, |0.75 - 0.5| 0.25, |0.7 - 0.75| 0.05: mean 0.40 / 3, largest 0.25 (1850 -> 1900).
    mean, largest, where = spread.swing(curve)
    assert mean == pytest.approx(0.4 / 3) and largest == pytest.approx(0.25) and where == (1850, 1900)
    assert spread.swing([[0, 0.4], [700, 0.8]]) is None                     # ppo's 700 steps end before 1800
    lines = spread.swings([spread_record("X", "own", "grpo", 0, 0.7, curve),
                           spread_record("X", "own", "gspo", 0, 0.7, [[1800, 0.5], [1850, 0.8]]),
                           spread_record("X", "own", "ppo", 0, 0.8, [[0, 0.4], [700, 0.8]], steps=700)])
    assert "| grpo | X | own | 0 | 3 | 0.133 | 0.250 (1850 → 1900) |" in lines
    assert "| gspo | X | own | 0 | 1 | 0.300 | 0.300 (1800 → 1850) |" in lines
    # Together: changes 0.10, 0.25, 0.05, 0.30: mean 0.175, largest 0.300.
    assert lines[-1] == ("Every run above together (2 runs, 4 changes): one evaluation moves 0.175 from the one "
                         "before on average, 0.300 at most. Left out: ppo (its runs end before step 1800).")


def test_a_spread_run_keeps_its_curve_and_a_rerun_replaces_its_record(tmp_path, monkeypatch):
    import spread
    monkeypatch.setattr(spread, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(spread, "RECORDS", tmp_path / "spread.jsonl")
    monkeypatch.setattr(spread.bench, "cpu_name", lambda: "X")
    other = spread_record("Y", "own", "grpo", 0, 0.5)
    (tmp_path / "spread.jsonl").write_text(json.dumps(spread_record("X", "own", "grpo", 0, 0.9)) + "\n"
                                           + json.dumps(other) + "\n")
    launched = []

    def launch(script, flags, out, threads, env=None):
        launched.append((script, flags, threads, env))
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows([0.4, 0.5, 0.7])))
        (out / "wall_seconds").write_text("3.0\n")
        return 0
    monkeypatch.setattr(spread.bench, "launch", launch)
    assert spread.one(("grpo", 0, "avx2", "AVX2", True)) == 0
    assert launched[0][:3] == ("grpo.py", ["--seed", "0"], 1)
    assert launched[0][3]["ATEN_CPU_CAPABILITY"] == "avx2"
    assert spread.one(("grpo", 0, "own", "AVX512", True)) == 0            # the recorded run, run again
    kept = spread.records()
    assert len(kept) == 3 and other in kept and all(r["final"] != 0.9 for r in kept)
    new = next(r for r in kept if r["cpu"] == "X" and r["kernels"] == "own")
    assert new["curve"] == [[0, 0.4], [2, 0.5], [4, 0.7]] and new["final"] == 0.7 and new["steps"] == 4


def test_defaults_png_draws_seed_0_of_every_script_on_the_machine_that_ran_the_most(tmp_path, monkeypatch):
    import spread
    curve = [[0, 0.4], [50, 0.6]]
    records = [spread_record("X", "own", arm, 0, 0.6, curve) for arm in ("grpo", "gspo", "dapo")]
    records += [spread_record("X", "own", "grpo", 1, 0.6, curve), spread_record("X", "avx2", "ppo", 0, 0.6, curve),
                spread_record("Y", "own", "sapo", 0, 0.6, curve), spread_record("Y", "own", "cispo", 0, 0.6)]
    runs, where = spread.figure_runs(records)
    assert where == ("X", "own") and list(runs) == ["grpo", "gspo", "dapo"]      # ARMS' order, seed 0 only
    assert spread.figure_runs([spread_record("X", "own", "grpo", 0, 0.6)]) == ({}, None)    # no curve: no figure
    (tmp_path / "spread.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    monkeypatch.setattr(spread, "RECORDS", tmp_path / "spread.jsonl")
    monkeypatch.setattr(spread, "RESULTS", tmp_path)
    spread.report()
    assert (tmp_path / "defaults.png").read_bytes().startswith(b"\x89PNG")
    assert ("Seed 0 of every script on the X, own kernels, held-out greedy accuracy against step (finals: grpo "
            "0.600, gspo 0.600, dapo 0.600):") in (tmp_path / "spread.md").read_text()


def test_loss_verdicts_read_cispo_against_dapo_and_sapo_against_grpo_and_gspo_by_the_rule():
    seeds = lambda *finals: [rows([0.4, 0.4 + (f - 0.4) / 2 if f > 0.4 else f + 0.1, f]) for f in finals]
    losses = {"cispo": [rows([0.4, 0.60, 0.70]), rows([0.4, 0.62, 0.72])], "dapo": seeds(0.60, 0.62)}
    stress = {"grpo": seeds(0.20, 0.22), "gspo": seeds(0.30, 0.32), "sapo": seeds(0.40, 0.42)}
    lr = {f"{arm} lr x1 toy MoE": seeds(0.5, 0.52) for arm in ("grpo", "gspo", "sapo")}
    lr |= {"grpo lr x3 toy MoE": [rows([0.4, 0.2, 0.10]), rows([0.4, 0.2, 0.12])],      # both fell
           "gspo lr x3 toy MoE": [rows([0.4, 0.2, 0.10]), rows([0.4, 0.5, 0.45])],      # one fell
           "sapo lr x3 toy MoE": [rows([0.4, 0.45, 0.50]), rows([0.4, 0.47, 0.52])]}
    f, g, h, i = compare.loss_verdicts(losses, stress, lr, 4, 200)
    # 0.71 - 0.61 over seeds: sqrt(0.0002 / 2 + 0.0002 / 2) = 0.014 at 2 df (t 4.30); the evaluation alone
    # sqrt(0.71 * 0.29 / 200 + 0.61 * 0.39 / 200) = 0.047.
    assert f == ("- (f) CISPO learns faster than DAPO at equal steps: CISPO's final greedy accuracy minus DAPO's: 4 "
                 "steps: **holds here** (CISPO − DAPO **+0.100 ± 0.014** (2.0 df, t 4.30; evaluation ± 0.047, "
                 "unpaired)).")
    # At step 2 CISPO's 0.60 and 0.62 are DAPO's final 0.61 exactly; its first seed reaches 0.61 at step 4, the second
    # at step 2.
    assert g.endswith("step 2 against 4: **inconclusive** (CISPO − DAPO +0.000 ± 0.014 (2.0 df, t 4.30; evaluation "
                      "± 0.049, unpaired); steps to DAPO's mean final 0.610: 4, 2).")
    # GRPO ended 0.2 below its base, so the claim is testable: SAPO 0.41 against 0.21 and 0.31.
    assert h.endswith("16 minibatches: **holds here** (SAPO − GRPO **+0.200 ± 0.014** (2.0 df, t 4.30; evaluation ± "
                      "0.045, unpaired); SAPO − GSPO **+0.100 ± 0.014** (2.0 df, t 4.30; evaluation ± 0.048, "
                      "unpaired)).")
    # x1: nobody fell; x3 is the first multiple where a seed fell. GSPO's finals 0.10 and 0.45 put its error at
    # sqrt(0.35^2 / 2 / 2 + 0.0001) = 0.175 at 1.0065 df: that part, and so the claim, is inconclusive.
    assert "lr x3: **inconclusive** (fell: sapo 0/2, grpo 2/2, gspo 1/2; SAPO − GRPO **+0.400 ± 0.014**" in i
    assert "SAPO − GSPO +0.235 ± 0.175 (1.0 df, t 12.51" in i          # Welch: 0.030725^2 / (0.030625^2 + 1e-8)
    stress = {arm: seeds(0.5, 0.52) for arm in stress}                    # nobody fell or ended below
    lr = {label: runs for label, runs in lr.items() if "x1 " in label}
    _, _, h, i = compare.loss_verdicts({}, stress, lr, 4, 200)
    assert "16 minibatches: **not testable here**" in h and i.endswith("toy MoE: **not testable here** (no seed fell "
                                                                      "at any multiple tried).")
    assert compare.loss_verdicts({}, {}, {}, 4, 200)[0].endswith("DAPO's: no verdict: its runs are not here.")


def test_losses_experiments_run_cispo_and_sapo_beside_the_others_on_the_toy_moe():
    assert [label for label, _, _ in compare.EXPERIMENTS["losses"][3]] == ["grpo", "dapo", "gspo", "cispo", "sapo"]
    stress = compare.EXPERIMENTS["losses-stress"]
    assert stress[0] == compare.EXPERIMENTS["stress"][0] and stress[1] == compare.EXPERIMENTS["stress"][1]
    assert [label for label, _, _ in stress[3]] == ["grpo", "grpo + replay", "gspo", "cispo", "sapo"]
    runs = compare.EXPERIMENTS["losses-lr"][3]
    assert len(runs) == 4 * len(compare.LR_TIMES) and runs[-1] == ("sapo lr x30 toy MoE", "sapo.py", ["--lr", "0.003"])


def test_an_evaluation_before_the_last_is_read_with_its_own_record_and_a_missing_one_gives_no_verdict(tmp_path):
    rs = rows([0.4, 0.5, 0.6])                                          # evaluations at steps 0, 2 and 4
    (tmp_path / "eval_correct.jsonl").write_text("".join(json.dumps({"step": s, "correct": c}) + "\n"
                                                         for s, c in ((0, "0011"), (2, "0111"), (4, "1111"))))
    rs[-1] |= {"out": tmp_path, "correct": "1111"}                      # as collect() marks it
    assert compare.evaluated(rs) == (0.6, "1111") and compare.evaluated(rs, 2) == (0.5, "0111")
    assert compare.evaluated(rs, 3) is None
    losses = {"cispo": [rows([0.4, 0.5, 0.6, 0.7])] * 2, "dapo": [rows([0.4, 0.5, 0.6, 0.7])] * 2}   # 6 steps
    assert "step 3 against 6: **no verdict** (a CISPO run has no evaluation at step 3" in \
        compare.loss_verdicts(losses, {}, {}, 6, 200)[1]
