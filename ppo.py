"""PPO for language models, InstructGPT-style (Ouyang et al. 2022; as in verl, and in TRL up to 0.29).

The baseline the other scripts remove: a learned critic V (the policy's architecture and weights with a
scalar head, its own optimiser) estimates the value of every completion prefix, and GAE turns token
rewards into per-token advantages.

    r_t   = -beta_kl (log pi_old(o_t) - log pi_ref(o_t))  on every completion token, + the task reward on the last
    delta_t = r_t + gamma V(s_t+1) - V(s_t)             (V after the last token = 0)
    A_t   = delta_t + gamma lam A_t+1,   returns_t = A_t + V(s_t),   A whitened over the batch's tokens
    policy loss = -(1 / sum mask) sum_it min(r_it A_it, clip(r_it, 1-eps, 1+eps) A_it)      (r_it: the ratio)
    value loss  = 0.5 (1 / sum mask) sum_it max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)

Run it
    python ppo.py                     # toy MoE learns two-digit addition on one CPU thread
    python ppo.py --help              # every flag
    python ppo.py --model Qwen/Qwen3-0.6B --data train.jsonl --max-new-tokens 512 --prompts-per-step 64 \\
        --lr 1e-6 --critic-lr 1e-5 --gradient-checkpointing   # its memory: docs/models.md

Each step: sample one completion for each of --prompts-per-step prompts (128: as many completions as the
other scripts' 16 prompts x 8), score them, compute old, reference and value estimates once, then take
--epochs passes over --minibatches minibatches, one policy step and one critic step each.
Metrics go to runs/ppo-<task>-<date>-<time>/metrics.jsonl.

What to expect: `python ppo.py` (seed 0, one thread of an AMD EPYC) takes greedy accuracy on the 500
held-out problems from 0.418 to 0.782 in 700 steps. Seed and CPU move the final; the figures are in
benchmarks/results/spread.md.

verl 0.9.1's defaults differ from these (`python ppo.py --print-verl` prints the settings that match):
algorithm.lam=1.0, algorithm.kl_ctrl.kl_coef=0.001, critic.cliprange_value=0.5, actor.ppo_epochs=1 (here
--lam 0.95, --beta-kl 0.05, --value-clip 0.2, --epochs 2), and dual clip, actor.clip_ratio_c=3.0: the loss
of a token with A < 0 is capped at -3A (none here).

What differs from grpo.py
- compute_advantages is GAE over a critic's values instead of a group mean; advantages are per token.
- token_rewards puts the KL penalty into the reward (InstructGPT), not into the loss.
- value_loss and a second model with its own optimiser; several epochs; one completion per prompt.
- What GRPO drops: the critic (a second model as large as the policy, its memory, its forward and
  backward passes, its learning rate to tune) and GAE; a group of completions per prompt is its baseline.
"""
import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

import common
from common import arg, check
from moe_model import MoETransformer


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
    steps: int = arg(700, "rollout batches; each gives --epochs x --minibatches optimizer steps")
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
    prompts_per_step: int = arg(128, "prompts per rollout batch")
    group_size: int = arg(1, "completions per prompt (1: classic PPO)")
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
    # PPO
    clip_eps: float = arg(0.2, "clip range of the token ratio")
    beta_kl: float = arg(0.05, "KL penalty to the frozen reference policy, in the reward")
    gamma: float = arg(1.0, "discount")
    lam: float = arg(0.95, "GAE lambda")
    critic_lr: Optional[float] = arg(None, "AdamW learning rate of the critic (default: --lr's)")
    value_clip: float = arg(0.2, "clip range of the value update around the old value")
    epochs: int = arg(2, "passes over the rollout batch's minibatches")
    routing_replay: bool = arg(False, "MoE models: the update uses the experts chosen when the old log-probs "
                                      "were computed (Routing Replay)")


def compute_advantages(rewards, values, mask, gamma=1.0, lam=0.95):
    """GAE, right to left over each completion (no whitening here). rewards, values, mask [N, T] ->
    advantages, returns [N, T], 0 on padding. The value after the last valid token is 0."""
    N, T = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value, next_advantage = rewards.new_zeros(N), rewards.new_zeros(N)     # on the batch's device
    for t in reversed(range(T)):                                         # over time, batched over N
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantages[:, t] = (delta + gamma * lam * next_advantage) * mask[:, t]
        next_value, next_advantage = values[:, t] * mask[:, t], advantages[:, t]
    return advantages, (advantages + values) * mask


def token_rewards(scores, old_logp, ref_logp, mask, beta_kl):
    """Per-token rewards [N, T]: -beta_kl (log pi_old - log pi_ref) on every completion token, plus the
    task score [N] on the last one (the EOS, or the last token of a truncated completion)."""
    rewards = -beta_kl * (old_logp - ref_logp) * mask
    last = mask.sum(1).long() - 1
    rewards[torch.arange(len(scores)), last] += scores
    return rewards


def whiten(advantages, mask):
    """Zero mean, unit variance over the batch's valid tokens only."""
    mean = common.masked_mean(advantages, mask)
    var = common.masked_mean((advantages - mean) ** 2, mask)
    return (advantages - mean) * torch.rsqrt(var + 1e-8) * mask


