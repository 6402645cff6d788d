"""Speed: where a step's time goes in each script, what the KV cache buys, and grpo.py against TRL.

    python benchmarks/speed.py              # about 10 min on 2 CPU cores; writes benchmarks/results/speed.md
    python benchmarks/speed.py --device cuda --out benchmarks/results/speed-cuda.md

1. Each script (a subprocess, as users run it) for --steps at two toy sizes on `add`: the default
   (width 64, 2 layers) and a larger toy (width 256, 4 layers; its warm start, cached, takes a few
   minutes the first time). From its metrics.jsonl: seconds per step split into generation / old
   log-probs / reference / critic / update, and peak memory. The first steps (warm-up) are left out.
2. Generation alone, 16 prompts x 8 completions, with and without the KV cache: tokens per second for
   the default toy with 8 new tokens and the larger toy with 64 (freshly initialised weights: speed does
   not depend on them, and untrained models do not stop early).
3. grpo.py against TRL's GRPOTrainer on the same tiny Hugging Face Qwen3-MoE (hidden 64, 2 layers,
   8 experts top-2, built here from a config with random weights), the same prompts, 8 prompts x 8
   completions of at most 16 new tokens, one optimizer step per rollout batch, beta 0. The two
   alternate, round by round; the table gives medians. Skipped, with a message, if trl is missing.
"""
import argparse
import cProfile
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import common  # noqa: E402  (the repository root is not a package)
from extras import hf_models, rewards  # noqa: E402
import grpo  # noqa: E402
import bench  # noqa: E402
from moe_model import MoETransformer  # noqa: E402

SIZES = {"toy default": ["--task", "add"], "larger toy": ["--task", "add", "--d-model", "256", "--n-layers", "4"]}
GENERATION = {"toy default": SIZES["toy default"], "larger toy": SIZES["larger toy"] + ["--max-new-tokens", "64"]}
SCRIPTS = {"grpo": ["grpo.py"], "grpo + replay": ["grpo.py", "--routing-replay"],
           "grpo, beta 0.04": ["grpo.py", "--beta", "0.04"], "gspo": ["gspo.py"], "dapo": ["dapo.py"],
           "ppo": ["ppo.py"]}
PHASES = ["generate", "old_logp", "ref", "critic", "update"]
WARMUP = 3


