"""What a default run prints on your machine: `python <script>` over seeds and over the CPU kernels torch runs.

    python benchmarks/spread.py                          # python grpo.py, seeds 0-2, this CPU's kernels and AVX2's
    python benchmarks/spread.py --only all --seeds 0     # every script's default run, seed 0, both kernel sets
    python benchmarks/spread.py --only all --seeds 0 --kernels own --rerun   # run recorded runs again, replace them
    python benchmarks/spread.py --report                 # spread.md and defaults.png again from the recorded runs

A run's result depends on more than its seed. torch picks its CPU kernels when it starts (AVX-512, AVX2 or plain
code: `ATEN_CPU_CAPABILITY`), and each sums in its own order, as another CPU would; reinforcement learning amplifies
the last bit of a sampled token's probability into other samples, other updates and another final accuracy. So a
run on this machine with ATEN_CPU_CAPABILITY=avx2 stands in for the same run on another CPU, and the spread over
seeds and kernel sets is what a user should expect of their own run, not one printed figure.

Each run is the script exactly as `python <script>` runs it (one thread), warm-started from nothing (the base
depends on the kernels too), two at a time. Its result is one line of benchmarks/results/spread.jsonl (the CPU, the
kernels asked for and used, the seed, base, final and sampled accuracies, training time, and the held-out accuracy
curve: [step, greedy accuracy] at each evaluation); a recorded run is not run again (--rerun runs it again and
replaces its line), so runs on other machines add to the table. benchmarks/results/spread.md is made from every line:
the table, grpo's final pooled over each CPU's runs, and how far one late evaluation swings from the one before.
benchmarks/results/defaults.png draws the curves of every script's seed-0 run on one machine's own kernels.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import bench
import compare

ROOT = Path(__file__).resolve().parent.parent
RUNS, RESULTS = ROOT / "benchmarks" / "runs" / "spread", ROOT / "benchmarks" / "results"
RECORDS = RESULTS / "spread.jsonl"
ARMS = {"grpo": ("grpo.py", []), "grpo + replay": ("grpo.py", ["--routing-replay"]), "gspo": ("gspo.py", []),
        "dapo": ("dapo.py", []), "ppo": ("ppo.py", []), "cispo": ("cispo.py", []), "sapo": ("sapo.py", [])}
KERNELS = {"own": None, "avx2": "avx2", "default": "default"}     # "own": torch's choice on this CPU
WRITING = threading.Lock()                                          # two runs finish at once: one line each


def kernels_env(kernels):
    """What a run's environment adds to choose its kernels."""
    return {} if KERNELS[kernels] is None else {"ATEN_CPU_CAPABILITY": KERNELS[kernels]}


def capability(kernels):
    """The kernels torch runs under that setting ("AVX512", "AVX2", "DEFAULT")."""
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    return subprocess.run([sys.executable, "-c", code], env=os.environ | kernels_env(kernels), capture_output=True,
                          text=True, check=True).stdout.strip()


def records():
    return [json.loads(line) for line in RECORDS.read_text().splitlines()] if RECORDS.exists() else []


def key(record):
    return record["cpu"], record["kernels"], record["arm"], record["seed"]


def one(job):
    """Run one arm, seed and kernel set to its end and record it (a record of the same run is replaced): the exit
    code. `rerun`: run it again even if its folder holds a finished run."""
    arm, seed, kernels, used, rerun = job
    script, flags = ARMS[arm]
    out = RUNS / kernels / arm.replace(" + ", "-") / f"seed{seed}"
    if rerun or not compare.finished(out, compare.default_steps(script)):      # a finished run is only recorded
        rc = bench.launch(script, flags + ["--seed", str(seed)], out, 1, {"RL_CACHE_DIR": str(out / "cache")} |
                          kernels_env(kernels))
        shutil.rmtree(out / "cache", ignore_errors=True)
        if rc != 0:
            return rc
    rows = bench.read_metrics(out)
    summary = compare.summarise(rows)
    steps = sum(1 for r in rows if "step_time_s" in r)
    record = {"cpu": bench.cpu_name(), "kernels": kernels, "capability": used, "arm": arm, "seed": seed,
              "base": summary["base"], "final": summary["final"],
              "sampled_start": round(summary["sampled_accuracy_start"], 4),
              "sampled_end": round(summary["sampled_accuracy_end"], 4), "steps": steps,
              "train_seconds": round(summary["train_seconds"], 1),
              "wall_seconds": float((out / "wall_seconds").read_text()),
              "curve": [[r["step"], r["eval_accuracy"]] for r in rows if "eval_accuracy" in r]}
    with WRITING:
        kept = [r for r in records() if key(r) != key(record)]
        RECORDS.write_text("".join(json.dumps(r) + "\n" for r in kept + [record]))
    return 0


SWING_FROM = 1800      # the last quarter of the GRPO family's 2400 steps: where a user reads a run's end


