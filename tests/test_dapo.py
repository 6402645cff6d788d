"""DAPO's loss, overlong penalty, group filter and Dynamic Sampling, and each switch."""
import math

import pytest
import torch
from conftest import TINY, read_metrics

import common
import dapo
import grpo


def test_loss_by_hand_asymmetric_clip_and_token_level_normaliser():
    # Row 0 (A = +1): ratios 1.0, 1.25, 1.3 -> min(r, clip(r, 0.8, 1.28)) = 1.0, 1.25, 1.28 (clipped high).
    # Row 1 (A = -1): ratios 0.75, 0.9 -> min(-r, -clip(r)) = -0.8 (clipped low), -0.9.
    ratios = torch.tensor([[1.0, 1.25, 1.3], [0.75, 0.9, 1.0]])
    old_logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.3, -2.0]])
    logp = (old_logp + ratios.log()).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    loss, metrics = dapo.policy_loss(logp, old_logp, adv, mask)
    # Token-level: -(1.0 + 1.25 + 1.28 - 0.8 - 0.9) / 5 tokens
    assert loss.item() == pytest.approx(-(1.0 + 1.25 + 1.28 - 0.8 - 0.9) / 5, abs=1e-6)
    assert metrics["clip_frac_high"] == pytest.approx(1 / 5) and metrics["clip_frac_low"] == pytest.approx(1 / 5)
    assert metrics["clip_frac"] == pytest.approx(2 / 5)
    # The clipped tokens, and by quarter: token 0 of each row (row 1's clipped low); row 0 token 2 (clipped
    # high) and row 1 token 1.
    assert torch.equal(metrics["clipped"] & mask.bool(), torch.tensor([[False, False, True], [True, False, False]]))
    by_quarter = common.by_quarter("clip_frac", metrics["clipped"].float(), mask)   # the caller's split
    assert by_quarter == {"clip_frac_q1": pytest.approx(0.5), "clip_frac_q4": pytest.approx(0.5)}
    loss.backward()
    # Every unclipped token: -r A / 5, whatever its sequence's length.
    assert torch.allclose(logp.grad, torch.tensor([[-1.0 / 5, -1.25 / 5, 0.0], [0.0, 0.9 / 5, 0.0]]), atol=1e-6)
    # Symmetric clipping at 0.2 clips 1.25 too; GRPO's per-sequence mean weighs rows equally.
    seq_loss, _ = dapo.policy_loss(logp, old_logp, adv, mask, 0.2, 0.2, token_level=False)
    assert seq_loss.item() == pytest.approx(-((1.0 + 1.2 + 1.2) / 3 + (-0.8 - 0.9) / 2) / 2, abs=1e-6)


def test_token_level_loss_weighs_a_long_completion_more():
    # One long (8 tokens) and one short (2 tokens) completion, both on-policy, A = +1 and -1.
    logp = torch.zeros(2, 8, requires_grad=True)
    mask = torch.zeros(2, 8)
    mask[0], mask[1, :2] = 1, 1
    dapo.policy_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), mask)[0].backward()
    token_grad, logp.grad = logp.grad.clone(), None
    dapo.policy_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), mask, token_level=False)[0].backward()
    # Token-level: each token 1/10 of the weight; per sequence: 1/(2*8) for the long one, 1/(2*2) for the short.
    assert torch.allclose(token_grad[0], torch.full((8,), -0.1))
    assert torch.allclose(token_grad[1, :2], torch.full((2,), 0.1))
    assert torch.allclose(logp.grad[0], torch.full((8,), -1 / 16))
    assert torch.allclose(logp.grad[1, :2], torch.full((2,), 0.25))
    assert token_grad[0].abs().sum() / token_grad[1].abs().sum() == pytest.approx(4.0)   # 8 tokens vs 2
    assert logp.grad[0].abs().sum() / logp.grad[1].abs().sum() == pytest.approx(1.0)     # each sequence alike


def test_overlong_penalty_at_every_boundary():
    lengths = torch.tensor([1, 10, 24, 25, 28, 31, 32, 33, 40])
    penalty = dapo.overlong_penalty(lengths, max_len=32, cache_len=8)
    # <= 24: 0; inside (24, 32]: (24 - |o|) / 8; beyond 32: -1.
    assert penalty.tolist() == pytest.approx([0, 0, 0, -1 / 8, -4 / 8, -7 / 8, -1, -1, -1])


