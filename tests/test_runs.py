"""Runs that survive: determinism, checkpoints, resume, Ctrl-C, non-finite updates, refusals; and how every
script runs a step."""
import io
import json
import math
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from conftest import CHAIN, TINIER, TINY_NO_STEPS, read_metrics, run

import cispo
import common
import dapo
import grpo
import gspo
import moe_model
import ppo
import sapo

ROOT = Path(__file__).resolve().parent.parent


def test_same_seed_same_metrics_other_seed_other_metrics(tmp_path):
    run(grpo, TINY_NO_STEPS + ["--steps", "4", "--out", str(tmp_path / "a")])
    run(grpo, TINY_NO_STEPS + ["--steps", "4", "--out", str(tmp_path / "b")])
    run(grpo, TINY_NO_STEPS + ["--steps", "4", "--out", str(tmp_path / "c"), "--seed", "1"])
    a, b, c = (read_metrics(tmp_path / name, timings=False) for name in "abc")
    assert len(a) == 5 and a == b
    assert a[1:] != c[1:]


@pytest.mark.parametrize("script", [grpo, gspo, cispo, sapo])
def test_resume_gives_the_same_metrics_as_one_long_run(tmp_path, script):
    run(script, TINY_NO_STEPS + ["--steps", "4", "--out", str(tmp_path / "long")])
    run(script, TINY_NO_STEPS + ["--steps", "2", "--out", str(tmp_path / "split")])
    assert torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=True)["step"] == 2
    run(script, TINY_NO_STEPS + ["--steps", "4", "--resume", str(tmp_path / "split")])
    assert read_metrics(tmp_path / "split", timings=False) == read_metrics(tmp_path / "long", timings=False)
    # The final weights are the same too.
    long = torch.load(tmp_path / "long" / "checkpoint.pt", weights_only=True)["policy"]
    split = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=True)["policy"]
    assert all(torch.equal(long[k], split[k]) for k in long)


def test_ctrl_c_saves_after_the_step_and_resume_continues_exactly(tmp_path, monkeypatch, capsys):
    run(grpo, TINY_NO_STEPS + ["--steps", "4", "--out", str(tmp_path / "long")])
    real_generate, calls = common.generate, []

    def generate_then_ctrl_c(*args, **kw):
        if not kw.get("greedy"):                                    # a rollout, not an evaluation
            calls.append(1)
            if len(calls) == 2:                                      # during step 2
                os.kill(os.getpid(), signal.SIGINT)
        return real_generate(*args, **kw)

    monkeypatch.setattr(common, "generate", lambda *a, **kw: generate_then_ctrl_c(*a, **kw))
    code, err = run(grpo, TINY_NO_STEPS + ["--steps", "4", "--out", str(tmp_path / "cut")], capsys)
    assert code == 130 and "SIGINT: saved step 2" in err
    assert err.endswith(f"; continue with --resume {tmp_path / 'cut'} (on to step 4; add --steps N to end elsewhere)\n")
    monkeypatch.setattr(common, "generate", real_generate)
    # What the hint says, and nothing else: the run's own settings, --steps 4 among them, not the script's defaults.
    args = common.parse_args(grpo.Args, "", ["--resume", str(tmp_path / "cut")])
    common.check_common_args(args)
    assert (args.steps, args.prompts_per_step, args.eval_every) == (4, 4, 2)
    code, err = run(grpo, ["--resume", str(tmp_path / "cut")], capsys)
    assert code == 0 and read_metrics(tmp_path / "cut", timings=False) == read_metrics(tmp_path / "long",
                                                                                       timings=False)


def test_a_resume_ends_where_steps_given_again_says(finished, tmp_path, capsys):
    for name in ("checkpoint.pt", "metrics.jsonl"):                   # a run of 2 steps, stopped at its end
        (tmp_path / name).write_bytes((finished / name).read_bytes())
    code, err = run(grpo, ["--resume", str(tmp_path)], capsys)
    assert (code, err) == (2, f"error: --resume {tmp_path}: the checkpoint is at step 2 already (--steps 2); give a "
                              f"larger --steps to train on\n")
    assert run(grpo, ["--resume", str(tmp_path), "--steps", "3"])[0] == 0
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["args"]["steps"] == 3    # its own from now on


