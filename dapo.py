"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al. 2025, arXiv 2503.14476).

GRPO without the KL term, plus four fixes, each with its own switch so you can take them out one at a
time; with all four off this is GRPO without KL.

    loss = -(1 / sum_i |o_i|) sum_i sum_t min(r_it A_i, clip(r_it, 1-eps_low, 1+eps_high) A_i)     (eq. 8)

1. Clip-Higher (--no-clip-higher): eps_low 0.2, eps_high 0.28. Symmetric clipping caps how fast an
   unlikely token can gain probability, so entropy collapses; a higher upper bound lets it rise.
2. Dynamic Sampling (--no-dynamic-sampling): a group whose rewards are all equal has zero advantage and
   gives no gradient. Drop such groups and generate more until the step holds --prompts-per-step
   informative groups (at most --max-generation-rounds rounds; if the cap is hit, train on what was
   kept and log it; if nothing was kept, stop and say so).
3. Token-level loss (--no-token-level-loss): divide by the minibatch's total number of completion tokens
   (above), not per sequence, so every token weighs the same and long completions are not down-weighted.
4. Overlong reward shaping (--no-overlong-shaping): with L_max = --max-new-tokens and L_cache =
   --overlong-buffer, add 0 if |o| <= L_max - L_cache, ((L_max - L_cache) - |o|) / L_cache inside the
   buffer, -1 beyond L_max (eq. 13). --overlong-filtering masks truncated completions out of the loss
   (on top of shaping, or instead of it with --no-overlong-shaping). With --no-token-level-loss a masked
   completion still counts in the mean over sequences (GRPO's 1/G, G all the completions), as in TRL's
   loss_type="grpo" and in verl 0.9.1's seq-mean-token-mean, which divides by the minibatch's row count.

Run it
    python dapo.py                          # toy MoE learns two-digit addition on one CPU thread
    python dapo.py --task progression       # answers of 3-24 tokens: where the length techniques act
    python dapo.py --task progression --no-overlong-shaping     # ...and one taken out
    python dapo.py --help                   # every flag
    python dapo.py --model Qwen/Qwen3-0.6B --data train.jsonl --max-new-tokens 512 \\
        --prompts-per-step 8 --group-size 8 --lr 1e-6 --gradient-checkpointing   # its memory: docs/models.md

Each step: sample --prompts-per-step x --group-size completions (more rounds under Dynamic Sampling),
score them, then take one optimizer step per minibatch (the old log-probs as in grpo.py).
Metrics go to runs/dapo-<task>-<date>-<time>/metrics.jsonl.

What to expect: `python dapo.py` (seed 0, one thread of an AMD EPYC) takes greedy accuracy on the 500
held-out problems from 0.418 to 0.778 in 2400 steps. Seed and CPU move the final; the figures are in
benchmarks/results/spread.md.

What differs from grpo.py
- policy_loss: asymmetric clipping, the token-level normaliser; clip fraction split into low and high.
- overlong_penalty and filter_groups, sample_groups and dynamic_sampling before the update.
- No KL term and no reference model (the paper drops it: the policy is meant to move far from its
  start on long reasoning).
"""
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

import common
from common import arg, check


@dataclass
class Args:
    # run
    task: str = arg("add", "toy task (ignored with --model): " + ", ".join(common.TASKS))
    chain_length: int = arg(common.CHAIN_LENGTH, "--task chain: running totals in each completion, 4 tokens each "
                                                 "(default 10: 44 tokens); --task chains: every length up to it")
    model: Optional[str] = arg(None, "Hugging Face causal LM: a local folder, a Hub id or a FILE.gguf (needs gguf) "
                                     "(default: the toy MoE)")
    data: Optional[str] = arg(None, 'JSONL file of {"prompt": ..., "answer": ...} rows, used with --model; reward 1 '
                              'when the final answer (last \\boxed{}, else "#### x" line, else last number) equals '
                              '"answer" and the completion ended (a truncated one scores 0)')
    reward: Optional[str] = arg(None, "FILE.py:NAME, your reward function NAME(completion, answer, finished) -> "
                                      "float, instead of the default (toy: exact answer then EOS)")
    steps: int = arg(2400, "rollout batches; each gives --minibatches optimizer steps")
    seed: int = arg(0, "seed of every random draw (prompts, sampling)")
    device: str = arg("auto", "auto (cuda, then mps, then cpu), cpu, cuda or mps")
    threads: Optional[int] = arg(None, "CPU threads (default: OMP_NUM_THREADS if set, else 1 on the toy, whose "
                                      "operations are too small to share, and every core with --model)")
    dtype: str = arg("auto", "bf16 (autocast, fp32 weights) or fp32 forward passes (default auto: bf16 on CUDA, "
                             "and with --model on a CPU with native bf16: AVX512-BF16 or AMX)")
    out: Optional[str] = arg(None, "folder for metrics.jsonl and checkpoint.pt (default: a new "
                                    "runs/<script>-<task>-<date>-<time>)")
    resume: Optional[str] = arg(None, "continue the run whose checkpoint.pt is in this folder (same settings)")
    save_every: int = arg(100, "checkpoint every N steps (0: only at the end); also on Ctrl-C or SIGTERM")
    eval_every: int = arg(50, "greedy evaluation on the held-out set every N steps (0: only at start and end)")
    eval_size: int = arg(500, "held-out prompts for evaluation")
    # toy model
    d_model: int = arg(64, "toy model width")
    n_layers: int = arg(2, "toy model layers")
    n_experts: int = arg(8, "toy model experts per layer (1: dense)")
    top_k: int = arg(2, "toy model experts each token is routed to")
    expert_hidden: int = arg(128, "toy model hidden size of each expert")
    # rollouts
    prompts_per_step: int = arg(16, "prompts per rollout batch")
    group_size: int = arg(8, "completions per prompt (G)")
    max_new_tokens: Optional[int] = arg(None, "completion length limit (default: 8 on the toy, 256 with --data)")
    temperature: float = arg(1.0, "sampling temperature; log-probs use the same one")
    static_cache: bool = arg(False, "dense --model: a static KV cache, the decode step a CUDA graph; off until timed")
    sampler: str = arg("policy", "policy: sample with the weights being trained, in the run's precision (a dense "
                                 "model's old log-probs are then the sampler's own); bf16: with a bf16 copy of them, "
                                 "refreshed after each update (the old log-probs take a separate pass, and "
                                 "--rollout-correction weighs the difference)")
    rollout_correction: str = arg("auto", "importance weights for a sampler that differs from the learner, TRL's "
                                          "modes: token_truncate, token_mask, sequence_truncate, sequence_mask, or "
                                          "none (default auto: sequence_mask, TRL's, with --sampler bf16, else none)")
    rollout_correction_max: float = arg(3.0, "--rollout-correction: the largest ratio kept (default 3.0, TRL's; "
                                             "verl's is 2.0)")
    rollout_correction_min: Optional[float] = arg(None, "--rollout-correction: the smallest ratio kept (default none)")
    # optimisation
    lr: Optional[float] = arg(None, "AdamW learning rate (default: 1e-4 on the toy, 1e-6 with --model)")
    minibatches: int = arg(4, "optimizer steps per rollout batch (1: purely on-policy)")
    max_grad_norm: float = arg(1.0, "gradient clipping")
    gradient_checkpointing: bool = arg(False, "recompute activations in the backward: less memory, slower updates")
    # LoRA (--model only)
    lora_r: int = arg(0, "LoRA rank: train low-rank adapters on every linear layer but the vocabulary head, the base "
                         "frozen (0: off, every weight trains); needs peft. Give a larger --lr (~10x)")
    lora_alpha: float = arg(32.0, "LoRA scale: the adapters add (alpha / r) B A to each weight")
    merge_lora: bool = arg(False, "LoRA: besides DIR/adapter, export the base with the adapters merged in to DIR/model")
    # graduating: the same run in verl or TRL (print, then exit without training)
    print_verl: bool = arg(False, "print the verl 0.9.1 command (verl.trainer.main_ppo) for these settings")
    print_trl: bool = arg(False, "print the TRL 1.16 GRPOConfig and GRPOTrainer code for these settings")
    export_verl_data: Optional[str] = arg(None, "write --data's training and held-out rows as verl's parquet files "
                                                "(train.parquet, test.parquet) to this folder; needs pyarrow")
    # DAPO
    clip_eps_low: float = arg(0.2, "clip range of the token ratio below 1")
    clip_eps_high: float = arg(0.28, "clip range above 1 (ignored with --no-clip-higher: then = --clip-eps-low)")
    clip_higher: bool = arg(True, "Clip-Higher: turn off to clip symmetrically at --clip-eps-low")
    dynamic_sampling: bool = arg(True, "Dynamic Sampling: turn off to keep groups whose rewards are all equal")
    max_generation_rounds: int = arg(5, "Dynamic Sampling's cap on generation rounds per step")
    token_level_loss: bool = arg(True, "token-level loss: turn off for GRPO's per-sequence mean")
    overlong_shaping: bool = arg(True, "overlong reward shaping: turn off for no length penalty")
    overlong_buffer: Optional[int] = arg(None, "L_cache, the length buffer before --max-new-tokens "
                                               "(default: 1/4 of it)")
    overlong_filtering: bool = arg(False, "mask truncated completions out of the loss")
    routing_replay: bool = arg(False, "MoE models: the update uses the experts chosen when the old log-probs "
                                      "were computed (Routing Replay)")


def compute_advantages(rewards, group_size):
    """Group-relative advantage: A_i = (R_i - mean_group R) / (std_group R + 1e-6), std unbiased.
    rewards [N], grouped by prompt (rows g*G .. g*G+G-1) -> [N]. An all-equal group gets 0."""
    grouped = rewards.view(-1, group_size)
    advantages = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
    return advantages.flatten()


def policy_loss(logp, old_logp, advantages, mask, clip_eps_low=0.2, clip_eps_high=0.28, token_level=True,
                correction=1.0):
    """DAPO loss (DAPO paper eq. 8): per-token ratio clipped asymmetrically (Clip-Higher); summed over
    all tokens and divided by their total count (token-level loss), or with token_level=False GRPO's
    per-sequence mean. logp, old_logp, mask [N, T]; advantages [N]; correction: the rollout correction's weight
    of each token's clipped term ([N, T] or [N, 1]), as TRL and verl."""
    mean = lambda x: ((x * mask).sum() / mask.sum().clamp(min=1)).item()   # over the completions' tokens
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)                                         # r_it [N, T]
    adv = advantages[:, None]                                            # A_i, the same for every token
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * adv)
    per_token = -surrogate * correction
    if token_level:
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)        # 1 / sum_i |o_i|
    else:
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()   # seq-mean-token-mean
    with torch.no_grad():
        clipped_low = (adv < 0) & (ratio < 1 - clip_eps_low)
        clipped_high = (adv > 0) & (ratio > 1 + clip_eps_high)
        clipped = clipped_low | clipped_high                                 # [N, T]: gradient cut
        metrics = {"clip_frac_low": mean(clipped_low.float()), "clip_frac_high": mean(clipped_high.float())}
        metrics |= {"clip_frac": mean(clipped.float()), "clipped": clipped,
                    "approx_kl": mean(ratio - 1 - log_ratio)}                 # k3 KL(old || new)
    return loss, metrics


