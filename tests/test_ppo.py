"""PPO: GAE, token rewards, whitening, the two losses, and end-to-end runs."""
import math

import pytest
import torch
from conftest import COUNTER_REWARD, TINY_NO_STEPS, read_metrics
from torch.optim.optimizer import register_optimizer_step_post_hook

import common
import ppo
from extras import hf_models


def ragged_mask():
    mask = torch.zeros(4, 6)
    for i, n in enumerate([6, 3, 1, 4]):
        mask[i, :n] = 1
    return mask


def test_gae_matches_a_slow_reference_loop():
    torch.manual_seed(0)
    mask = ragged_mask()
    rewards, values = torch.randn(4, 6) * mask, torch.randn(4, 6) * mask
    gamma, lam = 0.9, 0.8
    advantages, returns = ppo.compute_advantages(rewards, values, mask, gamma, lam)
    for i in range(4):                                               # one sequence at a time, plain Python
        n = int(mask[i].sum())
        r, v = rewards[i, :n].tolist(), values[i, :n].tolist() + [0.0]   # V after the last token = 0
        running, expected = 0.0, [0.0] * n
        for t in reversed(range(n)):
            running = r[t] + gamma * v[t + 1] - v[t] + gamma * lam * running
            expected[t] = running
        assert advantages[i, :n].tolist() == pytest.approx(expected, abs=1e-6)
        assert returns[i, :n].tolist() == pytest.approx([a + b for a, b in zip(expected, v[:n])], abs=1e-6)
        assert (advantages[i, n:] == 0).all() and (returns[i, n:] == 0).all()


def test_gae_with_gamma_and_lam_one_is_reward_to_go_minus_value():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    values = torch.tensor([[0.2, 0.5, 0.7, 9.0]])                      # the padded value must not leak in
    advantages, returns = ppo.compute_advantages(torch.tensor([[0.1, 0.0, 1.0, 5.0]]), values, mask, 1.0, 1.0)
    assert advantages[0].tolist() == pytest.approx([1.1 - 0.2, 1.0 - 0.5, 1.0 - 0.7, 0.0])
    assert returns[0].tolist() == pytest.approx([1.1, 1.0, 1.0, 0.0])


def test_token_rewards_kl_on_every_token_score_on_the_last():
    mask = ragged_mask()
    old_logp = -torch.rand(4, 6)
    ref_logp = old_logp - 0.5 * mask                                  # log pi_old - log pi_ref = 0.5 on valid tokens
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    rewards = ppo.token_rewards(scores, old_logp, ref_logp, mask, beta_kl=0.1)
    expected = -0.05 * mask
    for i, n in enumerate([6, 3, 1, 4]):
        expected[i, n - 1] += scores[i]
    assert torch.allclose(rewards, expected)


def test_whitening_uses_valid_tokens_only():
    mask = ragged_mask()
    advantages = torch.randn(4, 6) * mask + 100 * (1 - mask)           # huge junk on the padding
    white = ppo.whiten(advantages, mask)
    valid = white[mask.bool()]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-5)
    assert (valid ** 2).mean().item() == pytest.approx(1.0, abs=1e-4)
    assert (white[~mask.bool()] == 0).all()
    x = advantages[mask.bool()]
    assert torch.allclose(valid, (x - x.mean()) / x.var(unbiased=False).sqrt(), atol=1e-4)


def test_policy_loss_by_hand():
    ratios = torch.tensor([[1.0, 1.5, 0.5], [1.1, 0.7, 1.0]])
    old_logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.3, -2.0]])
    logp = (old_logp + ratios.log()).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages = torch.tensor([[1.0, 2.0, 1.0], [-1.0, -1.0, 3.0]])
    loss, metrics = ppo.policy_loss(logp, old_logp, advantages, mask)
    # Per token min(r A, clip(r) A): 1.0, 1.2*2, 0.5, -1.1, -0.8; mean over 5 valid tokens.
    assert loss.item() == pytest.approx(-(1.0 + 2.4 + 0.5 - 1.1 - 0.8) / 5, abs=1e-6)
    assert metrics["clip_frac"] == pytest.approx(2 / 5)
    # The clipped tokens, and by quarter: token 0 of each row, none clipped; row 0 token 2 and row 1 token 1
    # (clipped), one of two.
    assert torch.equal(metrics["clipped"] & mask.bool(), torch.tensor([[False, True, False], [False, True, False]]))
    by_quarter = common.by_quarter("clip_frac", metrics["clipped"].float(), mask)   # the caller's split
    assert by_quarter == {"clip_frac_q1": 0.0, "clip_frac_q4": pytest.approx(0.5)}
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.0 / 5, 0.0, -0.5 / 5], [1.1 / 5, 0.0, 0.0]]), atol=1e-6)


