"""Looking at a run: its metrics.jsonl drawn as one PNG, a panel a quantity over the steps.

    python -m extras.plot runs/grpo-add-20261204-101500          # writes runs/grpo-add-.../metrics.png
    python -m extras.plot runs/*                                  # each run's metrics.png
    python -m extras.plot DIR --out run.png

Panels: the sampled reward and accuracy, the greedy held-out accuracy (the evaluations), the completion length and
the share cut off, the clip fraction, and the KL estimates (k3 KL(old || new) of the update, the KL to the reference
where the run has one). A quantity the run did not log is left out. Over many steps each quantity is drawn faint,
under its running mean over a fiftieth of them. Needs matplotlib (pip install matplotlib).
"""
import argparse
import importlib.util
import json
import sys
from pathlib import Path

PANELS = [("reward", ["reward_mean", "accuracy"]), ("held-out accuracy (greedy)", ["eval_accuracy"]),
          ("completion length", ["response_len_mean"]), ("cut off at the limit", ["truncated_frac"]),
          ("clip fraction", ["clip_frac"]), ("KL", ["approx_kl", "kl_ref"])]


def plot(rows, path, title):
    """The panels of PANELS that the rows have, three a row, to `path`; returns the panels drawn."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    panels = [(name, [k for k in keys if any(r.get(k) is not None for r in rows)]) for name, keys in PANELS]
    panels = [(name, keys) for name, keys in panels if keys]
    grid_rows = (len(panels) + 2) // 3
    fig, axes = plt.subplots(grid_rows, 3, figsize=(10, 3 * grid_rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (name, keys) in zip(axes.flat, panels):
        for key in keys:
            steps, values = zip(*[(r["step"], r[key]) for r in rows if r.get(key) is not None])
            width = len(values) // 50     # many steps are noisy: each drawn faint, under their running mean
            if width < 2:
                ax.plot(steps, values, marker="o" if len(values) < 30 else None, ms=3, label=key)
                continue
            raw = ax.plot(steps, values, lw=0.5, alpha=0.3)[0]
            window = [values[max(0, i - width + 1):i + 1] for i in range(len(values))]
            mean = [sum(w) / len(w) for w in window]
            ax.plot(steps, mean, color=raw.get_color(), label=f"{key} (mean of {width})")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        if len(keys) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [name for name, _ in panels]


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def read(run):
    """The rows of a run's metrics.jsonl (the run's folder, or the file), or one line naming the problem."""
    metrics = Path(run) / "metrics.jsonl" if Path(run).is_dir() else Path(run)
    if not metrics.is_file():
        fail(f"{metrics}: no such file (give a run's folder, which holds metrics.jsonl)")
    *lines, torn = metrics.read_text().split("\n")   # text after the last newline: a row being written now
    try:
        rows = [json.loads(line) for line in lines]
    except json.JSONDecodeError as e:
        fail(f"{metrics} is not valid JSON lines ({e.msg})")
    if not rows or not all(isinstance(r, dict) and "step" in r for r in rows):
        fail(f"{metrics} has no steps")
    return metrics, rows


def main(argv=None):
    parser = argparse.ArgumentParser(description="Draw a run's metrics.jsonl as a PNG.")
    parser.add_argument("runs", nargs="+", help="the runs' folders (or their metrics.jsonl)")
    parser.add_argument("--out", help="the PNG to write, for one run (default: metrics.png in the run's folder)")
    args = parser.parse_args(argv)
    if args.out and len(args.runs) > 1:
        fail("--out names one file: give one run")
    if importlib.util.find_spec("matplotlib") is None:
        fail("plotting needs matplotlib, which is not installed: pip install matplotlib")
    for metrics, rows in [read(run) for run in args.runs]:   # every run read first: a bad one stops before any PNG
        out = Path(args.out) if args.out else metrics.with_suffix(".png")
        print(f"wrote {out} ({', '.join(plot(rows, out, str(metrics.parent)))})")


if __name__ == "__main__":
    main()
