"""Looking at a run, or comparing runs: their metrics.jsonl drawn as one PNG, a panel a quantity over the steps.

    python -m extras.plot runs/grpo-add-20261204-101500          # writes runs/grpo-add-.../metrics.png
    python -m extras.plot runs/grpo-add-* runs/gspo-add-*         # the runs on the same panels: runs.png, here
    python -m extras.plot DIR --out run.png

Panels: the sampled reward and accuracy, the greedy held-out accuracy (the evaluations), the completion length and
the share cut off, the clip fraction, the KL estimates (k3 KL(old || new) of the update, the KL to the reference
where the run has one) and, on MoE runs, what routing did since the rollout: the routing drift, and |log r| of the
re-routed tokens against the others (on a log scale, where the spikes of the first leave the second readable). A
quantity the run did not log is left out. The title names the script, the task or model, the settings that differ
from the script's defaults (read from the run's checkpoint.pt) and the held-out accuracy from base to last. Over many
steps each quantity is drawn faint, under its running mean over a fiftieth of them. Several runs share the panels, a
colour a run, named by their script and the settings that differ between them; a panel shows the runs that logged
it. Needs matplotlib (pip install matplotlib).
"""
import argparse
import dataclasses
import importlib
import importlib.util
import json
import math
import sys
from pathlib import Path

# (title, y axis, [(key, legend)]): a legend of None where the title says what the line is.
PANELS = [("sampled reward and accuracy", "mean over the step's completions",
           [("reward_mean", "reward_mean"), ("accuracy", "accuracy (share right)")]),
          ("held-out accuracy (greedy)", "share right", [("eval_accuracy", None)]),
          ("completion length", "tokens", [("response_len_mean", None)]),
          ("cut off at the limit", "share of completions", [("truncated_frac", None)]),
          ("clip fraction", "share of tokens clipped", [("clip_frac", None)]),
          ("KL per token", "nats", [("approx_kl", "approx_kl: KL(old ‖ new), the update (k3)"),
                                    ("kl_ref", "kl_ref: KL(policy ‖ reference)")]),
          ("routing drift since the rollout (MoE)", "share of (token, layer) pairs re-routed",
           [("routing_drift", None)]),
          ("|log r| of re-routed vs other tokens (MoE)", "mean |log r| (nats)",
           [("abs_log_ratio_rerouted", "re-routed tokens"), ("abs_log_ratio_other", "other tokens")])]
LOG_SCALE = {"|log r| of re-routed vs other tokens (MoE)"}
STYLES = ["-", "--", ":"]   # several runs: a colour a run, a line style a panel's quantity
# One colour per script in every figure (matplotlib's default cycle), so a script reads the same in each plot.
COLOURS = {"grpo": "C0", "gspo": "C1", "dapo": "C2", "ppo": "C3", "cispo": "C4", "sapo": "C5", "grpo + replay": "C7"}
# Settings that say where or how the run ran, not what it trained: left out of the title.
PLUMBING = {"out", "resume", "device", "threads", "save_every", "print_verl", "print_trl", "export_verl_data"}
# Shown in the title's own words, not as flags.
SHAPE = {"task", "model", "data", "prompts_per_step", "group_size", "minibatches", "lr", "critic_lr"}


def number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def series(rows, key):
    """(steps, values) of the rows that logged `key` as a number: NaN (no re-routed token in a step, say) is a gap."""
    points = [(r["step"], r[key]) for r in rows if number(r.get(key))]
    return tuple(zip(*points)) if points else ((), ())


def running_mean(values, width):
    """The mean of each value and the width - 1 before it (fewer at the start)."""
    windows = [values[max(0, i - width + 1):i + 1] for i in range(len(values))]
    return [sum(w) / len(w) for w in windows]


