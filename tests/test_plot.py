"""extras/plot.py: a run's metrics.jsonl drawn as a PNG."""
import importlib.util
import json

import pytest

from extras import plot

ROWS = [{"step": 0, "eval_accuracy": 0.4},
        {"step": 1, "reward_mean": 0.2, "accuracy": 0.2, "response_len_mean": 3.5, "truncated_frac": 0.0,
         "clip_frac": 0.01, "approx_kl": 0.001},
        {"step": 2, "reward_mean": 0.3, "accuracy": 0.3, "response_len_mean": 3.4, "truncated_frac": 0.0,
         "clip_frac": None, "approx_kl": 0.002, "eval_accuracy": 0.45}]


def test_a_run_s_metrics_become_a_png_of_the_panels_it_logged(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install matplotlib)")
    # The last row is being written (no newline yet): it is left out, not an error.
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS) + '{"step": 3, "rew')
    plot.main([str(tmp_path)])
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out == (f"wrote {tmp_path / 'metrics.png'} (sampled accuracy (its reward: 1 right, 0 "
                                       f"wrong), held-out accuracy (greedy), completion length, cut off at the limit, "
                                       f"clip fraction, KL per token)\n")
    # Without the update's keys (a run stopped after its base evaluation): only the panel it has.
    (tmp_path / "base.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    plot.main([str(tmp_path / "base.jsonl"), "--out", str(tmp_path / "base.png")])
    assert capsys.readouterr().out == f"wrote {tmp_path / 'base.png'} (held-out accuracy (greedy))\n"


@pytest.mark.parametrize("text, message", [(None, "no such file"), ("", "has no steps"),
                                           ("{oops\n", "is not valid JSON lines"), ('{"x": 1}\n', "has no steps")])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, text, message):
    if text is not None:
        (tmp_path / "metrics.jsonl").write_text(text)
    with pytest.raises(SystemExit) as stop:
        plot.main([str(tmp_path)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and message in err


def test_without_matplotlib_it_says_what_to_install(tmp_path, capsys, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name))
    with pytest.raises(SystemExit) as stop:
        plot.main([str(tmp_path)])
    assert stop.value.code == 2 and capsys.readouterr().err == ("error: plotting needs matplotlib, which is not "
                                                               "installed: pip install matplotlib\n")


def lines(ax):
    """(legend, y values) of the lines of one panel, in the order drawn; the faint ones have no legend."""
    return [(None if line.get_label().startswith("_") else line.get_label(), list(line.get_ydata()))
            for line in ax.get_lines()]


def fake_run(folder, steps, algorithm=None, **settings):
    """A run's folder: metrics.jsonl (an evaluation at steps 0 and 2, {key: [value at step 1, at step 2]} between)
    and, for a script, a checkpoint.pt holding what the plot reads: the script's name and its settings."""
    import dataclasses
    import importlib
    import torch
    folder.mkdir()
    rows = [{"step": 0, "eval_accuracy": 0.4}] + [{"step": s} for s in (1, 2)]
    rows[2]["eval_accuracy"] = 0.5
    for key, values in steps.items():
        rows[1][key], rows[2][key] = values
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if algorithm:
        args = dataclasses.asdict(importlib.import_module(algorithm).Args(**{"lr": 1e-4, "steps": 2} | settings))
        torch.save({"algorithm": algorithm, "args": args | {"out": str(folder)}}, folder / "checkpoint.pt")
    return folder


def test_several_runs_share_the_panels_a_colour_and_a_legend_entry_a_run(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install matplotlib)")
    moe = {"routing_drift": [0.01, 0.02], "abs_log_ratio_rerouted": [2.0, 10.0], "abs_log_ratio_other": [0.01, 0.02]}
    # First a run that logged no routing. One run's reward is not its accuracy: both are drawn, for every run.
    runs = [fake_run(tmp_path / "a", {"reward_mean": [0.1, 0.2], "accuracy": [0.1, 0.2]}, "gspo", seed=1),
            fake_run(tmp_path / "b", {"reward_mean": [0.2, 0.3], "accuracy": [0.2, 0.3]} | moe, "grpo"),
            # Replayed routing: nothing re-routed (NaN), so no |log r| of re-routed tokens.
            fake_run(tmp_path / "c", {"reward_mean": [0.25, 0.35], "accuracy": [0.3, 0.4], "routing_drift": [0, 0],
                                      "abs_log_ratio_rerouted": [float("nan")] * 2,
                                      "abs_log_ratio_other": [0.005, 0.006]}, "grpo", routing_replay=True),
            fake_run(tmp_path / "copied", {})]   # metrics.jsonl without its checkpoint
    monkeypatch.chdir(tmp_path)
    # A folder without metrics.jsonl among them: one line, and no PNG.
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as stop:
        plot.main([str(run) for run in runs] + [str(tmp_path / "empty")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and f"{tmp_path / 'empty' / 'metrics.jsonl'}: no such" in err
    assert not (tmp_path / "runs.png").exists()

    figures = []
    figure = plot.figure
    monkeypatch.setattr(plot, "figure", lambda rows, title: figures.append(figure(rows, title)) or figures[-1])
    plot.main([str(run) for run in runs])
    assert (tmp_path / "runs.png").read_bytes()[:4] == b"\x89PNG"
    assert capsys.readouterr().out == ("wrote runs.png (sampled reward and accuracy, held-out accuracy (greedy), "
                                       "routing drift since the rollout (MoE), |log r| of re-routed vs other tokens "
                                       "(MoE))\n")
    (fig, panels), = figures
    # The legend: the script and the settings that differ between the runs where not the script's default (not
    # gspo's own clipping, not where each ran); the folder's name where no checkpoint says more.
    names = ["gspo --seed 1", "grpo", "grpo --routing-replay", "copied"]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == names
    assert fig.get_suptitle() == "\n".join(f"{name}: {run}; held-out accuracy (greedy): base 0.400 → 0.500 at step 2"
                                           for name, run in zip(names, runs))
    # One line a run and a quantity, in its script's colour; a panel's second quantity dashed, as its legend says.
    drawn = {ax.get_title(): [(line.get_label(), list(line.get_ydata()), line.get_color(), line.get_linestyle())
                              for line in ax.get_lines()] for ax in fig.axes}
    colours = ["C1", "C0", "C7", "C8"]                         # gspo's, grpo's, grpo + replay's, no script's
    assert list(drawn) == panels and drawn == {
        "sampled reward and accuracy": [("gspo --seed 1: reward", [0.1, 0.2], "C1", "-"),
                                        ("gspo --seed 1: accuracy (share right)", [0.1, 0.2], "C1", "--"),
                                        ("grpo: reward", [0.2, 0.3], "C0", "-"),
                                        ("grpo: accuracy (share right)", [0.2, 0.3], "C0", "--"),
                                        ("grpo --routing-replay: reward", [0.25, 0.35], "C7", "-"),
                                        ("grpo --routing-replay: accuracy (share right)", [0.3, 0.4], "C7", "--")],
        "held-out accuracy (greedy)": [(name, [0.4, 0.5], colour, "-") for name, colour in zip(names, colours)],
        "routing drift since the rollout (MoE)": [("grpo", [0.01, 0.02], "C0", "-"),
                                                  ("grpo --routing-replay", [0, 0], "C7", "-")],
        "|log r| of re-routed vs other tokens (MoE)": [("grpo: re-routed tokens", [2.0, 10.0], "C0", "-"),
                                                       ("grpo: other tokens", [0.01, 0.02], "C0", "--"),
                                                       ("grpo --routing-replay: other tokens", [0.005, 0.006], "C7",
                                                        "--")]}
    assert [line.get_color() for line in fig.legends[0].get_lines()] == colours
    assert {ax.get_title(): [(t.get_text(), line.get_linestyle()) for t, line in
                             zip(ax.get_legend().get_texts(), ax.get_legend().get_lines())]
            for ax in fig.axes if ax.get_legend()} == {
        "sampled reward and accuracy": [("reward", "-"), ("accuracy (share right)", "--")],
        "|log r| of re-routed vs other tokens (MoE)": [("re-routed tokens", "-"), ("other tokens", "--")]}
    assert all(ax.get_xlabel() == "step (rollout batch)" for ax in fig.axes)       # runs of one length: steps
    # Two runs of one script and settings: told apart by their folders; --out names the file.
    same = fake_run(tmp_path / "again", {"reward_mean": [0.2, 0.3], "accuracy": [0.2, 0.3]}, "grpo")
    plot.main([str(runs[1]), str(same), "--out", str(tmp_path / "two.png")])
    assert [t.get_text() for t in figures[-1][0].legends[0].get_texts()] == [f"grpo ({runs[1]})", f"grpo ({same})"]
    assert (tmp_path / "two.png").is_file()


def test_the_log_ratio_panel_is_on_a_log_scale():
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install matplotlib)")
    # Re-routed tokens spike to 10 where the others stay near 0.01: on a linear scale these would lie flat on 0.
    # An exact 0 (every token unmoved) is a gap on the log scale; the data drawn are still the metrics'.
    rerouted, other = [10.0, float("nan"), 3.0], [0.0, 0.01, 0.02]
    rows = [{"step": s, "abs_log_ratio_rerouted": r, "abs_log_ratio_other": o}
            for s, r, o in zip((1, 2, 3), rerouted, other)]
    fig, panels = plot.figure(rows, "spikes")
    (ax,) = fig.axes
    assert panels == ["|log r| of re-routed vs other tokens (MoE)"] and ax.get_yscale() == "log"
    assert lines(ax) == [("re-routed tokens", [10.0, 3.0]), ("other tokens", other)]
    low, high = ax.get_ylim()
    assert 0 < low < 0.01 and high >= 10


def test_a_long_run_is_drawn_faint_under_its_running_mean(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install matplotlib)")
    # 200 steps: a running mean over 4. The reward alternates 1, 0, 1, 0...: its mean over the last 4 is 1/2 from the
    # 4th step on (1, 1/2 and 2/3 before); the clip fraction climbs by one a step: its mean lags 1.5 behind. The reward
    # is the accuracy at every step: one line, the panel's title says both.
    rows = [{"step": s, "reward_mean": s % 2, "accuracy": s % 2, "clip_frac": s} for s in range(1, 201)]
    fig, panels = plot.figure(rows, "long")
    assert panels == ["sampled accuracy (its reward: 1 right, 0 wrong)", "clip fraction"]
    accuracy, clip = fig.axes
    assert accuracy.get_ylabel() == "share of the step's completions" and accuracy.get_legend() is None
    assert lines(accuracy) == [(None, [s % 2 for s in range(1, 201)]),
                               (None, [1, 1 / 2, pytest.approx(2 / 3)] + [1 / 2] * 197)]
    assert lines(clip) == [(None, list(range(1, 201))), (None, [1, 1.5, 2] + [s - 1.5 for s in range(4, 201)])]
    # Said once, under the panels, in words: a width that differs from run to run is no number to print.
    assert fig.get_suptitle() == "long"
    assert [t.get_text() for t in fig.texts if t.get_text() != "long"] == [
        "faint: each step's value; solid: its running mean over the last fiftieth of its run's steps"]
    assert plot.plot(rows, tmp_path / "long.png", "long") == panels
    assert (tmp_path / "long.png").read_bytes()[:4] == b"\x89PNG"


def test_runs_of_very_different_lengths_share_an_axis_of_each_run_s_steps():
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install matplotlib)")
    # ppo's 300 steps beside grpo's 2400: each from 0 to 1, not an eighth of a step axis; each run's mean over a
    # fiftieth of its own steps (6 and 48), the same width on this axis. A run stopped at step 64 of its 400 ends at
    # 0.16 of its --steps, which its checkpoint gives (64 steps: too few for a running mean).
    climb = lambda n, until: [{"step": s, "clip_frac": s} for s in range(1, until + 1)]
    runs = [plot.Drawn("ppo", climb(300, 300), "ppo", 300), plot.Drawn("grpo", climb(2400, 2400), "grpo", 2400),
            plot.Drawn("cispo", climb(400, 64), "cispo", 400)]
    fig, _ = plot.figure(runs, "lengths")
    (ax,) = fig.axes
    drawn = [(list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()]
    assert [x for x, _ in drawn] == [[s / n for s in range(1, until + 1)] for n, until in
                                     ((300, 300), (300, 300), (2400, 2400), (2400, 2400), (400, 64))]
    assert drawn[1][1][5:] == [s - 2.5 for s in range(6, 301)] and drawn[3][1][47:] == [s - 23.5 for s in
                                                                                         range(48, 2401)]
    assert ax.get_xlabel() == "share of the run's --steps"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["ppo (300 steps)", "grpo (2400 steps)",
                                                                  "cispo (400 steps)"]
    # Within twice each other's length: the step axis, where equal steps line up.
    fig, _ = plot.figure(runs[1:2] + [plot.Drawn("gspo", climb(1200, 1200), "gspo", 1200)], "steps")
    assert fig.axes[0].get_xlabel() == "step (rollout batch)" and max(fig.axes[0].get_lines()[0].get_xdata()) == 2400


def test_the_clip_panel_says_what_each_script_counts():
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install matplotlib)")
    # The same key counts five different events (each script's policy_loss): the legend names each script's, in its
    # colour, once a script.
    rows = [{"step": s, "clip_frac": 0.01} for s in (1, 2)]
    runs = [plot.Drawn(script, rows, script, 2) for script in ("grpo", "gspo", "cispo", "sapo", "dapo", "ppo")]
    fig, _ = plot.figure(runs + [plot.Drawn("grpo --seed 1", rows, "grpo", 2), plot.Drawn("copied", rows)], "clip")
    (ax,) = fig.axes
    assert ax.get_ylabel() == "share of tokens"
    assert [(t.get_text(), line.get_color()) for t, line in zip(ax.get_legend().get_texts(),
                                                                ax.get_legend().get_lines())] == [
        ("grpo: tokens whose gradient the clip zeroes", "C0"), ("gspo: all tokens of each clipped sequence", "C1"),
        ("cispo: tokens whose weight was capped", "C4"), ("sapo: tokens whose gate weight is < 1/2", "C5"),
        ("dapo: tokens whose gradient the clip zeroes", "C2"), ("ppo: tokens whose gradient the clip zeroes", "C3"),
        ("no script named: what its script counts", "C8")]
    # One run: its line says it.
    fig, _ = plot.figure(plot.Drawn(None, rows, "sapo", 2), "one")
    assert lines(fig.axes[0]) == [("tokens whose gate weight is < 1/2", [0.01, 0.01])]
    assert fig.axes[0].get_lines()[0].get_color() == "C5"


def test_a_script_has_its_colour_in_every_figure_and_its_next_runs_shades_of_it():
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install matplotlib)")
    from matplotlib.colors import rgb_to_hsv, to_rgb
    rows = [{"step": 1, "eval_accuracy": 0.4}]
    one = plot.colours([plot.Drawn("a", rows, "cispo"), plot.Drawn("b", rows, "grpo")])
    other = plot.colours([plot.Drawn("b", rows, "grpo"), plot.Drawn("x", rows), plot.Drawn("a", rows, "cispo"),
                          plot.Drawn("c", rows, "cispo"), plot.Drawn("d", rows, "cispo"),
                          plot.Drawn("r", rows, "grpo", replay=True)])
    assert one == ["C4", "C0"] and other[:3] == ["C0", "C8", "C4"] and other[5] == "C7"
    # cispo's second run a darker shade of its purple, its third a lighter one: the same hue, told apart.
    (hue, saturation, value), darker, lighter = (rgb_to_hsv(to_rgb(c)) for c in ("C4", other[3], other[4]))
    assert darker[0] == pytest.approx(hue, abs=0.01) and lighter[0] == pytest.approx(hue, abs=0.01)
    assert darker[2] < value - 0.2 and lighter[1] < saturation - 0.1 and len({"C4", other[3], other[4]}) == 3


