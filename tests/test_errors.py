"""Bad input gets one clear line on stderr and exit code 2, never a traceback; a reward file that Python would
import is not refused."""
import ast
import importlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINIER, run

import common
import grpo
from extras import hf_models, rewards

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("argv, message", [
    (["--group-size", "1"], "--group-size must be at least 2"),
    (["--steps", "0"], "--steps must be positive"),
    (["--prompts-per-step", "-3"], "--prompts-per-step must be positive"),
    (["--temperature", "0"], "--temperature must be positive"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be positive"),
    (["--clip-eps", "0"], "--clip-eps must be positive"),
    (["--beta", "-0.1"], "--beta must be 0 or positive"),
    (["--lr", "0"], "--lr must be positive"),
    (["--minibatches", "3"], "--minibatches 3 must divide the 128 completions"),
    (["--task", "chess"], "unknown --task 'chess'"),
    (["--task", "chain", "--chain-length", "0"], "--chain-length must be between 1 and 110, got 0"),
    (["--task", "chain", "--chain-length", "111"], "--chain-length must be between 1 and 110, got 111"),
    (["--task", "chains", "--chain-length", "100"], "--chain-length must be between 1 and 99, got 100"),
    (["--device", "tpu"], "unknown --device 'tpu'"),
    (["--n-experts", "1", "--routing-replay"], "--routing-replay needs a Mixture-of-Experts model"),
    (["--top-k", "9"], "--top-k must be between 1 and --n-experts (8), got 9"),
    (["--data", "x.jsonl"], "--data needs --model"),
    (["--steps", "abc"], "invalid int value: 'abc'"),
    (["--save-every", "-1"], "--save-every must be 0 (only at the end) or positive"),
    (["--max-grad-norm", "0"], "--max-grad-norm must be positive"),
    (["--eval-size", "0"], "--eval-size must be positive"),
    (["--eval-every", "-5"], "--eval-every must be 0"),
    (["--threads", "0"], "--threads must be positive, got 0"),
    (["--threads", "-2"], "--threads must be positive, got -2"),
    (["--dtype", "fp16"], "unknown --dtype 'fp16'; use auto, bf16 or fp32"),
])
def test_bad_flags(argv, message, capsys):
    code, err = run(grpo, argv, capsys)
    assert code == 2 and message in err and "Traceback" not in err


def test_model_folder_that_does_not_exist(tmp_path, jsonl, capsys):
    code, err = run(grpo, ["--model", str(tmp_path / "nope"), "--data", str(jsonl)], capsys)
    assert code == 2 and "no such folder" in err


UNREACHABLE = lambda *a, **k: (_ for _ in ()).throw(OSError(-2, "Name or service not known"))   # noqa: E731


@pytest.mark.parametrize("name, reach, message", [
    ("org/model", UNREACHABLE, "--model org/model: no such folder, not in the Hugging Face cache, and the Hub cannot "
                               "be reached (huggingface.co: Name or service not known)"),
    ("gpt2", UNREACHABLE, "--model gpt2: no such folder, not in the Hugging Face cache, and the Hub cannot be reached "
                          "(huggingface.co: Name or service not known)"),                # an older id, without an org
    ("runs/grpo/model", None, "--model runs/grpo/model: no such folder (and not a Hub id: those look like org/name, "
                              "or gpt2)")])
def test_a_model_name_that_is_no_folder_and_a_hub_out_of_reach_are_one_line_at_once(name, reach, message, jsonl, capsys,
                                                                                        monkeypatch, tmp_path):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))                        # an empty cache
    monkeypatch.setattr(hf_models.socket, "create_connection", reach or (lambda *a, **k: 1 / 0))
    monkeypatch.setattr(hf_models.urllib.request, "getproxies", dict)   # no proxy in between
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    code, err = run(grpo, ["--model", name, "--data", str(jsonl)], capsys)
    assert code == 2 and err == f"error: {message}\n" and time.perf_counter() - start < 5


