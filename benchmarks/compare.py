"""The study: the six algorithm scripts side by side on the toy MoE, several seeds each.

    pip install -r benchmarks/requirements.txt   # matplotlib for the figures (checked at the start)
    python benchmarks/compare.py            # main, length, stress, depth, fine, hf-moe: 72 runs, 56 min on 2 cores
    python benchmarks/compare.py --quick    # a smoke run of those six, a few minutes (--only NAME for the others)
    python benchmarks/compare.py --only lr  # where each algorithm breaks: 120 runs of 150 steps, ~3 hours
    python benchmarks/compare.py --only long   # the papers' claims at 12, 44 and 100 tokens: 99 runs
    python benchmarks/compare.py --only losses,losses-stress,losses-lr   # cispo and sapo's claims: 78 runs
    python benchmarks/compare.py --report   # redraw the tables and figures from the finished runs
    python benchmarks/compare.py --only defaults --seeds 0   # each script as it runs (one thread), two at a time

It runs the algorithm scripts as they are (a subprocess each, with flags), two at a time on one thread
each, and reads their metrics.jsonl. Every run of an experiment starts from the same warm-started base
and generates the same number of completions per step (ppo: 128 prompts x 1; the others 16 x 8);
Dynamic Sampling makes DAPO generate more, which the column `completions/step` shows.

Experiments (one markdown table each in benchmarks/results/study.md, one figure for most):
  defaults each script exactly as `python <script>` runs it (one thread), one seed: its docstring
  main    ppo, grpo, grpo + Routing Replay, dapo, gspo, gspo-token on `add`
  length  dapo with all four techniques, then each switched off, and all off, on `progression`
  stress  grpo, grpo + Routing Replay and gspo under off-policy pressure: 16 minibatches (4x the updates)
  depth   grpo on deeper toy models (2, 4, 8 layers): routing drift against depth
  fine    grpo, grpo + Routing Replay and gspo on a fine-grained toy MoE (4 layers, 64 experts, top-8,
          expert hidden size 16), whose routing moves far more than the default's
  hf-moe  the same three on a tiny Hugging Face Qwen3-MoE (random weights, experts and routers scaled
          by 3 so that they matter), built here, with a partial-credit reward (digits in place)
  lr      ppo, grpo, grpo + replay, gspo and dapo at 1, 3, 10 and 30 times the default --lr, on the toy MoE
          and the fine toy: final accuracy and which seeds fell (`fell`); one table, one figure (not in the
          default run: --only lr; on 2 cores shared with other work the toy MoE's 60 runs took ~50 min, the
          fine toy's ~2 h; its last 16 runs 14 min, with light other work)
  long    the papers' claims where they live, on `--task chain` at 12, 44 and 100 tokens, 150 steps: ppo,
          grpo, grpo + replay, gspo and dapo on the toy MoE (and the fine toy, at 12 and 44 tokens: LENGTHS);
          grpo on the dense toy; dapo with its token-level loss and with the per-sequence mean on mixed
          lengths (`--task chains`, 8-100 tokens); grpo, grpo + replay and gspo stressed on the fine toy
          (STRESSED); its own file, long.md, with long.png and long-claims.png (not in the default run:
          --only long)
  losses  grpo, dapo, gspo, cispo and sapo on `add`, 600 steps, with the claims made for cispo and sapo and
          their verdicts; losses-stress: the stress experiment with cispo and sapo (and grpo + replay);
          losses-lr: the lr experiment on the toy MoE for grpo, gspo, cispo and sapo (not in the default run)
Runs go to benchmarks/runs/ (ignored by git); a finished run is not run again unless --rerun. A --quick
run keeps its runs, tables and figures in benchmarks/runs/quick/, apart from the results.
"""
import argparse
import importlib
import math
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

import bench
from bench import read_metrics, stop_line

ROOT = Path(__file__).resolve().parent.parent
RUNS, RESULTS = ROOT / "benchmarks" / "runs", ROOT / "benchmarks" / "results"
HF_MOE = RUNS / "hf-moe-model"  # built by build_hf_moe before the hf-moe runs
SEEDS = (0, 1, 2)  # the study's seeds (--quick: the first two)
PER_STEP = 128  # completions a step generates in every run of the study at the scripts' defaults (16 x 8, ppo 128 x 1)
ALL_OFF = ["--no-clip-higher", "--no-dynamic-sampling", "--no-token-level-loss", "--no-overlong-shaping"]
FINE = ["--n-layers", "4", "--n-experts", "64", "--top-k", "8", "--expert-hidden", "16"]   # the fine-grained toy MoE
ARMS = [("ppo", "ppo.py", []), ("grpo", "grpo.py", []), ("grpo + replay", "grpo.py", ["--routing-replay"]),
        ("gspo", "gspo.py", []), ("dapo", "dapo.py", [])]
LR_TIMES, DEFAULT_LR = (1, 3, 10, 30), 1e-4      # every script's --lr on the toy (tests/test_benchmarks.py checks)
MODELS = {"toy MoE": [], "fine toy": FINE}
# The long experiment's --chain-length per model: completions of 12, 44 and 100 tokens. The fine toy's steps cost
# 2.8-5.3x the toy MoE's (150 steps of grpo at 12 tokens: 68 s against 23 s), so at 100 tokens its 15 runs would add
# about 2 h on 2 cores, taking the experiment past 3 hours: it stops at 44.
LENGTHS = {"toy MoE": (2, 10, 24), "fine toy": (2, 10)}
# The stressed variant: twice the updates per rollout batch. On the fine toy at 44 tokens (20-step pilots, grpo.py
# --task chain with FINE) it moves routing drift from 0.057 to 0.105, expert drift (the paper's measure) to 0.014
# (16 minibatches: 0.178 / 0.024). The paper's ~10% of experts is out of the toy's reach: 10x the lr gives 0.025,
# 3x the lr with 16 minibatches 0.038, and both fall to 0 greedy accuracy within those 20 steps.
STRESSED = ["--minibatches", "8"]
LONG = {}                           # long experiment label: (arm, completion tokens, model, variant)
LONG_MODELS = MODELS | {"dense toy": ["--n-experts", "1"]}
VARIANTS = {"": [], "stressed": STRESSED, "mixed lengths": ["--task", "chains"]}


def span(tokens, variant):
    """The completion length of a run: mixed lengths run from the 1-total chain's 8 tokens to the longest."""
    return f"{'8-' if variant == 'mixed lengths' else ''}{tokens} tokens"


def long_runs(lengths, stressed_length):
    """The long experiment's runs: every arm at each model's chain lengths (a dict); grpo on the dense toy (one
    expert: is a growth of the token-ratio variance with length the MoE's doing?); dapo with its token-level
    loss and with the per-sequence mean on chains of every length up to the longest, mixed in each batch
    (claim d: at one fixed length the two losses are the same number); and grpo, grpo + replay and gspo
    stressed on the fine toy (claim c). Each label's parts go to LONG."""
    runs = []
    def add(arm, script, flags, n, model, variant=""):
        tokens = 4 * n + 4
        label = f"{arm}, {span(tokens, variant)}, {model}" + (f", {variant}" if variant else "")
        LONG[label] = (arm, tokens, model, variant)
        runs.append((label, script, flags + ["--chain-length", str(n)] + LONG_MODELS[model] + VARIANTS[variant]))
    for model, chain_lengths in lengths.items():
        for n in chain_lengths:
            for arm, script, flags in ARMS:
                add(arm, script, flags, n, model)
    longest = max(max(ns) for ns in lengths.values())
    for n in sorted({n for ns in lengths.values() for n in ns}):
        add("grpo", "grpo.py", [], n, "dense toy")
    for arm, script, flags in (ARMS[4], ("dapo, sequence mean", "dapo.py", ["--no-token-level-loss"])):
        add(arm, script, flags, longest, "toy MoE", "mixed lengths")
    for arm, script, flags in ARMS[1:4]:                           # grpo, grpo + replay, gspo
        add(arm, script, flags, stressed_length, "fine toy", "stressed")
    return runs

