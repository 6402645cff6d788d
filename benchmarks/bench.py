"""What the benchmark scripts share: running an algorithm script, the tiny Hugging Face MoE, a figure's file, --only,
and the rule that turns a claim's numbers into its verdict."""
import collections
import functools
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


def cpu_name():
    """The CPU's model name, as Linux's /proc/cpuinfo gives it less its trademark signs ("AMD EPYC", "Intel Xeon
    Processor"), or "a CPU": absolute times need it."""
    info = Path("/proc/cpuinfo")
    name = next((line.split(":", 1)[1] for line in info.read_text().splitlines()
                 if line.startswith("model name")), "a CPU") if info.exists() else "a CPU"
    return " ".join(name.replace("(R)", "").replace("(TM)", "").split())


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


def seed_ids(parser, given):
    """--seeds' comma-separated seed ids (`0,1,2`; `2` is seed 2 alone), sorted, each once; else one line on stderr
    and exit 2."""
    try:
        seeds = sorted({int(s) for s in given.split(",")})
    except ValueError:
        seeds = []
    if not seeds or seeds[0] < 0:
        parser.exit(2, f"{parser.prog}: --seeds {given!r}: seed ids, comma-separated, each 0 or more (as 0,1,2)\n")
    return seeds


def require(module, why):
    """At the start, not after hours of runs: one line on stderr and exit 2 when `module` is not installed."""
    if importlib.util.find_spec(module) is None:
        print(f"{Path(sys.argv[0]).name} needs {module} ({why}): pip install -r benchmarks/requirements.txt",
              file=sys.stderr)
        sys.exit(2)


# ---------------------------------------------------------------------------------------------------
# Verdicts: one rule, stated in benchmarks/METHODS.md (its section "Verdicts"), which the functions below compute.
# real.md, study.md and long.md (all in benchmarks/results/) link to it in this line.

RULE = ("**Verdicts**: one of four outcomes (*holds here*, *does not hold here*, *inconclusive*, *not testable "
        "here*), by the rule stated in [METHODS.md](../METHODS.md#verdicts).")
NEEDS_SEEDS = "inconclusive: needs seeds"

# A difference by RULE: its value, its standard error over seeds and their degrees of freedom (0: an arm has one
# seed), and for held-out accuracy the evaluation's own standard error and whether it is paired (else None).
Difference = collections.namedtuple("Difference", "value error df evaluation paired", defaults=(None, None))


@functools.lru_cache
def t_quantile(df, p=0.975):
    """Student's t at `df` degrees of freedom (real, >= 1): the x with P(T <= x) = p (0.5 <= p < 1), by bisection on
    its CDF, the density (from math.lgamma) integrated from 0 by Simpson's rule in steps of 0.1 or less."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    density = lambda x: math.exp(log_c - (df + 1) / 2 * math.log1p(x * x / df))

    def cdf(x):
        n = 2 * max(500, math.ceil(5 * x))
        h = x / n
        return 0.5 + h / 3 * sum((1 if i in (0, n) else 4 if i % 2 else 2) * density(i * h) for i in range(n + 1))
    low, high = 0.0, 100.0                                  # t_0.975 is 12.71 at 1 degree of freedom, less above
    while cdf(high) < p:                                    # a higher quantile: widen the bracket until it holds it
        low, high = high, 2 * high
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) < p else (low, middle)
    return (low + high) / 2


def seeds_error(*arms):
    """(standard error, degrees of freedom) over seeds of a sum or difference of the arms' means, each arm its
    per-seed values: sqrt(sum s_i^2 / k_i) and Welch-Satterthwaite's (sum s_i^2 / k_i)^2 / sum (s_i^2 / k_i)^2 /
    (k_i - 1). One arm: its mean against a fixed value. (inf, 0) when an arm has fewer than 2 seeds."""
    if any(len(arm) < 2 for arm in arms):
        return math.inf, 0
    shares = [statistics.variance(arm) / len(arm) for arm in arms]
    if not any(shares):                                     # every seed of every arm alike: no spread to weigh
        return 0.0, sum(len(arm) - 1 for arm in arms)
    return math.sqrt(sum(shares)), sum(shares) ** 2 / sum(v ** 2 / (len(arm) - 1) for v, arm in zip(shares, arms))


def seeds_difference(a, b=()):
    """mean(a) - mean(b), or mean(a) against 0 when b is empty, over seeds: a Difference."""
    arms = (a, b) if b else (a,)
    return Difference(statistics.fmean(a) - (statistics.fmean(b) if b else 0.0), *seeds_error(*arms))


def held_out_difference(a, b, n):
    """Runs a's mean final held-out accuracy minus runs b's, by RULE: a Difference with its error over seeds and the
    evaluation's own. a, b: [(final accuracy, the final evaluation's per-problem record "0110..." or None)], evaluated
    on the same n held-out problems."""
    pa, pb = [acc for acc, _ in a], [acc for acc, _ in b]
    return Difference(statistics.fmean(pa) - statistics.fmean(pb), *seeds_error(pa, pb), *evaluation_error(a, b, n))


def evaluation_error(a, b, n):
    """(the held-out evaluation's standard error of the difference, paired?): paired where every run's record is there
    and n long, else binomial from the two means."""
    if all(record is not None and len(record) == n for _, record in [*a, *b]):
        share = lambda runs, i: statistics.fmean(record[i] == "1" for _, record in runs)
        d = [share(a, i) - share(b, i) for i in range(n)]
        mean = statistics.fmean(d)
        return math.sqrt(sum((x - mean) ** 2 for x in d)) / n, True
    pa, pb = statistics.fmean(acc for acc, _ in a), statistics.fmean(acc for acc, _ in b)
    return math.sqrt(pa * (1 - pa) / n + pb * (1 - pb) / n), False


def beyond(d):
    """More than t standard errors from zero (exactly t is within; so is an arm of one seed)."""
    return d.df >= 1 and abs(d.value) > t_quantile(d.df) * d.error


def verdict(d, testable=True):
    """RULE's outcome for a claim that predicts d.value > 0."""
    if not testable:
        return "not testable here"
    if not d.df >= 1:
        return NEEDS_SEEDS
    if not beyond(d):
        return "inconclusive"
    return "holds here" if d.value > 0 else "does not hold here"


def difference_text(d, digits=".3f"):
    """'+0.031 ± 0.045 (2.0 df, t 4.30)', in bold when beyond t standard errors, or '+0.031 (one seed: no error over
    seeds)'; the evaluation's own error inside the brackets where there is one: '(2.0 df, t 4.30; evaluation ±
    0.030, unpaired)'. `digits`: the numbers' format (".2g" for small quantities)."""
    if d.df >= 1:
        text, why = f"{d.value:+{digits}} ± {d.error:{digits}}", f"{d.df:.1f} df, t {t_quantile(d.df):.2f}"
        text = f"**{text}**" if beyond(d) else text
    else:
        text, why = f"{d.value:+{digits}}", "one seed: no error over seeds"
    if d.evaluation is not None:
        why += f"; evaluation ± {d.evaluation:.3f}, {'paired' if d.paired else 'unpaired'}"
    return f"{text} ({why})"


def final_correct(out, step):
    """The per-problem record ("0110...") of a run's evaluation at `step` (its eval_correct.jsonl), or None: runs
    recorded before the scripts wrote it have none."""
    path = out / "eval_correct.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return next((line["correct"] for line in reversed(lines) if line["step"] == step), None)