def test_every_panel_says_what_it_draws_and_in_what_unit():
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install matplotlib)")
    # An MoE run with a KL penalty and a reward that is not the accuracy (a length penalty, say); a step where no
    # token was re-routed has no |log r| for them (NaN): a gap, not a line through NaN.
    rows = [dict(ROWS[2], reward_mean=0.1, kl_ref=0.02, routing_drift=0.01, abs_log_ratio_rerouted=float("nan"),
                 abs_log_ratio_other=0.03, step=s) for s in (1, 2)]
    rows[1]["abs_log_ratio_rerouted"] = 0.2
    fig, panels = plot.figure(rows, "moe")
    drawn = {ax.get_title(): (ax.get_ylabel(), lines(ax)) for ax in fig.axes}
    assert list(drawn) == panels and all(ax.get_xlabel() == "step (rollout batch)" for ax in fig.axes)
    assert [ax.get_yscale() for ax in fig.axes] == ["linear"] * 6 + ["log"]
    assert drawn == {
        "sampled reward and accuracy": ("mean over the step's completions",
                                        [("reward", [0.1, 0.1]), ("accuracy (share right)", [0.3, 0.3])]),
        "held-out accuracy (greedy)": ("share right", [(None, [0.45, 0.45])]),
        "completion length": ("tokens", [(None, [3.4, 3.4])]),
        "cut off at the limit": ("share of completions", [(None, [0.0, 0.0])]),
        "KL per token": ("nats", [("approx_kl: KL(old ‖ new), the update (k3)", [0.002, 0.002]),
                                  ("kl_ref: KL(policy ‖ reference)", [0.02, 0.02])]),
        "routing drift since the rollout (MoE)": ("share of (token, layer) pairs re-routed", [(None, [0.01, 0.01])]),
        "|log r| of re-routed vs other tokens (MoE)": ("mean |log r| (nats)", [("re-routed tokens", [0.2]),
                                                                                ("other tokens", [0.03, 0.03])])}
    # A legend where a panel has lines to tell apart or one to name; no note on running means (2 steps: none drawn).
    assert {ax.get_title(): [t.get_text() for t in ax.get_legend().get_texts()] for ax in fig.axes
            if ax.get_legend()} == {title: [legend for legend, _ in drawn_lines] for title, (_, drawn_lines)
                                    in drawn.items() if drawn_lines[0][0]}
    assert [t.get_text() for t in fig.texts] == ["moe"] and fig.get_suptitle() == "moe"