def overlong_penalty(lengths, max_len, cache_len):
    """Soft overlong punishment (DAPO paper eq. 13), added to the reward. lengths [N] count the EOS."""
    expected = max_len - cache_len
    inside = (expected - lengths) / cache_len                            # from 0 at L_max - L_cache to -1 at L_max
    return torch.where(lengths <= expected, 0.0, torch.where(lengths <= max_len, inside, -1.0))


def filter_groups(rewards, group_size):
    """Dynamic Sampling's filter: keep a group only if its rewards are not all equal. rewards [N] grouped
    by prompt -> bool [N // group_size], True = keep. The paper (eq. 11) filters on accuracy; this filters
    on the rewards the advantages come from (with the overlong penalty), the ones whose equality really
    means zero advantage: an all-wrong group whose completions differ in length is kept."""
    grouped = rewards.view(-1, group_size)
    return grouped.max(1).values != grouped.min(1).values


def sample_groups(sampler, world, args):
    """One generation round: G completions for each of --prompts-per-step prompts, their task rewards
    and the rewards the advantages are computed from (with the overlong penalty when shaping is on)."""
    prompts, answers = world.sample(args.prompts_per_step)
    rollout = common.generate(sampler, world, prompts, args.group_size, args.temperature)
    task_rewards = common.rewards_of(world, rollout, answers, args.group_size)           # [N]
    rewards = task_rewards
    if args.overlong_shaping:
        buffer = args.overlong_buffer or max(1, world.max_new_tokens // 4)
        rewards = task_rewards + overlong_penalty(rollout.mask.sum(1), world.max_new_tokens, buffer)
    return rollout, rewards, task_rewards


def cat_rollouts(rollouts, pad_id):
    """One rollout from several generation rounds: prompts left-padded to the longest, completions
    right-padded to the longest."""
    P = max(r.tokens.shape[1] - r.mask.shape[1] for r in rollouts)
    T = max(r.mask.shape[1] for r in rollouts)
    padded = []
    for r in rollouts:
        p, t = r.tokens.shape[1] - r.mask.shape[1], r.mask.shape[1]
        padded.append([F.pad(r.tokens, (P - p, T - t), value=pad_id), F.pad(r.attention_mask, (P - p, T - t)),
                       F.pad(r.mask, (0, T - t)), r.finished, F.pad(r.entropy, (0, T - t)),
                       None if r.sampler_logp is None else F.pad(r.sampler_logp, (0, T - t))])   # --static-cache: None
    return common.Rollout(*(None if field[0] is None else torch.cat(field) for field in zip(*padded)))


def dynamic_sampling(sample, prompts_per_step, group_size, max_rounds, pad_id):
    """Call `sample()` (one generation round) until `prompts_per_step` groups with unequal rewards are
    kept or `max_rounds` rounds are spent. Returns the kept rollout, its rewards and task rewards, and
    what happened. Stops the run if no group at all was informative."""
    kept, seen, n_kept = [], [], 0
    for rounds in range(1, max_rounds + 1):
        rollout, rewards, task_rewards = sample()
        seen.append((task_rewards, rollout.finished))
        keep = filter_groups(rewards, group_size).repeat_interleave(group_size)         # whole groups [N]
        kept.append((rollout[keep], rewards[keep], task_rewards[keep]))
        n_kept += int(keep.sum()) // group_size
        if n_kept >= prompts_per_step:
            break
    n_seen = rounds * len(rewards) // group_size
    if n_kept == 0:
        raise common.RunStopped(f"Dynamic Sampling: all {n_seen} groups of {rounds} generation rounds had equal "
                                f"rewards, so nothing is left to learn from; --no-dynamic-sampling trains on them")
    if n_kept < prompts_per_step:
        tqdm.write(f"Dynamic Sampling: {n_kept} of {prompts_per_step} informative groups after {rounds} rounds "
                   f"(--max-generation-rounds); training on those")
    n = min(n_kept, prompts_per_step) * group_size                        # the surplus of the last round goes
    rollout = cat_rollouts([r for r, _, _ in kept], pad_id)[:n]
    rewards, task_rewards = torch.cat([r for _, r, _ in kept])[:n], torch.cat([t for _, _, t in kept])[:n]
    seen_rewards, seen_finished = torch.cat([r for r, _ in seen]), torch.cat([f for _, f in seen])
    return rollout, rewards, task_rewards, {
        "generation_rounds": rounds, "groups_dropped_frac": 1 - n_kept / n_seen,
        "groups_missing": max(0, prompts_per_step - n_kept),           # > 0 when the cap was hit
        # The policy's own rates, over every completion generated (the kept batch is a biased subset):
        "sampled_accuracy": (seen_rewards == 1).float().mean().item(),
        "sampled_truncated_frac": 1 - seen_finished.float().mean().item()}


def train(args):
    # ------------------------------------------------------------ setup (plumbing)
    common.check_common_args(args)
    check(args.clip_eps_low > 0 and args.clip_eps_high > 0,
          f"--clip-eps-low and --clip-eps-high must be positive, got {args.clip_eps_low} and {args.clip_eps_high}")
    check(args.max_generation_rounds > 0, f"--max-generation-rounds must be positive, got {args.max_generation_rounds}")
    clip_eps_high = args.clip_eps_high if args.clip_higher else args.clip_eps_low
    device = common.pick_device(args.device)
    policy, world = common.make_policy(args, device)
    if args.routing_replay:
        common.check_replay(policy)                                    # or stop: never train without it
    check(args.overlong_buffer is None or 0 < args.overlong_buffer < world.max_new_tokens,
          f"--overlong-buffer must be between 1 and --max-new-tokens - 1 ({world.max_new_tokens - 1}), "
          f"got {args.overlong_buffer}")
    common.seed_everything(args.seed)                                   # after the warm start: cached or not, same run
    optimizer = torch.optim.AdamW(common.trainable(policy), lr=args.lr, weight_decay=0.0, fused=True)  # one kernel
    run = common.Run(Path(__file__).stem, args, world, {"policy": policy, "optimizer": optimizer})
    sampler = common.make_sampler(policy, args)   # the policy itself, or a bf16 copy of it (after a resume)

    for step in run.steps():
        # ------------------------------------------------------------ rollout
        t0 = time.perf_counter()
        if args.dynamic_sampling:
            rollout, rewards, task_rewards, sampling = dynamic_sampling(
                lambda: sample_groups(sampler, world, args), args.prompts_per_step, args.group_size,
                args.max_generation_rounds, world.pad_id)
        else:
            (rollout, rewards, task_rewards), sampling = sample_groups(sampler, world, args), {}
        advantages = compute_advantages(rewards, args.group_size)                         # [N]
        t1 = time.perf_counter()
        old_logp, old_routing = common.old_logprobs(policy, sampler, world, rollout, args.temperature,
                                                    args.minibatches)              # a pass only where needed
        t2 = time.perf_counter()

        # ------------------------------------------------------------ update
        stats, correction = [], common.RolloutCorrection(args, rollout, old_logp)
        for i, idx in enumerate(common.minibatches(len(rewards), args.minibatches)):
            first = i == 0                     # the policy has not moved since it sampled these rows
            rollout_experts = None if old_routing is None or first else old_routing[:, idx]   # the old pass's choice
            logp, _, routing, aux_loss = common.logprobs(policy, world, rollout[idx], args.temperature,
                                                         rollout_experts if args.routing_replay else None,
                                                         entropy=False)
            # The old policy's log-probs of these rows: in the first minibatch this forward pass itself, detached
            # (ratio exactly 1); later the sampler's own where it is the policy, else the separate pass.
            old = logp.detach() if first else old_logp[idx]
            old_experts = routing if first else rollout_experts          # what routing drift is measured against
            mask = rollout.mask[idx]
            if args.overlong_filtering:                                         # truncated: out of the loss
                mask = mask * rollout.finished[idx, None]
            loss, metrics = policy_loss(logp, old, advantages[idx], mask, args.clip_eps_low,
                                        clip_eps_high, args.token_level_loss, correction.weights(old, idx, first))
            metrics |= common.by_quarter("clip_frac", metrics.pop("clipped").float(), mask)
            metrics |= common.optimizer_step(policy, optimizer, loss, args.max_grad_norm)
            stats.append(metrics | common.ratio_metrics(logp, old, rollout.mask[idx], routing, old_experts, aux_loss))
        common.refresh_sampler(sampler, policy)                         # a bf16 copy takes the new weights
        t4 = time.perf_counter()

        # ------------------------------------------------------------ log
        record = {"step": step, **common.rollout_metrics(task_rewards, rollout), **common.mean_metrics(stats),
                  **correction.metrics(),
                  **sampling, "shaped_reward_mean": rewards.mean().item(),
                  "overlong_punished_frac": (rewards < task_rewards).float().mean().item(),
                  "step_time_s": t4 - t0, "time_generate_s": t1 - t0, "time_old_logp_s": t2 - t1,
                  "time_update_s": t4 - t2}
        run.log(record)

    run.finish()


def main(argv=None):
    common.run_main(train, common.parse_args(Args, __doc__, argv))


if __name__ == "__main__":
    main()
