"""SAPO: Soft Adaptive Policy Optimization (Gao et al. 2025, Qwen team, arXiv 2511.20347).

GRPO with the hard clip replaced by a smooth gate, per token and asymmetric in the advantage's sign. PPO's
clip keeps a token's gradient whole inside its band and zeroes it outside; SAPO's gate weighs it down smoothly
as the ratio leaves 1. GSPO, from the same team, drops a whole sequence whose ratio leaves its band; SAPO damps
only the off-policy tokens. The paper aims it, as GSPO, at the instability of Mixture-of-Experts models.

    A_i  = (R_i - mean(R_1..R_G)) / (std(R_1..R_G) + 1e-6)
    r_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t)
    f(r; tau) = sigmoid(tau (r - 1)) * 4 / tau        tau_it = tau_pos if A_i > 0 else tau_neg   (1.0, 1.05)
    loss = -(1/G) sum_i (1/|o_i|) sum_t [ f(r_it; tau_it) A_i - beta KL_it ]
    KL_it = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1                   (k3 estimator, >= 0)
    its gradient: PPO's r_it A_i grad log pi_theta(o_it), weighed by the gate f'(r_it) = 4 s (1 - s),
    s = sigmoid(tau_it (r_it - 1)), where PPO's clip weighs it by 1 inside the band and 0 outside

f'(1) = 1: on-policy SAPO is the plain policy gradient. f' falls smoothly on both sides of 1, faster for a
larger tau; tau_neg > tau_pos closes the gate sooner on tokens with A <= 0, which the paper finds the less
stable. At these temperatures the gate is gentle: below r = 1 it never drops under 0.76, and it halves a
token's gradient only beyond r = 2.7 (A <= 0) or 2.8 (A > 0). TRL 1.16 (loss_type="sapo",
sapo_temperature_pos/neg) and verl 0.9.1 (loss_mode=sapo, tau_pos/tau_neg) both use these defaults and this
mean over each sequence's tokens, then over sequences.

Run it
    python sapo.py                     # toy MoE learns two-digit addition on one CPU thread
    python sapo.py --tau-neg 3         # a gate that closes sooner on below-average completions
    python sapo.py --help              # every flag
    python sapo.py --model Qwen/Qwen3-0.6B --data train.jsonl --max-new-tokens 512 \\
        --prompts-per-step 8 --group-size 8 --lr 1e-6 --gradient-checkpointing   # its memory: docs/models.md

Each step: sample --prompts-per-step x --group-size completions with the current policy, keeping each
token's log-prob, and score them; then split the batch into --minibatches and take one optimizer step on
each (the old log-probs as in grpo.py). The first minibatch is on-policy (ratio exactly 1, gate 1); later
ones are off-policy, which is where the gate acts. clip_frac is the share of tokens whose gate weight
f'(r_it) is below 1/2 (their gradient at least halved; none is ever zeroed), gate_weight_mean the mean
f'(r_it) over the completions' tokens. Metrics go to runs/sapo-<task>-<date>-<time>/metrics.jsonl.

What to expect: `python sapo.py` (seed 0, one thread of an AMD EPYC) takes greedy accuracy on the 500
held-out problems from 0.418 to 0.728 in 2400 steps. Seed and CPU move the final; the figures are in
benchmarks/results/spread.md.

What differs from grpo.py
- policy_loss: the gate f(r_it; tau_it) in place of the clipped ratio, tau by the sign of A_i; clip_frac
  counts the tokens the gate damps to under half, and gate_weight_mean says how much it damps on average.
- As in grpo.py: the mean per sequence then over sequences, no KL by default (--beta), Routing Replay on
  request, lr 1e-4 on the toy, one pass over contiguous minibatches, and the MoE load-balancing loss is
  logged but not trained on.
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
    # SAPO
    tau_pos: float = arg(1.0, "gate temperature of tokens with A > 0 (TRL's and verl's default)")
    tau_neg: float = arg(1.05, "gate temperature of tokens with A <= 0 (TRL's and verl's default); larger, their "
                                 "gate closes sooner")
    beta: float = arg(0.0, "KL coefficient to the frozen reference policy")
    routing_replay: bool = arg(False, "MoE models: the update uses the experts chosen when the old log-probs "
                                      "were computed (Routing Replay)")


def compute_advantages(rewards, group_size):
    """Group-relative advantage: A_i = (R_i - mean_group R) / (std_group R + 1e-6), std unbiased.
    rewards [N], grouped by prompt (rows g*G .. g*G+G-1) -> [N]. An all-equal group gets 0."""
    grouped = rewards.view(-1, group_size)
    advantages = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
    return advantages.flatten()


def policy_loss(logp, old_logp, advantages, mask, ref_logp=None, tau_pos=1.0, tau_neg=1.05, beta=0.0,
                correction=1.0):
    """SAPO loss: per-token soft gate f(r) = sigmoid(tau (r - 1)) 4 / tau, tau_pos where A > 0 and tau_neg
    elsewhere, k3 KL to the reference, mean over each sequence's tokens, then mean over sequences.
    logp, old_logp, ref_logp, mask [N, T]; advantages [N]; correction: the rollout correction's weight of each
    token's term ([N, T] or [N, 1]), as TRL and verl."""
    mean = lambda x: ((x * mask).sum() / mask.sum().clamp(min=1)).item()   # over the completions' tokens
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)                                         # r_it [N, T]
    adv = advantages[:, None]                                            # A_i, the same for every token
    tau = torch.where(adv > 0, tau_pos, tau_neg)                         # tau_it by the sign of A_i [N, 1]
    gate = torch.sigmoid(tau * (ratio - 1))                              # sigmoid(tau_it (r_it - 1)) [N, T]
    surrogate = gate * 4 / tau * adv                                     # f(r_it; tau_it) A_i, f'(1) = 1
    per_token = -surrogate * correction
    metrics = {}
    if beta > 0:
        assert ref_logp is not None, "policy_loss: beta > 0 needs ref_logp"
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1          # k3, >= 0, 0 at ref = policy
        per_token = per_token + beta * kl
        metrics["kl_ref"] = mean(kl)
    lengths = mask.sum(1).clamp(min=1)                                   # |o_i|
    loss = ((per_token * mask).sum(1) / lengths).mean()                  # seq-mean-token-mean
    with torch.no_grad():
        gate_weight = 4 * gate * (1 - gate)                              # f'(r_it) = 4 s (1 - s): 1 at r = 1
        clipped = gate_weight < 0.5                                      # [N, T]: gradient at least halved
        metrics |= {"clip_frac": mean(clipped.float()), "clipped": clipped, "gate_weight_mean": mean(gate_weight),
                    "approx_kl": mean(ratio - 1 - log_ratio)}                 # k3 KL(old || new)
    return loss, metrics