def test_the_title_says_what_ran_with_which_settings_and_how_it_ended(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install matplotlib)")
    import grpo
    from conftest import TINIER, read_metrics
    grpo.main(TINIER + ["--beta", "0.04", "--out", str(tmp_path)])
    rows = read_metrics(tmp_path)
    base, final = rows[0]["eval_accuracy"], rows[-1]["eval_accuracy"]
    titles = []
    figure = plot.figure
    monkeypatch.setattr(plot, "figure", lambda rows, title: titles.append(title) or figure(rows, title))
    capsys.readouterr()
    plot.main([str(tmp_path)])
    # The flags that differ from grpo.py's defaults, but for where it ran (--out) and what the second line says.
    assert titles == [f"grpo.py, toy task add: {tmp_path}\n"
                      f"2 prompts × 4 completions a step, 2 minibatches, lr 0.0001; --steps 2 --eval-size 8 "
                      f"--beta 0.04\n"
                      f"held-out accuracy (greedy): base {base:.3f} → {final:.3f} at step 2"]
    assert capsys.readouterr().out == (f"wrote {tmp_path / 'metrics.png'} (sampled accuracy (its reward: 1 right, 0 "
                                       f"wrong), held-out accuracy (greedy), completion length, cut off at the limit, "
                                       f"clip fraction, KL per token, routing drift since the rollout (MoE), |log r| "
                                       f"of re-routed vs other tokens (MoE))\n")
    # A script that is not there to give its defaults: the settings the second line names, no flags.
    import torch
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    torch.save(checkpoint | {"algorithm": "gone"}, tmp_path / "checkpoint.pt")
    assert plot.title(tmp_path, rows).split("\n")[:2] == [f"gone.py, toy task add: {tmp_path}",
                                                          "2 prompts × 4 completions a step, 2 minibatches, lr 0.0001"]
    # Without a checkpoint (a run stopped before its first, or metrics.jsonl copied alone): what the rows tell.
    (tmp_path / "checkpoint.pt").write_bytes(b"torn")
    assert plot.title(tmp_path, rows).startswith(f"{tmp_path} (checkpoint.pt unreadable (")
    (tmp_path / "checkpoint.pt").unlink()
    assert plot.title(tmp_path, rows) == (f"{tmp_path} (no checkpoint.pt, so no settings)\n"
                                          f"held-out accuracy (greedy): base {base:.3f} → {final:.3f} at step 2")
    assert plot.title(tmp_path, rows[:1]) == (f"{tmp_path} (no checkpoint.pt, so no settings)\n"
                                              f"held-out accuracy (greedy): base {base:.3f}")