def test_a_write_that_fails_half_way_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    real_save, saves = torch.save, []

    def save_that_breaks(obj, path):
        saves.append(path)
        if len(saves) == 3:                                          # the step-3 checkpoint
            with open(path, "wb") as f:
                f.write(b"half a checkpoint")
            raise OSError("disk full")
        real_save(obj, path)

    monkeypatch.setattr(torch, "save", save_that_breaks)
    with pytest.raises(OSError, match="disk full"):
        grpo.main(TINY_NO_STEPS + ["--steps", "4", "--save-every", "1", "--out", str(tmp_path)])
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 2
    run(grpo, TINY_NO_STEPS + ["--steps", "4", "--resume", str(tmp_path)])
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("script", [grpo, gspo, cispo, sapo])
def test_non_finite_updates_are_skipped_counted_and_stop_the_run(tmp_path, monkeypatch, capsys, script):
    real_loss = script.policy_loss

    def nan_loss(*a, **kw):
        loss, metrics = real_loss(*a, **kw)
        return loss * float("nan"), metrics

    monkeypatch.setattr(script, "policy_loss", nan_loss)
    code, err = run(script, TINY_NO_STEPS + ["--steps", "10", "--out", str(tmp_path)], capsys)
    assert code == 1 and "non-finite loss or gradient in 3 steps in a row (steps 1-3)" in err
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and all(r["skipped_updates"] == 2 for r in rows[1:])
    # Nothing was applied: the saved policy is the warm-started base.
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    base, _ = common.make_policy(script.Args(), torch.device("cpu"))
    assert checkpoint["step"] == 3
    assert all(torch.equal(v, checkpoint["policy"][k]) for k, v in base.state_dict().items())


def test_one_non_finite_update_is_skipped_and_the_run_goes_on(tmp_path, monkeypatch):
    real_loss, calls = grpo.policy_loss, []

    def nan_once(*a, **kw):
        calls.append(1)
        loss, m = real_loss(*a, **kw)
        return (loss * float("nan"), m) if len(calls) == 3 else (loss, m)   # step 2, first minibatch

    monkeypatch.setattr(grpo, "policy_loss", nan_once)
    assert run(grpo, TINY_NO_STEPS + ["--steps", "4", "--out", str(tmp_path)])[0] == 0
    rows = read_metrics(tmp_path)
    assert [r["skipped_updates"] for r in rows[1:]] == [0, 1, 0, 0]
    assert all(r["grad_norm"] is not None and math.isfinite(r["grad_norm"]) for r in rows[1:])


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished")
    run(grpo, TINY_NO_STEPS + ["--steps", "2", "--out", str(out)])
    return out


@pytest.mark.parametrize("extra, message", [
    (["--lr", "0.001"], "settings differ from the checkpoint's: --lr 0.0001 in the checkpoint, 0.001 now"),
    (["--n-experts", "4"], "--n-experts 8 in the checkpoint, 4 now"),
    (["--steps", "2"], "the checkpoint is at step 2 already"),
    (["--out", "elsewhere"], "--resume DIR continues in DIR"),
])
def test_resume_refuses_what_does_not_fit(finished, extra, message, capsys):
    code, err = run(grpo, TINY_NO_STEPS + ["--steps", "4", "--resume", str(finished)] + extra, capsys)
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("case", ["out elsewhere", "out holds a run", "at its end", "settings differ", "another script",
                                  "no metrics", "metrics not JSON"])
def test_a_refused_resume_or_out_is_one_line_before_anything_is_built(case, finished, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "warm_start", lambda *a: pytest.fail("a base was built"))
    folder = tmp_path / "run"
    folder.mkdir()
    checkpoint = torch.load(finished / "checkpoint.pt", weights_only=True)
    torch.save(checkpoint | ({"algorithm": "gspo"} if case == "another script" else {}), folder / "checkpoint.pt")
    if case != "no metrics":
        (folder / "metrics.jsonl").write_text("{oops\n" if case == "metrics not JSON" else
                                              (finished / "metrics.jsonl").read_text())
    argv = {"out elsewhere": ["--resume", str(folder), "--steps", "4", "--out", str(tmp_path)],
            "out holds a run": TINY_NO_STEPS + ["--out", str(folder)],
            "at its end": ["--resume", str(folder)],
            "settings differ": ["--resume", str(folder), "--steps", "4", "--lr", "0.001"]}.get(
        case, ["--resume", str(folder), "--steps", "4"])
    code, _ = run(grpo, argv)
    printed = capsys.readouterr()
    assert code == 2 and printed.out == "" and printed.err.startswith("error: ") and printed.err.count("\n") == 1


