"""What the benchmark scripts share: running an algorithm script, the tiny Hugging Face MoE, a figure's file, --only."""
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def read_metrics(out):
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def stop_line(out):
    """The script's 'stopped: ...' line (in a run's log.txt, or the `stopped` file of real.py's record) when the run
    stopped on purpose (repeated non-finite updates; dapo.py with no group left that has a reward signal): an
    outcome, not a failure. None otherwise."""
    for name in ("stopped", "log.txt"):
        if (out / name).exists():
            return next((line for line in (out / name).read_text().splitlines() if line.startswith("stopped: ")), None)
    return None


def launch(script, flags, out, threads, env=None, resume=False):
    """One run as a subprocess on `threads` threads, its output in out/log.txt, its wall time in out/wall_seconds;
    the exit code, 0 for a run that stopped on purpose. A run starts from nothing, or with `resume` continues from
    its checkpoint if it has one, its pieces' wall times added up (and printed, in minutes: such runs are long)."""
    if not resume:
        shutil.rmtree(out, ignore_errors=True)           # an unfinished or --rerun run starts again from nothing
    out.mkdir(parents=True, exist_ok=True)
    where = ["--resume", str(out)] if (out / "checkpoint.pt").exists() else ["--out", str(out)]
    wall = out / "wall_seconds"
    start = time.perf_counter() - (float(wall.read_text()) if wall.exists() else 0.0)   # and the pieces before
    with open(out / "log.txt", "a") as log:
        rc = subprocess.run([sys.executable, str(ROOT / script), *flags, *where], cwd=ROOT, stdout=log,
                            env=dict(os.environ, OMP_NUM_THREADS=str(threads), **(env or {})),
                            stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    wall.write_text(f"{seconds:.1f}\n")
    rc = 0 if rc == 1 and stop_line(out) else rc
    print(f"  {'done' if rc == 0 else f'FAILED (exit {rc}, see {out}/log.txt)'}"
          f"{f' in {seconds / 60:.1f} min' if resume else ''}: {script} {' '.join(flags)}", flush=True)
    return rc


def run_all(one, todo, jobs):
    """one(run) for each run of `todo`, `jobs` at a time: how many failed (a nonzero exit code)."""
    with ThreadPoolExecutor(jobs) as pool:
        return sum(rc != 0 for rc in pool.map(one, todo))


def tiny_qwen3_moe(folder, data, chars, scale=1, **config):
    """A Qwen3-MoE of hidden size 64 (4 heads of 16, 2 for keys and values) with a character tokenizer over `chars`
    and random weights (seed 0), its experts and routers times `scale`, saved to `folder` with the `add` problems
    as JSONL (folder / data). `config`: the rest of its Qwen3MoeConfig."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3MoeConfig
    sys.path.insert(0, str(ROOT))
    import common
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"] + list(chars))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    config = Qwen3MoeConfig(vocab_size=len(vocab), hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, decoder_sparse_step=1, mlp_only_layers=[], pad_token_id=0, eos_token_id=1,
                            bos_token_id=1, **config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp." in name:                                     # the experts and the router
                p.mul_(scale)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / data).write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in common.add_problems()))


def write(path, text):
    """A results file, in its folder (made if need be), and the line that says so."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
    print(f"wrote {path}")


def subplots(*args, **kwargs):
    """matplotlib's plt.subplots, drawn to files (no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt.subplots(*args, **kwargs)


def save_figure(fig, path, dpi=90):
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def only(parser, given, choices, what):
    """--only's comma-separated names, each one of `choices`, or the parser's error (exit 2)."""
    names = given.split(",")
    unknown = [name for name in names if name not in choices]
    if unknown:
        parser.error(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(choices)}")
    return names
