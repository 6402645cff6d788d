"""--static-cache on a GPU, in one run of at most 8 minutes.

It needs a CUDA machine (no network) with Python 3.12 and torch with Triton, a C compiler and Python's headers (Triton
builds its launcher with them), and what `bash benchmarks/gpu_check.sh prepare` downloads on a machine with network
into benchmarks/runs/gpu/: the wheels of transformers 5.25 (5.24 at least), trl 1.16 and their dependencies
(gpu_check.sh lists them) and SmolLM2's config and tokenizer files. There, `bash benchmarks/gpu_check.sh run`
installs the wheels into /tmp/site and runs this script. `python benchmarks/gpu_check.py --cpu` runs the same parts
at a tiny shape on a CPU, to test the script (about a minute).

In order, each part added to the table (--out) as it ends, or skipped with a note when too little time is left:
1. torch.compile's smoke test (10-20 s, 45 at most): a small function compiled on CUDA and replayed as a CUDA graph,
   in a process of its own; the run stops there, saying why, if Triton, a C compiler or the graph is missing.
2. Generation at SmolLM2-360M's shape (random weights: every completion runs to the limit), 8 prompts x 8
   completions x 256 new tokens under bf16 autocast, in this process: generate's loop against --static-cache (its
   first call, which compiles, timed apart), peak memory, the KV cache's size, graphs compiled, and a call at another
   temperature that must compile nothing.
3. grpo.py steps/s with --static-cache, TRL 1.16's GRPOTrainer (gradient checkpointing off) at equal work, then
   grpo.py with generate's loop: benchmarks/speed.py's runs, with the decode step's recompiles from dynamo's log.
4. With --gguf, if time is left: the real model's greedy answers by both paths (speed.py's greedy table).
TORCHINDUCTOR_CUDAGRAPH_OR_ERROR=1 throughout: a CUDA graph that inductor would skip (and run slower without) is an
error, not a slow row.
"""
import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "benchmarks" / "runs" / "gpu"      # what gpu_check.sh prepare downloads
os.environ.setdefault("TORCHINDUCTOR_CUDAGRAPH_OR_ERROR", "1")   # before torch is imported, here and in each run

import torch  # noqa: E402

import bench  # noqa: E402
import speed  # noqa: E402  (it puts the repository root on sys.path)
import common  # noqa: E402
import grpo  # noqa: E402
from extras import static_decode  # noqa: E402

# Part 1, in a process of its own (a compiler that hangs cannot hang the check): what torch.compile needs, then a small
# function compiled, recorded as a CUDA graph and replayed. Prints one JSON line.
SMOKE = r"""
import json, os, shutil, sys, sysconfig, time
device = sys.argv[1]
missing = [name for name, ok in (
    ("a C compiler (cc, gcc or clang)", any(shutil.which(c) for c in ("cc", "gcc", "clang"))),
    ("Python's headers (Python.h)", os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h"))))
    if not ok]
if device == "cuda":
    try:
        import triton
    except ImportError:
        missing.append("Triton (the triton package)")
if missing:
    sys.exit("torch.compile cannot run here: no " + ", no ".join(missing))
import torch
from torch._dynamo.utils import counters
f = torch.compile(lambda x, w: torch.relu(x @ w).sum(-1), fullgraph=True,
                  mode="reduce-overhead" if device == "cuda" else None)
x, w = torch.randn(64, 256, device=device), torch.randn(256, 256, device=device)
sync = torch.cuda.synchronize if device == "cuda" else lambda: None
start = time.perf_counter()
for _ in range(3):                                  # a warm-up run, the graph's recording, a replay
    y = f(x, w)
sync()
compiled = time.perf_counter() - start
start = time.perf_counter()
for _ in range(100):
    f(x, w)
sync()
replay = (time.perf_counter() - start) / 100
if not torch.allclose(y, torch.relu(x @ w).sum(-1), rtol=1e-2, atol=1e-2):
    sys.exit("torch.compile's result differs from eager's")
print(json.dumps({"compile s": compiled, "call us": replay * 1e6,
                  "cudagraph skips": counters["inductor"]["cudagraph_skips"]}))
"""


def smoke(device, seconds):
    try:
        done = subprocess.run([sys.executable, "-c", SMOKE, device], capture_output=True, text=True,
                              timeout=seconds)
    except subprocess.TimeoutExpired:
        return None, f"torch.compile's smoke test ran past {seconds} s"
    if done.returncode != 0:
        return None, f"torch.compile's smoke test failed (exit {done.returncode}): {speed.tail(done.stderr, 1500)}"
    return json.loads(done.stdout.splitlines()[-1]), None


