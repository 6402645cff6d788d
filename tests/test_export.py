"""The trained model leaves the run: DIR/model holds the final policy, loadable with the Auto classes of
transformers (the toy: moe_model.load), in the dtype of the checkpoint the run started from."""
import json

import pytest
import torch
from conftest import COUNTER_REWARD, TINIER, moe_configs, run
from safetensors import safe_open

import cispo
import common
import grpo
import moe_model
import ppo
import sapo
from extras import hf_routing


@pytest.mark.parametrize("script", [grpo, ppo, cispo, sapo])
def test_a_toy_run_exports_its_final_policy(script, tmp_path):
    (tmp_path / "counter.py").write_text(COUNTER_REWARD)
    out = tmp_path / "run"
    assert run(script, TINIER + ["--out", str(out), "--reward", f"{tmp_path / 'counter.py'}:counter"])[0] == 0
    checkpoint = torch.load(out / "checkpoint.pt", weights_only=True)
    model = moe_model.load(out / "model")
    assert sorted(f.name for f in (out / "model").iterdir()) == ["config.json", "model.safetensors", "vocab.json"]
    assert model.cfg == common.toy_model_config(script.Args(), common.toy_world("add", 8, None))
    final = model.state_dict()
    assert final.keys() == checkpoint["policy"].keys()
    assert all(torch.equal(v, checkpoint["policy"][k]) for k, v in final.items())    # ppo.py: not the critic
    base, _ = common.make_policy(script.Args(), torch.device("cpu"))
    assert not all(torch.equal(v, final[k]) for k, v in base.state_dict().items())    # trained, not the base
    assert json.loads((out / "model" / "vocab.json").read_text()) == common.TOY_VOCAB


def train_hf(source, data, tmp_path, *extra):
    """A 2-step grpo.py run on `source`, rewarded by a counter so that every group has advantages."""
    (tmp_path / "counter.py").write_text(COUNTER_REWARD)
    out = tmp_path / "run"
    grpo.main(["--model", str(source), "--data", str(data), "--reward", f"{tmp_path / 'counter.py'}:counter",
               "--max-new-tokens", "6", "--eval-size", "5", "--steps", "2", "--prompts-per-step", "2",
               "--group-size", "3", "--minibatches", "2", "--lr", "1e-3", "--out", str(out), *extra])
    return out


def final_and_base(source, out):
    """The run's final policy, from checkpoint.pt, in fp32 as it trained; and the model it started from."""
    from transformers import AutoModelForCausalLM
    final = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    final.load_state_dict(torch.load(out / "checkpoint.pt", weights_only=True)["policy"])
    return final, AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)


def stored(folder):
    """The tensors in a folder's model.safetensors: name -> dtype."""
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name).dtype for name in f.keys()}


@torch.no_grad()
def logprobs(model, tokens):
    return torch.log_softmax(model(input_ids=tokens).logits.float(), -1)


