"""--rollout-correction: the weights equal TRL 1.16's and verl 0.9.1's own code, and each script's loss with them equals
TRL's loss with its importance-sampling ratio (and verl's, for grpo.py) in value and gradient; the sampler's log-probs
stand in for a separate pass only where the sampler is the policy; --sampler bf16 and the gap each step logs."""
import importlib.util
import math
import textwrap
import typing
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import COUNTER_REWARD, TINIER, read_metrics, run
from peers import VerlActorConfig, functions_from, verl_policy_loss

import common
import cispo
import dapo
import grpo
import gspo
import ppo
import sapo
from extras import graduate, hf_models

MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def example():
    """Log-probs of 3 completions (4, 3 and 1 tokens): some ratios pi_old / pi_sampler above 3 or below 0.5, a whole
    sequence's above 3 (row 0) and one's below 0.5 (row 1)."""
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    old = -torch.rand(3, 4, generator=torch.Generator().manual_seed(0)) * 2 * mask
    gap = torch.tensor([[-1.3, 0.1, 0.05, 0.7], [0.3, 0.2, -0.3, 0.8], [-0.01, 0.0, 0.0, 0.0]])
    return old, (old + gap) * mask, mask


def test_the_weights_by_hand():
    old = torch.tensor([[-1.0, -2.0, 0.0]])
    sampler = torch.tensor([[-1.0 - math.log(4), -2.0 + math.log(2), 0.0]])   # ratios 4 and 1/2, then padding
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights, dropped = common.rollout_weights(old, sampler, mask, "token_truncate", 3.0)
    assert weights[0, :2].tolist() == pytest.approx([3.0, 0.5]) and not dropped.any()
    weights, dropped = common.rollout_weights(old, sampler, mask, "token_mask", 3.0)
    assert weights[0, :2].tolist() == pytest.approx([0.0, 0.5]) and dropped.tolist() == [[True, False, False]]
    weights, dropped = common.rollout_weights(old, sampler, mask, "sequence_mask", 3.0)   # 4 x 1/2 = 2: kept
    assert weights.shape == (1, 1) and weights.item() == pytest.approx(2.0) and not dropped.any()
    weights, dropped = common.rollout_weights(old, sampler, mask, "sequence_mask", 1.5)
    assert weights.item() == 0.0 and dropped.tolist() == [[True, True, False]]          # padding is never counted
    weights, _ = common.rollout_weights(old, sampler, mask, "sequence_truncate", 3.0, clip_min=2.5)
    assert weights.item() == pytest.approx(2.5)


def trl_ratio(mode, old_logp, sampler_logp, mask, clip_max, clip_min):
    """TRL's importance-sampling ratio, computed by the lines of GRPOTrainer._generate_and_score_completions that
    compute it (importing the trainer module is enough; the lines run on a stand-in for the trainer)."""
    trl = pytest.importorskip("trl", reason="trl is not installed (pip install --no-deps trl==1.16.0)")
    source = (Path(trl.__file__).parent / "trainer" / "grpo_trainer.py").read_text()
    start = source.index("            # Compute the importance sampling ratio when using vLLM")
    end = source.index("            # Compute the per-token log probabilities for the reference model", start)
    trainer = SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True,
                              vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_max=clip_max,
                              vllm_importance_sampling_clip_min=clip_min)
    space = {"self": trainer, "torch": torch, "math": math, "old_per_token_logps": old_logp,
             "sampling_per_token_logps": sampler_logp, "completion_mask": mask, "tool_mask": None}
    exec(textwrap.dedent(source[start:end]), space)
    return space["vllm_importance_sampling_ratio"]


@pytest.mark.parametrize("clip_min", [None, 0.5])
@pytest.mark.parametrize("mode", MODES)
def test_the_weights_are_trls(mode, clip_min):
    old, sampler, mask = example()
    expected = trl_ratio(mode, old, sampler, mask, 3.0, clip_min)
    weights, dropped = common.rollout_weights(old, sampler, mask, mode, 3.0, clip_min)
    assert weights.shape == expected.shape == ((3, 4) if mode.startswith("token") else (3, 1))
    counted = mask.bool() if mode.startswith("token") else torch.ones(3, 1, dtype=torch.bool)   # TRL's padding: 1
    assert torch.equal(weights[counted], expected[counted])
    assert dropped.any() == mode.endswith("mask") and torch.equal(dropped, (weights == 0).expand(3, 4) & mask.bool())