@pytest.mark.parametrize("proxies, probed", [
    ({}, True),
    ({"NO_PROXY": "localhost"}, True),                                   # NO_PROXY alone sets no proxy
    ({"HTTPS_PROXY": "http://proxy:3128"}, False),                       # huggingface_hub finds out through it
    ({"ALL_PROXY": "http://proxy:3128"}, False),
    ({"HTTPS_PROXY": "http://proxy:3128", "NO_PROXY": "localhost,huggingface.co"}, True),    # bypassed
    ({"HTTP_PROXY": "http://proxy:3128"}, True)])                        # not for the Hub's https
def test_the_hub_is_probed_unless_a_proxy_stands_between(proxies, probed, monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://huggingface.co")
    for key in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "NO_PROXY", "REQUEST_METHOD"):
        monkeypatch.delenv(key, raising=False)
        monkeypatch.delenv(key.lower(), raising=False)
    for key, value in proxies.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(hf_models.socket, "create_connection", UNREACHABLE)
    assert hf_models.hub_unreachable() == ("huggingface.co: Name or service not known" if probed else None)


@pytest.mark.parametrize("argv, message", [
    (["--step", "3"], "error: unknown flag --step (did you mean --steps?)\n"),      # no abbreviations
    (["--lrr", "1", "--stepz=3"], "error: unknown flag --lrr (did you mean --lr or --lora-r?); unknown flag --stepz "
                                  "(did you mean --steps?)\n"),
    (["--routingreplay"], "error: unknown flag --routingreplay (did you mean --routing-replay?)\n"),
])
def test_an_unknown_flag_is_one_line_with_the_closest_real_ones(argv, message, capsys):
    code, err = run(grpo, argv, capsys)
    assert (code, err) == (2, message)


