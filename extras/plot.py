"""Looking at a run, or comparing runs: their metrics.jsonl drawn as one PNG, a panel a quantity over the steps.

    python -m extras.plot runs/grpo-add-20261204-101500          # writes runs/grpo-add-.../metrics.png
    python -m extras.plot runs/grpo-add-* runs/gspo-add-*         # the runs on the same panels: runs.png, here
    python -m extras.plot DIR --out run.png

Panels: the sampled reward and accuracy (one line where the reward is the accuracy), the greedy held-out accuracy
(the evaluations), the completion length and the share cut off, the clip fraction, the KL estimates (k3 KL(old || new)
of the update, the KL to the reference where the run has one) and, on MoE runs, what routing did since the rollout:
the routing drift, and |log r| of the re-routed tokens against the others (on a log scale, where the spikes of the first
leave the second readable). A quantity the run did not log is left out. The clip fraction counts another event in
each script (CLIP_COUNTS): the panel's legend says which. The title names the script, the task or model, the settings
that differ from the script's defaults (read from the run's checkpoint.pt) and the held-out accuracy from base to last.
Over many steps each quantity is drawn faint, under its running mean over the last fiftieth of the run's steps.
Several runs share the panels, named by their script and the settings that differ between them; a panel shows the
runs that logged it. A script has one colour in every figure (COLOURS); its second run is a darker shade of it, its
third a lighter one. Runs whose --steps differ more than twofold (ppo's 700 beside grpo's 2400) are drawn against the
share of each run's --steps, 0 to 1, so that none fills only a corner of the axis and each run's start, middle and end
line up (README compares such runs the same way: first 1/8, last 1/10); others against the step, where equal steps
line up. Needs matplotlib (pip install matplotlib).
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
           [("reward_mean", "reward"), ("accuracy", "accuracy (share right)")]),
          ("held-out accuracy (greedy)", "share right", [("eval_accuracy", None)]),
          ("completion length", "tokens", [("response_len_mean", None)]),
          ("cut off at the limit", "share of completions", [("truncated_frac", None)]),
          ("clip fraction", "share of tokens", [("clip_frac", None)]),
          ("KL per token", "nats", [("approx_kl", "approx_kl: KL(old ‖ new), the update (k3)"),
                                    ("kl_ref", "kl_ref: KL(policy ‖ reference)")]),
          ("routing drift since the rollout (MoE)", "share of (token, layer) pairs re-routed",
           [("routing_drift", None)]),
          ("|log r| of re-routed vs other tokens (MoE)", "mean |log r| (nats)",
           [("abs_log_ratio_rerouted", "re-routed tokens"), ("abs_log_ratio_other", "other tokens")])]
# Where every run's reward is its accuracy (1 for a right answer, else 0), one line says both.
ACCURACY_IS_REWARD = ("sampled accuracy (its reward: 1 right, 0 wrong)", "share of the step's completions",
                      [("accuracy", None)])
LOG_SCALE = {"|log r| of re-routed vs other tokens (MoE)"}
STYLES = ["-", "--", ":"]   # a line style a panel's quantity
# One colour per script in every figure (matplotlib's default cycle), so a script reads the same in each plot; a
# second run of a script is a darker shade of it, a third a lighter one (SHADES); a run of no known script takes one
# of the colours no script has.
COLOURS = {"grpo": "C0", "gspo": "C1", "dapo": "C2", "ppo": "C3", "cispo": "C4", "sapo": "C5", "grpo + replay": "C7"}
OTHER_COLOURS = ["C8", "C9", "C6"]
SHADES = [0, -0.4, 0.4, -0.65, 0.65]   # towards black (< 0) or white (> 0)
# What each script's clip_frac counts: the same key, five different events (each script's policy_loss).
CLIP_COUNTS = {"grpo": "tokens whose gradient the clip zeroes", "dapo": "tokens whose gradient the clip zeroes",
               "ppo": "tokens whose gradient the clip zeroes", "gspo": "all tokens of each clipped sequence",
               "cispo": "tokens whose weight was capped", "sapo": "tokens whose gate weight is < 1/2"}
# Runs whose --steps differ by more than this factor share an axis of the share of each run's --steps.
SHARE_AXIS_ABOVE = 2
# Settings that say where or how the run ran, not what it trained: left out of the title.
PLUMBING = {"out", "resume", "device", "threads", "save_every", "print_verl", "print_trl", "export_verl_data"}
# Shown in the title's own words, not as flags.
SHAPE = {"task", "model", "data", "prompts_per_step", "group_size", "minibatches", "lr", "critic_lr"}


@dataclasses.dataclass
class Drawn:
    """A run as the figure draws it: its legend, rows, script (None where no checkpoint names it), --steps (None:
    its last step) and, for grpo.py, whether it replayed routing (its own colour)."""
    name: str
    rows: list
    script: str = None
    steps: int = None
    replay: bool = False

    @property
    def kind(self):
        return "grpo + replay" if self.script == "grpo" and self.replay else self.script

    @property
    def length(self):
        return self.steps or max(r["step"] for r in self.rows) or 1


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


def colours(runs):
    """Each run's colour: its script's (COLOURS), a shade of it for the script's second run and after, one of
    OTHER_COLOURS for a run of no known script."""
    from matplotlib.colors import to_hex, to_rgb
    seen, others, out = {}, iter(OTHER_COLOURS * len(runs)), []
    for run in runs:
        if run.kind not in COLOURS:
            out.append(next(others))
            continue
        t = SHADES[seen.setdefault(run.kind, 0) % len(SHADES)]
        seen[run.kind] += 1
        rgb = to_rgb(COLOURS[run.kind])
        out.append(COLOURS[run.kind] if t == 0 else to_hex([c * (1 + t) if t < 0 else c + (1 - c) * t for c in rgb]))
    return out


def as_runs(rows):
    """figure's argument as a list of Drawn runs: one run's rows, a Drawn run, or a list of them."""
    if isinstance(rows, Drawn):
        return [rows]
    return list(rows) if isinstance(rows[0], Drawn) else [Drawn(None, rows)]


def figure(rows, title):
    """The panels of PANELS that the runs have, three a row, as a matplotlib figure; returns it and the panels'
    titles. rows: one run's rows, or Drawn runs, drawn on the same panels."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    runs = as_runs(rows)
    several, colour = len(runs) > 1, dict(zip(map(id, runs), colours(runs)))
    lengths = [run.length for run in runs]
    share = max(lengths) > SHARE_AXIS_ABOVE * min(lengths)     # x: the share of each run's --steps, not the step
    panels = []
    for name, ylabel, lines in PANELS:
        if name == "sampled reward and accuracy" and all(
                number(r.get("accuracy")) and math.isclose(r["reward_mean"], r["accuracy"], abs_tol=1e-9)
                for run in runs for r in run.rows if number(r.get("reward_mean"))):
            name, ylabel, lines = ACCURACY_IS_REWARD
        lines = [(key, legend) for key, legend in lines if any(series(run.rows, key)[0] for run in runs)]
        if lines:
            panels.append((name, ylabel, lines))
    grid_rows = (len(panels) + 2) // 3
    height = 3.2 * grid_rows + 1 + (0.3 * ((len(runs) + 2) // 3) if several else 0)   # inches: room for the runs
    fig, axes = plt.subplots(grid_rows, 3, figsize=(11, height), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.remove()
    smoothed = False
    for ax, (name, ylabel, lines) in zip(axes.flat, panels):
        for run in runs:
            for style, (key, legend) in zip(STYLES, lines):
                steps, values = series(run.rows, key)
                if not steps:
                    continue
                if key == "clip_frac" and not several:   # what this script counts as clipped
                    legend = CLIP_COUNTS.get(run.script)
                x = [s / run.length for s in steps] if share else steps
                look = dict(color=colour[id(run)], linestyle=style)
                label = ": ".join(filter(None, [run.name, legend])) or None
                width = len(values) // 50     # many steps are noisy: each drawn faint, under their running mean
                if width < 2:
                    ax.plot(x, values, marker="o" if len(values) < 30 else None, ms=3, label=label, **look)
                    continue
                smoothed = True
                ax.plot(x, values, lw=0.5, alpha=0.3, **look)
                ax.plot(x, running_mean(values, width), label=label, **look)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("share of the run's --steps" if share else "step (rollout batch)", fontsize=9)
        ax.set_ylabel(ylabel, fontsize=9)
        if name in LOG_SCALE:
            ax.set_yscale("log", nonpositive="mask")   # an exact 0 (no update yet moved them) is a gap
        handles = []
        if several:   # the runs' colours are the figure's legend; here the quantities' styles and what runs count
            handles = [Line2D([], [], color="grey", linestyle=style, label=legend)
                       for style, (_, legend) in zip(STYLES, lines) if legend]
            if name == "clip fraction":
                scripts = {}                                   # a script's first run's colour
                for run in runs:
                    if series(run.rows, "clip_frac")[0]:
                        scripts.setdefault(run.script, colour[id(run)])
                handles += [Line2D([], [], color=c, label=f"{script or 'no script named'}: "
                                                          f"{CLIP_COUNTS.get(script, 'what its script counts')}")
                            for script, c in scripts.items()]
            if handles:
                ax.legend(handles=handles, fontsize=7 if name == "clip fraction" else 8)
        elif ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7 if name == "clip fraction" else 8)
    bottom = 0.25 if smoothed else 0   # inches, under the panels
    if smoothed:   # said once for every panel, not in each legend
        fig.text(0.5, 0.005, "faint: each step's value; solid: its running mean over the last fiftieth of its run's "
                             "steps", ha="center", va="bottom", fontsize=9)
    if several:
        fig.legend(handles=[Line2D([], [], color=colour[id(run)], label=run.name + (
            f" ({run.length} steps)" if share else "")) for run in runs],
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


def as_drawn(name, rows, folder):
    """The run in `folder` as the figure draws it: its script, --steps and routing replay from its checkpoint."""
    algorithm, args = read_settings(folder)
    if algorithm is None:
        return Drawn(name, rows)
    return Drawn(name, rows, algorithm, args.get("steps"), bool(args.get("routing_replay")))


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
    folders = [metrics.parent for metrics, _ in runs]
    names = legends(folders) if len(runs) > 1 else [None]
    drawn = [as_drawn(name, rows, folder) for name, folder, (_, rows) in zip(names, folders, runs)]
    if len(runs) == 1:
        (metrics, rows), = runs
        out = Path(args.out or metrics.with_suffix(".png"))
        panels = plot(drawn, out, title(metrics.parent, rows))
    else:
        out = Path(args.out or "runs.png")
        panels = plot(drawn, out, "\n".join(
            "; ".join(filter(None, [f"{name}: {folder}", held_out(rows)])) for name, folder, (_, rows)
            in zip(names, folders, runs)))
    print(f"wrote {out} ({', '.join(panels)})")


if __name__ == "__main__":
    main()