def train(args):
    # ------------------------------------------------------------ setup (plumbing)
    common.check_common_args(args)
    check(args.tau_pos > 0 and args.tau_neg > 0,
          f"--tau-pos and --tau-neg must be positive, got {args.tau_pos} and {args.tau_neg}")
    check(args.beta >= 0, f"--beta must be 0 or positive, got {args.beta}")
    device = common.pick_device(args.device)
    policy, world = common.make_policy(args, device)
    if args.routing_replay:
        common.check_replay(policy)                                    # or stop: never train without it
    common.seed_everything(args.seed)                                   # after the warm start: cached or not, same run
    ref = common.frozen_copy(policy) if args.beta > 0 else None         # no reference model when beta = 0
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
        ref_logp = None if ref is None else common.fixed_logprobs(ref, world, rollout, args.temperature,
                                                                args.minibatches)[0]
        t3 = time.perf_counter()

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
            loss, metrics = policy_loss(logp, old, advantages[idx], rollout.mask[idx],
                                        None if ref is None else ref_logp[idx], args.tau_pos, args.tau_neg,
                                        args.beta, correction.weights(old, idx, first))
            metrics |= common.by_quarter("clip_frac", metrics.pop("clipped").float(), rollout.mask[idx])
            metrics |= common.optimizer_step(policy, optimizer, loss, args.max_grad_norm)
            stats.append(metrics | common.ratio_metrics(logp, old, rollout.mask[idx], routing, old_experts, aux_loss))
        common.refresh_sampler(sampler, policy)                         # a bf16 copy takes the new weights
        t4 = time.perf_counter()

        # ------------------------------------------------------------ log
        record = {"step": step, **common.rollout_metrics(rewards, rollout), **common.mean_metrics(stats),
                  **correction.metrics(),
                  "step_time_s": t4 - t0, "time_generate_s": t1 - t0, "time_old_logp_s": t2 - t1,
                  "time_ref_s": t3 - t2, "time_update_s": t4 - t3}
        run.log(record)

    run.finish()


def main(argv=None):
    common.run_main(train, common.parse_args(Args, __doc__, argv))


if __name__ == "__main__":
    main()
