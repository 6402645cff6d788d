"""SAPO's loss against hand-computed numbers, its defining properties (a smooth gate, f'(1) = 1, asymmetric in the
advantage's sign), and verl's and TRL's SAPO losses with the settings --print-verl and --print-trl give; sapo.py
end to end on the toy."""
import inspect
import math

import pytest
import torch
from conftest import TINIER, read_metrics
from peers import trl_loss, verl_policy_loss, VerlActorConfig

import common
import grpo
import sapo
from extras import graduate


def f(r, tau):
    """The gate by hand: sigmoid(tau (r - 1)) * 4 / tau."""
    return 4 / tau / (1 + math.exp(-tau * (r - 1)))


def gate_weight(r, tau):
    """f'(r) by hand: 4 s (1 - s), s = sigmoid(tau (r - 1))."""
    s = 1 / (1 + math.exp(-tau * (r - 1)))
    return 4 * s * (1 - s)


def random_case(seed=0, N=6, T=7, spread=0.5):
    """Ratios exp(N(0, spread)), ragged lengths (none empty), junk on the padding, advantages of both signs."""
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
    # ratios row 0: 1.0, 1.5, 3.0 (A = +1: tau 1); row 1: 1.1, 0.7, padding (A = -1: tau 1.05)
    ratios = [[1.0, 1.5, 3.0], [1.1, 0.7]]
    old_logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.3, -2.0]])
    logp = (old_logp + torch.tensor([r + [1.0] * (3 - len(r)) for r in ratios]).log()).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, metrics = sapo.policy_loss(logp, old_logp, torch.tensor([1.0, -1.0]), mask)
    # Mean over each sequence's tokens, then over the 2 sequences, of -f(r; tau) A.
    row0 = sum(f(r, 1.0) for r in ratios[0]) / 3
    row1 = -sum(f(r, 1.05) for r in ratios[1]) / 2
    assert loss.item() == pytest.approx(-(row0 + row1) / 2, abs=1e-6)
    loss.backward()
    # d loss / d logp_it = -(1/G)(1/|o_i|) A_i f'(r_it) r_it: PPO's gradient weighed by the gate, 0 on the padding.
    expected = [[-gate_weight(r, 1.0) * r / 6 for r in ratios[0]], [gate_weight(r, 1.05) * r / 4 for r in ratios[1]]]
    assert torch.allclose(logp.grad, torch.tensor([expected[0], expected[1] + [0.0]]), atol=1e-6)
    # Damped below half: only r = 3 (f'(3) = 0.42 at tau 1); 1.5, 1.1 and 0.7 keep over 0.78.
    assert gate_weight(3.0, 1.0) < 0.5 < min(gate_weight(r, 1.05) for r in ratios[1] + [1.5])
    assert metrics["clip_frac"] == pytest.approx(1 / 5)
    assert torch.equal(metrics["clipped"] & mask.bool(), torch.tensor([[False, False, True], [False, False, False]]))
    every = [gate_weight(r, 1.0) for r in ratios[0]] + [gate_weight(r, 1.05) for r in ratios[1]]
    assert metrics["gate_weight_mean"] == pytest.approx(sum(every) / 5, rel=1e-6)


def test_on_policy_the_gate_is_one_and_the_gradient_is_the_plain_policy_gradient():
    logp, _, adv, mask = random_case(seed=1)
    loss, grad, metrics = loss_and_grad(sapo.policy_loss, logp, logp.detach(), adv, mask)
    # f'(1) = 1 for either temperature: GRPO's length-normalised policy gradient.
    assert torch.allclose(grad, -(adv[:, None] * mask / mask.sum(1, keepdim=True)) / len(mask), atol=1e-7)
    # The value is not 0 as GRPO's: f(1) = 2 / tau, so each row contributes -2 A_i / tau_i.
    tau = torch.where(adv > 0, 1.0, 1.05)
    assert loss.item() == pytest.approx((-2 * adv / tau).mean().item(), rel=1e-6)
    assert metrics["clip_frac"] == 0.0 and metrics["gate_weight_mean"] == pytest.approx(1.0)


def test_the_gate_is_smooth_and_closes_sooner_where_the_advantage_is_negative():
    # One token per row, ratios from 0.05 to 6: the gradient's weight relative to PPO's r A, d loss/d logp / (-r A / N).
    ratios = torch.linspace(0.05, 6, 600)
    ones = torch.ones(len(ratios), 1)

    def weights(fn, sign, **kw):
        adv = torch.full((len(ratios),), sign)
        _, grad, _ = loss_and_grad(fn, ratios.log()[:, None], torch.zeros(len(ratios), 1), adv, ones, **kw)
        return grad[:, 0] / (-ratios * adv / len(ratios))

    pos, neg = weights(sapo.policy_loss, 1.0), weights(sapo.policy_loss, -1.0)
    expected = [gate_weight(r, 1.0) for r in ratios.tolist()]
    assert torch.allclose(pos, torch.tensor(expected), atol=1e-5)
    at_one = (ratios - 1).abs().argmin()
    assert pos.max() <= 1 + 1e-6 and pos[at_one] > 0.999 and neg[at_one] > 0.999   # f'(1) = 1
    assert (pos > 0).all() and (neg > 0).all()                         # damped, never cut
    # Falling on both sides of 1, and sooner for A < 0 (tau 1.05) than for A > 0 (tau 1.0).
    assert (pos[:at_one].diff() > 0).all() and (pos[at_one + 1:].diff() < 0).all()
    away = (ratios - 1).abs() > 0.05
    assert (neg[away] < pos[away]).all()
    # Smooth: neighbours 0.01 apart differ by little; PPO's clip jumps from r to 0 at 1 + eps.
    assert pos.diff().abs().max() < 0.01 and neg.diff().abs().max() < 0.01
    assert weights(grpo.policy_loss, 1.0).diff().abs().max() > 0.9
    # A larger temperature closes it sooner: the whole point of tau_neg > tau_pos.
    steep = weights(sapo.policy_loss, -1.0, tau_neg=3.0)
    assert (steep[away] < neg[away]).all()