@pytest.mark.parametrize("which", ["hf_chat", "hf_moe", "hf_tied"])
def test_a_hf_run_exports_what_from_pretrained_loads_with_the_final_log_probs(which, request, jsonl, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    source = request.getfixturevalue(which)
    out = train_hf(source, jsonl, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(out / "model", local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(out / "model", local_files_only=True)
    final, base = final_and_base(source, out)
    tokens = tokenizer("what is 2+3? 5", return_tensors="pt")["input_ids"]
    assert model.dtype == torch.float32                                # as the checkpoint was saved
    assert torch.equal(logprobs(model, tokens), logprobs(final, tokens))
    assert not torch.allclose(logprobs(model, tokens), logprobs(base, tokens))       # trained, not the base
    # The source's tensors: a tied head is not written twice, MoE experts are in the checkpoint's layout.
    assert stored(out / "model") == stored(source)
    original = AutoTokenizer.from_pretrained(source)
    assert tokenizer("what is 2+3?")["input_ids"] == original("what is 2+3?")["input_ids"]
    assert tokenizer.chat_template == original.chat_template and tokenizer.eos_token == original.eos_token
    assert model.generation_config.eos_token_id == GenerationConfig.from_pretrained(source).eos_token_id


@pytest.fixture
def hf_bf16(hf_tied, tmp_path):
    """The tiny dense model with a tied head, saved in bf16 as most Hub checkpoints are (Qwen3-0.6B, for one)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = tmp_path / "tiny-qwen3-bf16"
    AutoModelForCausalLM.from_pretrained(hf_tied, dtype=torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(hf_tied).save_pretrained(folder)
    return folder


def test_a_bf16_checkpoint_is_exported_in_bf16(hf_bf16, jsonl, tmp_path):
    from transformers import AutoModelForCausalLM
    out = train_hf(hf_bf16, jsonl, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(out / "model", local_files_only=True)
    final, _ = final_and_base(hf_bf16, out)
    assert json.loads((out / "model" / "config.json").read_text())["dtype"] == "bfloat16"
    assert stored(out / "model") == stored(hf_bf16) and set(stored(hf_bf16).values()) == {torch.bfloat16}
    assert model.dtype == torch.bfloat16
    # The fp32 weights it trained, rounded to bf16 once; the log-probs within that rounding.
    trained = final.state_dict()
    assert all(torch.equal(v, trained[k].to(torch.bfloat16)) for k, v in model.state_dict().items())
    tokens = torch.tensor([[5, 9, 12, 20, 7, 30, 3, 11]])
    # 0.003 here; 0.02 is about one bf16 step (2^-6) at these log-probs near -ln(51 tokens) = -3.9.
    assert (logprobs(model, tokens) - logprobs(final, tokens)).abs().max() < 0.02


@pytest.fixture
def hf_deepseek_bf16(hf_dense, tmp_path):
    """A tiny DeepSeek-V3 saved as its Hub checkpoints are: bf16, but the router's weight and e_score_correction_bias
    in fp32 (its model class makes and keeps them so), the bias away from any bf16 value, as trained ones are."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    config = moe_configs()["deepseek_v3"]
    config.vocab_size = 51                                                  # hf_dense's tokenizer
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for router in hf_routing.routers(model):
        router.e_score_correction_bias.copy_(torch.tensor([4.3738, 4.8763, 5.1250, 4.8833, 5.0101, 4.9, 5.2, 4.7]))
    folder = tmp_path / "tiny-deepseek-v3-bf16"
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(hf_dense).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("lora", [[], ["--lora-r", "4", "--merge-lora"]])
def test_a_tensor_the_model_keeps_in_fp32_is_exported_in_fp32(lora, hf_deepseek_bf16, jsonl, tmp_path):
    if lora:
        pytest.importorskip("peft")
    out = train_hf(hf_deepseek_bf16, jsonl, tmp_path, *lora)
    bias = "model.layers.0.mlp.gate.e_score_correction_bias"
    assert {n: d for n, d in stored(hf_deepseek_bf16).items() if d == torch.float32} == {
        f"model.layers.{i}.mlp.gate.{t}": torch.float32 for i in (0, 1) for t in ("weight", "e_score_correction_bias")}
    assert stored(out / "model") == stored(hf_deepseek_bf16)                # fp32 where the source is, bf16 elsewhere
    with safe_open(hf_deepseek_bf16 / "model.safetensors", "pt") as f:
        source = f.get_tensor(bias)
    with safe_open(out / "model" / "model.safetensors", "pt") as f:
        exported = f.get_tensor(bias)
    assert torch.equal(exported, source) and not torch.equal(source.bfloat16().float(), source)   # bf16: 4.375...
    if not lora:  # the router trained in fp32 and is written as it trained, not rounded to bf16
        trained = torch.load(out / "checkpoint.pt", weights_only=True)["policy"]["model.layers.0.mlp.gate.weight"]
        with safe_open(out / "model" / "model.safetensors", "pt") as f:
            assert torch.equal(f.get_tensor("model.layers.0.mlp.gate.weight"), trained)