def spread(values):
    """mean ± std (min-max) of one column, or the single value."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def pooled(rows):
    """[(what, runs)]: each script's runs pooled on each CPU (every seed and kernel set it ran there), and over every
    CPU where it ran on more than one; only groups of two runs or more."""
    groups = []
    for arm in ARMS:
        runs = [r for r in rows if r["arm"] == arm]
        cpus = sorted({r["cpu"] for r in runs})
        for cpu in cpus:
            here = [r for r in runs if r["cpu"] == cpu]
            kernels = sorted({r["kernels"] for r in here}, key=list(KERNELS).index)
            seeds = sorted({r["seed"] for r in here})
            groups.append((f"{arm} on {cpu}: seed{'s' * (len(seeds) > 1)} {','.join(map(str, seeds))}, "
                           f"{' and '.join(kernels)} kernels",
                           here))
        if len(cpus) > 1:
            groups.append((f"{arm} on every CPU above", runs))
    return [(what, runs) for what, runs in groups if len(runs) > 1]


def swing(curve, start=SWING_FROM):
    """(mean, largest, (step, step) of the largest) absolute change between consecutive evaluations of a curve
    [[step, accuracy], ...], over the evaluations at `start` and after; None with fewer than two there."""
    late = [(step, acc) for step, acc in curve if step >= start]
    if len(late) < 2:
        return None
    changes = [(abs(b - a), (s, t)) for (s, a), (t, b) in zip(late, late[1:])]
    largest = max(changes)
    return statistics.fmean(c for c, _ in changes), largest[0], largest[1]


def swings(rows):
    """The table's lines: each recorded curve's late swing, then all of them together."""
    runs = sorted((r for r in rows if r.get("curve") and swing(r["curve"])),
                  key=lambda r: (list(ARMS).index(r["arm"]), r["cpu"], r["kernels"], r["seed"]))
    if not runs:
        return ["No recorded run has its curve yet (runs recorded since spread.py kept it)."]
    lines = ["| script | CPU | kernels | seed | changes | mean | largest (steps) |", "| --- " * 7 + "|"]
    changes = []
    for r in runs:
        late = [acc for step, acc in r["curve"] if step >= SWING_FROM]
        changes += [abs(b - a) for a, b in zip(late, late[1:])]
        mean, largest, (s, t) = swing(r["curve"])
        lines.append(f"| {r['arm']} | {r['cpu']} | {r['kernels']} | {r['seed']} | {len(late) - 1} | {mean:.3f} | "
                     f"{largest:.3f} ({s} → {t}) |")
    left_out = sorted({r["arm"] for r in rows if r.get("curve") and not swing(r["curve"])})
    lines += ["", f"Every run above together ({len(runs)} runs, {len(changes)} changes): one evaluation moves "
                  f"{statistics.fmean(changes):.3f} from the one before on average, {max(changes):.3f} at most."]
    if left_out:
        lines[-1] += f" Left out: {', '.join(left_out)} (its runs end before step {SWING_FROM})."
    return lines


def figure_runs(rows):
    """The runs defaults.png draws: seed 0 of every script with a curve, on the CPU and kernel set that has the most
    such scripts (ties: the first recorded); {arm: record} in ARMS' order, and (cpu, kernels)."""
    curves = [r for r in rows if r["seed"] == 0 and r.get("curve")]
    if not curves:
        return {}, None
    counts = {}
    for r in curves:
        counts.setdefault((r["cpu"], r["kernels"]), set()).add(r["arm"])
    where = max(counts, key=lambda k: len(counts[k]))
    chosen = {r["arm"]: r for r in curves if (r["cpu"], r["kernels"]) == where}
    return {arm: chosen[arm] for arm in ARMS if arm in chosen}, where


def figure(rows, path):
    """defaults.png: held-out greedy accuracy against step, each script's default run of seed 0 on one machine."""
    sys.path.insert(0, str(ROOT))
    from extras.plot import COLOURS
    runs, where = figure_runs(rows)
    if not runs:
        return False
    usual = statistics.mode(r["steps"] for r in runs.values())
    fig, ax = bench.subplots(figsize=(11, 5))
    for arm, r in runs.items():
        steps, accs = zip(*r["curve"])
        label = f"{arm} ({r['steps']} steps)" if r["steps"] != usual else arm
        ax.plot(steps, accs, color=COLOURS[arm], marker=".", markersize=3, linewidth=1.2,
                label=f"{label}: {r['final']:.3f}")
    bases = sorted({r["base"] for r in runs.values()})
    for base in bases:
        ax.axhline(base, color="grey", linestyle="--", linewidth=1)
    ax.plot([], [], color="grey", linestyle="--", label="base (step 0): " + " / ".join(f"{b:.3f}" for b in bases))
    cpu, kernels = where
    ax.set(xlabel="step", ylabel="held-out greedy accuracy (500 problems)",
           title=f"Each script as `python <script>` runs it, seed 0: {cpu}, {kernels} kernels "
                 f"({runs[next(iter(runs))]['capability']}), one thread")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))   # beside, not over, the curves
    bench.save_figure(fig, path)
    print(f"wrote {path}")
    return True


