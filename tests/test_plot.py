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
    assert capsys.readouterr().out == (f"wrote {tmp_path / 'metrics.png'} (reward, held-out accuracy (greedy), "
                                       f"completion length, cut off at the limit, clip fraction, KL)\n")
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


def test_several_runs_each_get_their_png(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install matplotlib)")
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    plot.main([str(tmp_path / "a"), str(tmp_path / "b")])
    assert (tmp_path / "a" / "metrics.png").is_file() and (tmp_path / "b" / "metrics.png").is_file()
    assert capsys.readouterr().out.count("wrote ") == 2
    with pytest.raises(SystemExit) as stop:
        plot.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "x.png")])
    assert stop.value.code == 2 and "--out names one file" in capsys.readouterr().err


def test_a_long_run_is_drawn_under_its_running_mean(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install matplotlib)")
    rows = [{"step": s, "reward_mean": s % 2, "clip_frac": 0.01} for s in range(1, 201)]
    assert plot.plot(rows, tmp_path / "long.png", "long") == ["reward", "clip fraction"]
    assert (tmp_path / "long.png").read_bytes()[:4] == b"\x89PNG"
