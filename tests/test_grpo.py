"""GRPO's advantages and loss, against hand-computed numbers and their defining properties, and grpo.py end to
end on the toy and on tiny Hugging Face models built locally."""
import inspect
import math

import pytest
import torch
from conftest import TINY, read_metrics

import common
import grpo


def test_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0, 1.0, 1.0])
    adv = grpo.compute_advantages(rewards, group_size=4)
    # Group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025.
    s = math.sqrt(1 / 3)
    assert adv[:4].tolist() == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s], rel=1e-5)
    # Group 2: all equal -> exactly zero advantage, never NaN.
    assert adv[4:8].tolist() == [0.0, 0.0, 0.0, 0.0]
    # Group 3: mean 1, unbiased std sqrt((1 + 1 + 0 + 0) / 3).
    s3 = math.sqrt(2 / 3)
    assert adv[8:].tolist() == pytest.approx([1 / s3, -1 / s3, 0.0, 0.0], rel=1e-5)


def test_all_equal_groups_give_zero_loss_and_gradient():
    adv = grpo.compute_advantages(torch.ones(8), group_size=4)
    assert torch.isfinite(adv).all() and (adv == 0).all()
    logp = torch.randn(8, 5, requires_grad=True)
    loss, _ = grpo.policy_loss(logp, logp.detach() + 0.1, adv, torch.ones(8, 5), beta=0.0)
    loss.backward()
    assert loss.item() == 0.0 and (logp.grad == 0).all()


def hand_case():
    # ratios row 0: 1.0, 1.5, 0.5 (A = +1); row 1: 1.1, 0.7, padding (A = -1)
    ratios = torch.tensor([[1.0, 1.5, 0.5], [1.1, 0.7, 1.0]])
    old_logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.3, -2.0]])
    logp = (old_logp + ratios.log()).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return logp, old_logp, torch.tensor([1.0, -1.0]), mask


def test_loss_by_hand():
    logp, old_logp, adv, mask = hand_case()
    loss, metrics = grpo.policy_loss(logp, old_logp, adv, mask, clip_eps=0.2, beta=0.0)
    # Row 0: min(r, clip(r)) = 1.0, 1.2, 0.5 -> mean 0.9.
    # Row 1: min(-r, -clip(r)) = -1.1, -0.8 -> mean -0.95.   loss = -(0.9 - 0.95) / 2 = 0.025
    assert loss.item() == pytest.approx(0.025, abs=1e-6)
    # Clipped: row 0 token 1 (A > 0, r > 1.2) and row 1 token 1 (A < 0, r < 0.8): 2 of 5 tokens.
    assert metrics["clip_frac"] == pytest.approx(0.4)
    # The clipped tokens, and by quarter (common.quarters): token 0 of each row, none clipped; row 0 token 2 and
    # row 1 token 1, one clipped.
    assert torch.equal(metrics["clipped"] & mask.bool(), torch.tensor([[False, True, False], [False, True, False]]))
    by_quarter = common.by_quarter("clip_frac", metrics["clipped"].float(), mask)   # the caller's split
    assert by_quarter == {"clip_frac_q1": 0.0, "clip_frac_q4": pytest.approx(0.5)}
    loss.backward()
    # d loss / d logp_it = -(1/G)(1/|o_i|) r_it A_i where unclipped, 0 where clipped or padded.
    expected = torch.tensor([[-1 / 6, 0.0, -0.5 / 6], [1.1 / 4, 0.0, 0.0]])
    assert torch.allclose(logp.grad, expected, atol=1e-6)


def test_clipping_zeroes_exactly_the_right_gradients():
    torch.manual_seed(0)
    N, T, eps = 64, 6, 0.2
    old_logp = -torch.rand(N, T) * 3
    log_ratio = (torch.rand(N, T) - 0.5) * 1.0                        # ratios in [0.61, 1.65]
    logp = (old_logp + log_ratio).requires_grad_(True)
    adv = torch.randn(N)
    mask = torch.ones(N, T)
    grpo.policy_loss(logp, old_logp, adv, mask, clip_eps=eps, beta=0.0)[0].backward()
    ratio, a = log_ratio.exp(), adv[:, None].expand(N, T)
    zeroed = ((a > 0) & (ratio > 1 + eps)) | ((a < 0) & (ratio < 1 - eps))
    assert zeroed.any() and (~zeroed).any()
    assert (logp.grad[zeroed] == 0).all()
    assert (logp.grad[~zeroed] != 0).all()


def test_ratio_one_gives_the_plain_policy_gradient():
    torch.manual_seed(1)
    N, T = 6, 5
    logp = (-torch.rand(N, T)).requires_grad_(True)
    adv = torch.randn(N)
    mask = torch.ones(N, T)
    mask[0, 3:] = 0
    mask[4, 1:] = 0
    loss, metrics = grpo.policy_loss(logp, logp.detach(), adv, mask, beta=0.0)
    loss.backward()
    # Policy gradient of -(1/N) sum_i A_i (1/|o_i|) sum_t logp_it.
    pg = -(adv[:, None] * mask / mask.sum(1, keepdim=True)) / N
    assert torch.allclose(logp.grad, pg, atol=1e-7)
    assert metrics["clip_frac"] == 0.0 and metrics["approx_kl"] == 0.0