def test_resume_from_a_folder_without_a_checkpoint_says_so_before_building_anything(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(common, "warm_start", lambda *a: 1 / 0)        # nothing is built
    code, err = run(grpo, ["--resume", str(tmp_path / "nope")], capsys)
    assert (code, err) == (2, f"error: --resume {tmp_path / 'nope'}: no such folder\n")
    code, err = run(grpo, ["--resume", str(tmp_path)], capsys)
    assert code == 2 and err.startswith(f"error: --resume {tmp_path}: no checkpoint.pt in that folder")


def test_a_copy_of_a_script_for_the_toy_names_every_file_a_flag_needs_at_once(tmp_path):
    for name in ("grpo.py", "common.py", "moe_model.py"):                 # all the toy needs
        shutil.copy(ROOT / name, tmp_path)
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1?", "answer": 2}\n')
    env = dict(os.environ, PYTHONPATH="")
    model = "extras/__init__.py, extras/hf_models.py, extras/hf_routing.py and extras/rewards.py"
    for flags, files in [(["--reward", "r.py:f"], "extras/__init__.py and extras/rewards.py"),
                         (["--model", "m", "--data", "data.jsonl"], model),
                         (["--print-trl"], "extras/__init__.py and extras/graduate.py")]:
        out = subprocess.run([sys.executable, "grpo.py", *flags], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert (out.returncode, out.stderr) == (2, f"error: {flags[0]} needs {files} beside common.py "
                                                   f"(extras/__init__.py lists what each file of extras/ is for); copy "
                                                   f"them from the project\n")
    (tmp_path / "extras").mkdir()
    shutil.copy(ROOT / "extras" / "__init__.py", tmp_path / "extras")
    out = subprocess.run([sys.executable, "grpo.py", "--print-verl"], cwd=tmp_path, env=env, capture_output=True,
                         text=True)
    assert (out.returncode, out.stderr) == (2, "error: --print-verl needs extras/graduate.py beside common.py "
                                               "(extras/__init__.py lists what each file of extras/ is for); copy it "
                                               "from the project\n")


def test_the_files_each_module_of_extras_needs_are_the_ones_it_imports():
    # common.EXTRAS_NEEDS names them in a copy's error: the modules of extras/ each one imports when it is imported.
    for path in (ROOT / "extras").glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = [alias.name for node in tree.body if isinstance(node, ast.ImportFrom) and node.module == "extras"
                    for alias in node.names]
        imported += [node.module.split(".")[1] for node in tree.body if isinstance(node, ast.ImportFrom)
                     and (node.module or "").startswith("extras.")]
        assert sorted(imported) == sorted(common.EXTRAS_NEEDS.get(path.stem, [])), path.name
    assert common.EXTRAS_NEEDS["hf_models"] == ["hf_routing", "rewards"]        # the check above reads something


def test_a_copy_with_graduate_py_prints_both_frameworks_without_the_real_model_files(tmp_path):
    # README's copy list: grpo.py, common.py, moe_model.py, extras/__init__.py and graduate.py. --print-verl and
    # --print-trl need nothing more, with --model and --data too; what they print says which files it needs that the
    # copy lacks, and imports only those it needs. --export-verl-data reads --data, so it names the file that does, in
    # one line.
    for name in ("grpo.py", "common.py", "moe_model.py", "extras/__init__.py", "extras/graduate.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    env = dict(os.environ, PYTHONPATH="")
    lacks = "# this copy lacks {}, which the code below needs: copy {} from the project beside common.py\n"
    for flags, verl, trl in [([], "python3 -m verl.trainer.main_ppo", lacks.format("extras/rewards.py", "it")),
                             (["--model", "m", "--data", "data.jsonl"], lacks.format("extras/rewards.py", "it"),
                              lacks.format("extras/rewards.py, extras/hf_models.py and extras/hf_routing.py", "them"))]:
        out = subprocess.run([sys.executable, "grpo.py", *flags, "--print-verl", "--print-trl"], cwd=tmp_path, env=env,
                             capture_output=True, text=True)                # the command, then the program
        assert (out.returncode, out.stderr) == (0, "") and out.stdout.count("lacks") == (2 if flags else 1), flags
        lines = out.stdout.splitlines(keepends=True)     # the command: from main_ppo to its first line without a \\
        start = next(i for i, line in enumerate(lines) if "main_ppo" in line)
        end = next(i for i in range(start, len(lines)) if not lines[i].endswith("\\\n"))
        command, program = "".join(lines[:end + 1]), "".join(lines[end + 1:])
        assert verl in command and program.startswith(trl), flags
        assert ("from extras import graduate, hf_models\n" in program) == bool(flags)
        assert ("from extras import graduate\n" in program) == (not flags)
    out = subprocess.run([sys.executable, "grpo.py", "--model", "m", "--data", "data.jsonl", "--export-verl-data", "v"],
                         cwd=tmp_path, env=env, capture_output=True, text=True)
    assert (out.returncode, out.stderr) == (2, "error: --export-verl-data needs extras/hf_models.py, "
                                               "extras/hf_routing.py and extras/rewards.py beside common.py "
                                               "(extras/__init__.py lists what each file of extras/ is for); copy them "
                                               "from the project\n")


def test_too_few_rows_to_hold_out_are_evaluated_as_training_prompts(tmp_path, hf_dense, capsys):
    data = tmp_path / "two.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": 2}\n{"prompt": "2+2?", "answer": 4}\n')
    code = run(grpo, ["--model", str(hf_dense), "--data", str(data), "--steps", "1", "--prompts-per-step", "1",
                      "--group-size", "2", "--minibatches", "1", "--max-new-tokens", "2", "--out", str(tmp_path / "o")])[0]
    printed = capsys.readouterr()
    assert code == 0 and "step 0: eval accuracy (greedy, 2 training prompts)" in printed.out


def test_model_folder_that_is_not_a_model(tmp_path, jsonl, capsys):
    code, err = run(grpo, ["--model", str(tmp_path), "--data", str(jsonl)], capsys)
    assert code == 2 and "no config.json in that folder" in err


def test_gguf_file_that_does_not_exist(tmp_path, jsonl, capsys):
    code, err = run(grpo, ["--model", str(tmp_path / "nope.gguf"), "--data", str(jsonl)], capsys)
    assert code == 2 and f"--model {tmp_path / 'nope.gguf'}: no such file" in err


def test_gguf_file_without_the_gguf_package(tmp_path, jsonl, capsys, monkeypatch):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "gguf", None)          # what `import gguf` meets when it is not installed
    code, err = run(grpo, ["--model", str(tmp_path / "model.gguf"), "--data", str(jsonl)], capsys)
    assert code == 2 and err.strip().endswith("needs the gguf package: pip install gguf") and "Traceback" not in err


def test_gguf_file_that_is_not_one(tmp_path, jsonl, capsys):
    pytest.importorskip("gguf")
    (tmp_path / "model.gguf").write_bytes(b"not a gguf file at all")
    code, err = run(grpo, ["--model", str(tmp_path / "model.gguf"), "--data", str(jsonl)], capsys)
    assert code == 2 and "cannot load this GGUF file" in err and "Traceback" not in err


def test_export_verl_data_without_pyarrow_or_without_data(tmp_path, jsonl, capsys, monkeypatch):
    code, err = run(grpo, ["--export-verl-data", str(tmp_path)], capsys)
    assert code == 2 and "--export-verl-data needs --data" in err
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    code, err = run(grpo, ["--model", "m", "--data", str(jsonl), "--export-verl-data", str(tmp_path)], capsys)
    assert code == 2 and err.strip().endswith("needs pyarrow, which is not installed: pip install pyarrow")


def test_model_that_is_not_a_causal_lm(tmp_path, jsonl, hf_dense, capsys):
    from transformers import ViTConfig, ViTModel
    ViTModel(ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                       image_size=8, patch_size=4)).save_pretrained(tmp_path)
    code, err = run(grpo, ["--model", str(tmp_path), "--data", str(jsonl)], capsys)
    assert code == 2 and "cannot load a causal LM (Unrecognized configuration class" in err


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2", "answer": \n', "line 2: not valid JSON"),
    ('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2"}\n', 'line 2: each line needs a "prompt" and an "answer"'),
    ('["1+1", "2"]\n', 'line 1: each line needs'),
    ('{"prompt": "", "answer": "2"}\n', 'line 1: "prompt" must be a non-empty string'),
    ("\n\n", "the file holds no rows"),
])
def test_malformed_data(tmp_path, hf_dense, content, message, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    code, err = run(grpo, ["--model", str(hf_dense), "--data", str(path)], capsys)
    assert code == 2 and message in err


def test_missing_data_file(tmp_path, hf_dense, capsys):
    code, err = run(grpo, ["--model", str(hf_dense), "--data", str(tmp_path / "none.jsonl")], capsys)
    assert code == 2 and "no such file" in err


def test_prompt_longer_than_the_context(tmp_path, hf_dense, capsys):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "what is 1+1?", "answer": 2}) + "\n"
                    + json.dumps({"prompt": "a" * 200, "answer": 2}) + "\n")
    code, err = run(grpo, ["--model", str(hf_dense), "--data", str(path), "--max-new-tokens", "8"], capsys)
    assert code == 2 and "row 2: prompt of 200 tokens" in err and "context of 128 tokens" in err


