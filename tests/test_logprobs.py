"""The log-prob path that fits real models: the head over chunks of tokens (never the full [N, T, V] logits),
activation checkpointing, training mode without dropout, and the critic's dtype."""
import contextlib
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
    # A dense Hugging Face model runs a group's prompt once (trunk's prompt sharing), but not under checkpointing,
    # where transformers keeps no cache: the same values up to rounding. The others compute the same way both times.
    same = torch.equal if which != "hf_dense" else lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-5)
    assert same(logp2, logp) and same(entropy2, entropy)
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


def test_a_groups_prompt_runs_once_with_the_same_log_probs_and_gradient(hf_dense, monkeypatch):
    model, world = hf_model(hf_dense)
    common.training_mode(model, gradient_checkpointing=False)
    prompts = [torch.tensor([5, 9, 11]), torch.tensor([7, 8, 9, 10, 12, 13])]          # left padding on row group 0
    torch.manual_seed(0)
    rollout = common.generate(model, world, prompts, 3, 0.7)
    weights = torch.randn(rollout.mask.shape)
    rows, forward = [], type(model.model).forward
    monkeypatch.setattr(type(model.model), "forward", lambda self, **kw: rows.append(
        len(kw.get("input_ids", kw.get("inputs_embeds")))) or forward(self, **kw))
    logp = common.logprobs(model, world, rollout, 0.7)[0]
    assert rows == [2, 6]                                # the 2 prompts once, then the 6 rows' completions
    shared = grads(model, logp, weights)
    monkeypatch.setattr(common, "sharing_prompts", lambda *a: None)
    rows.clear()
    each = common.logprobs(model, world, rollout, 0.7)[0]
    assert rows == [6] and (logp - each).abs().max() <= 1e-5
    assert_close_grads(shared, grads(model, each, weights), rel=1e-4)


def test_rows_split_by_length_where_that_saves_an_eighth():
    mask = lambda lengths: (torch.arange(11)[None] < torch.tensor(lengths)[:, None]).long()
    (short, a), (long, b) = common.by_length(mask([2, 11, 3, 11, 1, 11]))   # 3*3 + 3*11 = 42 of 66 columns
    assert (short.tolist(), a, long.tolist(), b) == ([4, 0, 2], 3, [1, 3, 5], 11)
    (rows, width), = common.by_length(mask([10, 11, 9, 11]))                   # 2*10 + 2*11 = 42 of 44: one set
    assert (rows.tolist(), width) == ([2, 0, 1, 3], 11)


def test_completions_of_two_lengths_run_apart_with_the_same_log_probs_and_gradient(hf_dense, monkeypatch):
    model, world = hf_model(hf_dense)
    common.training_mode(model, gradient_checkpointing=False)
    torch.manual_seed(0)
    prompts = torch.randint(3, 40, (2, 5)).repeat_interleave(3, 0)                 # 2 groups of 3 rows
    mask = (torch.arange(12)[None] < torch.tensor([2, 12, 3, 12, 1, 11])[:, None])
    completions = torch.randint(3, 40, (6, 12)).masked_fill(~mask, world.pad_id)
    rollout = common.Rollout(torch.cat([prompts, completions], 1),
                             torch.cat([torch.ones(6, 5, dtype=torch.long), mask.long()], 1), mask.float(),
                             torch.zeros(6, dtype=torch.bool))
    weights = torch.randn(mask.shape)
    widths, forward = [], type(model.model).forward
    monkeypatch.setattr(type(model.model), "forward", lambda self, **kw: widths.append(
        tuple(kw.get("input_ids", kw.get("inputs_embeds")).shape[:2])) or forward(self, **kw))
    logp = common.logprobs(model, world, rollout, 0.7)[0]
    assert widths == [(2, 5), (3, 3), (3, 11)]     # the prompts once, then the shorter rows, then the longer
    split = grads(model, logp, weights)
    monkeypatch.setattr(common, "sharing_prompts", lambda *a: None)
    each = common.logprobs(model, world, rollout, 0.7)[0]
    assert (logp - each).abs().max() <= 1e-5 and (logp[~mask] == 0).all()
    assert_close_grads(split, grads(model, each, weights), rel=1e-4)


def test_the_inverse_cdf_draws_by_the_probabilities_and_never_a_zero():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25], [0.1, 0.0, 0.6, 0.3, 0.0]])
    torch.manual_seed(0)
    draws = torch.stack([common.inverse_cdf(probs, torch.rand(2, 1, dtype=torch.float64))
                         for _ in range(20000)])                                      # [20000, 2]
    for row in range(2):
        counts = torch.bincount(draws[:, row], minlength=5).float() / len(draws)
        assert (counts[probs[row] == 0] == 0).all()
        assert torch.allclose(counts, probs[row], atol=4 * (0.25 / len(draws)) ** 0.5)   # four standard errors
    # Exactly: the first token whose cumulative probability exceeds the uniform number drawn, times the total.
    u = torch.tensor([[0.5], [0.05]], dtype=torch.float64)
    token = common.inverse_cdf(probs, u)
    assert token.tolist() == [3, 0]                                   # 0.5 < 0.75 (token 3); 0.05 < 0.1 (token 0)
    u = torch.rand(2, 1, dtype=torch.float64)
    token = common.inverse_cdf(probs, u)
    for row in range(2):
        cdf = probs[row].double().cumsum(0)
        assert token[row] == next(i for i in range(5) if cdf[i] > u[row, 0] * cdf[-1])