def test_kl_term():
    torch.manual_seed(2)
    N, T = 4, 3
    logp = (-torch.rand(N, T)).requires_grad_(True)
    mask = torch.ones(N, T)
    adv = torch.zeros(N)  # isolate the KL term
    # ref = policy: KL is 0 and so is its gradient.
    loss, metrics = grpo.policy_loss(logp, logp.detach(), adv, mask, ref_logp=logp.detach(), beta=0.04)
    loss.backward()
    assert loss.item() == 0.0 and metrics["kl_ref"] == 0.0 and torch.allclose(logp.grad, torch.zeros(N, T))
    # ref != policy: k3 = exp(d) - d - 1 with d = ref_logp - logp, >= 0; loss = beta * mean of it.
    ref_logp = logp.detach() + torch.randn(N, T)
    loss, metrics = grpo.policy_loss(logp, logp.detach(), adv, mask, ref_logp=ref_logp, beta=0.04)
    d = ref_logp - logp.detach()
    k3 = d.exp() - d - 1
    assert (k3 >= 0).all()
    assert loss.item() == pytest.approx(0.04 * k3.mean().item(), rel=1e-5)
    assert metrics["kl_ref"] == pytest.approx(k3.mean().item(), rel=1e-5)
    # Gradient: d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp), pulling logp to ref.
    logp.grad = None
    loss.backward()
    assert torch.allclose(logp.grad, 0.04 * (1 - d.exp()) / (N * T), atol=1e-7)


def test_padding_does_not_change_the_loss():
    logp, old_logp, adv, mask = hand_case()
    padded = torch.cat([logp.detach(), torch.full((2, 4), -7.0)], 1)
    padded_old = torch.cat([old_logp, torch.full((2, 4), -1.0)], 1)
    padded_mask = torch.cat([mask, torch.zeros(2, 4)], 1)
    a = grpo.policy_loss(logp.detach(), old_logp, adv, mask, beta=0.0)[0]
    b = grpo.policy_loss(padded, padded_old, adv, padded_mask, beta=0.0)[0]
    assert a.item() == pytest.approx(b.item(), abs=1e-7)


@pytest.mark.parametrize("extra", [[], ["--routing-replay"], ["--beta", "0.04"], ["--n-experts", "1"]])
def test_grpo_end_to_end_on_the_toy(tmp_path, extra):
    grpo.main(TINY + extra + ["--out", str(tmp_path)])
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [("eval_accuracy" in r) for r in rows] == [True, False, True, True]
    for r in rows[1:]:
        for key in ("reward_mean", "clip_frac", "entropy", "response_len_mean", "step_time_s", "grad_norm"):
            assert key in r and math.isfinite(r[key])                  # present, a finite number
        assert ("routing_drift" in r) == (extra != ["--n-experts", "1"])
        assert ("kl_ref" in r) == (extra == ["--beta", "0.04"])


@pytest.mark.parametrize("which", ["hf_dense", "hf_moe"])
def test_grpo_end_to_end_on_a_tiny_hf_model(tmp_path, jsonl, which, request):
    folder = request.getfixturevalue(which)
    grpo.main(["--model", str(folder), "--data", str(jsonl), "--max-new-tokens", "6", "--eval-size", "5",
               "--steps", "2", "--prompts-per-step", "2", "--group-size", "3", "--minibatches", "2",
               "--out", str(tmp_path)])
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert ("routing_drift" in rows[1]) == (which == "hf_moe")
    assert all(0 <= r["reward_mean"] <= 1 and r["entropy"] > 0 for r in rows[1:])


def test_routing_replay_feeds_the_recorded_experts_to_the_update(tmp_path, monkeypatch):
    recorded, replayed = [], []
    old_logprobs, logprobs = common.old_logprobs, common.logprobs

    def record(*a):                                                    # the experts of the old log-probs' pass
        out = old_logprobs(*a)
        recorded.append(out[1])
        return out
    monkeypatch.setattr(common, "old_logprobs", record)
    monkeypatch.setattr(common, "logprobs", lambda *a, **k: (len(a) > 4 and replayed.append(a[4])) or logprobs(*a, **k))
    grpo.main(TINY + ["--routing-replay", "--out", str(tmp_path)])
    assert len(recorded) == 3 and len(replayed) == 6                   # 3 steps x 2 minibatches
    for step in range(3):
        # The first minibatch routes freely: the policy has not moved since it sampled. The second replays.
        first, second = common.minibatches(16, 2)
        assert replayed[2 * step] is None and (recorded[step][:, first] == 0).all()     # no pass scored those rows
        assert torch.equal(replayed[2 * step + 1], recorded[step][:, second])


def test_policy_loss_defaults_are_the_scripts():
    # A reader who copies policy_loss and calls it with its defaults gets the script's run: no KL, no reference.
    defaults = inspect.signature(grpo.policy_loss).parameters
    assert defaults["beta"].default == grpo.Args().beta == 0.0 and defaults["clip_eps"].default == grpo.Args().clip_eps
    logp = torch.randn(2, 3)
    loss, metrics = grpo.policy_loss(logp, logp, torch.tensor([1.0, -1.0]), torch.ones(2, 3))
    assert loss.item() == pytest.approx(0.0) and "kl_ref" not in metrics