def generation(folder, device, new_tokens):
    """Part 2: one policy, as grpo.py makes it (bf16 autocast on CUDA, fp32 weights), sampling the same 64 rows by
    both paths from the same seed."""
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    args = common.parse_args(grpo.Args, "", ["--model", str(folder), "--data", str(folder / "data.jsonl"),
                                             "--max-new-tokens", str(new_tokens), "--device", device])
    common.check_common_args(args)
    model, world = common.make_policy(args, torch.device(device))
    torch.manual_seed(0)
    prompts, _ = world.sample(8)
    graphs = lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]
    rows, tokens = {}, {}
    for name, static, calls in (("generate's loop", False, 2), ("--static-cache", True, 3)):
        world.static_cache = static
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(calls):                       # the first warms up (and, with --static-cache, compiles)
            torch.manual_seed(1)
            start = time.perf_counter()
            rollout = common.generate(model, world, prompts, 8, 1.0)
            sync()
            times.append(time.perf_counter() - start)
            print(f"  {name}: {times[-1]:.2f} s", flush=True)
        tokens[name] = rollout.tokens
        rows[name] = {"first s": times[0], "s": statistics.median(times[1:]),
                      "tokens/s": rollout.mask.sum().item() / statistics.median(times[1:]),
                      "peak GB": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
                      "graphs": graphs()}
    before = graphs()
    common.generate(model, world, prompts, 8, 0.7)                      # another temperature: the same graph
    cache = static_decode.CACHES[model][64]
    return rows, {"equal rows": (tokens["generate's loop"] == tokens["--static-cache"]).all(1).sum().item(),
                  "new graphs": graphs() - before,
                  "cache GB": sum(t.numel() * t.element_size() for layer in cache.layers
                                  for t in (layer.keys, layer.values)) / 2**30,
                  "cache dtype": str(cache.layers[0].keys.dtype).replace("torch.", ""),
                  "cache length": cache.get_max_length(), "new tokens": new_tokens}


def generation_lines(rows, facts):
    cell = lambda value, f: "—" if value is None else f"{value:{f}}"
    today, static = rows["generate's loop"], rows["--static-cache"]
    return ["| path | first call s | s a call, after | ms a token | tokens/s | peak GB | graphs compiled so far |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *(f"| {path} | {r['first s']:.2f} | {r['s']:.3f} | {1e3 * r['s'] / facts['new tokens']:.2f} | "
              f"{r['tokens/s']:.0f} | {cell(r['peak GB'], '.1f')} | {r['graphs']} |" for path, r in rows.items()), "",
            f"Generation {today['s'] / static['s']:.2f}× as fast with --static-cache. Its KV cache: "
            f"{facts['cache GB']:.2f} GB in {facts['cache dtype']}, {facts['cache length']} positions. Rows sampled "
            f"alike by both paths from the same seed: {facts['equal rows']} of 64 (compiled code may round bf16 "
            f"otherwise). Graphs compiled by a call at another temperature: {facts['new graphs']} (0 expected).",
            ""]


