"""What the benchmark scripts share: running an algorithm script, the tiny Hugging Face MoE, a figure's file, --only,
and the rule that turns a claim's numbers into its verdict."""
import importlib.util
import json
import math
import os
import shutil
import statistics
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


def require(module, why):
    """At the start, not after hours of runs: one line on stderr and exit 2 when `module` is not installed."""
    if importlib.util.find_spec(module) is None:
        print(f"{Path(sys.argv[0]).name} needs {module} ({why}): pip install -r benchmarks/requirements.txt",
              file=sys.stderr)
        sys.exit(2)


# ---------------------------------------------------------------------------------------------------
# Verdicts: one rule for real.md, long.md and benchmarks/README.md

RULE = ("**Verdicts.** A claim's verdict is one of four outcomes. *Holds here* / *does not hold here*: the difference "
        "the claim predicts is more than two standard errors from zero, in its direction / against it. "
        "*Inconclusive*: within two standard errors (exactly two is within). *Not testable here*: the setting cannot "
        "show the mechanism (the claim says why). A difference in held-out accuracy has the held-out evaluation's "
        "standard error: *paired* where every run of both arms recorded which problems it answered right "
        "(eval_correct.jsonl): over the same n problems, each problem's share of A's runs right minus B's, the "
        "standard error of their mean, `sqrt(sum (d_i - mean)^2) / n` (McNemar's for one run each); else *unpaired*, "
        "binomial from the two means, `sqrt(p_A (1 - p_A) / n + p_B (1 - p_B) / n)`. A quantity measured in training "
        "(explained variance, token-ratio variance) has its standard error over seeds, `sqrt(s_A^2 / k_A + "
        "s_B^2 / k_B)` (none from one seed).")


def verdict(difference, error, testable=True):
    """RULE's outcome for a claim that predicts difference > 0."""
    if not testable:
        return "not testable here"
    if not abs(difference) > 2 * error:                    # exactly two standard errors is within; so is nan
        return "inconclusive"
    return "holds here" if difference > 0 else "does not hold here"


def seeds_error(a, b=()):
    """The standard error over seeds of mean(a) - mean(b), or of mean(a) alone: infinite from a single seed."""
    var = lambda values: statistics.variance(values) / len(values) if len(values) > 1 else math.inf
    return math.sqrt(var(a) + (var(b) if b else 0.0))


def held_out_difference(a, b, n):
    """(mean final accuracy of runs a minus b's, its standard error, paired?) by RULE. a, b: [(final accuracy,
    the final evaluation's per-problem record "0110..." or None)], evaluated on the same n held-out problems."""
    pa, pb = statistics.fmean(acc for acc, _ in a), statistics.fmean(acc for acc, _ in b)
    if all(record is not None and len(record) == n for _, record in [*a, *b]):
        share = lambda runs, i: statistics.fmean(record[i] == "1" for _, record in runs)
        d = [share(a, i) - share(b, i) for i in range(n)]
        mean = statistics.fmean(d)
        return mean, math.sqrt(sum((x - mean) ** 2 for x in d)) / n, True
    return pa - pb, math.sqrt(pa * (1 - pa) / n + pb * (1 - pb) / n), False


def difference_text(difference, error, paired=None):
    """'+0.031 ± 0.045' (and 'paired' or 'unpaired'), in bold when beyond two standard errors."""
    text = f"{difference:+.3f} ± {error:.3f}"
    text = f"**{text}**" if abs(difference) > 2 * error else text
    return text + ("" if paired is None else ", paired" if paired else ", unpaired")


def final_correct(out, step):
    """The per-problem record ("0110...") of a run's evaluation at `step` (its eval_correct.jsonl), or None: runs
    recorded before the scripts wrote it have none."""
    path = out / "eval_correct.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return next((line["correct"] for line in reversed(lines) if line["step"] == step), None)
