"""CISPO's loss against hand-computed numbers, its defining properties, and verl's and TRL's CISPO losses with the
settings --print-verl and --print-trl give; cispo.py end to end on the toy."""
import inspect
import math

import pytest
import torch
from conftest import TINIER, read_metrics
from peers import trl_loss, verl_policy_loss, VerlActorConfig

import cispo
import common
import grpo
from extras import graduate


def hand_case():
    # ratios row 0: 1.0, 1.5, 0.5 (A = +1); row 1: 1.1, 0.7, padding (A = -1)
    ratios = torch.tensor([[1.0, 1.5, 0.5], [1.1, 0.7, 1.0]])
    old_logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.3, -2.0]])
    logp = (old_logp + ratios.log()).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return logp, old_logp, torch.tensor([1.0, -1.0]), mask


def random_case(seed=0, N=6, T=7, spread=0.5):
    """Ratios exp(N(0, spread)), ragged lengths, junk on the padding, advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    old_logp = -torch.rand(N, T, generator=g) * 3
    logp = old_logp + spread * torch.randn(N, T, generator=g)
    mask = (torch.arange(T) < torch.tensor([7, 3, 5, 1, 6, 2][:N])[:, None]).float()
    return logp, old_logp, torch.randn(N, generator=g), mask


def loss_and_grad(fn, logp, *args, **kwargs):
    x = logp.detach().clone().requires_grad_(True)
    loss, metrics = fn(x, *args, **kwargs)
    loss.backward()
    return loss.detach(), x.grad, metrics


def test_loss_by_hand():
    logp, old_logp, adv, mask = hand_case()
    loss, metrics = cispo.policy_loss(logp, old_logp, adv, mask, ratio_cap=1.2)
    # Weights min(r, 1.2): row 0 1.0, 1.2 (capped), 0.5; row 1 1.1, 0.7. loss = -(1/5) sum w A logp over 5 tokens.
    lp = [[-1.0, -2.0 + math.log(1.5), -0.5 + math.log(0.5)], [-1.5 + math.log(1.1), -0.3 + math.log(0.7)]]
    expected = -(1.0 * lp[0][0] + 1.2 * lp[0][1] + 0.5 * lp[0][2] - 1.1 * lp[1][0] - 0.7 * lp[1][1]) / 5
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    # One token capped of five: row 0 token 1 (1.5 > 1.2). Its gradient is scaled down to the cap, not cut.
    assert metrics["clip_frac"] == pytest.approx(0.2)
    assert torch.equal(metrics["clipped"] & mask.bool(), torch.tensor([[False, True, False], [False, False, False]]))
    loss.backward()
    # d loss / d logp_it = -w_it A_i / 5, the weight taken as a constant; 0 on the padding.
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -1.2, -0.5], [1.1, 0.7, 0.0]]) / 5, atol=1e-7)
    # With a floor 1 - 0.2 as well (verl's two-sided clamp), 0.5 and 0.7 count 0.8 and are capped too.
    logp.grad = None
    loss, metrics = cispo.policy_loss(logp, old_logp, adv, mask, ratio_cap=1.2, clip_eps_low=0.2)
    loss.backward()
    assert metrics["clip_frac"] == pytest.approx(3 / 5)
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -1.2, -0.8], [1.1, 0.8, 0.0]]) / 5, atol=1e-7)


def test_ratio_one_gives_the_plain_token_level_policy_gradient():
    logp, _, adv, mask = random_case(seed=1)
    loss, grad, metrics = loss_and_grad(cispo.policy_loss, logp, logp.detach(), adv, mask)
    # Policy gradient of -(1 / sum_i |o_i|) sum_i A_i sum_t logp_it: every token weighs the same.
    assert torch.allclose(grad, -adv[:, None] * mask / mask.sum(), atol=1e-7)
    assert loss.item() == pytest.approx(-(adv[:, None] * logp * mask).sum().item() / mask.sum().item(), rel=1e-6)
    assert metrics["clip_frac"] == 0.0 and metrics["approx_kl"] == 0.0


def test_every_token_keeps_its_gradient_where_ppo_s_clip_zeroes_it():
    logp, old_logp, adv, mask = random_case(seed=2)
    ratio = (logp - old_logp).exp()
    _, grpo_grad, grpo_metrics = loss_and_grad(grpo.policy_loss, logp, old_logp, adv, mask, clip_eps=0.2)
    _, grad, metrics = loss_and_grad(cispo.policy_loss, logp, old_logp, adv, mask, ratio_cap=1.2, clip_eps_low=0.2)
    zeroed = grpo_metrics["clipped"] & mask.bool()                     # PPO's clip cut these tokens' gradient
    assert zeroed.sum() >= 3 and (grpo_grad[zeroed] == 0).all()
    assert (grad[mask.bool()] != 0).all()                              # CISPO: none is cut
    # Each token's gradient is -sg[clip(r)] A / (tokens): the weight is detached, the capped ones count the cap.
    weight = ratio.clamp(0.8, 1.2)
    assert torch.allclose(grad, -weight * adv[:, None] * mask / mask.sum(), atol=1e-7)
    capped = ((ratio > 1.2) | (ratio < 0.8)) & mask.bool()
    assert torch.equal(metrics["clipped"] & mask.bool(), capped)
    assert metrics["clip_frac"] == pytest.approx(capped.sum().item() / mask.sum().item())
    assert metrics["clip_frac"] > grpo_metrics["clip_frac"] > 0        # capped on both sides of A, clipped on one


def test_the_weight_takes_no_gradient():
    # Were the weight not detached, d/dlogp of -r A logp would add -r A logp to each token's -r A: not what CISPO is.
    logp, old_logp, adv, mask = random_case(seed=3, spread=0.1)
    _, grad, _ = loss_and_grad(cispo.policy_loss, logp, old_logp, adv, mask)
    ratio = (logp - old_logp).exp()
    assert torch.allclose(grad, -ratio * adv[:, None] * mask / mask.sum(), atol=1e-7)
    assert not torch.allclose(grad, -ratio * (1 + logp) * adv[:, None] * mask / mask.sum(), atol=1e-4)


def test_padding_does_not_change_the_loss():
    logp, old_logp, adv, mask = hand_case()
    padded = torch.cat([logp.detach(), torch.full((2, 4), -7.0)], 1)
    padded_old = torch.cat([old_logp, torch.full((2, 4), -1.0)], 1)
    padded_mask = torch.cat([mask, torch.zeros(2, 4)], 1)
    a = cispo.policy_loss(logp.detach(), old_logp, adv, mask, ratio_cap=1.2)[0]
    b = cispo.policy_loss(padded, padded_old, adv, padded_mask, ratio_cap=1.2)[0]
    assert a.item() == pytest.approx(b.item(), abs=1e-7)


def test_policy_loss_defaults_are_the_scripts():
    defaults = inspect.signature(cispo.policy_loss).parameters
    args = cispo.Args()
    assert (defaults["ratio_cap"].default, defaults["clip_eps_low"].default, defaults["beta"].default) == \
           (args.ratio_cap, args.clip_eps_low, args.beta) == (5.0, None, 0.0)


# Equal to the peers, with the settings the script prints for them: verl's two-sided clamp and the cap alone.
SETTINGS = [[], ["--ratio-cap", "1.2", "--clip-eps-low", "0.2"], ["--ratio-cap", "1.5", "--beta", "0.04"]]


def script_args(flags):
    return common.parse_args(cispo.Args, cispo.__doc__, ["--minibatches", "1", *flags])


@pytest.mark.parametrize("flags", SETTINGS[:2])
def test_equals_verls_cispo_with_the_printed_settings(flags):
    verl_loss = verl_policy_loss("compute_policy_loss_cispo")
    args = script_args(flags)
    printed = dict(line.partition("=")[::2] for line in graduate.verl_overrides("cispo", args) if "=" in line)
    actor = "actor_rollout_ref.actor."
    assert printed[actor + "policy_loss.loss_mode"] == "cispo"
    config = VerlActorConfig(clip_ratio_low=float(printed[actor + "clip_ratio_low"]),
                             clip_ratio_high=float(printed[actor + "clip_ratio_high"]))
    logp, old_logp, adv, mask = random_case(seed=4, spread=1.0)        # some ratios above 5, some under 0.8
    ratio = (logp - old_logp).exp()[mask.bool()]
    assert (ratio > 5).any() and (ratio < 0.8).any()
    ours = loss_and_grad(cispo.policy_loss, logp, old_logp, adv, mask, ratio_cap=args.ratio_cap,
                         clip_eps_low=args.clip_eps_low)
    theirs = loss_and_grad(lambda x: verl_loss(old_log_prob=old_logp, log_prob=x, advantages=adv[:, None] * mask,
                                               response_mask=mask, config=config,
                                               loss_agg_mode=printed[actor + "loss_agg_mode"]), logp)
    assert ours[0].item() == pytest.approx(theirs[0].item(), rel=1e-6)
    assert torch.allclose(ours[1], theirs[1], atol=1e-7) and ours[1].abs().sum() > 0
    assert ours[2]["clip_frac"] == pytest.approx(theirs[2]["actor/pg_clipfrac"], abs=1e-6) and ours[2]["clip_frac"] > 0


@pytest.mark.parametrize("flags", [SETTINGS[0], SETTINGS[2]])
def test_equals_trls_cispo_with_the_printed_settings(flags):
    args = script_args(flags)
    kwargs = graduate.trl_config_kwargs("cispo", args)
    assert kwargs["loss_type"] == "cispo" and kwargs["epsilon_high"] == args.ratio_cap
    logp, old_logp, adv, mask = random_case(seed=5, spread=1.0)
    ref_logp = old_logp - 0.3 * torch.rand(old_logp.shape) if args.beta else None
    ours = loss_and_grad(cispo.policy_loss, logp, old_logp, adv, mask, ref_logp, args.ratio_cap, args.clip_eps_low,
                         args.beta)
    theirs = loss_and_grad(lambda x: trl_loss(kwargs, x, old_logp, adv, mask, ref_logp), logp)
    assert ours[0].item() == pytest.approx(theirs[0].item(), rel=1e-6)
    assert torch.allclose(ours[1], theirs[1], atol=1e-7) and ours[1].abs().sum() > 0
    # TRL counts a capped token only where A > 0; clip_frac here counts every capped token, as verl does.
    ratio = (logp - old_logp).exp()
    assert theirs[2]["cispo_clip_ratio"] == pytest.approx(
        ((ratio > args.ratio_cap) & (adv[:, None] > 0) & mask.bool()).sum().item() / mask.sum().item())
    if args.beta:
        assert ours[2]["kl_ref"] == pytest.approx(theirs[2]["kl"], rel=1e-5)


@pytest.mark.parametrize("extra", [[], ["--ratio-cap", "1.2", "--clip-eps-low", "0.2", "--beta", "0.04"]])
def test_cispo_end_to_end_on_the_toy(tmp_path, extra):
    cispo.main(TINIER + extra + ["--out", str(tmp_path)])
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval_accuracy" in rows[-1]
    for r in rows[1:]:
        for key in ("reward_mean", "clip_frac", "approx_kl", "entropy", "routing_drift", "grad_norm"):
            assert r[key] is not None and math.isfinite(r[key]), key
        assert ("kl_ref" in r) == bool(extra)
