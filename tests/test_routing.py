"""Routing on Hugging Face Mixture-of-Experts models: the experts each router really chose are recorded, and
Routing Replay makes the update use them, for six families built from tiny configs."""
import pytest
import torch
from conftest import MOE_FAMILIES, read_metrics, run

import common
import grpo
from extras import hf_routing


def rollout(n=4, seed=0):
    """n sequences of 14 tokens, the last 6 of them the completion, one row left-padded by 3."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, 40, (n, 14), generator=g)
    attention_mask = torch.ones_like(tokens)
    tokens[0, :3], attention_mask[0, :3] = 0, 0
    return common.Rollout(tokens, attention_mask, torch.ones(n, 6), torch.ones(n, dtype=torch.bool))


WORLD = common.World([], [], None, None, eos_ids=(1,), pad_id=0, max_new_tokens=6)


def logprobs_and_grads(model, batch, routing=None):
    model.zero_grad(set_to_none=True)
    logp, _, chosen, _ = common.logprobs(model, WORLD, batch, 1.0, routing)
    (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
    return logp.detach(), chosen, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", MOE_FAMILIES + ["deepseek_v3_one_group"])
def test_the_recorded_experts_are_the_ones_the_layer_used(family, tiny_moe):
    model = tiny_moe(family)
    used = []                                       # what each layer's experts module was given, independently
    for module in model.modules():
        if type(module).__name__.endswith("Experts"):
            module.register_forward_pre_hook(lambda module, args: used.append(args[1]))
    batch = rollout()
    _, _, recorded, aux_loss = common.logprobs(model, WORLD, batch, 1.0)
    assert recorded.shape == (2, 4, 13, 2) and len(used) == 2 and aux_loss > 0
    assert all(torch.equal(u.view(4, 13, 2), r) for u, r in zip(used, recorded))
    if family.startswith("deepseek_v3"):            # the naive reading, top-k of the router logits, is wrong here
        logits = []
        for router in hf_routing.routers(model):
            router.register_forward_hook(lambda module, args, out: logits.append(out[0]))
        common.logprobs(model, WORLD, batch, 1.0)
        naive = torch.stack([x.topk(2, -1).indices.view(4, 13, 2) for x in logits])
        assert not torch.equal(naive.sort(-1).values, recorded.sort(-1).values)


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
@pytest.mark.parametrize("family", MOE_FAMILIES + ["deepseek_v3_one_group"])
def test_replay_at_unchanged_weights_equals_free_routing_exactly(family, gradient_checkpointing, tiny_moe):
    model = tiny_moe(family, gradient_checkpointing)
    batch = rollout()
    logp, recorded, grads = logprobs_and_grads(model, batch)
    logp_replay, chosen, grads_replay = logprobs_and_grads(model, batch, recorded)
    assert torch.equal(logp_replay, logp) and torch.equal(chosen, recorded)
    assert grads.keys() == grads_replay.keys() and all(torch.equal(grads[n], grads_replay[n]) for n in grads)
    assert sum(".gate." in n or "router" in n for n in grads) >= 2     # the routers learn, replayed or not


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_after_an_update_replay_changes_only_what_rerouting_changed(family, gradient_checkpointing, tiny_moe):
    model = tiny_moe(family, gradient_checkpointing)
    batch = rollout(16)
    with torch.no_grad():
        old_logp, _, recorded, _ = common.logprobs(model, WORLD, batch, 1.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    for _ in range(30):                             # small updates until a few tokens change experts
        logp, _, rerouted, _ = common.logprobs(model, WORLD, batch, 1.0)
        if not torch.equal(rerouted.sort(-1).values, recorded.sort(-1).values):
            break
        common.optimizer_step(model, optimizer, -(logp * torch.randn(logp.shape)).sum(), 1.0)
    free, rerouted, _ = logprobs_and_grads(model, batch)
    replay, _, grads = logprobs_and_grads(model, batch, recorded)
    assert any(g.abs().sum() > 0 for n, g in grads.items() if ".gate." in n or "router" in n)
    changed = (rerouted.sort(-1).values != recorded.sort(-1).values).any(-1).any(0)      # [16, 13] any layer
    changed &= batch.attention_mask[:, :-1].bool()                  # left padding is attended by nothing
    assert 0 < changed.float().mean() < 0.9
    # A completion token's log-prob depends on every position up to the one that predicts it: where none of
    # those was re-routed, replay and free routing are the same computation (up to the order of the k gates).
    untouched = (changed.long().cumsum(1) == 0)[:, -6:]                                  # [16, 6]
    assert untouched.any() and (~untouched).any()
    assert torch.allclose(replay[untouched], free[untouched], atol=1e-6)
    with torch.no_grad():                           # and at each re-routed position, replay changes the output
        hidden_free = common.trunk(model, batch.tokens[:, :-1], batch.attention_mask[:, :-1])[0]
        hidden_replay = common.trunk(model, batch.tokens[:, :-1], batch.attention_mask[:, :-1], recorded)[0]
    assert ((hidden_replay - hidden_free)[changed].abs().amax(-1) > 1e-5).all()
    assert not torch.allclose(replay, old_logp)     # the update moved the policy either way


def test_the_hooks_follow_copies_of_the_model(tiny_moe):
    """The reference policy and PPO's critic are deep copies: each must record its own routing."""
    model = tiny_moe("qwen3_moe")
    copy = common.frozen_copy(model)
    with torch.no_grad():
        for router in hf_routing.routers(copy):
            router.weight.mul_(-1)                  # the copy routes differently from the original
        _, _, original, _ = common.logprobs(model, WORLD, rollout(), 1.0)
        _, _, copied, _ = common.logprobs(copy, WORLD, rollout(), 1.0)
    assert copied is not None and not torch.equal(copied, original)