def verl_weights():
    """verl's compute_rollout_correction_weights (verl/trainer/ppo/rollout_corr_helper.py), taken from its source as
    tests/peers.py takes its losses (verl's package imports ray)."""
    spec = importlib.util.find_spec("verl")
    if spec is None:
        pytest.skip("verl is not installed (pip install --no-deps verl==0.9.1)")
    root = Path(spec.origin).parent
    functional = {"torch": torch}
    exec(functions_from(root / "utils" / "torch_functional.py", ["masked_sum", "masked_mean"]), functional)
    space = {"torch": torch, "math": math, "Optional": typing.Optional, "Any": typing.Any,
             "verl_F": SimpleNamespace(**functional), "SAFETY_BOUND": 20.0}
    exec(functions_from(root / "trainer" / "ppo" / "rollout_corr_helper.py",
                        ["_parse_rollout_is_threshold", "compute_rollout_correction_weights", "compute_is_metrics"]),
         space)
    return space["compute_rollout_correction_weights"]


@pytest.mark.parametrize("mode", MODES)
def test_the_weights_are_verls_with_the_printed_settings(mode):
    # verl masks ratios outside two bounds (a "low_high" threshold) and truncates at one: graduate prints which.
    low = 0.5 if mode.endswith("mask") else None
    args = common.parse_args(grpo.Args, "", ["--rollout-correction", mode, *(["--rollout-correction-min", "0.5"]
                                                                             if low else [])])
    printed = dict(line.partition("=")[::2] for line in graduate.verl_overrides("grpo", args) if "=" in line)
    key = "algorithm.rollout_correction."
    old, sampler, mask = example()
    expected, _ = verl_weights()(old - sampler, mask, rollout_is=printed[key + "rollout_is"],
                                 rollout_is_threshold=printed[key + "rollout_is_threshold"].strip("'\""))
    weights, _ = common.rollout_weights(old, sampler, mask, mode, 3.0, low)
    assert torch.allclose(weights * mask, expected, rtol=1e-6, atol=0)     # verl zeroes padding; the loss masks it
    assert (expected[mask.bool()] == 0).any() == mode.endswith("mask")