def test_the_decode_steps_attend_eagerly_on_a_cpu_in_bf16(hf_dense, monkeypatch):
    model, world = hf_model(hf_dense)
    common.training_mode(model, gradient_checkpointing=False)
    seen, forward = [], common.forward
    monkeypatch.setattr(common, "forward", lambda m, tokens, *a: seen.append(
        (tuple(tokens.shape), m.config._attn_implementation)) or forward(m, tokens, *a))
    for bf16, decode in ((False, "sdpa"), (True, "eager")):
        model.bf16, seen[:] = bf16, []
        common.generate(model, world, [torch.tensor([5, 6, 7])], 2, 1.0)
        assert seen[0] == ((1, 3), "sdpa")                 # the prompt once for its group of 2, with sdpa
        assert len(seen) > 1 and seen[1] == ((2, 1), decode)                           # then a token a row
        assert {impl for _, impl in seen[1:]} == {decode}
        assert model.config._attn_implementation == "sdpa"                              # and back after


def test_the_decode_multiplies_by_packed_weights_and_gets_the_model_s_own_products(hf_dense, monkeypatch):
    """On a CPU every linear layer multiplies by its weight packed for oneDNN while sampling, by its own after; the
    products are the model's own (fp32's rounding; under autocast, bf16's), and so is the rollout."""
    model, world = hf_model(hf_dense)
    common.training_mode(model, gradient_checkpointing=False)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    x = torch.randn(3, 1, model.config.hidden_size)
    for bf16 in (False, True):
        model.bf16 = bf16
        with common.autocast(model):
            own = [F.linear(x, m.weight) for m in linears if m.in_features == x.shape[-1]]
            with common.packed_linears(model):
                assert all("forward" in m.__dict__ for m in linears)
                ours = [m(x) for m in linears if m.in_features == x.shape[-1]]
        assert len(ours) > 3 and not any("forward" in m.__dict__ for m in linears)
        for a, b in zip(ours, own):
            assert a.dtype == b.dtype == (torch.bfloat16 if bf16 else torch.float32)
            torch.testing.assert_close(a.float(), b.float(), rtol=2**-7 if bf16 else 1e-5, atol=1e-5)
    model.bf16, packed, forward = False, [], common.forward
    monkeypatch.setattr(common, "forward", lambda m, *a: packed.append("forward" in linears[0].__dict__)
                        or forward(m, *a))

    def rollout(pack):
        torch.manual_seed(0)
        with monkeypatch.context() as patch:
            if not pack:
                patch.setattr(common, "packed_linears", lambda model: contextlib.nullcontext())
            return common.generate(model, world, [torch.tensor([5, 9, 11]), torch.tensor([7, 8])], 4, 1.0)
    ours = rollout(True)
    assert packed and all(packed)
    packed[:] = []
    own = rollout(False)
    assert packed and not any(packed)
    assert torch.equal(ours.tokens, own.tokens)
    torch.testing.assert_close(ours.sampler_logp, own.sampler_logp, rtol=0, atol=1e-5)


def test_ended_rows_leave_the_decode_batch_and_the_rollout_stays_exact(hf_dense, monkeypatch):
    model, world = hf_model(hf_dense)
    common.training_mode(model, gradient_checkpointing=False)
    world.eos_ids, world.max_new_tokens = tuple(range(3, 40, 3)), 10        # a third of the vocabulary ends a row
    rows, forward = [], common.forward
    monkeypatch.setattr(common, "forward", lambda m, tokens, *a: rows.append(len(tokens)) or forward(m, tokens, *a))
    torch.manual_seed(0)
    rollout = common.generate(model, world, [torch.tensor([5, 9, 11]), torch.tensor([7, 8])], 4, 0.7)
    lengths = rollout.mask.sum(1)
    assert rows[0] == 2 and rows[1] == 8 and min(rows[1:]) < 8                    # prompts once, then fewer rows
    assert rows[1:] == sorted(rows[1:], reverse=True) and len(set(lengths.tolist())) > 2
    assert all(n >= (lengths > t + 1).sum() for t, n in enumerate(rows[1:]))      # every row still writing is in
    learner = common.logprobs(model, world, rollout, 0.7)[0]
    assert (rollout.sampler_logp - learner).abs().max() < 1e-5                    # each token's own distribution
    assert rollout.finished.sum() > 4 and (rollout.completions[~rollout.mask.bool()] == world.pad_id).all()