def test_a_right_chain_answer_is_never_in_the_overlong_buffer():
    for n in (1, 2, 10, 24, 110):                     # the longest answer, EOS included: 4n + 4 tokens
        limit = common.toy_world("chain", 16, None, n).max_new_tokens
        buffer = max(1, limit // 4)                   # dapo.py's default --overlong-buffer
        assert dapo.overlong_penalty(torch.tensor([4 * n + 4, 4 * n + 5]), limit, buffer).tolist() == [0, 0]


def test_filter_groups_keeps_only_groups_with_unequal_rewards():
    rewards = torch.tensor([1, 1, 1, 0, 0, 1, 0.5, 0.5, 0.5, 1, 0, 1.0])
    assert dapo.filter_groups(rewards, 3).tolist() == [False, True, False, True]
    assert dapo.filter_groups(torch.tensor([-0.25, -0.25, 0.75, 0.75]), 2).tolist() == [False, False]


def stub_round(group_rewards, group_size=2, T=3):
    """A fake generation round: len(group_rewards) groups with the given rewards."""
    rewards = torch.tensor([r for g in group_rewards for r in g], dtype=torch.float)
    N = len(rewards)
    tokens = torch.arange(N)[:, None].expand(N, 2 + T).clone()       # row i is filled with i: traceable
    rollout = common.Rollout(tokens, torch.ones(N, 2 + T, dtype=torch.long), torch.ones(N, T),
                             torch.ones(N, dtype=torch.bool), torch.arange(N)[:, None].expand(N, T).float())
    return rollout, rewards, rewards.clone()


def test_dynamic_sampling_refills_the_batch_from_later_rounds():
    rounds = iter([stub_round([(1, 1), (0, 1), (0, 0)]),               # 1 informative group of 3
                   stub_round([(1, 0), (1, 1), (0, 1)])])              # 2 more: enough (3 asked for)
    rollout, rewards, task_rewards, stats = dapo.dynamic_sampling(lambda: next(rounds), 3, 2, 5, pad_id=0)
    assert rewards.tolist() == [0, 1, 1, 0, 0, 1]
    assert rollout.tokens[:, 0].tolist() == [2, 3, 0, 1, 4, 5]        # rows 2-3 of round 1, 0-1 and 4-5 of round 2
    assert stats == {"generation_rounds": 2, "groups_dropped_frac": pytest.approx(3 / 6), "groups_missing": 0,
                     "sampled_accuracy": pytest.approx(7 / 12), "sampled_truncated_frac": 0.0}


def test_dynamic_sampling_trims_the_surplus_and_pads_rounds_of_different_lengths():
    first = stub_round([(1, 1), (0, 1)], T=3)                         # 1 informative group
    second = stub_round([(1, 0), (0, 1), (1, 0)], T=5)                 # 3 more, longer completions: 1 too many
    rounds = iter([first, second])
    rollout, rewards, _, stats = dapo.dynamic_sampling(lambda: next(rounds), 3, 2, 5, pad_id=0)
    assert len(rewards) == 6 and stats["groups_missing"] == 0
    assert rollout.tokens[:, 0].tolist() == [2, 3, 0, 1, 2, 3]         # the third group of round 2 is cut
    assert rollout.mask.shape == (6, 5) and rollout.mask[:2, 3:].sum() == 0 and rollout.mask[2:].sum() == 20
    assert rollout.tokens.shape == (6, 7)
    assert rollout.entropy.tolist()[:3] == [[2, 2, 2, 0, 0], [3, 3, 3, 0, 0], [0] * 5]   # padded as the mask is


def test_dynamic_sampling_stops_at_its_cap_and_trains_on_what_it_kept():
    calls = []
    def sample():
        calls.append(1)
        return stub_round([(1, 1), (0, 1), (0, 0)])                  # 1 informative group a round
    rollout, rewards, _, stats = dapo.dynamic_sampling(sample, 4, 2, 3, pad_id=0)
    assert len(calls) == 3 and stats["generation_rounds"] == 3 and stats["groups_missing"] == 1
    assert len(rewards) == 6 and rewards.tolist() == [0, 1] * 3


def test_dynamic_sampling_with_nothing_informative_stops_the_run_clearly():
    with pytest.raises(common.RunStopped, match="all 6 groups of 3 generation rounds had equal rewards"):
        dapo.dynamic_sampling(lambda: stub_round([(1, 1), (0, 0)]), 2, 2, 3, pad_id=0)


def spy_on_loss(monkeypatch):
    calls, real = [], dapo.policy_loss
    def spy(logp, old_logp, advantages, mask, *hyper):
        calls.append((mask.clone(), hyper))
        return real(logp, old_logp, advantages, mask, *hyper)
    monkeypatch.setattr(dapo, "policy_loss", spy)
    return calls


@pytest.mark.first   # builds the progression base
def test_dapo_end_to_end_with_everything_on(tmp_path, monkeypatch):
    calls = spy_on_loss(monkeypatch)
    dapo.main(TINY + ["--task", "progression", "--out", str(tmp_path)])
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows[1:]:
        for key in ("generation_rounds", "groups_dropped_frac", "overlong_punished_frac", "clip_frac_low",
                    "clip_frac_high", "entropy", "truncated_frac", "routing_drift"):
            assert r[key] is not None and math.isfinite(r[key])
    assert all(hyper[:3] == (0.2, 0.28, True) for _, hyper in calls)
    assert any(r["overlong_punished_frac"] > 0 for r in rows[1:])     # the planted rambling is punished


@pytest.mark.parametrize("flag, check", [
    ("--no-clip-higher", lambda rows, calls: all(h[:3] == (0.2, 0.2, True) for _, h in calls)),
    ("--no-token-level-loss", lambda rows, calls: all(h[:3] == (0.2, 0.28, False) for _, h in calls)),
    ("--no-dynamic-sampling", lambda rows, calls: all("generation_rounds" not in r for r in rows)),
    ("--no-overlong-shaping", lambda rows, calls: all(r["overlong_punished_frac"] == 0 for r in rows[1:])),
])
def test_each_switch_turns_its_technique_off(tmp_path, monkeypatch, flag, check):
    calls = spy_on_loss(monkeypatch)
    dapo.main(TINY + ["--task", "progression", flag, "--out", str(tmp_path)])
    assert check(read_metrics(tmp_path), calls)


def test_with_all_four_off_dapo_is_grpo_without_kl(tmp_path):
    off = ["--no-clip-higher", "--no-dynamic-sampling", "--no-token-level-loss", "--no-overlong-shaping"]
    dapo.main(TINY + off + ["--out", str(tmp_path / "dapo")])
    grpo.main(TINY + ["--beta", "0", "--out", str(tmp_path / "grpo")])
    d_rows, g_rows = read_metrics(tmp_path / "dapo"), read_metrics(tmp_path / "grpo")
    assert len(d_rows) == len(g_rows) == 4
    for d, g in zip(d_rows[1:], g_rows[1:]):
        for key in ("reward_mean", "clip_frac", "grad_norm", "entropy", "approx_kl"):
            assert d[key] == g[key], key
    assert [r.get("eval_accuracy") for r in d_rows] == [r.get("eval_accuracy") for r in g_rows]


def test_overlong_filtering_masks_exactly_the_truncated_completions(tmp_path, monkeypatch):
    calls, rollouts, real_generate = spy_on_loss(monkeypatch), [], common.generate
    monkeypatch.setattr(common, "generate", lambda *a, **kw: rollouts.append(real_generate(*a, **kw)) or rollouts[-1])
    dapo.main(TINY + ["--task", "progression", "--no-dynamic-sampling", "--overlong-filtering", "--steps", "1",
                      "--prompts-per-step", "8", "--out", str(tmp_path)])   # 16 completions a minibatch
    rollout = rollouts[1]                                             # [0] is the base evaluation
    assert (~rollout.finished).any()    # the planted rambling is there (not always in each minibatch)
    for (mask, _), idx in zip(calls, common.minibatches(32, 2)):
        finished = rollout.finished[idx]
        assert torch.equal(mask[finished], rollout.mask[idx][finished])
        assert (mask[~finished] == 0).all()


def test_sample_groups_wires_the_penalty_from_max_new_tokens_and_the_buffer(monkeypatch):
    lengths = [10, 28, 30, 32]                                        # the last one truncated, the others end in EOS
    mask = torch.tensor([[1.0] * n + [0.0] * (32 - n) for n in lengths])
    fake = common.Rollout(torch.zeros(4, 39, dtype=torch.long), torch.ones(4, 39, dtype=torch.long), mask,
                          torch.tensor([True, True, True, False]))
    monkeypatch.setattr(common, "generate", lambda *a, **kw: fake)
    monkeypatch.setattr(common, "rewards_of", lambda *a: torch.tensor([1.0, 0.0, 1.0, 0.0]))
    world = common.toy_world("progression", 16, None)
    args = dapo.Args(task="progression", prompts_per_step=1, group_size=4, overlong_buffer=4)
    _, rewards, task_rewards = dapo.sample_groups(None, world, args)
    # L_max 32, L_cache 4: 0 up to 28, (28 - |o|) / 4 inside, -1 at 32 (EOS counted in |o|).
    assert rewards.tolist() == pytest.approx([1.0, 0.0, 1.0 - 0.5, -1.0]) and task_rewards.tolist() == [1, 0, 1, 0]
