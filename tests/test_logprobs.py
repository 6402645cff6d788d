"""The log-prob path that fits real models: the head over chunks of tokens (never the full [N, T, V] logits),
activation checkpointing, training mode without dropout, and the critic's dtype."""
import copy

import pytest
import torch
import torch.nn.functional as F

import common
import ppo
from moe_model import MoEConfig, MoETransformer
from extras import hf_models


def toy_model():
    torch.manual_seed(0)
    return MoETransformer(MoEConfig(vocab_size=len(common.TOY_VOCAB))), common.toy_world("add", 50, None)


def hf_model(folder):
    model, tokenizer = hf_models.load_hf(str(folder), torch.device("cpu"))
    world = common.World([], [], None, None, (tokenizer.eos_token_id,), tokenizer.pad_token_id, 8)
    return model, world


def model_and_rollout(which, request):
    if which == "toy":
        model, world = toy_model()
        prompts, _ = world.sample(4)
    else:
        model, world = hf_model(request.getfixturevalue(which))
        tokenizer = hf_models.load_hf(str(request.getfixturevalue(which)), torch.device("cpu"))[1]
        prompts = [torch.tensor(tokenizer(p)["input_ids"]) for p in ("1+2?", "what is 12+34? ok", "7*8=", "a b")]
    common.training_mode(model, gradient_checkpointing=False)
    torch.manual_seed(1)
    rollout = common.generate(model, world, prompts, 3, 0.7)
    assert rollout.mask.sum() > 8 and (rollout.mask == 0).any()        # some padding to mask
    return model, world, rollout


def full_logits_logprobs(model, world, rollout, temperature):
    """The plain way: the model's own forward, every position's logits [N, T, V] in fp32."""
    T = rollout.mask.shape[1]
    tokens, attention_mask = rollout.tokens[:, :-1], rollout.attention_mask[:, :-1]
    if isinstance(model, MoETransformer):
        logits = model(tokens)[0]
    else:
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=tokens, attention_mask=attention_mask, position_ids=positions).logits
    logits = logits[:, -T:].float() / temperature
    logits[..., world.pad_id] = torch.finfo(logits.dtype).min
    all_logp = F.log_softmax(logits, -1)
    logp = all_logp.gather(-1, rollout.completions[..., None]).squeeze(-1) * rollout.mask
    entropy = -(all_logp.exp() * all_logp).sum(-1) * rollout.mask
    return logp, entropy


def grads(model, logp, weights):
    model.zero_grad(set_to_none=True)
    (logp * weights).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_close_grads(got, expected, rel=1e-5):
    assert got.keys() == expected.keys() and len(got) > 5
    for name in expected:
        scale = expected[name].abs().max().clamp(min=1e-12)
        assert (got[name] - expected[name]).abs().max() <= rel * scale, name


@pytest.mark.parametrize("which", ["toy", "hf_dense", "hf_moe"])
def test_chunked_logprobs_equal_the_full_logits_in_value_and_gradient(which, request, monkeypatch):
    model, world, rollout = model_and_rollout(which, request)
    weights = torch.randn(rollout.mask.shape)
    expected_logp, expected_entropy = full_logits_logprobs(model, world, rollout, 0.7)
    expected_grads = grads(model, expected_logp, weights)
    vocab = common.output_head(model).weight.shape[0]
    monkeypatch.setattr(common, "LOGITS_CHUNK", 5 * vocab)             # chunks of 5 tokens: several of them
    logp, entropy, _, _ = common.logprobs(model, world, rollout, 0.7)
    assert (logp - expected_logp).abs().max() <= 1e-6
    assert (entropy - expected_entropy).abs().max() <= 1e-6 and not entropy.requires_grad
    assert_close_grads(grads(model, logp, weights), expected_grads)


@pytest.mark.parametrize("which", ["toy", "hf_dense", "hf_moe"])
def test_gradient_checkpointing_changes_no_value_or_gradient(which, request):
    model, world, rollout = model_and_rollout(which, request)
    weights = torch.randn(rollout.mask.shape)
    logp, entropy, routing, _ = common.logprobs(model, world, rollout, 0.7)
    expected = grads(model, logp, weights)
    recomputing = common.training_mode(copy.deepcopy(model), gradient_checkpointing=True)
    logp2, entropy2, routing2, _ = common.logprobs(recomputing, world, rollout, 0.7)
    assert torch.equal(logp2, logp) and torch.equal(entropy2, entropy)
    assert (routing is None) == (which == "hf_dense") and (routing is None or torch.equal(routing2, routing))
    assert_close_grads(grads(recomputing, logp2, weights), expected)


def test_checkpointing_really_recomputes_in_the_backward(monkeypatch):
    model, world = toy_model()
    common.training_mode(model, gradient_checkpointing=True)
    rollout = common.generate(model, world, world.sample(4)[0], 2, 1.0)
    calls = []
    block_forward = type(model.blocks[0]).forward
    monkeypatch.setattr(type(model.blocks[0]), "forward", lambda *a: calls.append(1) or block_forward(*a))
    logp = common.logprobs(model, world, rollout, 1.0)[0]
    assert len(calls) == 2                                             # 2 layers, once each
    logp.sum().backward()
    assert len(calls) == 4                                             # and again in the backward


def test_sampling_runs_in_eval_mode_and_the_update_in_training_mode(hf_dense, monkeypatch):
    model, world = hf_model(hf_dense)
    common.training_mode(model, gradient_checkpointing=True)
    modes, real_forward = [], common.forward
    monkeypatch.setattr(common, "forward", lambda m, *a: modes.append(m.training) or real_forward(m, *a))
    rollout = common.generate(model, world, [torch.tensor([5, 6, 7])], 2, 1.0)
    assert modes and not any(modes) and model.training                 # eval while sampling, then back
    assert model.model.gradient_checkpointing
    common.logprobs(model, world, rollout, 1.0)
    assert model.training


def test_training_mode_turns_dropout_off(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3Config
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, attention_dropout=0.5))
    tokens = torch.randint(0, 40, (2, 9))
    model.train()
    assert not torch.equal(model(tokens).logits, model(tokens).logits)  # dropout acts in training mode
    common.training_mode(model, gradient_checkpointing=False)
    assert model.training and torch.equal(model(tokens).logits, model.eval()(tokens).logits)


def test_a_head_the_log_prob_path_cannot_reproduce_is_refused(hf_dense):
    model, _ = hf_model(hf_dense)
    model.config.logits_scaling = 2.0                                 # Qwen3's own forward ignores it
    with pytest.raises(common.UsageError, match="its logits cannot be reproduced"):
        hf_models.check_scoring(model, "tiny")
    model.config.logits_scaling = None
    hf_models.check_scoring(model, "tiny")


def test_the_critic_takes_the_dtype_of_a_bf16_model(hf_dense):
    model, world = hf_model(hf_dense)
    critic = ppo.make_critic(model.to(torch.bfloat16))
    rollout = common.generate(model, world, [torch.tensor([5, 6, 7])], 2, 1.0)
    values = ppo.values(critic, rollout)
    assert values.shape == rollout.mask.shape and values.dtype == torch.float32 and (values == 0).all()