def runs(folder, new_tokens, steps, device, left):
    """Part 3's rows, the most wanted first, each given the time left (less a margin); a run that fails or runs out
    of time is a note."""
    rows, notes = {}, []
    grpo_row = lambda static: lambda t: speed.static_row(folder, new_tokens, steps, device, static, t)
    trl_row = lambda t: speed.trl_row(folder, new_tokens, steps, device, t)
    for name, run in (("grpo.py --static-cache", grpo_row(True)), ("TRL GRPOTrainer, checkpointing off", trl_row),
                      ("grpo.py, generate's loop", grpo_row(False))):
        if left() < 45:
            notes.append(f"{name}: skipped, too little time left")
            continue
        try:
            rows[name] = run(left() - 15)
            print(f"  {name}: {rows[name]}", flush=True)
        except speed.RunFailed as e:
            notes.append(f"{name}: {str(e)[-1500:]}")
            print(f"  {name} FAILED: {e}", flush=True)
    trl = rows.get("TRL GRPOTrainer, checkpointing off")
    cell = lambda r, key, f: "—" if r.get(key) is None else f"{r[key]:{f}}"
    kept = f"those after the first {speed.WARMUP}" if steps > speed.WARMUP + 2 else "all of them (too few to drop any)"
    lines = [f"8 prompts × 8 completions, one optimizer step per rollout, {steps} steps a run, medians of {kept}; "
             f"bf16 on CUDA for both; recompiles of the decode step from dynamo's log "
             f"(one expected: the run's evaluation is greedy, its rollouts sampled).", "",
             "| run | s/step | steps/s | generation s/step | peak GB | steps/s vs TRL | recompiles |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in rows.items():
        versus = f"{trl['s/step'] / r['s/step']:.2f}×" if trl and "grpo" in name else "—"
        recompiles = ("; ".join(r["recompiles"]) or "none") if "recompiles" in r else "—"
        lines.append(f"| {name} | {r['s/step']:.3f} | {1 / r['s/step']:.2f} | {cell(r, 'generation s', '.3f')} | "
                     f"{cell(r, 'peak GB', '.1f')} | {versus} | {recompiles} |")
    return lines + [""] + [f"- {note}" for note in notes] + [""] * bool(notes)


def failing_safely(part):
    """A part's lines, or the error that stopped it (a skipped CUDA graph raises): the next part still runs."""
    try:
        return part()
    except Exception as e:  # noqa: BLE001  (whatever it is, the table says it)
        traceback.print_exc()
        return [f"Failed: {type(e).__name__}: {speed.tail(str(e), 1500)}", ""]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="the same parts at a tiny shape on this CPU")
    parser.add_argument("--seconds", type=float, default=450, help="time for all parts; later ones are skipped")
    parser.add_argument("--tokenizer", help="SmolLM2's config.json and tokenizer files (default: "
                                            "benchmarks/runs/gpu/tokenizer, else the GGUF's converted folder)")
    parser.add_argument("--gguf", help="part 4: the real model (benchmarks/real.py's GGUF file)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "speed-cuda.md"))
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.seconds
    left = lambda: deadline - time.monotonic()
    device, shape, steps = ("cpu", "tiny", 2) if args.cpu else ("cuda", "SmolLM2-360M", 6)
    if args.cpu:
        static_decode.CPU_BACKEND = "aot_eager"   # the compiled step's plumbing, without inductor's minutes on a CPU
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device here (--cpu tests the script on a CPU)")
    import transformers
    try:
        import trl
        trl_version = trl.__version__
    except ImportError:
        trl_version = "not installed"
    where = torch.cuda.get_device_name() if device == "cuda" else f"a CPU ({os.cpu_count()} cores)"
    lines = [f"# --static-cache on {where}", "",
             f"torch {torch.__version__}{f' (CUDA {torch.version.cuda})' if device == 'cuda' else ''}, "
             f"transformers {transformers.__version__}, "
             f"trl {trl_version}, Python {platform.python_version()}; "
             f"`bash benchmarks/gpu_check.sh {'smoke' if args.cpu else 'run'}` (benchmarks/gpu_check.py).", "",
             "Compiled: extras/static_decode.decode_step (the model's forward for one token, and the sampler) by "
             "torch.compile with inductor, fullgraph=True, dynamic=False, CUDA graphs (`triton.cudagraphs`) and "
             "eager's random numbers (`fallback_random`), TORCHINDUCTOR_CUDAGRAPH_OR_ERROR=1; the prompts' pass "
             "runs eagerly." + (" Here, on a CPU: aot_eager in this process, eager in the runs." if args.cpu else ""),
             ""]
    save = lambda: bench.write(args.out, "\n".join(lines) + "\n")

    lines += ["## 1. torch.compile's smoke test", ""]
    result, error = smoke(device, min(60 if args.cpu else 45, left()))
    lines += [f"- failed: {error}" if error else
              f"- compiled and ran 3 times in {result['compile s']:.1f} s, then {result['call us']:.0f} µs a call"
              f"{' (CUDA graph replays)' if device == 'cuda' else ''}; CUDA graphs skipped: "
              f"{result['cudagraph skips']}", ""]
    save()
    if error:
        sys.exit(error)

    overrides, new_tokens = speed.SHAPES[shape]
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = args.tokenizer or (GPU / "tokenizer" if (GPU / "tokenizer").is_dir() else
                                       speed.default_tokenizer())
        folder = speed.smollm2(Path(tmp) / shape, tokenizer, overrides)
        lines += [f"## 2. Generation at {shape}'s shape, 8 prompts × 8 completions × {new_tokens} new tokens", ""]
        if left() < 150 and not args.cpu:
            lines += ["Skipped: too little time left.", ""]
        else:
            lines += failing_safely(lambda: generation_lines(*generation(folder, device, new_tokens)))
            torch._dynamo.reset()                       # its model, caches and CUDA graphs freed for the runs
            gc.collect()
            torch.cuda.empty_cache()
        save()
        lines += ["## 3. grpo.py against TRL's GRPOTrainer, equal work", "",
                  *runs(folder, new_tokens, steps, device, left)]
        save()
    if args.gguf:
        lines += ["## 4. The real model's greedy answers by both paths", ""]
        lines += failing_safely(lambda: speed.greedy_table(device, args.gguf, 240)) if left() > 120 else \
            ["Skipped: too little time left."]
        lines += [""]
        save()


if __name__ == "__main__":
    main()