def test_clip_frac_counts_the_tokens_the_gate_damps_below_half():
    # At r = 2.72: A < 0 (tau 1.05) f' = 0.48, damped below half; A > 0 (tau 1.0) f' = 0.52, not.
    assert gate_weight(2.72, 1.05) < 0.5 < gate_weight(2.72, 1.0)
    logp = torch.full((2, 1), math.log(2.72))
    _, metrics = sapo.policy_loss(logp, torch.zeros(2, 1), torch.tensor([1.0, -1.0]), torch.ones(2, 1))
    assert metrics["clipped"][:, 0].tolist() == [False, True] and metrics["clip_frac"] == 0.5


def test_policy_loss_defaults_are_the_scripts():
    defaults = inspect.signature(sapo.policy_loss).parameters
    args = sapo.Args()
    assert (defaults["tau_pos"].default, defaults["tau_neg"].default, defaults["beta"].default) == \
           (args.tau_pos, args.tau_neg, args.beta) == (1.0, 1.05, 0.0)


SETTINGS = [[], ["--tau-pos", "2.0", "--tau-neg", "3.0", "--beta", "0.04"]]


def script_args(flags):
    return common.parse_args(sapo.Args, sapo.__doc__, ["--minibatches", "1", *flags])


@pytest.mark.parametrize("flags", SETTINGS)
def test_equals_verls_sapo_with_the_printed_settings(flags):
    verl_loss = verl_policy_loss("compute_policy_loss_sapo")
    args = script_args(flags)
    printed = dict(line.partition("=")[::2] for line in graduate.verl_overrides("sapo", args) if "=" in line)
    actor = "actor_rollout_ref.actor."
    assert printed[actor + "policy_loss.loss_mode"] == "sapo"
    assert printed[actor + "loss_agg_mode"] == "seq-mean-token-mean"
    config = VerlActorConfig(tau_pos=float(printed[actor + "tau_pos"]), tau_neg=float(printed[actor + "tau_neg"]))
    logp, old_logp, adv, mask = random_case(seed=4, spread=1.0)
    ours = loss_and_grad(sapo.policy_loss, logp, old_logp, adv, mask, tau_pos=args.tau_pos, tau_neg=args.tau_neg)
    theirs = loss_and_grad(lambda x: verl_loss(old_log_prob=old_logp, log_prob=x, advantages=adv[:, None] * mask,
                                               response_mask=mask, config=config,
                                               loss_agg_mode=printed[actor + "loss_agg_mode"]), logp)
    assert ours[0].item() == pytest.approx(theirs[0].item(), rel=1e-6)
    assert torch.allclose(ours[1], theirs[1], atol=1e-7) and ours[1].abs().sum() > 0


@pytest.mark.parametrize("flags", SETTINGS)
def test_equals_trls_sapo_with_the_printed_settings(flags):
    args = script_args(flags)
    kwargs = graduate.trl_config_kwargs("sapo", args)
    assert kwargs["loss_type"] == "sapo"
    assert (kwargs["sapo_temperature_pos"], kwargs["sapo_temperature_neg"]) == (args.tau_pos, args.tau_neg)
    logp, old_logp, adv, mask = random_case(seed=5, spread=1.0)
    ref_logp = old_logp - 0.3 * torch.rand(old_logp.shape) if args.beta else None
    ours = loss_and_grad(sapo.policy_loss, logp, old_logp, adv, mask, ref_logp, args.tau_pos, args.tau_neg, args.beta)
    theirs = loss_and_grad(lambda x: trl_loss(kwargs, x, old_logp, adv, mask, ref_logp), logp)
    assert ours[0].item() == pytest.approx(theirs[0].item(), rel=1e-6)
    assert torch.allclose(ours[1], theirs[1], atol=1e-7) and ours[1].abs().sum() > 0
    if args.beta:
        assert ours[2]["kl_ref"] == pytest.approx(theirs[2]["kl"], rel=1e-5)


@pytest.mark.parametrize("extra", [[], ["--tau-neg", "3", "--beta", "0.04", "--routing-replay"]])
def test_sapo_end_to_end_on_the_toy(tmp_path, extra):
    sapo.main(TINIER + extra + ["--out", str(tmp_path)])
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval_accuracy" in rows[-1]
    for r in rows[1:]:
        for key in ("reward_mean", "clip_frac", "gate_weight_mean", "approx_kl", "entropy", "routing_drift"):
            assert r[key] is not None and math.isfinite(r[key]), key
        assert 0 < r["gate_weight_mean"] <= 1 and ("kl_ref" in r) == bool(extra)