def test_value_loss_clipping_by_hand():
    old_values = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0, -1.0, 7.0]])
    values = torch.tensor([[0.5, 0.1, 0.5, 3.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss = ppo.value_loss(values, old_values, returns, mask, clip_range=0.2)
    # token 0: V moved 0.5 > 0.2: clipped V 0.2 -> max(0.25, 0.64) = 0.64 (the clipped term wins, no gradient)
    # token 1: inside the clip: (0.1 - 1)^2 = 0.81
    # token 2: clipped V 0.2 -> max((0.5 + 1)^2, (0.2 + 1)^2) = 2.25 (the unclipped term wins)
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81 + 2.25) / 3, abs=1e-6)
    loss.backward()
    assert values.grad.tolist()[0] == pytest.approx([0.0, 0.5 * 2 * (0.1 - 1) / 3, 0.5 * 2 * 1.5 / 3, 0.0], abs=1e-6)


def test_explained_variance():
    mask = ragged_mask()
    returns = torch.randn(4, 6) * mask
    assert ppo.explained_variance(returns, returns, mask) == pytest.approx(1.0)
    constant = torch.full((4, 6), returns[mask.bool()].mean().item())
    assert ppo.explained_variance(constant, returns, mask) == pytest.approx(0.0, abs=1e-5)


def test_explained_variance_by_quarter_by_hand():
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    returns = torch.tensor([[1.0, 5.0, 5.0, 3.0], [2.0, 0.0, 0.0, 0.0]])
    values = torch.tensor([[1.0, 0.0, 0.0, 3.0], [2.0, 1.0, 0.0, 0.0]])
    first, last = common.quarters(mask)          # token 0 of each row; row 0 token 3 and row 1 token 1
    assert ppo.explained_variance(values, returns, first) == pytest.approx(1.0)   # R 1, 2 known exactly
    # R 3, 0 (variance 2.25), R - V 0, -1 (variance 0.25): 1 - 0.25 / 2.25.
    assert ppo.explained_variance(values, returns, last) == pytest.approx(8 / 9)


@pytest.mark.parametrize("dtype", ["auto", "bf16"])         # bf16: autocast through the policy, reference and critic
def test_ppo_end_to_end_on_the_toy(dtype, tmp_path):
    ppo.main(["--steps", "3", "--prompts-per-step", "16", "--minibatches", "2", "--eval-size", "16",
              "--eval-every", "2", "--dtype", dtype, "--out", str(tmp_path)])
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows[1:]:
        for key in ("value_loss", "explained_variance", "kl_ref", "clip_frac", "time_critic_s", "peak_memory_mb",
                    "routing_drift", "entropy", "explained_variance_q1", "explained_variance_q4", "clip_frac_q4",
                    "token_ratio_var_q1", "routing_drift_q4"):
            assert r[key] is not None and math.isfinite(r[key]), key
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert {"policy", "optimizer", "critic", "critic_optimizer"} <= set(checkpoint)


def test_the_advantages_reaching_the_loss_are_whitened_over_the_batch(tmp_path, monkeypatch):
    seen, policy_loss = [], ppo.policy_loss
    def recording_policy_loss(logp, old_logp, advantages, mask, *hyper):
        seen.append((advantages, mask))
        return policy_loss(logp, old_logp, advantages, mask, *hyper)
    monkeypatch.setattr(ppo, "policy_loss", recording_policy_loss)
    (tmp_path / "counter.py").write_text(COUNTER_REWARD)       # rewards that differ, whatever the samples
    ppo.main(["--steps", "1"] + TINY_NO_STEPS + ["--reward", f"{tmp_path / 'counter.py'}:counter",
                                                 "--out", str(tmp_path / "run")])
    # Every minibatch of every epoch: each row comes `epochs` times, which leaves mean and variance as they are.
    advantages = torch.cat([a for a, _ in seen])
    real = torch.cat([m for _, m in seen]).bool()
    assert len(seen) == 4 and (advantages[~real] == 0).all()
    assert advantages[real].mean().item() == pytest.approx(0.0, abs=1e-5)
    assert advantages[real].var(correction=0).item() == pytest.approx(1.0, abs=1e-5)


def test_each_rollout_batch_takes_minibatches_times_epochs_steps_of_policy_then_critic(tmp_path):
    common.make_policy(ppo.Args(), torch.device("cpu"))               # the warm start's own steps, if any, go first
    steps = []
    def record(optimizer, args, kwargs):                            # the learning rate of each optimizer step
        steps.append(optimizer.param_groups[0]["lr"])
    hook = register_optimizer_step_post_hook(record)
    try:
        ppo.main(["--steps", "1"] + TINY_NO_STEPS + ["--epochs", "3", "--lr", "1e-4", "--critic-lr", "2e-4",
                                                     "--out", str(tmp_path)])
    finally:
        hook.remove()
    assert steps == [1e-4, 2e-4] * (2 * 3)                              # --minibatches 2 x --epochs 3


def test_ppo_end_to_end_on_a_tiny_hf_model(tmp_path, jsonl, hf_dense):
    ppo.main(["--model", str(hf_dense), "--data", str(jsonl), "--max-new-tokens", "6", "--eval-size", "5",
              "--steps", "2", "--prompts-per-step", "4", "--minibatches", "2", "--out", str(tmp_path)])
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["value_loss"] >= 0


def test_ppo_resume_gives_the_same_metrics(tmp_path):
    tiny = ["--prompts-per-step", "16", "--minibatches", "2", "--eval-size", "16", "--eval-every", "2"]
    ppo.main(tiny + ["--steps", "4", "--out", str(tmp_path / "long")])
    ppo.main(tiny + ["--steps", "2", "--out", str(tmp_path / "split")])
    ppo.main(tiny + ["--steps", "4", "--resume", str(tmp_path / "split")])
    assert read_metrics(tmp_path / "split", timings=False) == read_metrics(tmp_path / "long", timings=False)


def test_gae_stays_on_the_batch_device():
    # A CUDA run must not meet CPU tensors inside GAE; the meta device stands in for a GPU here.
    rewards = torch.zeros(2, 3, device="meta")
    values, mask = torch.zeros(2, 3, device="meta"), torch.ones(2, 3, device="meta")
    advantages, returns = ppo.compute_advantages(rewards, values, mask)
    assert advantages.device.type == returns.device.type == "meta"


@pytest.mark.parametrize("which", ["toy", "hf_tied"])
def test_critic_is_a_scalar_head_on_a_copy_of_the_policy(which, request):
    if which == "toy":
        model, world = common.make_policy(ppo.Args(), torch.device("cpu"))
    else:
        model, tokenizer = hf_models.load_hf(str(request.getfixturevalue("hf_tied")), torch.device("cpu"))
        world = common.World([], [], None, None, (tokenizer.eos_token_id,), tokenizer.pad_token_id, 5)
    critic = ppo.make_critic(model)
    if which != "toy":
        critic.tie_weights()                                            # what save_pretrained and friends call
    assert not set(map(id, critic.parameters())) & set(map(id, model.parameters()))
    prompts = [world.train[0][0]] if which == "toy" else [torch.tensor([5, 6, 7])]
    rollout = common.generate(model, world, prompts, 3, 1.0)
    values = ppo.values(critic, rollout)
    assert values.shape == rollout.mask.shape and (values == 0).all()  # zero-initialised head
    # V(s_t) is read where completion token t is predicted: the same position as its log-prob.
    torch.nn.init.normal_(critic.head.weight if which == "toy" else critic.get_output_embeddings().weight)
    values = ppo.values(critic, rollout)
    P = rollout.tokens.shape[1] - rollout.mask.shape[1]
    for t in range(int(rollout.mask[0].sum())):
        prefix = common.Rollout(rollout.tokens[:1, :P + t + 1], rollout.attention_mask[:1, :P + t + 1],
                                torch.ones(1, 1), rollout.finished[:1])
        assert ppo.values(critic, prefix)[0, -1].item() == pytest.approx(values[0, t].item(), abs=1e-5)


def test_the_critic_learns_the_returns_of_a_fixed_batch():
    model, world = common.make_policy(ppo.Args(), torch.device("cpu"))
    critic = ppo.make_critic(model)
    optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-3)
    torch.manual_seed(0)
    prompts, _ = world.sample(8)
    rollout = common.generate(model, world, prompts, 1, 1.0)
    returns = torch.rand(8, 1) * rollout.mask                          # one target per completion
    losses = []
    for _ in range(30):
        values = ppo.values(critic, rollout)
        loss = ppo.value_loss(values, values.detach(), returns, rollout.mask, clip_range=10.0)
        common.optimizer_step(critic, optimizer, loss, 1.0)
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]