@pytest.mark.parametrize("script, argv, message", [
    ("gspo", ["--clip-eps-low", "0"], "--clip-eps-low and --clip-eps-high must be positive"),
    ("gspo", ["--clip-eps-high", "-0.0001"], "--clip-eps-low and --clip-eps-high must be positive"),
    ("gspo", ["--group-size", "1"], "--group-size must be at least 2"),
    ("gspo", ["--routing-replay"], "error: unknown flag --routing-replay\n"),
    ("dapo", ["--clip-eps-low", "0"], "--clip-eps-low and --clip-eps-high must be positive"),
    ("dapo", ["--max-generation-rounds", "0"], "--max-generation-rounds must be positive"),
    ("dapo", ["--overlong-buffer", "8"], "--overlong-buffer must be between 1 and --max-new-tokens - 1 (7), got 8"),
    ("ppo", ["--epochs", "0"], "--epochs must be positive"),
    ("ppo", ["--critic-lr", "0"], "--critic-lr must be positive"),
    ("ppo", ["--lam", "1.5"], "--gamma and --lam must be in [0, 1]"),
    ("ppo", ["--group-size", "0"], "--group-size must be positive"),
    ("cispo", ["--ratio-cap", "1"], "--ratio-cap must be above 1 (an on-policy weight is 1), got 1.0"),
    ("cispo", ["--clip-eps-low", "1"], "--clip-eps-low must be between 0 and 1, got 1.0"),
    ("cispo", ["--clip-eps"], "error: unknown flag --clip-eps (did you mean --clip-eps-low?)\n"),
    ("sapo", ["--tau-neg", "0"], "--tau-pos and --tau-neg must be positive, got 1.0 and 0.0"),
    ("sapo", ["--beta", "-1"], "--beta must be 0 or positive"),
])
def test_bad_flags_of_the_other_scripts(script, argv, message, capsys):
    code, err = run(importlib.import_module(script), argv, capsys)
    assert code == 2 and message in err and "Traceback" not in err