def trl_corrected_loss(config_kwargs, ratio, logp, old_logp, advantages, mask):
    """TRL's GRPOTrainer._compute_loss with its rollout correction on (vLLM's log-probs, importance_sampling_ratio
    given), on a stand-in for the trainer as tests/peers.py's trl_loss: the loss, whose gradient reaches logp."""
    for name in ("trl", "accelerate", "datasets", "pandas"):
        pytest.importorskip(name, reason=f"{name} is not installed: TRL's trainer needs it")
    from trl import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer
    args = GRPOConfig(**(dict(output_dir="unused", use_cpu=True, bf16=False, report_to="none") | config_kwargs))
    trainer = SimpleNamespace(
        args=args, loss_type=args.loss_type, beta=args.beta, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        importance_sampling_level=args.importance_sampling_level, top_entropy_quantile=args.top_entropy_quantile,
        off_policy_mask_threshold=args.off_policy_mask_threshold, use_vllm=True,
        vllm_importance_sampling_correction=args.vllm_importance_sampling_correction, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x),
        _metrics=defaultdict(lambda: defaultdict(list)),
        _get_per_token_logps_and_entropies=lambda *a, **kw: (logp, torch.zeros_like(logp), None))
    n = len(mask)
    inputs = {"prompt_ids": torch.zeros(n, 0, dtype=torch.long), "prompt_mask": torch.zeros(n, 0, dtype=torch.long),
              "completion_ids": torch.zeros(mask.shape, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": old_logp, "importance_sampling_ratio": ratio,
              "num_items_in_batch": mask.sum() * args.steps_per_generation}
    return GRPOTrainer._compute_loss(trainer, None, inputs)


def loss_and_grad(loss_fn, logp):
    logp = logp.clone().requires_grad_(True)
    loss = loss_fn(logp)
    loss = loss[0] if isinstance(loss, tuple) else loss
    loss.backward()
    return loss.detach(), logp.grad


# Each script that has a TRL loss, its call with the rollout correction's weights, and its flags.
SCRIPTS = {"grpo": (grpo, lambda lp, old, adv, mask, w: grpo.policy_loss(lp, old, adv, mask, correction=w), []),
           "gspo": (gspo, lambda lp, old, adv, mask, w: gspo.policy_loss(lp, old, adv, mask, 0.05, 0.05, w),
                    ["--clip-eps-low", "0.05", "--clip-eps-high", "0.05"]),
           "dapo": (dapo, lambda lp, old, adv, mask, w: dapo.policy_loss(lp, old, adv, mask, correction=w), []),
           "cispo": (cispo, lambda lp, old, adv, mask, w: cispo.policy_loss(lp, old, adv, mask, correction=w), []),
           "sapo": (sapo, lambda lp, old, adv, mask, w: sapo.policy_loss(lp, old, adv, mask, correction=w), [])}


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
@pytest.mark.parametrize("name", SCRIPTS)
def test_each_loss_with_the_correction_is_trls(name, mode):
    script, loss, flags = SCRIPTS[name]
    args = common.parse_args(script.Args, "", ["--minibatches", "1", "--rollout-correction", mode, *flags])
    kwargs = graduate.trl_config_kwargs(name, args)
    assert kwargs["vllm_importance_sampling_mode"] == mode and kwargs["vllm_importance_sampling_clip_max"] == 3.0
    old, sampler, mask = example()
    logp = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1)) * mask   # moved since
    adv = torch.tensor([1.2, -0.7, 0.4])
    ratio = trl_ratio(mode, old, sampler, mask, 3.0, None)
    weights, _ = common.rollout_weights(old, sampler, mask, mode, 3.0, None)
    theirs = loss_and_grad(lambda x: trl_corrected_loss(kwargs, ratio, x, old, adv, mask), logp)
    ours = loss_and_grad(lambda x: loss(x, old, adv, mask, weights), logp)
    plain = loss_and_grad(lambda x: loss(x, old, adv, mask, 1.0), logp)
    assert ours[0].item() == pytest.approx(theirs[0].item(), rel=1e-6)
    assert torch.allclose(ours[1], theirs[1], atol=1e-7) and not torch.allclose(ours[1], plain[1], atol=1e-4)


class VanillaConfig(VerlActorConfig):
    """What verl's vanilla (PPO-clip) loss reads of its ActorConfig: the clip ranges, and clip_ratio_c by .get."""

    def get(self, name, default=None):
        return getattr(self, name, default)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate"])
def test_grpos_loss_with_the_correction_is_verls(mode):
    verl_loss = verl_policy_loss("compute_policy_loss_vanilla")
    old, sampler, mask = example()
    logp = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(2)) * mask
    adv = torch.tensor([1.2, -0.7, 0.4])
    weights, _ = common.rollout_weights(old, sampler, mask, mode, 3.0)
    verl_weights_ = verl_weights()(old - sampler, mask, rollout_is=mode.split("_")[0], rollout_is_threshold=3.0)[0]
    ours = loss_and_grad(lambda x: grpo.policy_loss(x, old, adv, mask, correction=weights), logp)
    theirs = loss_and_grad(lambda x: verl_loss(old_log_prob=old, log_prob=x, advantages=adv[:, None] * mask,
                                               response_mask=mask, loss_agg_mode="seq-mean-token-mean",
                                               config=VanillaConfig(clip_ratio_c=10000.0),
                                               rollout_is_weights=verl_weights_), logp)
    assert ours[0].item() == pytest.approx(theirs[0].item(), rel=1e-6)
    assert torch.allclose(ours[1], theirs[1], atol=1e-7) and ours[1].abs().sum() > 0


def test_auto_is_trls_default_for_a_bf16_sampler_and_none_for_the_policy():
    for sampler, mode in (("policy", "none"), ("bf16", "sequence_mask")):
        args = common.parse_args(grpo.Args, "", ["--sampler", sampler])
        assert common.correction_mode(args) == mode
    args = common.parse_args(grpo.Args, "", ["--sampler", "bf16", "--rollout-correction", "none"])
    assert common.correction_mode(args) == "none"