def test_resume_refuses_a_checkpoint_of_another_algorithm(finished, tmp_path, capsys):
    checkpoint = torch.load(finished / "checkpoint.pt", weights_only=True)
    checkpoint["algorithm"] = "gspo"
    torch.save(checkpoint, tmp_path / "checkpoint.pt")
    (tmp_path / "metrics.jsonl").write_text((finished / "metrics.jsonl").read_text())
    code, err = run(grpo, TINY_NO_STEPS + ["--steps", "4", "--resume", str(tmp_path)], capsys)
    assert code == 2 and "the checkpoint is from gspo.py, not grpo.py" in err


def test_resume_refuses_missing_or_broken_checkpoints(tmp_path, capsys):
    code, err = run(grpo, TINY_NO_STEPS + ["--resume", str(tmp_path)], capsys)
    assert code == 2 and "no checkpoint.pt in that folder" in err
    (tmp_path / "checkpoint.pt").write_bytes(b"not a checkpoint")
    code, err = run(grpo, TINY_NO_STEPS + ["--resume", str(tmp_path)], capsys)
    assert code == 2 and "cannot read checkpoint.pt" in err


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path, capsys):
    class Payload:
        def __reduce__(self):
            return (print, ("this must never run",))
    torch.save({"algorithm": "grpo", "payload": Payload()}, tmp_path / "checkpoint.pt")
    code, err = run(grpo, TINY_NO_STEPS + ["--resume", str(tmp_path)], capsys)
    assert code == 2 and "cannot read checkpoint.pt" in err and "this must never run" not in err


def test_a_reward_function_that_raises_names_the_prompt(tmp_path, monkeypatch, capsys):
    def broken(completion, answer, finished):
        raise ValueError("cannot parse")
    monkeypatch.setattr(common, "toy_reward", broken)
    code, err = run(grpo, TINY_NO_STEPS + ["--steps", "1", "--out", str(tmp_path)], capsys)
    assert code == 2 and "the reward function raised ValueError: cannot parse (prompt '" in err
    assert err.count("\n") == 1


def test_a_second_run_leaves_the_first_untouched(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                                        # runs/ goes here
    run(grpo, TINY_NO_STEPS + ["--steps", "2"])
    (first,) = (tmp_path / "runs").iterdir()
    files = lambda: {str(f.relative_to(first)): f.read_bytes() for f in first.rglob("*") if f.is_file()}
    before = files()
    assert first.name.startswith("grpo-add-") and set(before) == {
        "metrics.jsonl", "eval_correct.jsonl", "checkpoint.pt", "model/config.json", "model/model.safetensors",
        "model/vocab.json"}
    run(grpo, TINY_NO_STEPS + ["--steps", "2", "--seed", "1"])
    assert len(list((tmp_path / "runs").iterdir())) == 2
    assert files() == before


def test_an_out_folder_that_holds_a_run_is_refused(finished, capsys):
    metrics_before = (finished / "metrics.jsonl").read_text()
    code, err = run(grpo, TINY_NO_STEPS + ["--steps", "4", "--out", str(finished)], capsys)
    assert code == 2 and err.count("\n") == 1
    assert f"--out {finished} already holds a run; continue it with --resume {finished}" in err
    assert (finished / "metrics.jsonl").read_text() == metrics_before


def test_resume_without_metrics_is_one_line(finished, tmp_path, capsys):
    (tmp_path / "checkpoint.pt").write_bytes((finished / "checkpoint.pt").read_bytes())
    code, err = run(grpo, TINY_NO_STEPS + ["--steps", "4", "--resume", str(tmp_path)], capsys)
    assert code == 2 and err.count("\n") == 1 and "no metrics.jsonl in that folder" in err
    (tmp_path / "metrics.jsonl").write_text("not json\n")
    code, err = run(grpo, TINY_NO_STEPS + ["--steps", "4", "--resume", str(tmp_path)], capsys)
    assert code == 2 and err.count("\n") == 1 and "metrics.jsonl is not valid JSON lines" in err


def test_sigterm_finishes_the_step_and_saves(tmp_path):
    """As a cluster stops a job: a real SIGTERM to a real process."""
    import subprocess
    import sys
    import time
    out = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "grpo.py", *TINY_NO_STEPS, "--steps", "1000", "--save-every", "0",
                                "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "metrics.jsonl").exists()
                                          and len((out / "metrics.jsonl").read_text().splitlines()) >= 3):
        time.sleep(0.2)                                                # steps 0 to 2 logged: it is training
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    checkpoint = torch.load(out / "checkpoint.pt", weights_only=True)
    saved = checkpoint["step"]
    assert process.returncode == 128 + signal.SIGTERM
    assert f"SIGTERM: saved step {saved} to {out / 'checkpoint.pt'} and {out / 'model'}; continue with" in err
    assert "SIGTERM: finishing this step, then saving" in err           # said at once, from the handler
    assert saved == read_metrics(out)[-1]["step"] >= 2
    exported = moe_model.load(out / "model").state_dict()               # the policy of that step, exported
    assert exported.keys() == checkpoint["policy"].keys()
    assert all(torch.equal(v, checkpoint["policy"][k]) for k, v in exported.items())