# experiment: (flags shared by its runs, full steps, quick steps, [(label, script, flags)])
EXPERIMENTS = {
    # Each script exactly as `python <script>` runs it (steps and evaluation at its defaults), one seed: the
    # figures of its docstring: --only defaults --seeds 0 (one thread each, as the scripts default to, two at a time).
    "defaults": ([], None, 20, [
        ("grpo", "grpo.py", []),
        ("grpo + replay", "grpo.py", ["--routing-replay"]),
        ("gspo", "gspo.py", []),
        ("dapo", "dapo.py", []),
        ("ppo", "ppo.py", [])]),
    "main": (["--task", "add"], 600, 20, [
        ("ppo", "ppo.py", []),
        ("grpo", "grpo.py", []),
        ("grpo + replay", "grpo.py", ["--routing-replay"]),
        ("dapo", "dapo.py", []),
        ("gspo", "gspo.py", []),
        ("gspo-token", "gspo.py", ["--token-level"])]),
    "length": (["--task", "progression"], 300, 15, [
        ("dapo (all four)", "dapo.py", []),
        ("no clip-higher", "dapo.py", ["--no-clip-higher"]),
        ("no dynamic sampling", "dapo.py", ["--no-dynamic-sampling"]),
        ("no token-level loss", "dapo.py", ["--no-token-level-loss"]),
        ("no overlong shaping", "dapo.py", ["--no-overlong-shaping"]),
        ("all off (= grpo)", "dapo.py", ALL_OFF)]),
    "stress": (["--task", "add", "--minibatches", "16"], 400, 15, [
        ("grpo", "grpo.py", []),
        ("grpo + replay", "grpo.py", ["--routing-replay"]),
        ("gspo", "gspo.py", [])]),
    "depth": (["--task", "add"], 100, 10, [
        ("2 layers", "grpo.py", ["--n-layers", "2"]),
        ("4 layers", "grpo.py", ["--n-layers", "4"]),
        ("8 layers", "grpo.py", ["--n-layers", "8"])]),
    "fine": (["--task", "add"] + FINE, 300, 10, [
        ("grpo", "grpo.py", []),
        ("grpo + replay", "grpo.py", ["--routing-replay"]),
        ("gspo", "gspo.py", [])]),
    "hf-moe": (["--model", str(HF_MOE), "--data", str(HF_MOE / "add.jsonl"),
                "--reward", f"{HF_MOE / 'reward.py'}:digits", "--max-new-tokens", "8", "--eval-size", "100"], 300, 5, [
        ("grpo", "grpo.py", []),
        ("grpo + replay", "grpo.py", ["--routing-replay"]),
        ("gspo", "gspo.py", [])]),
    # Where each algorithm breaks: the policy's --lr at 1, 3, 10 and 30 times the default (ppo's critic keeps its
    # own), on both toy MoEs. Nothing else changes, for every arm alike.
    "lr": (["--task", "add"], 150, 6, [(f"{arm} lr x{k} {model}", script,
                                        flags + ["--lr", f"{DEFAULT_LR * k:g}"] + more)
                                       for model, more in MODELS.items() for arm, script, flags in ARMS
                                       for k in LR_TIMES]),
    # The papers' claims where they live: answers of 12, 44 and 100 tokens (`--task chain`). Its own file,
    # benchmarks/results/long.md; --quick runs a smaller set (QUICK_RUNS).
    "long": (["--task", "chain", "--eval-size", "200"], 150, 6, long_runs(LENGTHS, 10)),
}
# After GSPO, the losses TRL and verl added: cispo and sapo beside grpo, dapo and gspo, and their claims (LOSS_CLAIMS).
LOSS_ARMS = [("grpo", "grpo.py", []), ("dapo", "dapo.py", []), ("gspo", "gspo.py", []), ("cispo", "cispo.py", []),
             ("sapo", "sapo.py", [])]
LOSS_LR_ARMS = [arm for arm in LOSS_ARMS if arm[0] != "dapo"]
EXPERIMENTS |= {
    "losses": (["--task", "add"], 600, 20, LOSS_ARMS),
    "losses-stress": (["--task", "add", "--minibatches", "16"], 400, 15,
                      LOSS_ARMS[:1] + [("grpo + replay", "grpo.py", ["--routing-replay"])] + LOSS_LR_ARMS[1:]),
    "losses-lr": (["--task", "add"], 150, 6, [(f"{arm} lr x{k} toy MoE", script,
                                               flags + ["--lr", f"{DEFAULT_LR * k:g}"])
                                              for arm, script, flags in LOSS_LR_ARMS for k in LR_TIMES]),
}
LONG_RUNNING = ("defaults", "lr", "long", "losses", "losses-stress", "losses-lr")   # not in a plain run: --only
# A --quick run of `long` in a few minutes: chains of 1 and 2 totals (8 and 12 tokens) on the toy MoE only.
QUICK_RUNS = {"long": long_runs({"toy MoE": (1, 2)}, 2)}


def runs_of(name, quick):
    """An experiment's [(label, script, flags)]."""
    return QUICK_RUNS.get(name, EXPERIMENTS[name][3]) if quick else EXPERIMENTS[name][3]


# ---------------------------------------------------------------------------------------------------
# Running

REWARD = '''def digits(completion, answer, finished):
    """Partial credit, a signal a random model can climb: the share of the answer's characters in place."""
    return sum(a == b for a, b in zip(completion, answer)) / len(answer)
'''


def build_hf_moe(folder=HF_MOE):
    """A Qwen3-MoE shaped as real MoE models are (many small experts, large top-k): hidden 64, 4 layers,
    64 experts top-8 of hidden size 16, character tokenizer, random weights. At initialisation experts
    add little to the residual stream, so which ones a token gets hardly matters; scaled by 3, as after
    training, they do. Also writes the `add` problems as JSONL and the reward."""
    if (folder / "reward.py").exists():
        return
    bench.tiny_qwen3_moe(folder, "add.jsonl", "0123456789+=", scale=3, num_hidden_layers=4,
                          max_position_embeddings=64, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=16,
                          norm_topk_prob=True)
    (folder / "reward.py").write_text(REWARD)


def run_dir(experiment, label, seed, quick):
    return (RUNS / ("quick" if quick else "") / experiment / re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")
            / f"seed{seed}")


def default_steps(script):
    sys.path.insert(0, str(ROOT))
    return importlib.import_module(Path(script).stem).Args().steps


def finished(out, steps):
    """Ran to its last step, or stopped on purpose (dapo.py when no group has a reward signal left): an outcome,
    not a failure to run again."""
    rows = read_metrics(out)
    return bool(rows) and (rows[-1]["step"] == steps or stop_line(out) is not None)


def launch(job):
    """One run from nothing, as bench.launch. `defaults` runs start from an empty warm-start cache (their own), as
    a user's first run does."""
    script, flags, out, threads = job
    env = {"RL_CACHE_DIR": str(out / "cache")} if out.parent.parent.name == "defaults" else {}
    rc = bench.launch(script, flags, out, threads, env)
    shutil.rmtree(out / "cache", ignore_errors=True)
    return rc


def elapsed_file(name, quick):
    folder = RUNS / ("quick" if quick else "") / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "elapsed.txt"