def test_load_balancing_loss_of_hugging_face_routers_by_hand():
    # The toy's hand-computed case (tests/test_model.py): 2 tokens, 4 experts top-2, one layer.
    router_logits = torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.125, 0.5, 0.25, 0.125]]).log()[None]
    chosen = torch.tensor([[[0, 1], [1, 2]]])
    assert hf_routing.load_balancing_loss(router_logits, chosen).item() == pytest.approx(1.25, abs=1e-6)


def test_a_dense_model_with_routing_replay_stops_with_one_line(hf_dense, jsonl, capsys):
    code, err = run(grpo, ["--model", str(hf_dense), "--data", str(jsonl), "--max-new-tokens", "6",
                           "--routing-replay"], capsys)
    assert code == 2 and err.strip().splitlines()[-1] == ("error: --routing-replay: no router module found in "
                                                          "Qwen3ForCausalLM (a dense model, or an MoE family this "
                                                          "code cannot replay)")


def test_a_router_whose_top_k_is_not_seen_stops_with_one_line(hf_moe, jsonl, capsys, monkeypatch):
    """As a hub kernel that bypasses the router module would: the top-k is never made where it is watched."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    def forward(self, hidden_states):
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        experts = logits.argsort(-1, descending=True)[:, :self.top_k]
        return logits, logits.softmax(-1).gather(-1, experts), experts
    monkeypatch.setattr(Qwen3MoeTopKRouter, "forward", forward)
    code, err = run(grpo, ["--model", str(hf_moe), "--data", str(jsonl), "--max-new-tokens", "6",
                           "--routing-replay"], capsys)
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("error: --routing-replay: the routers of Qwen3MoeForCausalLM do not make "
                                         "the top-k choice this code intercepts") and "Traceback" not in err


def test_a_router_that_ignores_the_replayed_experts_stops_with_one_line(hf_moe, jsonl, capsys, monkeypatch):
    """The top-k is made where it is watched, but its experts are not the ones the layer uses: replaying
    would change nothing, so it must not be trusted."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    def forward(self, hidden_states):
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        torch.topk(logits, self.top_k, dim=-1)                        # seen, then thrown away
        experts = logits.argsort(-1, descending=True)[:, :self.top_k]
        return logits, logits.softmax(-1).gather(-1, experts), experts
    monkeypatch.setattr(Qwen3MoeTopKRouter, "forward", forward)
    code, err = run(grpo, ["--model", str(hf_moe), "--data", str(jsonl), "--max-new-tokens", "6",
                           "--routing-replay"], capsys)
    assert code == 2 and err.strip().splitlines()[-1] == ("error: --routing-replay: replaying routing on "
                                                          "Qwen3MoeForCausalLM does not act as it should; it "
                                                          "cannot be replayed") and "Traceback" not in err


@pytest.mark.parametrize("script", ["grpo", "dapo", "ppo", "cispo", "sapo"])
def test_routing_replay_runs_end_to_end_on_a_hugging_face_moe(script, hf_moe, jsonl, tmp_path):
    import importlib
    importlib.import_module(script).main(
        ["--model", str(hf_moe), "--data", str(jsonl), "--max-new-tokens", "6", "--eval-size", "5", "--steps", "2",
         "--prompts-per-step", "2", "--group-size", "3", "--minibatches", "2", "--routing-replay",
         "--gradient-checkpointing", "--out", str(tmp_path)]
        # dapo.py: keep groups whose rewards tie, else a run that samples no correct answer stops (this is about replay)
        + (["--no-dynamic-sampling"] if script == "dapo" else []))
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(0 <= r["routing_drift"] <= 1 and r["load_balancing_loss"] > 0 for r in rows[1:])