def test_a_signal_that_lands_while_stderr_is_written_still_saves(tmp_path, monkeypatch):
    """The handler runs wherever the loop is; here inside a write of tqdm's bar, where a print raises
    "reentrant call"."""
    written = []

    class CtrlCOnTheBar(io.RawIOBase):                               # the bottom layer of stderr
        def writable(self):
            return True

        def write(self, data):
            if not written and b"grpo" in bytes(data):              # the bar's first draw: the handler is in place
                os.kill(os.getpid(), signal.SIGINT)                  # handled here, with stderr's buffer locked
            written.append(bytes(data))
            return len(data)

    stderr = io.TextIOWrapper(io.BufferedWriter(CtrlCOnTheBar()), write_through=True)
    monkeypatch.setattr(sys, "stderr", stderr)
    code, _ = run(grpo, TINY_NO_STEPS + ["--steps", "4", "--out", str(tmp_path)])
    stderr.flush()
    assert code == 130 and f"SIGINT: saved step 1 to {tmp_path}" in b"".join(written).decode()
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 1


def test_a_torn_last_line_of_metrics_is_dropped_on_resume(finished, tmp_path, capsys):
    for name in ("checkpoint.pt", "metrics.jsonl"):
        (tmp_path / name).write_bytes((finished / name).read_bytes())
    whole = read_metrics(finished)
    torn = json.dumps(whole[-1] | {"step": 3})[:30]                  # killed while writing step 3's row
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(torn)
    code, err = run(grpo, TINY_NO_STEPS + ["--steps", "3", "--resume", str(tmp_path)], capsys)
    assert code == 0 and f"note: dropped the last line of metrics.jsonl, cut off while it was written: {torn!r}" in err
    rows = read_metrics(tmp_path)
    assert rows[:3] == whole and [r["step"] for r in rows] == [0, 1, 2, 3]
    # A whole last row that only lacks its newline is kept (the checkpoint is at step 3: nothing to train).
    (tmp_path / "metrics.jsonl").write_text((tmp_path / "metrics.jsonl").read_text().rstrip("\n"))
    code, err = run(grpo, TINY_NO_STEPS + ["--steps", "3", "--resume", str(tmp_path)], capsys)
    assert code == 2 and "note:" not in err and read_metrics(tmp_path) == rows


def test_a_run_stopped_before_its_first_checkpoint_starts_afresh_in_its_folder(finished, tmp_path, monkeypatch,
                                                                               capsys):
    real_evaluate = common.evaluate

    def ctrl_c_then_evaluate(*args):
        os.kill(os.getpid(), signal.SIGINT)                          # during the step-0 evaluation
        return real_evaluate(*args)

    monkeypatch.setattr(common, "evaluate", ctrl_c_then_evaluate)
    # Ctrl-C as a terminal delivers it (a job started with & in a script inherits SIGINT ignored).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code, _ = run(grpo, TINY_NO_STEPS + ["--steps", "2", "--out", str(tmp_path)], capsys)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 130 and sorted(f.name for f in tmp_path.iterdir()) == ["eval_correct.jsonl", "metrics.jsonl"]
    monkeypatch.setattr(common, "evaluate", real_evaluate)
    code, err = run(grpo, TINY_NO_STEPS + ["--steps", "2", "--resume", str(tmp_path)], capsys)
    assert code == 2 and f"no checkpoint.pt in that folder (to start a run there afresh: --out {tmp_path})" in err
    code, err = run(grpo, TINY_NO_STEPS + ["--steps", "2", "--out", str(tmp_path)], capsys)
    assert code == 0 and f"note: {tmp_path} holds no checkpoint.pt" in err
    assert read_metrics(tmp_path, timings=False) == read_metrics(finished, timings=False)   # as a first run


