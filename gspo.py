"""GSPO: Group Sequence Policy Optimization (Zheng et al. 2025, Qwen team, arXiv 2507.18071).

GRPO with the importance ratio and the clipping moved from tokens to whole sequences. The advantage
is GRPO's group-normalised reward; the ratio is the length-normalised likelihood ratio of the whole
completion (the geometric mean of its token ratios), clipped as one number.

    A_i  = (R_i - mean(R_1..R_G)) / (std(R_1..R_G) + 1e-6)
    s_i  = exp( (1/|o_i|) sum_t log( pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t) ) )
    loss = -(1/G) sum_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)     eps_low 3e-4, eps_high 4e-4
    GSPO-token (--token-level), for per-token advantages A_it:
    s_it = sg[s_i] * pi_theta(o_it) / sg[pi_theta(o_it)]     (value s_i; gradient through token t only)
    loss = -(1/G) sum_i (1/|o_i|) sum_t min(s_it A_it, clip(s_it, 1-eps_low, 1+eps_high) A_it)

Why, as the paper argues: a token ratio is one noisy sample of how the policy changed. On Mixture-of-
Experts models it is noisier still, because an update can change which experts a token is routed to;
GRPO then needs Routing Replay. s_i averages over the whole completion, so GSPO needs no replay.
The clip range is tiny because s_i is a per-token geometric mean, so it moves little.

Run it
    python gspo.py                     # toy MoE learns two-digit addition on one CPU thread
    python gspo.py --token-level       # GSPO-token (the same gradient here: advantages are per sequence)
    python gspo.py --help              # every flag
    python gspo.py --model Qwen/Qwen3-0.6B --data train.jsonl --max-new-tokens 512 \\
        --prompts-per-step 8 --group-size 8 --lr 1e-6 --gradient-checkpointing   # its memory: docs/models.md

Each step: sample --prompts-per-step x --group-size completions with the current policy, keeping each
token's log-prob, and score them; then split the batch into --minibatches (4, as in the paper) and take
one optimizer step on each (the old log-probs as in grpo.py). With a single on-policy update s_i = 1
exactly and GSPO, GRPO and the plain policy gradient coincide; from the second minibatch on the policy is
off-policy and the sequence clipping acts. Metrics go to runs/gspo-<task>-<date>-<time>/metrics.jsonl.

What to expect: `python gspo.py` (seed 0, one thread of an AMD EPYC) takes greedy accuracy on the 500
held-out problems from 0.418 to 0.700 in 2400 steps. Seed and CPU move the final; the figures are in
benchmarks/results/spread.md.

What differs from grpo.py
- policy_loss: the sequence ratio s_i and sequence clipping with eps_low 3e-4 / eps_high 4e-4;
  clip_frac counts every token of a clipped sequence, as the paper does; seq_log_ratio_std is the
  spread of the log s_i. policy_loss_token is GSPO-token.
- No KL term and no reference model; no Routing Replay (the point of GSPO).
- As in grpo.py: lr 1e-4, one pass over contiguous minibatches per rollout batch, and the MoE
  load-balancing loss is logged but not trained on.
"""
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

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
    # GSPO
    clip_eps_low: float = arg(3e-4, "clip range of the sequence ratio, below 1 (paper: 3e-4)")
    clip_eps_high: float = arg(4e-4, "clip range of the sequence ratio, above 1 (paper: 4e-4)")
    token_level: bool = arg(False, "GSPO-token: the per-token form of the objective")


def compute_advantages(rewards, group_size):
    """Group-relative advantage: A_i = (R_i - mean_group R) / (std_group R + 1e-6), std unbiased.
    rewards [N], grouped by prompt (rows g*G .. g*G+G-1) -> [N]. An all-equal group gets 0."""
    grouped = rewards.view(-1, group_size)
    advantages = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
    return advantages.flatten()


def policy_loss(logp, old_logp, advantages, mask, clip_eps_low=3e-4, clip_eps_high=4e-4, correction=1.0):
    """GSPO loss (GSPO paper eq. 5-7): length-normalised sequence ratio, clipped per sequence, mean over
    sequences. logp, old_logp, mask [N, T]; advantages [N]; correction: the rollout correction's weight of each
    token ([N, T] or [N, 1]): a sequence's term is weighted by their mean over its tokens, as TRL and verl."""
    mean = lambda x: ((x * mask).sum() / mask.sum().clamp(min=1)).item()   # over the completions' tokens
    log_ratio = logp - old_logp
    lengths = mask.sum(1).clamp(min=1)                                   # |o_i|: this completion's own length
    seq_log_ratio = (log_ratio * mask).sum(1) / lengths                  # log s_i [N]
    seq_ratio = torch.exp(seq_log_ratio)                                 # s_i, the geometric mean of r_it
    surrogate = torch.min(seq_ratio * advantages,
                          torch.clamp(seq_ratio, 1 - clip_eps_low, 1 + clip_eps_high) * advantages)
    if torch.is_tensor(correction):
        correction = (correction * mask).sum(1) / lengths                # the mean over the sequence's tokens
    loss = -(surrogate * correction).mean()
    with torch.no_grad():
        clipped = (((advantages > 0) & (seq_ratio > 1 + clip_eps_high))
                   | ((advantages < 0) & (seq_ratio < 1 - clip_eps_low)))[:, None].expand_as(mask)   # [N, T]
        # clip_frac as the paper counts it: clipped tokens over all tokens; the spread of the sequence log-ratios.
        return loss, {"clip_frac": mean(clipped.float()), "clipped": clipped,
                      "seq_log_ratio_std": seq_log_ratio.std().item() if len(seq_log_ratio) > 1 else 0.0,
                      "approx_kl": mean(torch.exp(log_ratio) - 1 - log_ratio)}      # k3 KL(old || new)