def explained_variance(values, returns, mask):
    """1 - Var(returns - V) / Var(returns) over valid tokens: 1 is a perfect critic, 0 no better than a constant."""
    var = lambda x: common.masked_mean((x - common.masked_mean(x, mask)) ** 2, mask)
    return (1 - var(returns - values) / var(returns).clamp(min=1e-8)).item()


def policy_loss(logp, old_logp, advantages, mask, clip_eps=0.2, correction=1.0):
    """PPO's clipped surrogate, per token, averaged over all valid tokens. logp, old_logp, advantages,
    mask [N, T]; correction: the rollout correction's weight of each token's term ([N, T] or [N, 1]), as verl."""
    mean = lambda x: ((x * mask).sum() / mask.sum().clamp(min=1)).item()   # over the completions' tokens
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)                                         # r_it [N, T]
    surrogate = torch.min(ratio * advantages, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages)
    loss = -(surrogate * correction * mask).sum() / mask.sum().clamp(min=1)
    with torch.no_grad():
        clipped = ((advantages > 0) & (ratio > 1 + clip_eps)) | ((advantages < 0) & (ratio < 1 - clip_eps))
        return loss, {"clip_frac": mean(clipped.float()), "clipped": clipped,           # [N, T]: gradient cut
                      "approx_kl": mean(ratio - 1 - log_ratio)}                 # k3 KL(old || new)


def value_loss(values, old_values, returns, mask, clip_range=0.2):
    """Clipped value loss: 0.5 * mean over valid tokens of max((V - R)^2, (clip(V, V_old +- c) - R)^2)."""
    clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    return 0.5 * (torch.max((values - returns) ** 2, (clipped - returns) ** 2) * mask).sum() / mask.sum().clamp(min=1)


def make_critic(policy):
    """The value model: the policy's architecture and weights (warm-started), with the vocabulary head
    swapped for a scalar one in the trunk's dtype (fp32 with LoRA: it trains, on a frozen bf16 base),
    initialised to 0 so that the first values are 0. With LoRA the critic is its own adapters and value head
    on the policy's frozen base, shared, not copied: the copy takes the policy's frozen tensors as they are."""
    shared = {id(p): p for p in policy.parameters() if not p.requires_grad} if common.is_lora(policy) else {}
    critic = copy.deepcopy(policy, memo=shared)
    if not isinstance(critic, MoETransformer):
        critic.config.tie_word_embeddings = False   # else a later tie_weights() would put the vocabulary head back
    head = common.output_head(critic)
    dtype = torch.float32 if common.is_lora(policy) else head.weight.dtype
    value_head = torch.nn.Linear(head.in_features, 1).to(head.weight.device, dtype)
    torch.nn.init.zeros_(value_head.weight), torch.nn.init.zeros_(value_head.bias)
    if isinstance(critic, MoETransformer):
        critic.head = value_head
    else:
        critic.set_output_embeddings(value_head)
    return critic


def values(critic, rollout):
    """V(s_t) [N, T]: the critic's value at the position that predicts completion token t, 0 on padding."""
    T = rollout.mask.shape[1]
    cut = common.needed_columns(rollout)[0]                  # the columns these rows need
    with common.autocast(critic):
        hidden = common.trunk(critic, cut.tokens[:, :-1], cut.attention_mask[:, :-1])[0][:, -cut.mask.shape[1]:]
        out = common.output_head(critic)(hidden).float()[..., 0]                  # [N, T'], T' <= T
    return F.pad(out, (0, T - out.shape[1])) * rollout.mask