# --reward FILE.py:NAME loads FILE.py as Python would a module: refused only when it cannot work.

def test_a_reward_file_with_postponed_annotations_and_a_dataclass_loads_and_pickles(tmp_path):
    (tmp_path / "r.py").write_text("from __future__ import annotations\n"
                                   "from dataclasses import dataclass\n\n\n"
                                   "@dataclass\nclass Score:\n    value: float\n\n\n"
                                   "def f(completion, answer, finished) -> float:\n"
                                   "    return Score(len(completion) / 4).value\n")
    f = rewards.load_reward(f"{tmp_path / 'r.py'}:f")
    assert f("12+34", "46", True) == 1.25
    assert pickle.loads(pickle.dumps(f)) is f                         # registered as a module: a reference pickles


def test_a_reward_file_imports_its_helpers_from_its_folder(tmp_path):
    (tmp_path / "r.py").write_text("from extras.rewards import answer_reward\nfrom reward_weights import weight\n\n\n"
                                   "def f(completion, answer, finished):\n"
                                   "    return weight * answer_reward(completion, answer, finished)\n")
    (tmp_path / "reward_weights.py").write_text("weight = 0.5\n")
    # The project's own common.py beside it (as when the reward file lies in the project folder) is no shadow.
    (tmp_path / "common.py").symlink_to(ROOT / "common.py")
    path_before = sys.path[:]
    try:
        f = rewards.load_reward(f"{tmp_path / 'r.py'}:f")
    finally:
        sys.modules.pop("reward_weights", None)                       # a later test may write another one
    assert f("so 46", "46", True) == 0.5 and f("so 45", "46", True) == 0.0
    assert sys.path == path_before


def test_a_reward_helper_that_a_loaded_module_would_shadow_is_refused(tmp_path, capsys):
    (tmp_path / "r.py").write_text("from common import answer_reward\n\n\n"
                                   "def f(completion, answer, finished):\n"
                                   "    return answer_reward(completion, answer, finished)\n")
    (tmp_path / "common.py").write_text("def answer_reward(completion, answer, finished):\n    return 5.0\n")
    code, err = run(grpo, TINIER + ["--reward", f"{tmp_path / 'r.py'}:f", "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and err.count("\n") == 1
    assert (f"rename {tmp_path / 'common.py'}: an import of common would get the already loaded {common.__file__}, "
            f"not that file") in err