def run_script(script, flags, out, threads=None):
    """Run a script to completion and return its metrics.jsonl rows."""
    shutil.rmtree(out, ignore_errors=True)           # a script refuses an --out that holds a run
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    cmd = [sys.executable, str(ROOT / script), *flags, "--out", str(out), "--eval-every", "0", "--eval-size", "50",
           "--save-every", "0"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return bench.read_metrics(Path(out))


def step_rows(rows):
    steps = [r for r in rows if "step_time_s" in r]
    return steps[WARMUP:] if len(steps) > WARMUP + 2 else steps


def phase_table(device, steps, tmp):
    lines = ["| size | script | s/step | " + " | ".join(PHASES) + " | peak MB | completion length |",
             "|" + " --- |" * (len(PHASES) + 5)]
    for size, size_flags in SIZES.items():
        for name, (script, *flags) in SCRIPTS.items():
            rows = step_rows(run_script(script, size_flags + flags + ["--steps", str(steps), "--device", device],
                                        Path(tmp) / "phases"))
            mean = lambda key: statistics.mean(r.get(key, 0.0) for r in rows)
            cells = [f"{mean(f'time_{p}_s'):.3f}" if f"time_{p}_s" in rows[0] else "—" for p in PHASES]
            lines.append(f"| {size} | {name} | {mean('step_time_s'):.3f} | " + " | ".join(cells) +
                         f" | {max(r['peak_memory_mb'] for r in rows):.0f} | {mean('response_len_mean'):.1f} |")
            print(lines[-1], flush=True)
    return lines


def generation_table(device, repeats=2):
    """Tokens per second of sampling 16 prompts x 8 completions, with and without the KV cache."""
    lines = ["| size | new tokens (max) | tokens/s with cache | tokens/s without | speed-up |", "|" + " --- |" * 5]
    for size, size_flags in GENERATION.items():
        args = common.parse_args(grpo.Args, "", size_flags)
        world = common.toy_world(args.task, args.eval_size, args.max_new_tokens)
        torch.manual_seed(0)
        policy = MoETransformer(common.toy_model_config(args, world)).to(device)
        prompts, _ = world.sample(16)
        speeds = {}
        for use_cache in (True, False):
            times = []
            for _ in range(repeats):
                torch.manual_seed(0)              # the same samples both ways: the cache changes only the cost
                start = time.perf_counter()
                rollout = common.generate(policy, world, prompts, 8, 1.0, use_cache=use_cache)
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            speeds[use_cache] = rollout.mask.sum().item() / statistics.median(times)
        lines.append(f"| {size} | {world.max_new_tokens} | {speeds[True]:.0f} | {speeds[False]:.0f} | "
                     f"{speeds[True] / speeds[False]:.1f}× |")
        print(lines[-1], flush=True)
    return lines


# ---------------------------------------------------------------------------------------------------
# grpo.py against TRL's GRPOTrainer

def build_hf_moe(folder):
    """A 229k-parameter Qwen3-MoE with a character tokenizer, random weights, saved to `folder`."""
    bench.tiny_qwen3_moe(folder, "data.jsonl", "0123456789+=,", num_hidden_layers=2, max_position_embeddings=128,
                          num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, tie_word_embeddings=False)
    return folder, folder / "data.jsonl"


def ours_step_times(model, data, steps, device):
    rows = run_script("grpo.py", ["--model", str(model), "--data", str(data), "--prompts-per-step", "8",
                                  "--group-size", "8", "--max-new-tokens", "16", "--minibatches", "1",
                                  "--steps", str(steps), "--device", device], Path(model) / "ours")
    rows = step_rows(rows)
    return ([r["step_time_s"] for r in rows], statistics.mean(r["response_len_mean"] for r in rows),
            {p: statistics.mean(r[f"time_{p}_s"] for r in rows) for p in ("generate", "old_logp", "update")})


def trl_step_times(model, data, steps, device, checkpointing=True, profile=None):
    """Run TRL's GRPOTrainer for `steps` steps; returns the time of each step after the warm-up (from
    the callback before a step to the one after its optimizer step) and the mean completion length."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.start)

    def reward(prompts, completions, answer, **kwargs):
        return [rewards.answer_reward(c, a, True) for c, a in zip(completions, answer)]

    config = GRPOConfig(output_dir=str(Path(model) / "trl"), per_device_train_batch_size=64, num_generations=8,
                        max_completion_length=16, num_iterations=1, steps_per_generation=1, beta=0.0,
                        learning_rate=1e-4, temperature=1.0, loss_type="grpo", max_steps=steps, seed=0,
                        use_cpu=device == "cpu", bf16=False, report_to="none", save_strategy="no",
                        logging_steps=10**6, disable_tqdm=True, gradient_checkpointing=checkpointing)
    timer = StepTimer()
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model), reward_funcs=reward, args=config,
                          train_dataset=load_dataset("json", data_files=str(data), split="train"),
                          processing_class=AutoTokenizer.from_pretrained(model), callbacks=[timer])
    if profile:
        cProfile.runctx("trainer.train()", globals(), {"trainer": trainer}, profile)
    else:
        trainer.train()
    lengths = [m["completions/mean_length"] for m in trainer.state.log_history if "completions/mean_length" in m]
    return timer.times[WARMUP:], statistics.mean(lengths) if lengths else float("nan")


def profile_share(path, names):
    """Share of the profiled time spent under each function name (cumulative time)."""
    stats = pstats.Stats(str(path))
    total = max(ct for (_, _, _, ct, _) in stats.stats.values())
    found = {name: 0.0 for name in names}
    for (_, _, fn), (_, _, _, ct, _) in stats.stats.items():
        if fn in found:
            found[fn] = max(found[fn], ct)
    return {name: ct / total for name, ct in found.items()}


def trl_table(device, steps, rounds, tmp):
    try:
        import trl
    except ImportError:
        print("skipped grpo.py vs TRL: trl is not installed (pip install -r benchmarks/requirements.txt)")
        return ["grpo.py vs TRL: skipped, trl is not installed (`pip install -r benchmarks/requirements.txt`)."]
    model, data = build_hf_moe(Path(tmp) / "qwen3-moe-tiny")
    n_params = sum(t.numel() for t in hf_models.load_hf(str(model), torch.device("cpu"))[0].parameters())
    # TRL's defaults turn gradient checkpointing on (a second forward in the backward): timed both ways.
    runs = {"grpo.py": lambda: ours_step_times(model, data, steps, device),
            "TRL GRPOTrainer (defaults)": lambda: trl_step_times(model, data, steps, device, True),
            "TRL, gradient_checkpointing=False": lambda: trl_step_times(model, data, steps, device, False)}
    times, lengths = {name: [] for name in runs}, {name: [] for name in runs}
    for _ in range(rounds):                          # alternate, so all see the same machine load
        for name, run in runs.items():
            step_times, length, *rest = run()
            times[name].append(statistics.median(step_times))
            lengths[name].append(length)
            if rest:                                 # grpo.py's own split of its step
                phases = rest[0]
        print("  round: " + ", ".join(f"{name} {t[-1]:.4f} s/step" for name, t in times.items()), flush=True)
    profile = Path(tmp) / "trl.prof"
    trl_step_times(model, data, steps, device, profile=str(profile))
    share = profile_share(profile, ["generate", "_get_per_token_logps_and_entropies", "backward", "step"])
    ours = (f"generation {phases['generate']:.3f} s, old log-probs {phases['old_logp']:.3f} s, "
            f"update {phases['update']:.3f} s")
    theirs = (f"`generate` {share['generate']:.0%}, loss forward {share['_get_per_token_logps_and_entropies']:.0%}, "
              f"backward {share['backward']:.0%}, optimizer {share['step']:.0%} (of a profiled `train()`)")
    lines = [f"Tiny Qwen3-MoE ({n_params / 1e3:.0f}k parameters: hidden 64, 2 layers, 8 experts top-2), 8 prompts × "
             f"8 completions, ≤ 16 new tokens, 1 optimizer step per rollout batch, beta 0, {steps} steps per run "
             f"({WARMUP} warm-up steps left out), median of {rounds} alternating rounds; TRL {trl.__version__}, "
             f"device {device}.", "",
             "| | s/step (median) | steps/s | mean completion length | where the time goes | each round |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name in runs:
        median = statistics.median(times[name])
        where = ours if name == "grpo.py" else theirs if name.endswith("(defaults)") else ""
        rounds_text = ", ".join(f"{t:.4f}" for t in times[name])
        lines.append(f"| {name} | {median:.4f} | {1 / median:.1f} | {statistics.mean(lengths[name]):.1f} | {where} | "
                     f"{rounds_text} |")
    ours_s = statistics.median(times["grpo.py"])
    theirs_s = min(statistics.median(t) for name, t in times.items() if name != "grpo.py")
    return lines + ["", f"**grpo.py does {theirs_s / ours_s:.2f}× the steps per second of TRL's faster setting.**"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--steps", type=int, default=20, help="steps per script run (phase table)")
    parser.add_argument("--trl-steps", type=int, default=40, help="steps per run of grpo.py and of TRL")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of grpo.py vs TRL")
    parser.add_argument("--only", default="phases,generation,trl", help="parts to run, comma-separated")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "speed.md"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    parts = args.only.split(",")
    cpu = f"{os.cpu_count()} CPU cores, {torch.get_num_threads()} torch threads" if args.device == "cpu" else \
        torch.cuda.get_device_name()
    device_flag = "" if args.device == "cpu" else f" --device {args.device}"
    lines = [f"# Speed ({args.device}: {cpu}; torch {torch.__version__})", "",
             f"Regenerate: `python benchmarks/speed.py{device_flag}`.", ""]
    with tempfile.TemporaryDirectory() as tmp:
        if "phases" in parts:
            lines += ["## Seconds per step, by phase", "", *phase_table(args.device, args.steps, tmp), ""]
        if "generation" in parts:
            lines += ["## Generation, 16 prompts × 8 completions: the KV cache", "",
                      *generation_table(args.device), ""]
        if "trl" in parts:
            lines += ["## grpo.py vs TRL's GRPOTrainer, equal work", "", *trl_table(args.device, args.trl_steps,
                                                                                   args.rounds, tmp), ""]
    bench.write(args.out, "\n".join(lines))


if __name__ == "__main__":
    main()