def shown(path):
    """A path as a reader of the results sees it: from the repository root."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def run_flags(name, flags, quick):
    """A run's flags, but for --seed and --out: the experiment's, the run's, then steps and evaluation."""
    shared, full_steps, quick_steps, _ = EXPERIMENTS[name]
    steps = quick_steps if quick else full_steps
    extra = [] if steps is None else ["--steps", str(steps), "--eval-every", str(steps // (2 if quick else 12)),
                                      "--save-every", "0"]
    return shared + flags + extra + (["--eval-size", "100"] if quick else [])


def run_all(experiments, seeds, quick, jobs, threads, rerun):
    todo = []
    for name in experiments:
        steps = EXPERIMENTS[name][2 if quick else 1]
        for label, script, flags in runs_of(name, quick):
            for seed in seeds:
                out = run_dir(name, label, seed, quick)
                if rerun or not finished(out, steps or default_steps(script)):
                    todo.append((script, run_flags(name, flags, quick) + ["--seed", str(seed)], out, threads))
    if "hf-moe" in experiments:
        build_hf_moe()
    print(f"{len(todo)} runs to do, {jobs} at a time", flush=True)
    start = time.perf_counter()
    failed = bench.run_all(launch, todo, jobs)
    minutes = (time.perf_counter() - start) / 60
    print(f"{len(todo)} runs in {minutes:.1f} min", flush=True)
    for name in experiments if todo else []:       # an experiment run in pieces: its pieces' times add up
        with open(elapsed_file(name, quick), "a") as f:
            f.write(f"{minutes:.1f} min, {len(todo)} runs, {jobs} at a time on {threads} thread(s) each: "
                    f"{','.join(experiments)}\n")
    return failed


# ---------------------------------------------------------------------------------------------------
# Summaries: one row of scalars per run, then mean +- std over seeds

def sampled_accuracy(row):
    """The policy's own accuracy: DAPO's `accuracy` is over the kept (filtered) groups only."""
    return row.get("sampled_accuracy", row["accuracy"])


def completions(row):
    return row.get("generation_rounds", 1) * PER_STEP


def steps_to(evals, target):
    """First evaluated step whose greedy accuracy reaches `target`, or None. evals: [(step, acc)]."""
    return next((step for step, acc in evals if acc >= target), None)


def nanmean(values):
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


def summarise(rows, target=None):
    """Scalars of one run's metrics.jsonl rows. Wall time is the training loop's own (sum of the
    step times: evaluation, identical for every algorithm, is left out). `target`: the greedy accuracy
    whose first crossing is timed."""
    steps = [r for r in rows if "step_time_s" in r]
    last = steps[-max(1, len(steps) // 10):]                        # "at the end": the last 10% of steps
    wall, clock = {0: 0.0}, 0.0
    for r in steps:
        clock += r["step_time_s"]
        wall[r["step"]] = clock
    evals = [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
    budget = len(steps) * PER_STEP                                  # completions a one-round run generates
    generated, at_budget = 0, evals[0][1]
    for r in steps:
        generated += completions(r)
        if generated > budget:
            break
        at_budget = next((acc for step, acc in evals if step == r["step"]), at_budget)
    reached = steps_to(evals, target) if target is not None else None
    first = steps[:max(1, len(steps) // 8)]                          # "at the start": the first 1/8 of steps
    mean = lambda key, rs=last: nanmean([r.get(key) for r in rs])
    return {
        "sampled_accuracy_start": nanmean([sampled_accuracy(r) for r in first]),
        "entropy_start": mean("entropy", first),
        "time_generate": mean("time_generate_s", steps), "time_old_logp": mean("time_old_logp_s", steps),
        "time_update": mean("time_update_s", steps) + nanmean([r.get("time_critic_s", 0.0) for r in steps]),
        "time_critic": mean("time_critic_s", steps),
        "train_seconds": clock,
        "base": evals[0][1], "final": evals[-1][1], "at_equal_completions": at_budget,
        "steps_to_target": reached, "seconds_to_target": None if reached is None else wall[reached],
        "sampled_accuracy_end": nanmean([sampled_accuracy(r) for r in last]), "reward_end": mean("reward_mean"),
        "clip_frac": mean("clip_frac", steps), "entropy_end": mean("entropy"),
        "length_end": mean("response_len_mean"),
        "truncated_end": nanmean([r.get("sampled_truncated_frac", r["truncated_frac"]) for r in last]),
        "steps_to_truncation_2pct": next((r["step"] for r in steps
                                          if r.get("sampled_truncated_frac", r["truncated_frac"]) < 0.02), None),
        "routing_drift": mean("routing_drift", steps),
        "log_ratio_rerouted": mean("abs_log_ratio_rerouted", steps),
        "log_ratio_other": mean("abs_log_ratio_other", steps),
        "ratio_var_mean": mean("token_ratio_var", steps),
        "ratio_var_max": max((r["token_ratio_var"] for r in steps if r.get("token_ratio_var") is not None),
                             default=float("nan")),
        "grad_norm_max": max((r["grad_norm"] for r in steps if "grad_norm" in r), default=float("nan")),
        "peak_memory_mb": max(r["peak_memory_mb"] for r in steps),
        "ratio_var_q1": mean("token_ratio_var_q1", steps), "ratio_var_q4": mean("token_ratio_var_q4", steps),
        "drift_q1": mean("routing_drift_q1", steps), "drift_q4": mean("routing_drift_q4", steps),
        "expert_drift": mean("expert_drift", steps), "gate_weight_mean": mean("gate_weight_mean", steps),
        "clip_q1": mean("clip_frac_q1", steps), "clip_q4": mean("clip_frac_q4", steps),
        "ev_q1": mean("explained_variance_q1", steps), "ev_q4": mean("explained_variance_q4", steps),
        "stopped": bool(rows[-1].get("stopped")), "fell": fell(evals) and not rows[-1].get("stopped"),
        "ended": ended_below(evals) and not rows[-1].get("stopped"),
        "seconds_per_step": clock / len(steps), "wall_seconds": rows[-1].get("wall_seconds"),
        "completions_per_step": sum(completions(r) for r in steps) / len(steps),
    }


def mean_std(values, fmt="{:.3f}"):
    """'mean ± std' over seeds (std with n-1); runs that never got there are counted, not averaged."""
    got = [v for v in values if v is not None and not math.isnan(v)]
    if not got:
        return "never" if values and all(v is None for v in values) else "—"
    text = fmt.format(statistics.mean(got))
    if len(got) > 1:
        text += " ± " + fmt.format(statistics.stdev(got))
    if len(got) < len(values):
        text += f" ({len(got)}/{len(values)} seeds)"
    return text


# summary key: (column title, format); "start" is the first 1/8 of the steps, "end" the last 1/10
TITLES = {
    "base": ("base eval acc", "{:.3f}"), "final": ("final eval acc", "{:.3f}"),
    "at_equal_completions": ("eval acc at equal completions", "{:.3f}"),
    "sampled_accuracy_start": ("sampled acc (start)", "{:.3f}"),
    "sampled_accuracy_end": ("sampled acc (end)", "{:.3f}"),
    "reward_end": ("sampled reward, partial credit (end)", "{:.3f}"),
    "entropy_start": ("entropy (start)", "{:.2f}"), "entropy_end": ("entropy (end)", "{:.3f}"),
    "steps_to_target": ("steps to half-gap", "{:.0f}"), "seconds_to_target": ("seconds to half-gap", "{:.0f}"),
    "steps_to_truncation_2pct": ("steps to < 2% truncated", "{:.0f}"), "truncated_end": ("truncated (end)", "{:.3f}"),
    "length_end": ("length (end)", "{:.2f}"), "clip_frac": ("clip frac", "{:.4f}"),
    "routing_drift": ("routing drift", "{:.4f}"), "log_ratio_rerouted": ("\\|log r\\| re-routed", "{:.3f}"),
    "log_ratio_other": ("\\|log r\\| other", "{:.3f}"), "ratio_var_mean": ("token-ratio var, mean", "{:.4f}"),
    "ratio_var_max": ("token-ratio var, max", "{:.3g}"), "grad_norm_max": ("grad norm, max", "{:.3g}"),
    "seconds_per_step": ("s/step", "{:.3f}"), "time_generate": ("generate", "{:.3f}"),
    "time_old_logp": ("old log-probs", "{:.3f}"), "time_update": ("update (+ critic)", "{:.3f}"),
    "time_critic": ("of which critic", "{:.3f}"),
    "train_seconds": ("training seconds", "{:.0f}"),
    "wall_seconds": ("wall seconds, whole process from an empty cache", "{:.0f}"),
    "peak_memory_mb": ("peak MB", "{:.0f}"),
    "completions_per_step": ("completions/step", "{:.0f}"),
    "ratio_var_q1": ("token-ratio var, first quarter", "{:.3g}"),
    "ratio_var_q4": ("token-ratio var, last quarter", "{:.3g}"),
    "expert_drift": ("expert drift", "{:.4f}"), "drift_q1": ("routing drift, first quarter", "{:.4f}"),
    "drift_q4": ("routing drift, last quarter", "{:.4f}"),
    "clip_q1": ("clip frac, first quarter", "{:.4f}"), "clip_q4": ("clip frac, last quarter", "{:.4f}"),
    "ev_q1": ("critic explained variance, first quarter", "{:.3f}"),
    "ev_q4": ("critic explained variance, last quarter", "{:.3f}"),
    "gate_weight_mean": ("gate weight, mean (sapo)", "{:.4f}"),
    "fell": ("seeds that fell", None), "ended": ("seeds that ended 0.10 below", None),
}
ROUTING = "routing_drift log_ratio_rerouted log_ratio_other ratio_var_mean ratio_var_max"
COLUMNS = {name: keys.split() for name, keys in {
    "defaults": f"base final sampled_accuracy_start sampled_accuracy_end entropy_start entropy_end clip_frac {ROUTING} "
                "grad_norm_max seconds_per_step time_generate time_old_logp time_update time_critic train_seconds "
                "wall_seconds peak_memory_mb",
    "main": f"final at_equal_completions steps_to_target seconds_to_target clip_frac entropy_end length_end {ROUTING} "
            "peak_memory_mb seconds_per_step completions_per_step",
    "length": "final at_equal_completions steps_to_truncation_2pct truncated_end length_end entropy_end clip_frac "
              "steps_to_target seconds_per_step completions_per_step",
    "stress": f"final sampled_accuracy_end clip_frac {ROUTING} grad_norm_max seconds_per_step",
    "depth": "base routing_drift log_ratio_rerouted log_ratio_other ratio_var_mean final seconds_per_step",
    "long": "final fell ended at_equal_completions steps_to_target clip_frac clip_q1 clip_q4 routing_drift "
            "expert_drift drift_q1 drift_q4 ratio_var_mean ratio_var_q1 ratio_var_q4 ev_q1 ev_q4 length_end "
            "seconds_per_step completions_per_step",
}.items()}
COLUMNS["fine"] = COLUMNS["stress"]
COLUMNS["losses"] = COLUMNS["main"] + ["gate_weight_mean"]
COLUMNS["losses-stress"] = ["final", "fell", "ended"] + COLUMNS["stress"][1:] + ["gate_weight_mean"]
# What the sampled column and curves show: accuracy, except hf-moe's partial-credit reward (a random model never
# earns the exact one). The table and the figure both read it from here, so they cannot show different things.
SAMPLED = {"hf-moe": "reward_end"}
CURVE_OF = {"sampled_accuracy_end": ("sampled accuracy", sampled_accuracy),
            "reward_end": ("sampled reward, partial credit", lambda r: r["reward_mean"])}
COLUMNS["hf-moe"] = [SAMPLED["hf-moe"] if key == "sampled_accuracy_end" else key for key in COLUMNS["fine"]]


def sampled_key(name):
    return SAMPLED.get(name, "sampled_accuracy_end")


def collect(name, seeds, quick):
    """{label: [metrics rows of each finished seed]} for one experiment (a run cut short is left out: it runs
    again next time)."""
    found = {}
    _, full_steps, quick_steps, _ = EXPERIMENTS[name]
    for label, script, _ in runs_of(name, quick):
        steps = (quick_steps if quick else full_steps) or default_steps(script)
        outs = [(seed, o) for seed, o in ((seed, run_dir(name, label, seed, quick)) for seed in seeds)
                if finished(o, steps)]
        found[label] = [read_metrics(o) for _, o in outs]
        for (seed, o), rows in zip(outs, found[label]):
            rows[-1]["seed"] = seed
            rows[-1]["stopped"] = stop_line(o) is not None   # its last row says whether the run stopped on purpose
            wall = o / "wall_seconds"
            rows[-1]["wall_seconds"] = float(wall.read_text()) if wall.exists() else None
            last = [r for r in rows if "eval_accuracy" in r][-1]
            rows[-1]["correct"] = bench.final_correct(o, last["step"])   # which problems it got right, if recorded
            rows[-1]["out"] = o                                         # for the records of earlier evaluations
    return found


def table(name, runs):
    """Markdown table: mean ± std over seeds. The half-gap target is base + half the gap to the best
    run's mean final accuracy."""
    finals = {label: statistics.mean(summarise(rs)["final"] for rs in seeds) for label, seeds in runs.items() if seeds}
    base = statistics.mean(summarise(rs)["base"] for seeds in runs.values() for rs in seeds)
    target = base + (max(finals.values()) - base) / 2
    target = target if target > base else None                     # no run ended above the base: no target
    header = ["run", "seeds"] + [TITLES[key][0] for key in COLUMNS[name]]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for label, seeds in runs.items():
        rows = [summarise(rs, target) for rs in seeds]
        cells = [fell_cell(rows) if key == "fell" else ended_cell(rows) if key == "ended" else
                 "—" if target is None and key.endswith("_to_target") else
                 mean_std([r[key] for r in rows], TITLES[key][1]) for key in COLUMNS[name]]
        lines.append("| " + " | ".join([label, str(len(rows))] + cells) + " |")
    return lines, base, target


def fell_cell(rows):
    """'k/n' seeds that fell, and how many others stopped before the end (dapo.py with no reward signal left,
    or any script after 3 non-finite updates in a row): neither counted as fallen nor as learning."""
    stopped = sum(r["stopped"] for r in rows)
    return f"{sum(r['fell'] for r in rows)}/{len(rows)}" + (f", {stopped} stopped" if stopped else "")


def ended_cell(rows):
    """'k/n' seeds whose last evaluation is more than 0.10 below their base, whether or not they fell (a run that
    stopped has no last evaluation: not counted)."""
    return f"{sum(r['ended'] for r in rows)}/{len(rows)}"


def curve(seeds, key, width=1):
    """One per-step quantity over seeds: (steps, training seconds, mean, std), each seed's values first
    smoothed by a moving mean over `width` steps. Row i of every metrics.jsonl is step i (row 0: the base's
    evaluation); steps where any seed has no value (evaluations come every few steps) are left out."""
    n = min(len(rs) for rs in seeds)
    clocks = [[0.0] * n for _ in seeds]
    for rs, clock in zip(seeds, clocks):
        for i in range(1, n):
            clock[i] = clock[i - 1] + rs[i].get("step_time_s", 0.0)
    steps = [i for i in range(n) if all(key(rs[i]) is not None for rs in seeds)]
    per_seed = [smooth([key(rs[i]) for i in steps], width) for rs in seeds]
    walls = [statistics.mean(clock[i] for clock in clocks) for i in steps]
    means = [statistics.mean(values) for values in zip(*per_seed)]
    stds = [statistics.stdev(values) if len(values) > 1 else 0.0 for values in zip(*per_seed)]
    return steps, walls, means, stds


def smooth(values, width):
    return [statistics.mean(values[max(0, i - width + 1):i + 1]) for i in range(len(values))]


def smoothing(runs):
    """The moving mean's width for per-step curves: 1/30 of the steps (evaluations are not smoothed)."""
    return max(1, (min(len(rs) for seeds in runs.values() for rs in seeds if seeds) - 1) // 30)


def panels(name, runs):
    """What an experiment's figure shows, as data: four panels, each a dict of x and y labels, y range,
    dashed lines and {run: (x, mean, std)}. Accuracy panels run from 0 to 1 with the base dashed. `length`
    shows what its claims are about: the share truncated (unsmoothed, log steps, 2% dashed) and the
    completion length, then greedy accuracy."""
    runs = {label: seeds for label, seeds in runs.items() if seeds}
    width = smoothing(runs)
    base = statistics.mean(rs[0]["eval_accuracy"] for seeds in runs.values() for rs in seeds)

    def sampled(value):                    # a per-step value of the samples; row 0 is the base's evaluation
        return lambda r: value(r) if "step_time_s" in r else None

    def panel(x, y, key, width=1, ylim=(0, 1), lines=(base,), xscale="linear"):
        series = {}
        for label, seeds in runs.items():
            steps, walls, means, stds = curve(seeds, key, width)
            series[label] = (steps if x == "step" else walls, means, stds)
        return dict(x=x, y=y, ylim=ylim, lines=lines, xscale=xscale, series=series)

    greedy = "greedy eval reward, partial credit" if name == "hf-moe" else "greedy eval accuracy"
    bottom = [panel(x, greedy, lambda r: r.get("eval_accuracy")) for x in ("step", "training seconds")]
    if name == "length":
        truncated = sampled(lambda r: r.get("sampled_truncated_frac", r["truncated_frac"]))
        return [panel("step", "share of samples truncated", truncated, ylim=(0, None), lines=(0.02,), xscale="log"),
                panel("step", "completion length, tokens", sampled(lambda r: r["response_len_mean"]),
                      width, ylim=(0, None), lines=())] + bottom
    what, value = CURVE_OF[sampled_key(name)]
    return [panel(x, what, sampled(value), width)
            for x in ("step", "training seconds")] + bottom


def figure(name, runs, path):
    fig, axes = bench.subplots(2, 2, figsize=(12, 8))
    for ax, p in zip(axes.flat, panels(name, runs)):
        for label, (xs, means, stds) in p["series"].items():
            ax.plot(xs, means, label=label, marker="." if len(xs) < 40 else None)
            ax.fill_between(xs, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)],
                            alpha=0.2)
        for value in p["lines"]:
            ax.axhline(value, color="grey", linestyle="--", linewidth=1)
        ax.set(xlabel=p["x"], ylabel=p["y"], ylim=p["ylim"], xscale=p["xscale"])
        ax.grid(alpha=0.3)
    axes[0, 0].legend()
    seeds = max(len(s) for s in runs.values())
    marks = "the base's greedy accuracy" + (" (bottom), 2% truncated (top left)" if name == "length" else "")
    fig.suptitle(f"{name}: mean over {seeds} seeds, band ± 1 std over seeds\nper-step curves: moving mean over "
                 f"{smoothing(runs)} steps{' (share truncated: none)' if name == 'length' else ''}; dashed: {marks}")
    bench.save_figure(fig, path)


# ---------------------------------------------------------------------------------------------------
# The lr experiment: final accuracy against the learning rate, and which seeds fell

def fell(evals, drop=0.10):
    """The instability criterion, written down before the lr study ran: greedy accuracy fell more than `drop`
    below the base (the step-0 evaluation) and stayed there, i.e. every evaluation from the first such one to
    the last is more than `drop` below the base. evals: [(step, accuracy)], the base first."""
    below = [acc < evals[0][1] - drop for _, acc in evals[1:]]
    return True in below and all(below[below.index(True):])


def ended_below(evals, drop=0.10):
    """Beside the criterion: the last evaluation is more than `drop` below the base (a run can end there without
    having fallen by the criterion, when an evaluation before the end came back above). Exactly `drop` below is
    not more (accuracies are multiples of 1/eval-size, so ties happen: 0.318 from 0.418)."""
    return evals[0][1] - evals[-1][1] > drop + 1e-9


def lr_results(runs, arms=ARMS, models=MODELS):
    """{(model, arm): {lr multiple: (final accuracies of the seeds that ran to the end, how many of them fell,
    [(step, sampled accuracy) where each other seed stopped], how many ended more than 0.10 below their base)}},
    and each model's base."""
    out, bases = {}, {}
    for model in models:
        for arm, _, _ in arms:
            for k in LR_TIMES:
                seeds = runs.get(f"{arm} lr x{k} {model}", [])
                ended = [[(r["step"], r["eval_accuracy"]) for r in rs if "eval_accuracy" in r]
                         for rs in seeds if not rs[-1].get("stopped")]
                stops = [(rs[-1]["step"], sampled_accuracy(rs[-1])) for rs in seeds if rs[-1].get("stopped")]
                if seeds:
                    out.setdefault((model, arm), {})[k] = ([e[-1][1] for e in ended], sum(map(fell, ended)), stops,
                                                           sum(map(ended_below, ended)))
                    bases.setdefault(model, []).extend(rs[0]["eval_accuracy"] for rs in seeds)
    return out, {model: statistics.mean(b) for model, b in bases.items()}


def lr_cell(finals, fallen, stops, ended=0):
    text = f"{mean_std(finals)}, {fallen}/{len(finals)} fell, {ended}/{len(finals)} ended below" if finals else ""
    if stops:
        text += ("; " if text else "") + (f"{len(stops)} stopped at step {'/'.join(str(s) for s, _ in stops)} "
                                          f"(sampled acc {'/'.join(f'{a:.2f}' for _, a in stops)})")
    return text


def lr_table(runs, arms=ARMS):
    results, bases = lr_results(runs, arms)
    header = ["model", "run"] + [f"lr x{k} ({DEFAULT_LR * k:g})" for k in LR_TIMES]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for (model, arm), by_lr in results.items():
        cells = [lr_cell(*by_lr[k]) if k in by_lr else "—" for k in LR_TIMES]
        lines.append("| " + " | ".join([f"{model} (base {bases[model]:.3f})", arm] + cells) + " |")
    return lines


def lr_figure(runs, path, arms=ARMS):
    results, bases = lr_results(runs, arms)
    models = [model for model in MODELS if model in bases]
    fig, axes = bench.subplots(1, len(models), figsize=(max(9, 6 * len(models)), 4.5), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, model in zip(axes, models):
        for (m, arm), by_lr in results.items():
            if m == model:
                ks = sorted(k for k in by_lr if by_lr[k][0])          # runs that stopped have no final
                finals = [by_lr[k][0] for k in ks]
                ax.errorbar([DEFAULT_LR * k for k in ks], [statistics.mean(f) for f in finals],
                            yerr=[statistics.stdev(f) if len(f) > 1 else 0.0 for f in finals], marker="o",
                            capsize=3, label=arm)
        if model in bases:
            ax.axhline(bases[model], color="grey", linestyle="--", linewidth=1)
            ax.axhline(bases[model] - 0.10, color="grey", linestyle=":", linewidth=1)
        ax.set(xscale="log", ylim=(0, 1), xlabel="policy learning rate", title=model)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("final greedy eval accuracy")
    axes[0].legend()
    seeds = max((len(f[0]) + len(f[2]) for by_lr in results.values() for f in by_lr.values()), default=0)
    fig.suptitle(f"{Path(path).stem}: final accuracy, mean ± 1 std over {seeds} seeds; dashed: the base, dotted: "
                 "0.10 below it")
    bench.save_figure(fig, path)


# ---------------------------------------------------------------------------------------------------
# The long experiment: one table per model and length, learning curves, and the claims against length

ARM_COLOURS = {"ppo": "C0", "grpo": "C1", "grpo + replay": "C2", "gspo": "C3", "dapo": "C4",
               "dapo, sequence mean": "C5"}


def long_groups(runs):
    """{(model, completion tokens, variant): {label: seeds}}, in the order of the runs."""
    groups = {}
    for label, seeds in runs.items():
        if seeds:
            arm, tokens, model, variant = LONG[label]
            groups.setdefault((model, tokens, variant), {})[label] = seeds
    return groups


def group_title(model, tokens, variant):
    return f"{model}, {span(tokens, variant)}" + (f", {variant}" if variant else "")


def long_points(runs, key):
    """{(arm, model): [(completion tokens, mean, std over seeds)]} of one summary key, unstressed runs only."""
    points = {}
    for (model, tokens, variant), group in long_groups(runs).items():
        for label, seeds in group.items():
            values = [v for v in (summarise(rs)[key] for rs in seeds) if v is not None and not math.isnan(v)]
            if not variant and values:
                std = statistics.stdev(values) if len(values) > 1 else 0.0
                points.setdefault((LONG[label][0], model), []).append((tokens, statistics.mean(values), std))
    return points


# claim, quantity, arms, summary key, format: the rows of long.md's claims table, one cell per length
ALL_ARMS = tuple(arm for arm, _, _ in ARMS)
CLAIMS = [("(a)", "PPO's critic: explained variance, first quarter", ("ppo",), "ev_q1", "{:.3f}"),
          ("(a)", "PPO's critic: explained variance, last quarter", ("ppo",), "ev_q4", "{:.3f}"),
          ("(a, c, e)", "final greedy accuracy", ALL_ARMS, "final", "{:.3f}"),
          ("(b)", "token-ratio variance, mean over steps", ("grpo", "grpo + replay", "gspo"), "ratio_var_mean",
           "{:.3g}"),
          ("(b)", "token-ratio variance, last quarter", ("grpo", "grpo + replay", "gspo"), "ratio_var_q4", "{:.3g}"),
          ("(c)", "seeds that fell", ALL_ARMS, "fell", None),
          ("(c)", "seeds that ended 0.10 below", ALL_ARMS, "ended", None),
          ("(e)", "clip fraction", ("grpo", "gspo"), "clip_frac", "{:.4f}")]


def long_claims(runs):
    """Each claim's quantities against the length: one row per quantity, model and arm, unstressed runs only."""
    groups = long_groups(runs)
    tokens = sorted({t for _, t, variant in groups if not variant})
    models = list(dict.fromkeys(m for m, _, variant in groups if not variant))
    lines = ["| claim | quantity | model | run | " + " | ".join(f"{t} tokens" for t in tokens) + " |",
             "|" + " --- |" * (4 + len(tokens))]
    for claim, what, arms, key, fmt in CLAIMS:
        for model in models:
            for arm in arms:
                cells = []
                for t in tokens:
                    seeds = next((s for label, s in groups.get((model, t, ""), {}).items()
                                  if LONG[label][0] == arm), [])
                    rows = [summarise(rs) for rs in seeds]
                    cells.append("—" if not rows else fell_cell(rows) if key == "fell" else
                                 ended_cell(rows) if key == "ended" else
                                 mean_std([r[key] for r in rows], fmt))
                if any(cell != "—" for cell in cells):
                    lines.append("| " + " | ".join([claim, what, model, arm] + cells) + " |")
    return lines


def spoken(items):
    """[12, 44, 100] -> '12, 44 and 100'."""
    *rest, last = map(str, items)
    return f"{', '.join(rest)} and {last}" if rest else last


def long_report(runs, quick, results):
    """long.md: the criterion, one table per model and length, the figures and every run's command."""
    steps = EXPERIMENTS["long"][2 if quick else 1]
    groups = long_groups(runs)
    n_runs = sum(len(seeds) for seeds in runs.values())
    planned = len(runs) * max(len(seeds) for seeds in runs.values())        # every run, as many seeds as the most
    run_hours = sum(rs[-1]["wall_seconds"] or 0 for seeds in runs.values() for rs in seeds) / 3600
    pieces = elapsed_file("long", quick).read_text().splitlines() if elapsed_file("long", quick).exists() else []
    lines = [f"# Long answers{' (--quick: a smoke run, not results)' if quick else ''}: the papers' claims at "
             f"{spoken(sorted({k[1] for k in groups}))} tokens", "",
             f"Regenerate: `python benchmarks/compare.py --only long{' --quick' if quick else ''}`: {n_runs} runs"
             f"{'' if n_runs == planned else f' (of {planned} planned: the others have not run yet)'} of "
             f"{steps} steps on `--task chain` (the answer's running totals, then `=` and the last one; the reward "
             f"reads only the final answer); {run_hours * 60:.0f} min of run time (whole processes, each on one "
             f"CPU thread), so about {run_hours * 30:.0f} min on 2 cores, two at a time. As run here "
             f"({shown(elapsed_file('long', quick))}): " + ("; ".join(pieces) or "not recorded") + ".", "",
             "**Instability criterion, fixed before the runs** (compare.fell, as in the lr experiment): a run *fell* "
             "when its greedy accuracy fell more than 0.10 below its base (the step-0 evaluation) and stayed there: "
             "every evaluation from the first such one to the last. Beside it, added after the runs: the seeds that "
             "*ended* more than 0.10 below their base (the last evaluation), fallen or not. The *stressed* runs take "
             f"twice the updates per rollout batch (`{' '.join(STRESSED)}`), which moves the fine toy's routing about "
             "twice as far (routing drift "
             "0.057 -> 0.105 in 20-step pilots; the GSPO paper's ~10% of experts is out of the toy's reach: 3-10x the "
             "lr reaches an expert drift of 0.025-0.038 and falls to 0 greedy accuracy within 20 steps). The "
             "*mixed lengths* runs (`--task chains`) put chains of every length up to the longest into each batch: at "
             "one fixed length DAPO's token-level loss and the per-sequence mean are the same number. The *dense toy* "
             "(`--n-experts 1`) is grpo without routing, the control for the MoE's part in the token ratios. "
             "*Routing drift*: the share of (token, layer) pairs whose top-k set changed since the rollout; *expert "
             "drift*: the share of chosen experts that are new (the GSPO paper's measure).", "",
             "Columns as in study.md (means over all steps; \"end\" the last 1/10 of the steps); \"first\" and "
             "\"last quarter\": the first and last quarter of each completion's positions. The half-gap target is "
             "each table's own: its base plus half the gap to its best arm's mean final accuracy.", ""]
    for (model, tokens, variant), group in groups.items():
        rows, base, target = table("long", {LONG[label][0]: seeds for label, seeds in group.items()})
        lines += [f"## {group_title(model, tokens, variant)}", "",
                  f"Base greedy accuracy {base:.3f}; " + (f"half-gap target {target:.3f}." if target
                                                          else "no run ended above the base."), ""] + rows + [""]
    lines += ["## The claims, quantity by length", "", "docs/long-answers.md's claims table reads these rows "
              "(unstressed runs; "
              "claim d is the mixed-lengths table above, claim c under stress the stressed one).", ""]
    lines += long_claims(runs) + [""]
    lines += ["## Verdicts", "", bench.RULE + f" Here n = {held_out('long', quick)} held-out problems.", "",
              VERDICTS, ""] + long_verdicts(runs, held_out("long", quick)) + [""]
    long_figure(runs, results / "long.png")
    long_claims_figure(runs, results / "long-claims.png")
    lines += ["## Figures", "", "Greedy accuracy per arm, model and length (mean over seeds, band ± 1 std, dashed: "
              "the base):", "", "![long](long.png)", "", "Each claim's quantity against the completion length "
              "(mean ± 1 std over seeds; solid: toy MoE, dashed: fine toy, dotted: dense toy):", "",
              "![long-claims](long-claims.png)",
              "", "## Every run's command", "", f"Each with `--seed S --out DIR`, seeds "
              f"{', '.join(map(str, sorted({rs[-1].get('seed') for s in runs.values() for rs in s})))}.", "",
              "| run | command |", "| --- | --- |"]
    for label, script, flags in runs_of("long", quick):
        lines.append(f"| {label} | `python {script} {' '.join(run_flags('long', flags, quick))}` |")
    bench.write(results / "long.md", "\n".join(lines) + "\n")


def long_figure(runs, path):
    groups = long_groups(runs)
    models = list(dict.fromkeys(k[0] for k in groups))
    columns = max(sum(k[0] == m for k in groups) for m in models)
    fig, axes = bench.subplots(len(models), columns, figsize=(4 * columns, 3.6 * len(models)), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    for row, model in enumerate(models):
        for ax, ((_, tokens, variant), group) in zip(axes[row], ((k, g) for k, g in groups.items() if k[0] == model)):
            ax.set_visible(True)
            base = statistics.mean(rs[0]["eval_accuracy"] for seeds in group.values() for rs in seeds)
            for label, seeds in group.items():
                steps, _, means, stds = curve(seeds, lambda r: r.get("eval_accuracy"))
                colour = ARM_COLOURS[LONG[label][0]]
                ax.plot(steps, means, color=colour, marker=".", label=LONG[label][0])
                ax.fill_between(steps, [m - d for m, d in zip(means, stds)], [m + d for m, d in zip(means, stds)],
                                color=colour, alpha=0.15)
            ax.axhline(base, color="grey", linestyle="--", linewidth=1)
            ax.set(title=group_title(model, tokens, variant), xlabel="step",
                   ylabel="greedy eval accuracy", ylim=(0, 1))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    seeds = max(len(s) for s in runs.values())
    fig.suptitle(f"long: greedy accuracy, mean over {seeds} seeds, band ± 1 std\n(evaluations: not smoothed); "
                 "dashed: the base")
    bench.save_figure(fig, path, dpi=80)


def long_claims_figure(runs, path):
    from matplotlib.ticker import NullLocator
    fig, axes = bench.subplots(2, 2, figsize=(12, 8))
    style = {"toy MoE": "-", "fine toy": "--", "dense toy": ":"}
    for ax, key, title, only, yscale in (
            (axes[0, 0], ("ev_q1", "ev_q4"),
             "(a) PPO's critic: explained variance, first (o, blue) and last (s, cyan) quarter",
             ("ppo",), "linear"),
            (axes[0, 1], ("final",), "(a, c, e) final greedy accuracy", None, "linear"),
            (axes[1, 0], ("ratio_var_mean",), "(b) token-ratio variance, mean over steps",
             ("grpo", "grpo + replay", "gspo"), "log"),
            (axes[1, 1], ("clip_frac",), "(e) clip fraction, mean over steps", None, "log")):
        for k, marker, quarter_colour in zip(key, "os", ("C0", "C9")):
            for (arm, model), pts in long_points(runs, k).items():
                if only is None or arm in only:
                    ax.errorbar([t for t, _, _ in pts], [m for _, m, _ in pts], yerr=[d for _, _, d in pts],
                                color=quarter_colour if len(key) > 1 else ARM_COLOURS[arm], linestyle=style[model],
                                marker=marker, capsize=3,
                                label=f"{arm}, {model}" + (f" ({'first' if marker == 'o' else 'last'} quarter)"
                                                           if len(key) > 1 else ""))
        if key == ("final",):                                         # and each model's bases, grey
            for model, pts in {m: p for (arm, m), p in long_points(runs, "base").items() if arm == "grpo"}.items():
                ax.plot([t for t, _, _ in pts], [m for _, m, _ in pts], color="grey", linestyle=style[model],
                        marker="x", label=f"base, {model}")
            ax.set_ylim(0, 1)
        tokens = sorted({t for pts in long_points(runs, "final").values() for t, _, _ in pts})
        ax.set(title=title, xlabel="completion tokens", xscale="log", yscale=yscale)
        ax.set_xticks(tokens, [str(t) for t in tokens])
        ax.minorticks_off() if yscale == "linear" else ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle("long: each claim's quantity against the completion length, mean ± 1 std over seeds")
    bench.save_figure(fig, path, dpi=80)


VERDICTS = (
    "How each claim is read, on each model, from the rows above (the lines below give the verdicts; "
    "docs/long-answers.md and README quote them). The differences each claim predicts: (a) the critic's explained "
    "variance over the first quarter minus the last, at the model's longest length (not testable where the first "
    "quarter's is within t standard errors of 0: a critic that knows nothing cannot know late positions worse); "
    "PPO's lead over GRPO in final greedy accuracy at the shortest length minus at the longest (four arms' means, "
    "over their seeds); (b) GRPO's token-ratio variance at the longest length minus at the shortest, on an MoE, "
    "holding only if replay's and GSPO's do not grow beyond t standard errors; (c) the final greedy accuracy of "
    "GRPO + replay and of GSPO, each minus GRPO's, at the longest length and stressed (not testable where no seed of "
    "any arm fell or ended 0.10 below its base: nothing to be more stable against); (d) the token-level loss's final "
    "minus the per-sequence mean's, on mixed lengths; (e) GSPO's final minus GRPO's at every length, with a clip "
    "fraction 10x GRPO's or more (else it does not hold). A claim made of several differences holds when all hold, "
    "does not hold when any does not, needs seeds when none of those and a part does, and is inconclusive otherwise. "
    "The claims' quantities were fixed after the toy MoE's runs and before the fine toy's; these four outcomes "
    "replaced, after all the runs, a rule of seed spread (two means differ when further apart than the larger std; "
    "*mixed* across models), and the standard error over seeds with Student's t replaced, later still, the held-out "
    "evaluation's as a held-out difference's error.")


LONG_CLAIMS = ("(a) PPO's critic knows late positions worse",
               "(a) PPO's lead over GRPO shrinks or reverses with length",
               "(b) token-ratio variance grows with length on MoE models; replay or GSPO remove the growth",
               "(c) at length GRPO without replay is less stable than with replay and than GSPO",
               "(d) DAPO's token-level loss keeps long answers from being drowned out",
               "(e) GSPO clips far more, yet converges at least as fast")


def held_out(name, quick):
    """The held-out problems an experiment's runs evaluate on: its last --eval-size, else the scripts' 500."""
    flags = run_flags(name, [], quick)
    return int(flags[len(flags) - flags[::-1].index("--eval-size")]) if "--eval-size" in flags else 500


def combined(outcomes):
    """One verdict from parts that must all hold (bench.RULE)."""
    if "does not hold here" in outcomes:
        return "does not hold here"
    if all(o == "holds here" for o in outcomes) or all(o == "not testable here" for o in outcomes):
        return outcomes[0]
    return bench.NEEDS_SEEDS if bench.NEEDS_SEEDS in outcomes else "inconclusive"


def long_verdicts(runs, n):
    """Each claim's verdict (bench.RULE, VERDICTS) on each model, with the differences it rests on."""
    groups = long_groups(runs)
    seeds = lambda model, tokens, arm, variant="": next(
        (s for label, s in groups.get((model, tokens, variant), {}).items() if LONG[label][0] == arm), [])
    values = lambda ss, key: [summarise(rs)[key] for rs in ss]
    finals = lambda ss: [([r for r in rs if "eval_accuracy" in r][-1]["eval_accuracy"], rs[-1].get("correct"))
                         for rs in ss]
    text = bench.difference_text
    found = {claim: [] for claim in LONG_CLAIMS}
    a, lead, b, c, d, e = found.values()
    for model in dict.fromkeys(m for m, _, variant in groups if not variant):
        lengths = sorted(t for m, t, variant in groups if m == model and not variant)
        short, longest = lengths[0], lengths[-1]
        ppo = seeds(model, longest, "ppo")
        q1, q4 = values(ppo, "ev_q1"), values(ppo, "ev_q4")
        if len(ppo) > 1 and not any(map(math.isnan, q1 + q4)):
            knows = bench.verdict(bench.seeds_difference(q1)) == "holds here"   # the first quarter's above 0
            ev = bench.seeds_difference([x - y for x, y in zip(q1, q4)])   # the same runs: paired (bench.RULE)
            a.append((model, bench.verdict(ev, knows), f"at {longest} tokens, first / last quarter {mean_std(q1)} / "
                      f"{mean_std(q4)}: {text(ev)}"))
        ends = [(seeds(model, t, "ppo"), seeds(model, t, "grpo")) for t in (short, longest)]
        if short != longest and all(all(pair) for pair in ends):
            d1, d2 = (bench.held_out_difference(finals(x), finals(y), n) for x, y in ends)
            # (PPO - GRPO at the shortest) - (at the longest): four arms' means, its error over their seeds
            accuracies = [[acc for acc, _ in finals(arm)] for pair in ends for arm in pair]
            shrinks = bench.Difference(d1.value - d2.value, *bench.seeds_error(*accuracies),
                                       math.hypot(d1.evaluation, d2.evaluation), d1.paired and d2.paired)
            lead.append((model, bench.verdict(shrinks), f"PPO − GRPO {d1.value:+.3f} at {short} tokens, "
                         f"{d2.value:+.3f} at {longest}: {text(shrinks)}"))
        if model != "dense toy" and short != longest:
            growth = {}
            for arm in ("grpo", "grpo + replay", "gspo"):
                before, after = values(seeds(model, short, arm), "ratio_var_mean"), values(seeds(model, longest, arm),
                                                                                          "ratio_var_mean")
                if before and after:
                    grows = bench.seeds_difference(after, before)
                    growth[arm] = (bench.verdict(grows), f"{arm} {text(grows, '.2g')}")
            if "grpo" in growth:
                removed = [o != "holds here" for arm, (o, _) in growth.items() if arm != "grpo"]
                outcome = growth["grpo"][0] if growth["grpo"][0] != "holds here" or all(removed) else \
                    "does not hold here"
                b.append((model, outcome, f"{short} → {longest} tokens: " + ", ".join(t for _, t in growth.values())))
    for model, tokens, variant in groups:
        if variant in ("", "stressed") and (variant or tokens == max(t for m, t, v in groups if m == model and not v)):
            arms = {arm: seeds(model, tokens, arm, variant) for arm in ("grpo", "grpo + replay", "gspo")}
            if all(arms.values()):
                rows = [summarise(rs) for ss in groups[(model, tokens, variant)].values() for rs in ss]
                testable = any(r["fell"] or r["ended"] for r in rows)
                parts = [bench.held_out_difference(finals(arms[arm]), finals(arms["grpo"]), n)
                         for arm in ("grpo + replay", "gspo")]
                outcome = combined([bench.verdict(part, testable) for part in parts])
                c.append((group_title(model, tokens, variant), outcome, "replay − GRPO " + text(parts[0]) +
                          "; GSPO − GRPO " + text(parts[1])))
        if variant == "mixed lengths":
            token = seeds(model, tokens, "dapo", variant)
            mean_loss = seeds(model, tokens, "dapo, sequence mean", variant)
            if token and mean_loss:
                loss = bench.held_out_difference(finals(token), finals(mean_loss), n)
                d.append((group_title(model, tokens, variant), bench.verdict(loss),
                          f"token-level − per-sequence mean {text(loss)}"))
    for model in dict.fromkeys(m for m, _, variant in groups if not variant):
        parts, clips = [], []
        for tokens in sorted(t for m, t, variant in groups if m == model and not variant):
            gspo, grpo = seeds(model, tokens, "gspo"), seeds(model, tokens, "grpo")
            if gspo and grpo:
                times = statistics.mean(values(gspo, "clip_frac")) / statistics.mean(values(grpo, "clip_frac"))
                final = bench.held_out_difference(finals(gspo), finals(grpo), n)
                parts.append(bench.verdict(final) if times >= 10 else "does not hold here")
                clips.append(f"{tokens} tokens {times:.0f}×, {text(final)}")
        if parts:
            e.append((model, combined(parts), "clip fraction GSPO / GRPO and GSPO − GRPO: " + "; ".join(clips)))
    return [f"- {claim}: " + ("; ".join(f"{where}: **{outcome}** ({why})" for where, outcome, why in results)
                              or "no verdict: its runs are not here (2 seeds an arm at least)") + "."
            for claim, results in found.items()]


# ---------------------------------------------------------------------------------------------------
# The losses after GSPO: what each loss does to a token's gradient, and the claims made for cispo and sapo

LOSSES_TEXT = (
    "The losses TRL and verl added after GSPO beside grpo, dapo and gspo, each script at its defaults. What *clip "
    "frac* counts differs by loss: grpo and dapo, the tokens whose gradient the clip zeroes; gspo, every token of a "
    "sequence whose gradient the clip zeroes; cispo, the tokens whose importance weight was capped (their gradient "
    "scaled down, never zeroed); sapo, the tokens whose gate weight f'(r) is below 1/2 (their gradient at least "
    "halved, never zeroed; *gate weight, mean* says how much it damps on average). The claims and how each is read "
    "were fixed before the runs (the verdicts below, by the rule of METHODS.md): the losses-stress experiment is "
    "the stress experiment's 16 minibatches with cispo and sapo, the losses-lr experiment the lr experiment's "
    "multiples on the toy MoE with them; a run *fell* as in the lr experiment.")
LOSS_CLAIMS = (
    "(f) CISPO learns faster than DAPO at equal steps: CISPO's final greedy accuracy minus DAPO's",
    "(g) CISPO reaches DAPO's accuracy in half the steps: CISPO's greedy accuracy at half the steps minus DAPO's "
    "final (and the steps each CISPO seed took to reach DAPO's mean final)",
    "(h) SAPO is more stable than GRPO and GSPO under stress, on the toy MoE without Routing Replay: SAPO's final "
    "minus each of theirs at 16 minibatches (not testable where no seed of any arm fell or ended 0.10 below)",
    "(i) SAPO falls at a higher learning rate than GRPO and GSPO: at the smallest lr multiple where a seed of any of "
    "the three fell, SAPO's final minus each of theirs (not testable where none fell)")


def evaluated(rs, step=None):
    """A run's greedy accuracy at `step` (default: its last evaluation) and that evaluation's per-problem record (None
    where it has none); None when the run was not evaluated at `step`."""
    evals = [r for r in rs if "eval_accuracy" in r]
    if step is None:
        return evals[-1]["eval_accuracy"], rs[-1].get("correct")
    acc = next((r["eval_accuracy"] for r in evals if r["step"] == step), None)
    return None if acc is None else (acc, bench.final_correct(rs[-1]["out"], step) if "out" in rs[-1] else None)


def loss_verdicts(losses, stress, lr, steps, n):
    """Each of LOSS_CLAIMS' verdicts (bench.RULE) from the runs of the losses, losses-stress and losses-lr
    experiments ({label: seeds} each); `steps`: the losses runs' steps, n: the held-out problems."""
    text, found = bench.difference_text, {claim: [] for claim in LOSS_CLAIMS}
    f, g, h, i = found.values()
    finals = lambda ss: [evaluated(rs) for rs in ss]
    cispo, dapo = losses.get("cispo"), losses.get("dapo")
    if cispo and dapo:
        final = bench.held_out_difference(finals(cispo), finals(dapo), n)
        f.append((f"{steps} steps", bench.verdict(final), f"CISPO − DAPO {text(final)}"))
        halves = [evaluated(rs, steps // 2) for rs in cispo]
        target = statistics.fmean(acc for acc, _ in finals(dapo))
        reached = [steps_to([(r["step"], r["eval_accuracy"]) for r in rs if "eval_accuracy" in r], target)
                   for rs in cispo]
        reached = (f"steps to DAPO's mean final {target:.3f}: "
                   + ", ".join("never" if r is None else str(r) for r in reached))
        if None in halves:
            g.append((f"step {steps // 2} against {steps}", "no verdict", f"a CISPO run has no evaluation at step "
                      f"{steps // 2}; {reached}"))
        else:
            half = bench.held_out_difference(halves, finals(dapo), n)
            g.append((f"step {steps // 2} against {steps}", bench.verdict(half),
                      f"CISPO − DAPO {text(half)}; {reached}"))
    three = ("sapo", "grpo", "gspo")
    if all(stress.get(arm) for arm in three):
        testable = any(r["fell"] or r["ended"] for ss in stress.values() for r in map(summarise, ss))
        parts = [bench.held_out_difference(finals(stress["sapo"]), finals(stress[arm]), n) for arm in three[1:]]
        h.append(("16 minibatches", combined([bench.verdict(part, testable) for part in parts]),
                  f"SAPO − GRPO {text(parts[0])}; SAPO − GSPO {text(parts[1])}"))
    at = {k: {arm: lr.get(f"{arm} lr x{k} toy MoE", []) for arm in three} for k in LR_TIMES}
    at = {k: arms for k, arms in at.items() if all(arms.values())}
    if at:
        fallen = {k: {arm: sum(summarise(rs)["fell"] for rs in ss) for arm, ss in arms.items()}
                  for k, arms in at.items()}
        where = next((k for k in at if any(fallen[k].values())), None)
        counts = lambda k: ", ".join(f"{arm} {fallen[k][arm]}/{len(at[k][arm])}" for arm in three)
        if where is None:
            i.append(("toy MoE", "not testable here", "no seed fell at any multiple tried"))
        else:
            parts = [bench.held_out_difference(finals(at[where]["sapo"]), finals(at[where][arm]), n)
                     for arm in three[1:]]
            i.append((f"lr x{where}", combined([bench.verdict(part) for part in parts]), f"fell: {counts(where)}; "
                      f"SAPO − GRPO {text(parts[0])}; SAPO − GSPO {text(parts[1])}"))
    return [f"- {claim}: " + ("; ".join(f"{where}: **{outcome}** ({why})" for where, outcome, why in results)
                              or "no verdict: its runs are not here") + "."
            for claim, results in found.items()]


OLD_RULE = re.compile(r"\*\*Verdicts\.\*\* A claim's verdict is one of four outcomes\..*?/ n\)`\.")


def restated(line):
    """A line of a kept table's text in the words this file writes now: the verdict rule, once copied whole, as
    bench.RULE's link; the losses' paragraph as LOSSES_TEXT."""
    line = OLD_RULE.sub(lambda _: bench.RULE, line)
    return LOSSES_TEXT if line.startswith(LOSSES_TEXT[:80]) else line


def old_sections(path):
    """{experiment: its section of an existing study.md}, kept for experiments with no runs here."""
    sections, name = {}, None
    for line in (path.read_text().splitlines() if path.exists() else []):
        if line.startswith("## "):
            name = line[3:].split(":")[0]
        if name:
            sections.setdefault(name, []).append(restated(line))
    return sections


def report(seeds, quick):
    """study.md from every finished run of every experiment (so a partial rerun keeps the other tables)."""
    results = RUNS / "quick" if quick else RESULTS     # a smoke run never overwrites the results
    results.mkdir(parents=True, exist_ok=True)
    lines = [f"# Study results{' (--quick: a smoke run, not results)' if quick else ''}", "",
             f"Regenerate: `python benchmarks/compare.py{' --quick' if quick else ''}` (mean ± std over seeds, "
             f"each run on one CPU thread, two runs at a time) and `python benchmarks/compare.py --only defaults "
             f"--seeds 0` (each script as `python <script>` runs it, on one thread, two at a time). \"start\" is the "
             f"first 1/8 of the steps, \"end\" the last 1/10; the other per-step columns are means over all steps. "
             f"How the study is run and read: [METHODS.md](../METHODS.md#the-toy-study).", ""]
    kept = old_sections(results / "study.md")
    for name in EXPERIMENTS:
        runs = collect(name, seeds, quick)
        if not any(runs.values()):
            kept_lines = kept.get(name, [])   # its runs are elsewhere: the table they made stays as it was
            if name == "long" and (results / "long.md").exists():       # long.md likewise, in today's words
                old = (results / "long.md").read_text()
                bench.write(results / "long.md", "\n".join(map(restated, old.split("\n"))))
            lines += kept_lines + ([""] if kept_lines and kept_lines[-1] else [])
            continue
        if name == "long":
            long_report(runs, quick, results)
            continue
        if name in ("lr", "losses-lr"):
            arms = ARMS if name == "lr" else LOSS_LR_ARMS
            lines += [f"## {name}: `--task add`, {EXPERIMENTS[name][2 if quick else 1]} steps, the policy's --lr at "
                      f"{', '.join(f'{k}' for k in LR_TIMES)} times the default ({DEFAULT_LR:g})", "",
                      "Final greedy accuracy, mean ± std over seeds; \"fell\": the seeds whose greedy accuracy "
                      "fell more than 0.10 below the base and stayed there (every evaluation from the first such "
                      "one to the last), a criterion fixed before the runs; \"ended below\", added after them: the "
                      "seeds whose last evaluation is more than 0.10 below the base, fallen or not." +
                      (" \"stopped\": dapo.py stops a run when no group of its 5 generation rounds has a reward "
                       "signal left (the step and the share of its samples that were right are given; such a run "
                       "has no final and is left out of the figure)." if name == "lr" else ""), ""]
            lines += lr_table(runs, arms) + ["", f"![{name}]({name}.png)", ""]
            lr_figure(runs, results / f"{name}.png", arms)
            continue
        rows, base, target = table(name, runs)
        shared, full_steps, quick_steps, _ = EXPERIMENTS[name]
        steps = quick_steps if quick else full_steps
        flags = " ".join(shared).replace(str(ROOT) + "/", "")
        lines += [f"## {name}: " + (f"`{flags}`, {steps} steps" if flags else "no flags, the scripts' own steps"), ""]
        if name not in ("depth", "defaults"):  # the deeper models have bases of their own
            lines += [f"Base greedy accuracy {base:.3f}; " + (f"half-gap target {target:.3f}." if target else
                                                              "no run ended above the base."), ""]
        lines += rows + [""]
        if name not in ("depth", "defaults"):
            figure(name, runs, results / f"{name}.png")
            lines += [f"![{name}]({name}.png)", ""]
        if name == "losses":
            others = [collect(other, seeds, quick) for other in ("losses-stress", "losses-lr")]
            lines += [LOSSES_TEXT, "", bench.RULE + f" Here n = {held_out(name, quick)} held-out problems.", ""]
            lines += loss_verdicts(runs, *others, steps, held_out(name, quick)) + [""]
    bench.write(results / "study.md", "\n".join(lines))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few steps per run: a smoke test of the study")
    parser.add_argument("--only", default=",".join(e for e in EXPERIMENTS if e not in LONG_RUNNING),
                        help="experiments to run, comma-separated (default: all but defaults, which runs alone, "
                             "lr and long, hours of their own, and the losses after GSPO)")
    parser.add_argument("--seeds", default=None,
                        help="seed ids, comma-separated (default 0,1,2, the study's three; 0,1 with --quick)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per run")
    parser.add_argument("--rerun", action="store_true", help="run again even where a finished run exists")
    parser.add_argument("--report", action="store_true", help="only redraw tables and figures from finished runs")
    args = parser.parse_args(argv)
    experiments = bench.only(parser, args.only, EXPERIMENTS, "experiment")
    seeds = list(SEEDS[:2] if args.quick else SEEDS) if args.seeds is None else bench.seed_ids(parser, args.seeds)
    if args.jobs < 1 or args.threads < 1:
        parser.error("--jobs and --threads must be at least 1")
    bench.require("matplotlib", "the report's figures")
    failed = 0 if args.report else run_all(experiments, seeds, args.quick, args.jobs, args.threads, args.rerun)
    report(sorted({*SEEDS, *seeds}), args.quick)         # the study's seeds and any others run
    if failed:
        sys.exit(f"{failed} runs failed; their log.txt says why")


if __name__ == "__main__":
    main()