@pytest.mark.parametrize("flags, message", [
    (["--sampler", "fp16"], "unknown --sampler 'fp16'; use policy or bf16"),
    (["--rollout-correction", "seq_mask"], "unknown --rollout-correction 'seq_mask'"),
    (["--rollout-correction-max", "0"], "--rollout-correction-min and -max must bound a range"),
    (["--rollout-correction-min", "3", "--rollout-correction-max", "2"], "must bound a range of positive ratios")])
def test_bad_settings_are_one_line(flags, message, capsys, tmp_path):
    code, err = run(grpo, TINIER + ["--out", str(tmp_path / "run"), *flags], capsys)
    assert code == 2 and err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------------
# Where the old log-probs come from, and the gap each step logs

def rows_scored(monkeypatch):
    """The rows of every forward pass common.logprobs makes without gradient (the separate pass)."""
    scored, logprobs = [], common.logprobs
    monkeypatch.setattr(common, "logprobs", lambda model, world, rollout, *a, **kw: (
        scored.append(len(rollout.mask)) if not torch.is_grad_enabled() else None) or logprobs(model, world, rollout,
                                                                                              *a, **kw))
    return scored


def test_the_sampler_is_the_policy_so_no_pass_runs_on_a_dense_model(hf_dense, jsonl, tmp_path, monkeypatch):
    scored = rows_scored(monkeypatch)
    firsts = []
    policy_loss = grpo.policy_loss
    monkeypatch.setattr(grpo, "policy_loss", lambda logp, old, *a: firsts.append(old.data_ptr() == logp.data_ptr())
                        or policy_loss(logp, old, *a))                  # old is this forward's own, detached
    code, _ = run(grpo, ["--model", str(hf_dense), "--data", str(jsonl), "--max-new-tokens", "6", "--eval-size", "4",
                         "--steps", "2", "--prompts-per-step", "2", "--group-size", "4", "--minibatches", "4",
                         "--dtype", "fp32", "--out", str(tmp_path / "run")])
    assert code == 0 and scored == []                                  # no separate pass: the sampler's own
    assert firsts == [True, False, False, False] * 2                   # the first minibatch: its own forward
    rows = read_metrics(tmp_path / "run")[1:]
    # Only the first minibatch's tokens are measured; the same weights in fp32 agree to rounding.
    assert all(0 <= r["sampler_logp_diff_mean"] <= r["sampler_logp_diff_max"] < 1e-4 for r in rows)
    assert all(r["correction_dropped_frac"] == 0 and r["time_old_logp_s"] < 0.01 for r in rows)


def test_moe_models_keep_the_pass_after_the_first_minibatch(monkeypatch, tmp_path):
    scored = rows_scored(monkeypatch)
    code, _ = run(grpo, TINIER + ["--minibatches", "2", "--out", str(tmp_path / "run")])   # the toy MoE: 8 rows a step
    assert code == 0 and scored == [4, 4]                              # the second minibatch's 4 rows, each step


def test_the_sampler_log_probs_are_the_learners(hf_dense, hf_moe):
    # What the pass would compute, up to rounding: the same weights and precision, the prompts shared, a KV cache.
    from test_logprobs import hf_model
    for folder in (hf_dense, hf_moe):
        model, world = hf_model(folder)
        common.training_mode(model, gradient_checkpointing=False)
        prompts = [torch.tensor([5, 9, 11]), torch.tensor([7, 8, 9, 10, 12, 13])]          # left padding
        torch.manual_seed(0)
        rollout = common.generate(model, world, prompts, 3, 0.7)
        assert rollout.sampler_logp.shape == rollout.mask.shape and (rollout.sampler_logp[rollout.mask == 0] == 0).all()
        learner = common.logprobs(model, world, rollout, 0.7)[0]
        assert (rollout.sampler_logp - learner).abs().max() < 1e-5 and learner[rollout.mask.bool()].lt(0).all()


