"""What holds the default runs below 0.85: the toy's capacity, the base, the update size.

    python benchmarks/ceiling.py       # about 15 min on 2 CPU cores (runs kept: a rerun measures only what is missing)

Writes benchmarks/results/ceiling.md, three tables, each from one part:
1. capacity: the warm start's own supervised recipe (batch 256, lr 3e-3, EMA 0.95, seed 0) run on past the
   base for 900 steps: greedy accuracy on the 500 held-out prompts (teacher forced, exactly the greedy
   reward) of the average and of the raw weights, and seconds on one thread.
2. knobs: grpo.py from the default base with one setting changed, one seed, each run to the same 102,400
   completions (800 steps of 16 x 8; 200 of 64 x 8): greedy accuracy along the way.
3. signal: for the base and for the end of `python grpo.py` (2400 steps), 8 samples at temperature 1 for
   each held-out prompt: how many groups carry a reward signal (some right, some wrong), and how often a
   prompt that greedy decoding gets wrong has a right answer among its 8 samples.
Runs go to benchmarks/runs/ceiling/ (ignored by git).
"""
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import common  # noqa: E402  (the repository root is not a package)
import grpo  # noqa: E402
import moe_model  # noqa: E402
import bench  # noqa: E402

RUNS, RESULTS = ROOT / "benchmarks" / "runs" / "ceiling", ROOT / "benchmarks" / "results"
COMPLETIONS = 102_400
# label: grpo.py flags; each run stops at COMPLETIONS completions
KNOBS = {"defaults": [], "lr x3 (3e-4)": ["--lr", "3e-4"], "temperature 0.5": ["--temperature", "0.5"],
         "temperature 1.5": ["--temperature", "1.5"],
         "64 prompts a step, lr x3": ["--prompts-per-step", "64", "--lr", "3e-4"]}


def capacity(world, cfg, steps=900, every=50):
    """The warm start's recipe (common.warm_start) without its stop: [(step, seconds, average acc, raw acc)]."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = moe_model.MoETransformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    average = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.95))
    rows, seconds = [], 0.0
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        common.warm_start_step(model, opt, average, world, common.TASKS["add"], gen, None)
        seconds += time.perf_counter() - t0
        if step % every == 0:
            rows.append((step, seconds, common.teacher_forced_accuracy(average.module, world.eval),
                         common.teacher_forced_accuracy(model, world.eval)))
    return rows


def grpo_run(label, flags, steps):
    out = RUNS / label.replace(" ", "-").replace("(", "").replace(")", "")
    metrics = out / "metrics.jsonl"
    if not (metrics.exists() and json.loads(metrics.read_text().splitlines()[-1])["step"] == steps):
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "log.txt", "w") as log:
            subprocess.run([sys.executable, str(ROOT / "grpo.py"), *flags, "--steps", str(steps), "--out", str(out)],
                           cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    return out, [json.loads(line) for line in metrics.read_text().splitlines()]


@torch.no_grad()
def signal(model, world, group_size=8):
    prompts, answers = [p for p, _ in world.eval], [a for _, a in world.eval]
    greedy = common.rewards_of(world, common.generate(model, world, prompts, 1, 1.0, greedy=True), answers, 1)
    torch.manual_seed(0)
    right = common.rewards_of(world, common.generate(model, world, prompts, group_size, 1.0), answers,
                              group_size).view(-1, group_size).sum(1)
    return {"greedy": greedy.mean().item(), "sampled": right.mean().item() / group_size,
            "signal": ((right > 0) & (right < group_size)).float().mean().item(),
            "all_wrong": (right == 0).float().mean().item(), "all_right": (right == group_size).float().mean().item(),
            "rescued": (right[greedy == 0] > 0).float().mean().item()}


def main():
    torch.set_num_threads(1)
    world = common.toy_world("add", 500, None)
    cfg = common.toy_model_config(grpo.Args(), world)
    lines = ["# What holds the default runs below 0.85", "", "Regenerate: `python benchmarks/ceiling.py` (one CPU "
             "thread; the runs are grpo.py subprocesses, seed 0, from the default base).", "",
             "## 1. capacity: the warm start's supervised recipe, run on past the base (seconds: its training "
             "steps alone, one thread)", "",
             "| step | seconds | held-out greedy acc, average (EMA 0.95) | held-out greedy acc, raw weights |",
             "| --- | --- | --- | --- |"]
    for step, seconds, avg, raw in capacity(world, cfg):
        if step in (100, 150, 200, 300, 400, 500, 600, 700, 800, 900):
            lines.append(f"| {step} | {seconds:.0f} | {avg:.3f} | {raw:.3f} |")
    lines += ["", f"## 2. knobs: grpo.py from the default base, one setting changed, {COMPLETIONS:,} completions "
                  "each", "", "| run | flags | steps | greedy acc at 1/4, 1/2, 3/4, all of its completions | "
                  "sampled acc (last 10%) | entropy (last 10%) |", "| --- | --- | --- | --- | --- | --- |"]
    for label, flags in KNOBS.items():
        per_step = int(flags[flags.index("--prompts-per-step") + 1]) * 8 if "--prompts-per-step" in flags else 128
        steps = COMPLETIONS // per_step
        _, rows = grpo_run(label, flags + ["--eval-every", str(steps // 8)], steps)
        evals = {r["step"]: r["eval_accuracy"] for r in rows if "eval_accuracy" in r}
        last = [r for r in rows if "entropy" in r][-steps // 10:]
        lines.append(f"| {label} | `{' '.join(flags) or '(none)'}` | {steps} | {evals[0]:.3f} → "
                     + ", ".join(f"{evals[steps * q // 4]:.3f}" for q in (1, 2, 3, 4))
                     + f" | {sum(r['accuracy'] for r in last) / len(last):.3f} | "
                       f"{sum(r['entropy'] for r in last) / len(last):.3f} |")
    end, _ = grpo_run("defaults to the end", [], grpo.Args().steps)
    base, _ = common.warm_start(world, cfg, common.TASKS["add"])
    lines += ["", "## 3. signal: 8 samples at temperature 1 for each of the 500 held-out prompts", "",
              "| model | greedy acc | sampled acc | groups with a signal | all wrong | all right | greedy-wrong "
              "prompts with a right sample |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, model in (("the base", base),
                         ("`python grpo.py` at its end (2400 steps)", moe_model.load(end / "model"))):
        s = signal(model.eval(), world)
        lines.append(f"| {label} | {s['greedy']:.3f} | {s['sampled']:.3f} | {s['signal']:.3f} | {s['all_wrong']:.3f} "
                     f"| {s['all_right']:.3f} | {s['rescued']:.3f} |")
    bench.write(RESULTS / "ceiling.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