def policy_loss_token(logp, old_logp, advantages, mask, clip_eps_low=3e-4, clip_eps_high=4e-4, correction=1.0):
    """GSPO-token loss (GSPO paper eq. 13-14) for per-token advantages [N, T]:
    s_it = sg[s_i] * pi(o_it) / sg[pi(o_it)] is numerically s_i, but its gradient flows through token t
    only, weighted by A_it. With A_it = A_i for all t it equals policy_loss in value and gradient."""
    mean = lambda x: ((x * mask).sum() / mask.sum().clamp(min=1)).item()   # over the completions' tokens
    log_ratio = logp - old_logp
    lengths = mask.sum(1).clamp(min=1)
    seq_log_ratio = (log_ratio * mask).sum(1) / lengths                  # log s_i [N]
    token_ratio = torch.exp(seq_log_ratio.detach()[:, None] + logp - logp.detach())   # s_it [N, T]
    surrogate = torch.min(token_ratio * advantages,
                          torch.clamp(token_ratio, 1 - clip_eps_low, 1 + clip_eps_high) * advantages)
    loss = -((surrogate * correction * mask).sum(1) / lengths).mean()
    with torch.no_grad():
        clipped = (((advantages > 0) & (token_ratio > 1 + clip_eps_high))
                   | ((advantages < 0) & (token_ratio < 1 - clip_eps_low)))
        return loss, {"clip_frac": mean(clipped.float()), "clipped": clipped,
                      "seq_log_ratio_std": seq_log_ratio.std().item() if len(seq_log_ratio) > 1 else 0.0,
                      "approx_kl": mean(torch.exp(log_ratio) - 1 - log_ratio)}      # k3 KL(old || new)


def train(args):
    # ------------------------------------------------------------ setup (plumbing)
    common.check_common_args(args)
    check(args.clip_eps_low > 0 and args.clip_eps_high > 0,
          f"--clip-eps-low and --clip-eps-high must be positive, got {args.clip_eps_low} and {args.clip_eps_high}")
    device = common.pick_device(args.device)
    policy, world = common.make_policy(args, device)
    common.seed_everything(args.seed)                                   # after the warm start: cached or not, same run
    optimizer = torch.optim.AdamW(common.trainable(policy), lr=args.lr, weight_decay=0.0, fused=True)  # one kernel
    run = common.Run(Path(__file__).stem, args, world, {"policy": policy, "optimizer": optimizer})
    sampler = common.make_sampler(policy, args)   # the policy itself, or a bf16 copy of it (after a resume)

    for step in run.steps():
        # ------------------------------------------------------------ rollout
        t0 = time.perf_counter()
        prompts, answers = world.sample(args.prompts_per_step)
        rollout = common.generate(sampler, world, prompts, args.group_size, args.temperature)
        rewards = common.rewards_of(world, rollout, answers, args.group_size)             # [N]
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
                                                         entropy=False)
            # The old policy's log-probs of these rows: in the first minibatch this forward pass itself, detached
            # (ratio exactly 1); later the sampler's own where it is the policy, else the separate pass.
            old = logp.detach() if first else old_logp[idx]
            old_experts = routing if first else rollout_experts          # what routing drift is measured against
            weights = correction.weights(old, idx, first)              # the rollout correction's (1.0: none)
            if args.token_level:                                                # A_it = A_i for every token
                loss, metrics = policy_loss_token(logp, old, advantages[idx, None].expand_as(logp),
                                                  rollout.mask[idx], args.clip_eps_low, args.clip_eps_high, weights)
            else:
                loss, metrics = policy_loss(logp, old, advantages[idx], rollout.mask[idx],
                                            args.clip_eps_low, args.clip_eps_high, weights)
            metrics |= common.by_quarter("clip_frac", metrics.pop("clipped").float(), rollout.mask[idx])
            metrics |= common.optimizer_step(policy, optimizer, loss, args.max_grad_norm)
            stats.append(metrics | common.ratio_metrics(logp, old, rollout.mask[idx], routing, old_experts, aux_loss))
        common.refresh_sampler(sampler, policy)                         # a bf16 copy takes the new weights
        t4 = time.perf_counter()

        # ------------------------------------------------------------ log
        record = {"step": step, **common.rollout_metrics(rewards, rollout), **common.mean_metrics(stats),
                  **correction.metrics(),
                  "step_time_s": t4 - t0, "time_generate_s": t1 - t0, "time_old_logp_s": t2 - t1,
                  "time_update_s": t4 - t2}
        run.log(record)

    run.finish()


def main(argv=None):
    common.run_main(train, common.parse_args(Args, __doc__, argv))


if __name__ == "__main__":
    main()