def figure(rows, title):
    """The panels of PANELS that the rows have, three a row, as a matplotlib figure; returns it and the panels'
    titles. rows: one run's, or {legend: rows} of several runs, drawn on the same panels."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    runs = rows if isinstance(rows, dict) else {None: rows}
    several = len(runs) > 1
    panels = []
    for name, ylabel, lines in PANELS:
        lines = [(key, legend) for key, legend in lines if any(series(rows, key)[0] for rows in runs.values())]
        keys = [key for key, _ in lines]
        if keys == ["reward_mean", "accuracy"] and all(
                number(r.get("accuracy")) and math.isclose(r["reward_mean"], r["accuracy"], abs_tol=1e-9)
                for rows in runs.values() for r in rows if number(r.get("reward_mean"))):
            lines = [("reward_mean", "reward_mean = accuracy (share right)")]   # one line would hide the other
        if lines:
            panels.append((name, ylabel, lines))
    grid_rows = (len(panels) + 2) // 3
    height = 3.2 * grid_rows + 1 + (0.3 * ((len(runs) + 2) // 3) if several else 0)   # inches: room for the runs
    fig, axes = plt.subplots(grid_rows, 3, figsize=(11, height), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.remove()
    widths = set()
    for ax, (name, ylabel, lines) in zip(axes.flat, panels):
        for i, (run, rows) in enumerate(runs.items()):
            for style, (key, legend) in zip(STYLES, lines):
                steps, values = series(rows, key)
                if not steps:
                    continue
                look = dict(color=f"C{i % 10}", linestyle=style) if several else {}
                label = ": ".join(filter(None, [run, legend])) or None
                width = len(values) // 50     # many steps are noisy: each drawn faint, under their running mean
                if width < 2:
                    ax.plot(steps, values, marker="o" if len(values) < 30 else None, ms=3, label=label, **look)
                    continue
                widths.add(width)
                raw = ax.plot(steps, values, lw=0.5, alpha=0.3, **look)[0]
                ax.plot(steps, running_mean(values, width), **(look or {"color": raw.get_color()}), label=label)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step (rollout batch)", fontsize=9)
        ax.set_ylabel(ylabel, fontsize=9)
        if name in LOG_SCALE:
            ax.set_yscale("log", nonpositive="mask")   # an exact 0 (no update yet moved them) is a gap
        if several and any(legend for _, legend in lines):   # the runs' colours are the figure's legend
            ax.legend(handles=[Line2D([], [], color="grey", linestyle=style, label=legend)
                               for style, (_, legend) in zip(STYLES, lines) if legend], fontsize=8)
        elif any(legend for _, legend in lines):
            ax.legend(fontsize=8)
    bottom = 0.25 if widths else 0   # inches, under the panels
    if widths:   # said once for every panel, not in each legend
        fig.text(0.5, 0.005, f"faint: each step's value; solid: its running mean over the last "
                             f"{' or '.join(map(str, sorted(widths)))} steps", ha="center", va="bottom", fontsize=9)
    if several:
        fig.legend(handles=[Line2D([], [], color=f"C{i % 10}", label=run) for i, run in enumerate(runs)],
                   loc="lower center", bbox_to_anchor=(0.5, bottom / height), ncol=3, fontsize=9, frameon=False)
        bottom += 0.3 * ((len(runs) + 2) // 3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, bottom / height, 1, 1))
    return fig, [name for name, _, _ in panels]


def plot(rows, path, title):
    """figure(rows, title) written to `path`; returns the panels drawn."""
    import matplotlib.pyplot as plt
    fig, panels = figure(rows, title)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return panels


def flag(name, value):
    """A setting as the flag that gives it: `--lr 3e-06`, `--routing-replay`, `--no-clip-higher`."""
    option = name.replace("_", "-")
    if isinstance(value, bool):
        return f"--{option}" if value else f"--no-{option}"
    return f"--{option} {value}"


def read_settings(folder):
    """The run's checkpoint.pt: (its script's name, its arguments), or (None, why there are none)."""
    path = folder / "checkpoint.pt"
    if not path.is_file():
        return None, "no checkpoint.pt, so no settings"
    import torch
    try:
        # mmap: only the arguments are read, not a real model's gigabytes of weights.
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return checkpoint["algorithm"], dict(checkpoint["args"])
    except Exception as e:   # torn, or not one of ours: the plot is still worth having
        return None, f"checkpoint.pt unreadable ({str(e).splitlines()[0][:80]})"


def title(folder, rows):
    """What the run is: script, task or model, settings that differ from the script's defaults, and the held-out
    accuracy from the first evaluation to the last."""
    algorithm, args = read_settings(folder)
    if algorithm is None:
        lines = [f"{folder} ({args})"]
    else:
        if args.get("model"):
            what = args["model"] + (f" on {args['data']}" if args.get("data") else "")
        else:
            what = f"toy task {args.get('task')}"
        lines = [f"{algorithm}.py, {what}: {folder}"]
        shape = []
        if "prompts_per_step" in args and "group_size" in args:
            shape.append(f"{args['prompts_per_step']} prompts × {args['group_size']} completions a step")
        if "minibatches" in args:
            shape.append(f"{args['minibatches']} minibatches")
        if number(args.get("lr")):
            shape.append(f"lr {args['lr']:g}")
        if number(args.get("critic_lr")):   # ppo.py's, set from --lr unless given
            shape.append(f"critic lr {args['critic_lr']:g}")
        defaults = script_defaults(algorithm)
        changed = [flag(name, value) for name, value in args.items()
                   if name in defaults and name not in PLUMBING | SHAPE and value != defaults[name]]
        lines.append(", ".join(shape) + (f"; {' '.join(changed)}" if changed else ""))
    return "\n".join(lines + [held_out(rows)] * bool(series(rows, "eval_accuracy")[0]))


def script_defaults(algorithm):
    """{setting: default} of the script as it is now; {} where it is not there to say."""
    try:
        return {f.name: f.default for f in dataclasses.fields(importlib.import_module(algorithm).Args)}
    except (ImportError, AttributeError):
        return {}


def held_out(rows):
    """The held-out accuracy from the first evaluation to the last, or "" where the run has none."""
    steps, accuracy = series(rows, "eval_accuracy")
    if not steps:
        return ""
    first = "base" if steps[0] == 0 else f"step {steps[0]}"
    return (f"held-out accuracy (greedy): {first} {accuracy[0]:.3f}" +
            (f" → {accuracy[-1]:.3f} at step {steps[-1]}" if len(steps) > 1 else ""))


def legends(folders):
    """Each run's legend: its script and the settings that differ between the runs where they are not its script's
    default ("grpo", "grpo --routing-replay", "gspo --seed 1"); the folder's name for a run without a checkpoint."""
    settings = [read_settings(folder) for folder in folders]
    known = [args for algorithm, args in settings if algorithm]
    differ = {name for args in known for name in args if name not in PLUMBING
              and len({repr(other[name]) for other in known if name in other}) > 1}
    names = []
    for folder, (algorithm, args) in zip(folders, settings):
        if algorithm is None:
            names.append(folder.resolve().name)
            continue
        defaults = script_defaults(algorithm)
        names.append(" ".join([algorithm] + [flag(name, value) for name, value in args.items()
                                             if name in differ and (name not in defaults or value != defaults[name])]))
    return [name if names.count(name) == 1 else f"{name} ({folder})" for name, folder in zip(names, folders)]


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
    parser = argparse.ArgumentParser(description="Draw a run's metrics.jsonl as a PNG, or several runs side by side.")
    parser.add_argument("runs", nargs="+", help="the runs' folders (or their metrics.jsonl)")
    parser.add_argument("--out", help="the PNG to write (default: metrics.png in the run's folder; for several runs, "
                                      "runs.png in the current folder)")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        fail("plotting needs matplotlib, which is not installed: pip install matplotlib")
    runs = [read(run) for run in args.runs]   # every run read first: a bad one stops before the PNG
    if len(runs) == 1:
        (metrics, rows), = runs
        out = Path(args.out or metrics.with_suffix(".png"))
        panels = plot(rows, out, title(metrics.parent, rows))
    else:
        folders = [metrics.parent for metrics, _ in runs]
        names = legends(folders)
        out = Path(args.out or "runs.png")
        panels = plot({name: rows for name, (_, rows) in zip(names, runs)}, out, "\n".join(
            "; ".join(filter(None, [f"{name}: {folder}", held_out(rows)])) for name, folder, (_, rows)
            in zip(names, folders, runs)))
    print(f"wrote {out} ({', '.join(panels)})")


if __name__ == "__main__":
    main()