def report():
    rows = records()
    lines = ["# What a default run gives: seeds and CPU kernel sets", "",
             "`python benchmarks/spread.py` (and `--only all --seeds 0`): each script exactly as `python <script>` "
             "runs it, one thread, warm-started from nothing, two runs at a time; \"own\" kernels are torch's "
             "choice on that CPU, \"avx2\" its AVX2 kernels (`ATEN_CPU_CAPABILITY=avx2`), as a CPU without AVX-512 "
             "runs. Greedy accuracy on the 500 held-out problems at the start (base) and the end (final); sampled: "
             "the last tenth of the steps. mean ± std (min-max) over the runs of a row.", "",
             "| script | CPU | kernels | seeds | base | final | sampled, end | s/step | wall min |", "| --- " * 9 + "|"]
    groups = {}
    for r in rows:
        groups.setdefault((r["arm"], r["cpu"], r["kernels"]), []).append(r)
    order = list(ARMS)
    for (arm, cpu, kernels), runs in sorted(groups.items(), key=lambda g: (order.index(g[0][0]), g[0][1:])):
        col = lambda name: spread([r[name] for r in runs])
        per_step = statistics.mean(r["train_seconds"] / r["steps"] for r in runs)
        lines.append(f"| {arm} | {cpu} | {kernels} ({runs[0]['capability']}) | "
                     f"{','.join(str(r['seed']) for r in sorted(runs, key=lambda r: r['seed']))} | {col('base')} | "
                     f"{col('final')} | {col('sampled_end')} | {per_step:.3f} | "
                     f"{statistics.mean(r['wall_seconds'] for r in runs) / 60:.1f} |")
    lines += ["", "s/step: the training loop's mean time a step (evaluation left out); wall min: the whole process's "
                  "mean, its warm start from an empty cache included. Both with two runs side by side on 2 "
                  "cores, with whatever else the machine ran: the AMD EPYC's \"own\" runs of seed 0 and grpo's seed 1 "
                  "shared it with test suites (3-4x slower). Quiet timings are in speed.md."]
    groups = pooled(rows)
    if groups:
        lines += ["", "## Finals pooled", "", "How far a final moves with seed and kernels: every run of a script "
                  "on one CPU together (its seeds on each kernel set), then on every CPU. mean ± std (min-max).", "",
                  "| runs pooled | runs | final |", "| --- | --- | --- |"]
        lines += [f"| {what} | {len(runs)} | {spread([r['final'] for r in runs])} |" for what, runs in groups]
    lines += ["", f"## How far one evaluation swings, from step {SWING_FROM} on", "",
              f"The absolute change of held-out greedy accuracy from one evaluation to the next (every 50 steps), "
              f"over the evaluations at step {SWING_FROM} and after, in each run that recorded its curve.", ""]
    lines += swings(rows)
    try:
        if figure(rows, RESULTS / "defaults.png"):
            runs, (cpu, kernels) = figure_runs(rows)
            finals = ", ".join(f"{arm} {r['final']:.3f}" for arm, r in runs.items())
            lines += ["", "## Each script's default run", "", f"Seed 0 of every script on the {cpu}, {kernels} "
                      f"kernels, held-out greedy accuracy against step (finals: {finals}):", "",
                      "![defaults](defaults.png)"]
    except ImportError:
        print("note: no matplotlib, so no defaults.png (pip install -r benchmarks/requirements.txt)", file=sys.stderr)
    bench.write(RESULTS / "spread.md", "\n".join(lines) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="grpo", help=f"scripts, comma-separated, or all: {', '.join(ARMS)}")
    parser.add_argument("--seeds", default="0,1,2", help="seed ids, comma-separated")
    parser.add_argument("--kernels", default="own,avx2", help=f"kernel sets, comma-separated: {', '.join(KERNELS)}")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    parser.add_argument("--rerun", action="store_true", help="run the recorded runs of this CPU again, replacing them")
    parser.add_argument("--report", action="store_true",
                        help="only write spread.md and defaults.png from the recorded runs")
    args = parser.parse_args(argv)
    arms = list(ARMS) if args.only == "all" else bench.only(parser, args.only, ARMS, "script")
    kernels = bench.only(parser, args.kernels, KERNELS, "kernel set")
    seeds = bench.seed_ids(parser, args.seeds)
    os.environ.pop("ATEN_CPU_CAPABILITY", None)          # "own" is this CPU's choice, whatever the shell set
    if not args.report:
        done = {key(r) for r in records()}
        used = {k: capability(k) for k in kernels}
        todo = [(arm, seed, k, used[k], args.rerun) for k in kernels for arm in arms for seed in seeds
                if args.rerun or (bench.cpu_name(), k, arm, seed) not in done]
        print(f"{len(todo)} runs to do, {args.jobs} at a time, on {bench.cpu_name()}", flush=True)
        failed = bench.run_all(one, todo, args.jobs)
        if failed:
            print(f"{failed} runs failed; their log.txt in {RUNS} says why", file=sys.stderr)
    report()


if __name__ == "__main__":
    main()
