"""The warm-started bases: the same on every machine, and how long each takes to build.

    python benchmarks/bases.py            # every base the study and the long experiment start from
    python benchmarks/bases.py --only "chain 24"
    python benchmarks/bases.py --report   # bases.md again from its rows, measuring nothing

For each base (task, chain length, model), the warm start (common.warm_start) from an empty cache with its
seed 0, 1 and 2 on one CPU thread, and seed 0 on two: the greedy accuracy each stops at on the 500 held-out
prompts (generated, as a run's step-0 evaluation), the spread over the four, and the seconds each took. The
rule every base must keep: a spread of 0.03 or less; and for `chain`, at most 2 minutes on 2 cores. A run uses
seed 0 whatever its --seed, so the other seeds test the recipe, not the runs.

Writes benchmarks/results/bases.md; the builds go to a temporary cache, never the one the scripts use.
"""
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import common  # noqa: E402  (the repository root is not a package)
import grpo  # noqa: E402
import bench  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
FINE = dict(n_layers=4, n_experts=64, top_k=8, expert_hidden=16)
# label: (task, chain length, model settings): every base the study and the long experiment (compare.LENGTHS) use
BASES = {"add": ("add", None, {}), "progression": ("progression", None, {}),
         **{f"chain {n}": ("chain", n, {}) for n in (2, 10, 24)},
         **{f"chain {n} fine toy": ("chain", n, FINE) for n in (2, 10)},
         **{f"chain {n} dense toy": ("chain", n, {"n_experts": 1}) for n in (2, 10, 24)},
         "chains 24": ("chains", 24, {})}
TRIALS = [(0, 1), (1, 1), (2, 1), (0, 2)]   # (warm-start seed, CPU threads)
HEADER = ["base", "completion tokens"] + [f"seed {s}, {t} thread{'s' * (t > 1)}" for s, t in TRIALS] + [
    "spread", "seconds (seed 0: 1 / 2 threads)"]


def tokens(label):
    """A base's completion lengths in tokens (the answer and EOS), from its task's problems: '2-4', '44'."""
    task, length, _ = BASES[label]
    toy = common.TASKS[task]
    sizes = {len(answer) + 1 for _, answer in (toy.problems(length) if toy.sized else toy.problems())}
    return f"{min(sizes)}-{max(sizes)}" if len(sizes) > 1 else str(min(sizes))


def build(task, length, model, seed, threads):
    """One warm start from an empty cache: (greedy accuracy on the 500 held-out prompts, seconds)."""
    torch.set_num_threads(threads)
    world = common.toy_world(task, 500, None, length or common.CHAIN_LENGTH)
    args = grpo.Args()
    for name, value in model.items():
        setattr(args, name, value)
    cfg = common.toy_model_config(args, world)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["RL_CACHE_DIR"] = cache
        start = time.perf_counter()
        base, _ = common.warm_start(world, cfg, common.TASKS[task], seed=seed)
        seconds = time.perf_counter() - start
    return common.evaluate(base.eval(), world)["eval_accuracy"], seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(BASES), help=f"bases, comma-separated: {', '.join(BASES)}")
    parser.add_argument("--report", action="store_true", help="only rewrite bases.md from its rows")
    args = parser.parse_args(argv)
    labels = [] if args.report else bench.only(parser, args.only, BASES, "base")
    rows = measured()                                    # the bases measured before: kept unless measured again
    if args.report:
        write(rows)
    for label in labels:
        task, length, model = BASES[label]
        results = [build(task, length, model, seed, threads) for seed, threads in TRIALS]
        accs = [a for a, _ in results]
        rows[label] = "| " + " | ".join([label, tokens(label)] + [f"{a:.3f}" for a in accs] + [
            f"{max(accs) - min(accs):.3f}", f"{results[0][1]:.0f} / {results[3][1]:.0f}"]) + " |"
        print(rows[label], flush=True)
        write(rows)                                      # after each base: a run cut short keeps what it measured
    print(f"wrote {RESULTS / 'bases.md'}")


def measured():
    """{label: its row} from the bases.md there is."""
    path = RESULTS / "bases.md"
    lines = path.read_text().splitlines() if path.exists() else []
    rows = {line.split(" | ")[0][2:]: line for line in lines if line.startswith("| ")}
    return {label: row for label, row in rows.items() if label in BASES}


def write(rows):
    """bases.md from its rows, each with its completion tokens as the code makes them."""
    rows = {label: " | ".join([row.split(" | ")[0], tokens(label)] + row.split(" | ")[2:])
            for label, row in rows.items()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bases.md").write_text(
        "# The warm-started bases\n\n"
        "`python benchmarks/bases.py` measures every base, `--only LABEL` one (each row was measured so, not all "
        "on one day; a row stays until its base is measured again): greedy "
        "accuracy on the 500 held-out prompts where each warm start stopped (its target: 0.40, on an EMA of the "
        "weights), from an empty cache, for warm-start seeds 0-2 on one thread and seed 0 on two; seconds of the "
        "warm start alone. The rule: spread 0.03 or less; `chain` at most 2 minutes on 2 cores.\n\n"
        + "\n".join(["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
                     + [rows[label] for label in BASES if label in rows]) + "\n")


if __name__ == "__main__":
    main()