def train(args):
    # ------------------------------------------------------------ setup (plumbing)
    common.check_common_args(args, min_group_size=1)
    check(args.clip_eps > 0, f"--clip-eps must be positive, got {args.clip_eps}")
    check(args.beta_kl >= 0, f"--beta-kl must be 0 or positive, got {args.beta_kl}")
    check(args.critic_lr > 0, f"--critic-lr must be positive, got {args.critic_lr}")
    check(args.value_clip > 0, f"--value-clip must be positive, got {args.value_clip}")
    check(args.epochs > 0, f"--epochs must be positive, got {args.epochs}")
    check(0 <= args.gamma <= 1 and 0 <= args.lam <= 1,
          f"--gamma and --lam must be in [0, 1], got {args.gamma}, {args.lam}")
    device = common.pick_device(args.device)
    policy, world = common.make_policy(args, device)
    if args.routing_replay:
        common.check_replay(policy)                                    # or stop: never train without it
    common.seed_everything(args.seed)                                   # after the warm start: cached or not, same run
    ref = common.frozen_copy(policy)                                   # for the KL penalty in the reward
    critic = make_critic(policy)                                 # the warm-started weights, a scalar head
    optimizer = torch.optim.AdamW(common.trainable(policy), lr=args.lr, weight_decay=0.0, fused=True)  # one kernel
    critic_optimizer = torch.optim.AdamW(common.trainable(critic), lr=args.critic_lr, weight_decay=0.0, fused=True)
    run = common.Run(Path(__file__).stem, args, world, {"policy": policy, "optimizer": optimizer,
                                                         "critic": critic, "critic_optimizer": critic_optimizer})
    sampler = common.make_sampler(policy, args)   # the policy itself, or a bf16 copy of it (after a resume)
    millions = lambda params: sum(p.numel() for p in params) / 1e6
    print(f"policy {millions(policy.parameters()):.2f} M parameters ({millions(common.trainable(policy)):.2f} M "
          f"trained), critic {millions(common.trainable(critic)):.2f} M more (trained)"
          + ("; with LoRA the critic and the reference share the policy's frozen base" if args.lora_r
             else f", reference {millions(ref.parameters()):.2f} M (frozen)"))

    for step in run.steps():
        # ------------------------------------------------------------ rollout
        t0 = time.perf_counter()
        prompts, answers = world.sample(args.prompts_per_step)
        rollout = common.generate(sampler, world, prompts, args.group_size, args.temperature)
        scores = common.rewards_of(world, rollout, answers, args.group_size)              # task reward [N]
        t1 = time.perf_counter()
        old_logp, old_routing = common.old_logprobs(policy, sampler, world, rollout, args.temperature,
                                                    args.minibatches, every_row=True)   # the KL reward reads all
        t2 = time.perf_counter()
        ref_logp = common.fixed_logprobs(ref, world, rollout, args.temperature, args.minibatches)[0]
        t3 = time.perf_counter()
        with torch.no_grad():
            old_values = torch.cat([values(critic, rollout[idx])                   # V(s_t) [N, T]
                                    for idx in common.minibatches(len(scores), args.minibatches)])
        critic_time = time.perf_counter() - t3                          # the critic's cost, summed below
        rewards = token_rewards(scores, old_logp, ref_logp, rollout.mask, args.beta_kl)  # [N, T]
        advantages, returns = compute_advantages(rewards, old_values, rollout.mask, args.gamma, args.lam)
        advantages = whiten(advantages, rollout.mask)

        # ------------------------------------------------------------ update
        stats, correction = [], common.RolloutCorrection(args, rollout, old_logp)
        for i, idx in enumerate(common.minibatches(len(scores), args.minibatches) * args.epochs):   # --epochs passes
            first = i == 0                     # the policy has not moved since it sampled these rows
            rollout_experts = None if old_routing is None else old_routing[:, idx]   # chosen in the old log-probs' pass
            logp, _, routing, aux_loss = common.logprobs(policy, world, rollout[idx], args.temperature,
                                                         rollout_experts if args.routing_replay else None,
                                                         entropy=False)
            # The old policy's log-probs of these rows: in the first minibatch this forward pass itself, detached
            # (ratio exactly 1); later the sampler's own where it is the policy, else the separate pass.
            old = logp.detach() if first else old_logp[idx]
            loss, metrics = policy_loss(logp, old, advantages[idx], rollout.mask[idx], args.clip_eps,
                                        correction.weights(old, idx, first))
            metrics |= common.by_quarter("clip_frac", metrics.pop("clipped").float(), rollout.mask[idx])
            metrics |= common.optimizer_step(policy, optimizer, loss, args.max_grad_norm)
            t_critic = time.perf_counter()
            critic_loss = value_loss(values(critic, rollout[idx]), old_values[idx], returns[idx],
                                     rollout.mask[idx], args.value_clip)
            critic_step = common.optimizer_step(critic, critic_optimizer, critic_loss, args.max_grad_norm)
            critic_time += time.perf_counter() - t_critic
            metrics |= {"value_loss": critic_loss.item(), "critic_grad_norm": critic_step["grad_norm"],
                        "skipped_updates": metrics["skipped_updates"] + critic_step["skipped_updates"]}
            stats.append(metrics | common.ratio_metrics(logp, old, rollout.mask[idx], routing, rollout_experts,
                                                        aux_loss))
        common.refresh_sampler(sampler, policy)                         # a bf16 copy takes the new weights
        t4 = time.perf_counter()

        # ------------------------------------------------------------ log
        first, last = common.quarters(rollout.mask)              # how well V is known early and late in an answer
        record = {"step": step, **common.rollout_metrics(scores, rollout), **common.mean_metrics(stats),
                  **correction.metrics(),
                  "explained_variance": explained_variance(old_values, returns, rollout.mask),
                  "explained_variance_q1": explained_variance(old_values, returns, first),
                  "explained_variance_q4": explained_variance(old_values, returns, last),
                  "kl_ref": common.masked_mean(old_logp - ref_logp, rollout.mask).item(),
                  "step_time_s": t4 - t0, "time_generate_s": t1 - t0, "time_old_logp_s": t2 - t1,
                  "time_ref_s": t3 - t2, "time_critic_s": critic_time, "time_update_s": t4 - t3 - critic_time}
        run.log(record)

    run.finish()


def main(argv=None):
    common.run_main(train, common.parse_args(Args, __doc__, argv))


if __name__ == "__main__":
    main()
