"""GSPO and GSPO-token against hand-computed numbers and their defining properties."""
import math

import pytest
import torch
from conftest import TINY, read_metrics

import common
import gspo


def ragged(seed=0, N=6, T=7, scale=0.02):
    torch.manual_seed(seed)
    old_logp = -torch.rand(N, T) * 2
    log_ratio = (torch.rand(N, T) - 0.5) * scale
    mask = torch.ones(N, T)
    for i, n in enumerate([7, 3, 5, 1, 6, 2][:N]):                   # ragged lengths
        mask[i, n:] = 0
    logp = (old_logp + log_ratio).requires_grad_(True)
    return logp, old_logp, mask                                       # junk, not zeros, on the padding


def test_sequence_ratio_is_the_geometric_mean_of_the_token_ratios():
    logp, old_logp, mask = ragged(scale=0.6)                         # log-ratios up to +-0.3
    N = len(mask)
    # Clip band wide open and A = 1: loss = -(1/N) sum_i s_i.
    loss, _ = gspo.policy_loss(logp, old_logp, torch.ones(N), mask, clip_eps_low=10, clip_eps_high=10)
    geo_means = []
    for i in range(N):
        n = int(mask[i].sum())
        ratios = (logp[i, :n] - old_logp[i, :n]).exp().tolist()
        geo_means.append(math.prod(ratios) ** (1 / n))               # the padded length never enters
    assert loss.item() == pytest.approx(-sum(geo_means) / N, rel=1e-6)


def test_loss_and_clip_fraction_by_hand():
    # Two sequences. Row 0: 3 tokens, log-ratios 3e-4 each -> s = exp(3e-4) = 1.0003 < 1.0004, A = +1.
    # Row 1: 2 tokens, log-ratios -1e-3 each -> s = exp(-1e-3) = 0.9990 < 0.9997, A = -1: clipped.
    old_logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.3, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    logp = (old_logp + torch.tensor([[3e-4, 3e-4, 3e-4], [-1e-3, -1e-3, 0.0]])).requires_grad_(True)
    loss, metrics = gspo.policy_loss(logp, old_logp, torch.tensor([1.0, -1.0]), mask)
    s0, s1 = math.exp(3e-4), math.exp(-1e-3)
    assert 1 - 3e-4 < s0 < 1 + 4e-4 and s1 < 1 - 3e-4                 # row 0 inside the band, row 1 below it
    # min(s0 * 1, clip(s0) * 1) = s0; min(-s1, -clip(s1)) = min(-0.9990, -0.9997) = -0.9997.
    assert loss.item() == pytest.approx(-(s0 - (1 - 3e-4)) / 2, abs=1e-6)
    assert metrics["clip_frac"] == pytest.approx(2 / 5)              # the 2 tokens of the clipped sequence
    # The clipped tokens, and by quarter: token 0 of each row, and row 0 token 2 with row 1 token 1: row 1's
    # token in each is clipped.
    assert torch.equal(metrics["clipped"] & mask.bool(), torch.tensor([[False, False, False], [True, True, False]]))
    by_quarter = common.by_quarter("clip_frac", metrics["clipped"].float(), mask)   # the caller's split
    assert by_quarter == {"clip_frac_q1": pytest.approx(0.5), "clip_frac_q4": pytest.approx(0.5)}
    loss.backward()
    # Row 0: d/dlogp_0t of -(1/2) s0 = -(1/2) s0 / 3; row 1 clipped: zero.
    assert torch.allclose(logp.grad[0], torch.full((3,), -s0 / 6), atol=1e-7)
    assert (logp.grad[1] == 0).all()


def test_clipping_zeroes_whole_sequences_exactly_on_the_side_of_their_advantage():
    N, T = 8, 4
    old_logp = -torch.ones(N, T)
    mask = torch.ones(N, T)
    # Sequence log-ratios: far above, inside, far below the band; advantages of both signs.
    seq_log = torch.tensor([1e-3, 1e-3, 1e-4, 1e-4, -1e-3, -1e-3, -1e-4, -1e-4])
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    token_noise = torch.tensor([1e-5, -2e-5, 3e-5, -2e-5])           # mean 0: s_i is set by seq_log
    logp = (old_logp + seq_log[:, None] + token_noise).requires_grad_(True)
    gspo.policy_loss(logp, old_logp, advantages, mask)[0].backward()
    s = seq_log.exp()
    clipped = ((advantages > 0) & (s > 1 + 4e-4)) | ((advantages < 0) & (s < 1 - 3e-4))
    assert clipped.tolist() == [True, False, False, False, False, True, False, False]
    zero_rows = (logp.grad == 0).all(1)
    assert torch.equal(zero_rows, clipped)
    assert (logp.grad[~clipped] != 0).all()
    _, metrics = gspo.policy_loss(logp, old_logp, advantages, mask)
    assert metrics["clip_frac"] == pytest.approx(2 / 8)               # every token of the 2 clipped sequences