@pytest.mark.parametrize("script", [grpo, gspo, dapo, cispo, sapo])
def test_a_single_minibatch_is_exactly_on_policy_without_a_separate_pass(script, tmp_path, monkeypatch):
    # One optimizer step per rollout batch: the update's own forward pass gives the old log-probs
    # (detached), so there is no separate pass, and the ratio is exactly 1.
    monkeypatch.setattr(common, "fixed_logprobs", lambda *a: pytest.fail("a separate old log-prob pass"))
    script.main(["--steps", "3", "--prompts-per-step", "4", "--group-size", "4", "--minibatches", "1",
                 "--eval-size", "16", "--out", str(tmp_path)])
    for r in read_metrics(tmp_path)[1:]:
        assert r["clip_frac"] == 0.0 and r["approx_kl"] == 0.0 and r["routing_drift"] == 0.0
        assert r["entropy"] > 0 and r["token_ratio_var"] == 0.0


@pytest.mark.slow    # the first run builds the chain base: minutes on a busy machine, then cached
@pytest.mark.parametrize("script", [grpo, gspo, dapo, ppo, cispo, sapo])
def test_every_script_runs_the_chain_task_with_diagnostics_by_position(tmp_path, script):
    script.main(CHAIN + TINIER + ["--out", str(tmp_path)])
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2] and 0 <= rows[0]["eval_accuracy"] <= 1
    for r in rows[1:]:
        assert 1 <= r["response_len_mean"] <= 12 + 12               # '130,137=137' and EOS: 12 tokens, 12 spare
        for key in ("clip_frac_q1", "clip_frac_q4", "token_ratio_var_q1", "token_ratio_var_q4", "routing_drift_q1",
                    "routing_drift_q4") + (("explained_variance_q1", "explained_variance_q4") if script is ppo else ()):
            assert r[key] is not None and math.isfinite(r[key]), key


def test_evaluation_generates_no_more_rows_at_once_than_a_rollout_batch(tmp_path, monkeypatch):
    # Its KV cache is then the rollout's, which memory estimates already count (2 prompts x 4 = 8 rows).
    sizes, generate = [], common.generate
    monkeypatch.setattr(common, "generate", lambda model, world, prompts, group_size, *a, greedy=False, **k:
                        (sizes.append((len(prompts) * group_size, greedy)), generate(model, world, prompts, group_size,
                                                                                    *a, greedy=greedy, **k))[1])
    grpo.main(TINIER[:-2] + ["--eval-size", "20", "--out", str(tmp_path)])
    assert [n for n, greedy in sizes if greedy] == [8, 8, 4] * 2        # at step 0 and after the last
    assert [n for n, greedy in sizes if not greedy] == [8, 8]            # the two steps' rollouts


def test_each_evaluation_records_which_problems_it_answered_right_and_resume_keeps_them(tmp_path):
    assert run(grpo, TINY_NO_STEPS + ["--steps", "3", "--out", str(tmp_path)])[0] == 0   # evaluations at 0, 2, 3
    correct = tmp_path / "eval_correct.jsonl"
    lines = [json.loads(line) for line in correct.read_text().splitlines()]
    evals = [r for r in read_metrics(tmp_path) if "eval_accuracy" in r]
    assert [line["step"] for line in lines] == [r["step"] for r in evals] == [0, 2, 3]
    for line, r in zip(lines, evals):                                  # 16 held-out prompts, a character each
        assert len(line["correct"]) == 16 and set(line["correct"]) <= {"0", "1"} and "eval_correct" not in r
        assert line["correct"].count("1") / 16 == r["eval_accuracy"]
    # A line after the checkpoint's step (a run killed later) and a torn one go; the resumed run writes its own.
    correct.write_text(correct.read_text() + '{"step": 5, "correct": "1111111111111111"}\n{"step": 6, "corr')
    assert run(grpo, TINY_NO_STEPS + ["--steps", "5", "--resume", str(tmp_path)])[0] == 0
    resumed = [json.loads(line) for line in correct.read_text().splitlines()]
    assert [line["step"] for line in resumed] == [0, 2, 3, 4, 5] and resumed[:3] == lines
    final = [r for r in read_metrics(tmp_path) if "eval_accuracy" in r][-1]
    assert resumed[-1]["correct"].count("1") / 16 == final["eval_accuracy"]