def test_a_bf16_sampler_is_a_refreshed_copy_corrected_by_default(hf_dense, jsonl, tmp_path, monkeypatch):
    scored = rows_scored(monkeypatch)
    samplers = []
    make_sampler = common.make_sampler
    monkeypatch.setattr(common, "make_sampler", lambda policy, args: samplers.append((policy, make_sampler(
        policy, args))) or samplers[-1][1])
    out = tmp_path / "run"
    code, _ = run(grpo, ["--model", str(hf_dense), "--data", str(jsonl), "--max-new-tokens", "6", "--eval-size", "4",
                         "--steps", "2", "--prompts-per-step", "2", "--group-size", "4", "--minibatches", "2",
                         "--sampler", "bf16", "--lr", "1e-2", "--out", str(out)])
    assert code == 0 and scored == [4, 4]                   # the pass scores the second minibatch: pi_old != sampler
    policy, sampler = samplers[0]
    assert sampler is not policy and {p.dtype for p in sampler.parameters()} == {torch.bfloat16}
    for mine, theirs in zip(sampler.parameters(), policy.parameters()):     # refreshed after the last update
        assert torch.equal(mine, theirs.detach().to(torch.bfloat16))
    rows = read_metrics(out)[1:]
    assert all(r["sampler_logp_diff_max"] > 1e-4 for r in rows)         # bf16 against fp32: a gap to correct
    assert all(0 <= r["correction_dropped_frac"] <= 1 for r in rows)


def test_the_mismatch_is_measured_where_the_learner_is_known():
    args = common.parse_args(grpo.Args, "", ["--rollout-correction", "token_mask", "--rollout-correction-max", "1.5"])
    old, sampler, mask = example()
    rollout = SimpleNamespace(sampler_logp=sampler, mask=mask)
    correction = common.RolloutCorrection(args, rollout, sampler)          # no pass: the sampler's own stand in
    first = correction.weights(old[:1], torch.tensor([0]), first=True)
    assert torch.equal(correction.weights(sampler[1:], torch.tensor([1, 2]), first=False), torch.ones(2, 4))
    gap = (old[0] - sampler[0]).abs()[:3]
    metrics = correction.metrics()
    assert metrics["sampler_logp_diff_mean"] == pytest.approx(gap.mean().item())
    assert metrics["sampler_logp_diff_max"] == pytest.approx(gap.max().item())
    assert first[0, 0] == 0 and metrics["correction_dropped_frac"] == pytest.approx(1 / 8)   # 1 of the 8 tokens


def test_a_resumed_run_samples_from_the_resumed_weights(hf_dense, jsonl, tmp_path, monkeypatch):
    out = tmp_path / "run"
    (tmp_path / "counter.py").write_text(COUNTER_REWARD)          # rewards that differ: the first step moves weights
    flags = ["--model", str(hf_dense), "--data", str(jsonl), "--max-new-tokens", "4", "--eval-size", "4",
             "--prompts-per-step", "2", "--group-size", "2", "--minibatches", "1", "--sampler", "bf16", "--lr", "1e-2",
             "--reward", f"{tmp_path / 'counter.py'}:counter", "--out", str(out)]
    assert run(grpo, flags + ["--steps", "1"])[0] == 0
    resumed = torch.load(out / "checkpoint.pt", weights_only=True)["policy"]          # step 1's weights
    made, make_sampler = [], common.make_sampler
    monkeypatch.setattr(common, "make_sampler", lambda policy, args: made.append(make_sampler(policy, args))
                        or made[-1])
    first, generate = {}, common.generate                  # the weights of the first rollout after the resume

    def generating(model, *a, **kw):
        if model in made and not first:
            first["weights"] = {k: v.clone() for k, v in model.state_dict().items()}
        return generate(model, *a, **kw)
    monkeypatch.setattr(common, "generate", generating)
    assert run(grpo, ["--resume", str(out), "--steps", "2"])[0] == 0
    base = hf_models.load_hf(str(hf_dense), torch.device("cpu"))[0].state_dict()
    assert len(made) == 1 and "weights" in first
    changed = [k for k in resumed if not torch.equal(resumed[k], base[k])]
    assert changed and all(torch.equal(first["weights"][k], resumed[k].to(torch.bfloat16)) for k in resumed)