def test_the_clip_acts_on_the_sequence_not_on_its_tokens():
    old_logp = -torch.ones(2, 4)
    mask = torch.ones(2, 4)
    # Row 0: every token far outside the band (+-2e-3), but s_0 = 1 inside it: nothing is clipped.
    # Row 1: s_1 = exp(1e-3) above the band, though 3 of its 4 tokens are inside it: all clipped.
    log_ratio = torch.tensor([[2e-3, -2e-3, 2e-3, -2e-3], [1e-4, 1e-4, 1e-4, 3.7e-3]])
    logp = (old_logp + log_ratio).requires_grad_(True)
    loss, metrics = gspo.policy_loss(logp, old_logp, torch.tensor([1.0, 1.0]), mask)
    loss.backward()
    assert (logp.grad[0] != 0).all() and (logp.grad[1] == 0).all()
    assert metrics["clip_frac"] == pytest.approx(0.5)


def test_at_ratio_one_the_gradient_is_the_length_normalised_policy_gradient():
    logp, _, mask = ragged(seed=1)
    advantages = torch.randn(len(mask))
    loss, metrics = gspo.policy_loss(logp, logp.detach(), advantages, mask)
    loss.backward()
    expected = -(advantages[:, None] * mask / mask.sum(1, keepdim=True)) / len(mask)
    assert torch.allclose(logp.grad, expected, atol=1e-7)
    assert metrics["clip_frac"] == 0.0 and metrics["seq_log_ratio_std"] == 0.0


@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (10.0, 10.0)])       # clipping active, and off
def test_gspo_token_equals_gspo_when_advantages_are_per_sequence(eps):
    logp, old_logp, mask = ragged(seed=2, scale=0.002)
    s = (((logp - old_logp) * mask).sum(1) / mask.sum(1)).exp().detach()
    # Advantages chosen so that sequences above the band have A > 0 and those below A < 0: both clip.
    advantages = torch.where(s > 1 + 4e-4, 1.0, torch.where(s < 1 - 3e-4, -1.0, 0.5))
    seq_loss, seq_metrics = gspo.policy_loss(logp, old_logp, advantages, mask, *eps)
    seq_loss.backward()
    seq_grad, logp.grad = logp.grad.clone(), None
    tok_loss, tok_metrics = gspo.policy_loss_token(logp, old_logp, advantages[:, None].expand_as(mask), mask, *eps)
    tok_loss.backward()
    assert tok_loss.item() == pytest.approx(seq_loss.item(), abs=1e-7)
    assert torch.allclose(logp.grad, seq_grad, atol=1e-8)
    assert tok_metrics["clip_frac"] == pytest.approx(seq_metrics["clip_frac"])
    if eps[0] < 1:
        assert (advantages == 1).any() and (advantages == -1).any() and 0 < seq_metrics["clip_frac"] < 1


def test_gspo_token_differs_in_gradient_when_advantages_are_per_token():
    logp, old_logp, mask = ragged(seed=3)
    advantages = torch.randn(len(mask))
    per_token = advantages[:, None] + torch.randn(mask.shape)         # A_it varies within a sequence
    gspo.policy_loss(logp, old_logp, advantages, mask, 10, 10)[0].backward()
    seq_grad, logp.grad = logp.grad.clone(), None
    gspo.policy_loss_token(logp, old_logp, per_token, mask, 10, 10)[0].backward()
    assert not torch.allclose(logp.grad, seq_grad, atol=1e-4)
    # Each token's gradient is weighted by its own advantage: -(1/N) s_i A_it / |o_i|.
    s = (((logp - old_logp) * mask).sum(1) / mask.sum(1)).exp().detach()
    expected = -(s[:, None] * per_token * mask / mask.sum(1, keepdim=True)) / len(mask)
    assert torch.allclose(logp.grad, expected, atol=1e-7)


@pytest.mark.parametrize("extra", [[], ["--token-level"]])
def test_gspo_end_to_end_on_the_toy(tmp_path, extra):
    gspo.main(TINY + extra + ["--out", str(tmp_path)])
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows[1:]:
        for key in ("clip_frac", "seq_log_ratio_std", "routing_drift", "token_ratio_var", "entropy"):
            assert r[key] is not None and math.isfinite(r[key])


def test_gspo_end_to_end_on_a_tiny_hf_moe(tmp_path, jsonl, hf_moe):
    gspo.main(["--model", str(hf_moe), "--data", str(jsonl), "--max-new-tokens", "6", "--eval-size", "5",
               "--steps", "2", "--prompts-per-step", "2", "--group-size", "3", "--minibatches", "3",
               "--out", str(tmp_path)])
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(0 <= r["routing_drift"] <= 1 for r in rows[1:])
