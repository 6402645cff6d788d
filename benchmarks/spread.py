"""What a default run prints on your machine: `python <script>` over seeds and over the CPU kernels torch runs.

    python benchmarks/spread.py                          # python grpo.py, seeds 0-2, this CPU's kernels and AVX2's
    python benchmarks/spread.py --only all --seeds 0     # every script's default run, seed 0, both kernel sets
    python benchmarks/spread.py --report                 # spread.md again from the recorded runs

A run's result depends on more than its seed. torch picks its CPU kernels when it starts (AVX-512, AVX2 or plain
code: `ATEN_CPU_CAPABILITY`), and each sums in its own order, as another CPU would; reinforcement learning amplifies
the last bit of a sampled token's probability into other samples, other updates and another final accuracy. So a
run on this machine with ATEN_CPU_CAPABILITY=avx2 stands in for the same run on another CPU, and the spread over
seeds and kernel sets is what a user should expect of their own run, not one printed figure.

Each run is the script exactly as `python <script>` runs it (one thread), warm-started from nothing (the base
depends on the kernels too), two at a time. Its result is one line of benchmarks/results/spread.jsonl (the CPU, the
kernels asked for and used, the seed, base, final and sampled accuracies, training time); a recorded run is not run
again, so runs on other machines add to the table. benchmarks/results/spread.md is made from every line.
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
    """Run one arm, seed and kernel set to its end and record it: the exit code."""
    arm, seed, kernels, used = job
    script, flags = ARMS[arm]
    out = RUNS / kernels / arm.replace(" + ", "-") / f"seed{seed}"
    if not compare.finished(out, compare.default_steps(script)):      # a finished run is only recorded
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
              "wall_seconds": float((out / "wall_seconds").read_text())}
    with WRITING, open(RECORDS, "a") as f:
        f.write(json.dumps(record) + "\n")
    return 0


def spread(values):
    """mean ± std (min-max) of one column, or the single value."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def report():
    rows = records()
    lines = ["# What a default run gives: seeds and CPU kernel sets", "",
             "`python benchmarks/spread.py` (and `--only all --seeds 0`): each script exactly as `python <script>` "
             "runs it, one thread, warm-started from nothing, two runs at a time; \"own\" kernels are torch's "
             "choice on that CPU, \"avx2\" its AVX2 kernels (`ATEN_CPU_CAPABILITY=avx2`), as a CPU without AVX-512 "
             "runs. Greedy accuracy on the 500 held-out problems at the start (base) and the end (final); sampled: "
             "the last tenth of the steps. mean ± std (min-max) over the runs of a row.", "",
             "| script | CPU | kernels | seeds | base | final | sampled, end | s/step |", "| --- " * 8 + "|"]
    groups = {}
    for r in rows:
        groups.setdefault((r["arm"], r["cpu"], r["kernels"]), []).append(r)
    order = list(ARMS)
    for (arm, cpu, kernels), runs in sorted(groups.items(), key=lambda g: (order.index(g[0][0]), g[0][1:])):
        col = lambda name: spread([r[name] for r in runs])
        per_step = statistics.mean(r["train_seconds"] / r["steps"] for r in runs)
        lines.append(f"| {arm} | {cpu} | {kernels} ({runs[0]['capability']}) | "
                     f"{','.join(str(r['seed']) for r in sorted(runs, key=lambda r: r['seed']))} | {col('base')} | "
                     f"{col('final')} | {col('sampled_end')} | {per_step:.3f} |")
    for arm in order:
        finals = [r["final"] for r in rows if r["arm"] == arm]
        if len(finals) > 1:
            lines += ["", f"{arm}, every run above together ({len(finals)}): final {spread(finals)}"]
    lines += ["", "s/step: the training loop's mean time a step (evaluation left out), two runs side by side on 2 "
                  "cores, with whatever else the machine ran (the AMD EPYC's \"own\" grpo runs shared it with a test "
                  "suite: 4x slower); quiet timings are in speed.md."]
    bench.write(RESULTS / "spread.md", "\n".join(lines))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="grpo", help=f"scripts, comma-separated, or all: {', '.join(ARMS)}")
    parser.add_argument("--seeds", default="0,1,2", help="seed ids, comma-separated")
    parser.add_argument("--kernels", default="own,avx2", help=f"kernel sets, comma-separated: {', '.join(KERNELS)}")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    parser.add_argument("--report", action="store_true", help="only write spread.md from the recorded runs")
    args = parser.parse_args(argv)
    arms = list(ARMS) if args.only == "all" else bench.only(parser, args.only, ARMS, "script")
    kernels = bench.only(parser, args.kernels, KERNELS, "kernel set")
    seeds = bench.seed_ids(parser, args.seeds)
    os.environ.pop("ATEN_CPU_CAPABILITY", None)          # "own" is this CPU's choice, whatever the shell set
    if not args.report:
        done = {key(r) for r in records()}
        used = {k: capability(k) for k in kernels}
        todo = [(arm, seed, k, used[k]) for k in kernels for arm in arms for seed in seeds
                if (bench.cpu_name(), k, arm, seed) not in done]
        print(f"{len(todo)} runs to do, {args.jobs} at a time, on {bench.cpu_name()}", flush=True)
        failed = bench.run_all(one, todo, args.jobs)
        if failed:
            print(f"{failed} runs failed; their log.txt in {RUNS} says why", file=sys.stderr)
    report()


if __name__ == "__main__":
    main()
