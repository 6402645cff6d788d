"""The main path the six algorithm scripts share; they import it, it imports moe_model.py, and a module of extras/
only when a flag asks for one (--model, --data, --reward, --print-verl...: extras/__init__.py lists them). It reads
in the order a training step calls it:

    policy, world = make_policy(args, device)
        the toy MoE after its supervised warm start (cached on disk), or --model with --data (extras/hf_models);
        in training mode with every dropout off, the update's mode (sampling switches to eval mode on its own)
    rollout = generate(policy, world, prompts, group_size, temperature)
        G completions per prompt in one batch, with a KV cache (--static-cache: extras/static_decode); PAD is never
        sampled; a completion ends at its first end-of-sequence token, which belongs to it (rollout.mask counts it)
    rewards = rewards_of(world, rollout, answers, group_size)
        the task's reward, or yours (--reward); a broken reward function stops the run naming the prompt
    old_logp, entropy, routing = fixed_logprobs(policy, world, rollout, temperature, chunks)
        log-probs under the weights that sampled (or a frozen reference), no gradient; for MoE models
        also the experts each token was routed to, for Routing Replay and the routing metrics
    for idx in minibatches(N, count):
        logp, entropy, routing, aux_loss = logprobs(policy, world, rollout[idx], temperature, replay)
            from logits / temperature with PAD masked, the distribution that was sampled; 0 on padding;
            the vocabulary head runs over chunks of tokens and never holds the [N, T, V] logits
        optimizer_step(policy, optimizer, loss, max_grad_norm)
            backward, clipping, step; a non-finite loss or gradient skips the update and is counted
    run = Run(...); for step in run.steps(): ...; run.log(record); run.finish()
        metrics.jsonl, evaluation (eval_correct.jsonl: the problems it got right), progress bar, checkpoints,
        --resume, Ctrl-C and SIGTERM; at the end (or on a stop) the policy goes to DIR/model

The sections, in order: sampling; log-probs and the update's plumbing; the toy world (tasks, reward, warm start)
and make_policy; metrics (evaluation, rollout and ratio metrics, clipping by quarter); the command line; a run.
"""
import argparse
import contextlib
import copy
import dataclasses
import difflib
import functools
import hashlib
import importlib
import inspect
import json
import math
import numbers
import os
import resource
import shutil
import signal
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

import moe_model
from moe_model import MoEConfig, MoETransformer


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2, no traceback."""


def check(ok, message):
    if not ok:
        raise UsageError(message)


EXTRAS_NEEDS = {"hf_models": ["hf_routing", "rewards"]}   # what a module of extras/ imports (tests/test_errors.py)


def side_module(name, flag):
    """extras/<name>.py, imported when `flag` asks for it. A copy of a script with only common.py and moe_model.py (all
    the toy needs) says in one line every file the flag needs that it lacks, not with a traceback."""
    try:
        return importlib.import_module(f"extras.{name}")
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("extras"):
            raise                                                   # a package missing: its own message says which
        needed = ["extras/__init__.py"] + [f"extras/{m}.py" for m in [name, *EXTRAS_NEEDS.get(name, [])]]
        here = Path(__file__).resolve().parent
        missing = [f for f in needed if not (here / f).is_file()] or [f"{e.name.replace('.', '/')}.py"]
        raise UsageError(f"{flag} needs {listed(missing)} beside common.py (extras/__init__.py lists what each file of "
                         f"extras/ is for); copy {'them' if len(missing) > 1 else 'it'} from the project") from None


# ----------------------------------------------------------------------------------------------
# Sampling: G completions for each prompt, in one batch
# ----------------------------------------------------------------------------------------------

@dataclass
class Rollout:
    """G completions for each of a batch of prompts. Prompts are left-padded to one length P so
    that completion token t sits at column P + t of `tokens` for every row."""
    tokens: torch.Tensor          # [N, P + T] prompt then completion, completion padded after EOS
    attention_mask: torch.Tensor  # [N, P + T] 0 on left padding of the prompt
    mask: torch.Tensor            # [N, T] 1 on completion tokens up to and including the first EOS
    finished: torch.Tensor        # [N] bool, the completion ended with EOS (not truncated)
    entropy: torch.Tensor = None  # [N, T] entropy of the distribution each token was sampled from, 0 after
    sampler_logp: torch.Tensor = None  # [N, T] the log-prob of each token where it was sampled, 0 after

    def __getitem__(self, idx):
        return Rollout(self.tokens[idx], self.attention_mask[idx], self.mask[idx], self.finished[idx],
                       *(None if x is None else x[idx] for x in (self.entropy, self.sampler_logp)))

    @property
    def completions(self):
        return self.tokens[:, self.tokens.shape[1] - self.mask.shape[1]:]


@torch.no_grad()
def generate(model, world, prompts, group_size, temperature, greedy=False, use_cache=True):
    """Sample `group_size` completions for each prompt in one batch, reusing the KV cache.
    Rows are grouped: rows g*G .. g*G+G-1 are the completions of prompt g. use_cache=False runs
    the whole sequence again for every new token (what the cache saves; benchmarks/speed.py).
    The rollout keeps the log-prob of each sampled token (sampler_logp): where the sampler is the policy, the old
    policy's log-probs without another forward pass (old_logprobs)."""
    device = next(model.parameters()).device
    tokens, attention_mask = left_pad([p for p in prompts for _ in range(group_size)], world.pad_id)
    tokens, attention_mask = tokens.to(device), attention_mask.to(device)
    N, P = tokens.shape
    new, chosen, entropy, alive = [], [], [], torch.ones(N, dtype=torch.bool, device=device)
    eos_ids = torch.tensor(world.eos_ids, device=device)
    static = world.static_cache and use_cache          # its compiled step records the model's own products: not packed
    with sampling_mode(model), (contextlib.nullcontext() if static else packed_linears(model)):
        if static:  # --static-cache: this loop with a static cache, on CUDA a CUDA graph
            static_decode = side_module("static_decode", "--static-cache")
            new, entropy, chosen = static_decode.decode(model, world, tokens, attention_mask, temperature, greedy)
        else:
            logits, cache = prefill(model, tokens, attention_mask, group_size if use_cache else 1)
            rows = torch.arange(N, device=device)          # the rows in the batch (dropping_ended takes ended ones out)
            with eager_attention(model, N * (P + world.max_new_tokens)):       # one query a row
                for t in range(world.max_new_tokens):
                    next_logits = mask_logits(logits if temperature == 1 else logits / temperature, world)
                    token = torch.full((N,), world.pad_id, device=device)
                    if greedy:
                        token[rows] = next_logits.argmax(-1)
                    else:
                        logp = F.log_softmax(next_logits, dim=-1)
                        probs = logp.exp()
                        token[rows] = draw(model, probs, rows, N)
                        entropy.append(torch.zeros(N, device=device).index_copy(0, rows, -(probs * logp).sum(-1)))
                        chosen.append(torch.zeros(N, device=device).index_copy(
                            0, rows, logp.gather(-1, token[rows, None]).squeeze(1)))
                    token = torch.where(alive, token, world.pad_id)
                    new.append(token)
                    alive = alive & ~torch.isin(token, eos_ids)
                    left = int(alive.sum())                      # one host sync per token, to stop early
                    if t == world.max_new_tokens - 1 or left == 0:
                        break
                    attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], 1)
                    if use_cache and dropping_ended(model, left, len(rows)):
                        kept = alive[rows].nonzero().squeeze(1)
                        rows = rows[kept]
                        cache.batch_select_indices(kept)
                    if use_cache:
                        logits, cache = forward(model, token[rows, None], attention_mask[rows], cache)
                    else:
                        logits, _ = forward(model, torch.cat([tokens, torch.stack(new, 1)], 1), attention_mask)
    completion = torch.stack(new, 1)                                     # [N, T]
    is_eos = torch.isin(completion, eos_ids)
    finished = is_eos.any(1)
    # Mask: tokens up to and including the first EOS (all of them when truncated).
    mask = (is_eos.long().cumsum(1) - is_eos.long()) == 0
    completion = completion.masked_fill(~mask, world.pad_id)
    entropy = torch.stack(entropy, 1) * mask if entropy else None
    sampler_logp = torch.stack(chosen, 1).masked_fill(~mask, 0.0) if chosen else None    # None when greedy
    return Rollout(torch.cat([tokens, completion], 1), torch.cat([attention_mask[:, :P], mask.long()], 1),
                   mask.float(), finished, entropy, sampler_logp)


def dropping_ended(model, left, rows):
    """Whether the rows that have ended leave the batch now, with their KV cache: once a quarter of those in it have
    ended (a copy of the cache each time, a handful of times a rollout), for a Hugging Face model. Each decode step
    then computes only the rows still writing (real.py's completions end after 8-64 tokens: a fifth of the decode
    steps' rows had ended). The toy keeps every row, as its recorded runs did."""
    return left <= 3 * rows // 4 and not isinstance(model, MoETransformer)


def prefill(model, tokens, attention_mask, group_size):
    """The prompts' forward pass, once for each prompt: a group's G rows share their prompt, so a Hugging Face model
    runs it on one row of each group and repeats the KV cache and the last logits G times (real.py's prompts, 39
    tokens, cost a tenth of the generation when run for every row). The toy's prompts are 6 tokens: it runs every row,
    as its recorded runs did."""
    if group_size == 1 or isinstance(model, MoETransformer):
        return forward(model, tokens, attention_mask)
    logits, cache = forward(model, tokens[::group_size], attention_mask[::group_size])
    cache.batch_repeat_interleave(group_size)
    return logits.repeat_interleave(group_size, 0), cache


# Attention scores ([rows, heads, queries, keys] entries a layer) up to which a CPU under bf16 attends eagerly.
EAGER_ATTENTION = 2**22


@contextlib.contextmanager
def eager_attention(model, scores):
    """On a CPU under bf16, transformers' eager attention (matrix products and a softmax) in place of torch's CPU
    attention kernel (scaled_dot_product_attention), which takes several times as long there at short lengths,
    forward and backward: a quarter of the real model's decode steps, a tenth of its update. Only where a layer's
    attention scores have at most EAGER_ATTENTION entries: eager attention holds them for the backward (16 MB a layer
    in fp32), the kernel does not; and not under activation checkpointing, whose recomputation in the backward runs
    after this context. Elsewhere nothing changes."""
    body = model.get_base_model() if is_lora(model) else model
    bf16 = getattr(model, "bf16", False) or next(model.parameters()).dtype == torch.bfloat16
    recomputed = torch.is_grad_enabled() and getattr(body, "is_activation_checkpointing", False)
    if isinstance(model, MoETransformer) or next(model.parameters()).device.type != "cpu" or not bf16 or recomputed \
            or scores * body.config.num_attention_heads > EAGER_ATTENTION:
        yield
        return
    was = body.config._attn_implementation
    body.set_attn_implementation("eager")
    try:
        yield
    finally:
        body.set_attn_implementation(was)


def draw(model, probs, rows, n):
    """One token a row from probs [len(rows), V], the rows still writing out of a batch of n. torch.multinomial draws
    an exponential number for every entry of the vocabulary (for SmolLM2's 49,152, a sixth of its generation on a
    CPU); a Hugging Face model draws by the inverse of the cumulative distribution, one uniform number a row of the
    batch, ended rows' too, so that extras/static_decode (which keeps every row) draws the same. The toy keeps
    multinomial, with which its recorded runs drew (a 16-token vocabulary)."""
    if isinstance(model, MoETransformer):
        return torch.multinomial(probs, 1).squeeze(1)
    return inverse_cdf(probs, torch.rand(n, 1, dtype=torch.float64, device=probs.device)[rows])


def inverse_cdf(probs, uniform):
    """probs [N, V], uniform [N, 1] in [0, 1) -> one token a row: the first whose cumulative probability (in fp64)
    exceeds the uniform number times the row's total. A token of probability 0 adds nothing to the sum, so it is never
    the first to exceed it."""
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)


@contextlib.contextmanager
def sampling_mode(model):
    """For a whole generation: eval mode (activation checkpointing acts only in training mode, and in
    transformers it would turn the KV cache off) and, in bf16 (--dtype), one autocast context: autocast keeps
    its bf16 copies of the weights only while its context is open, so one context per token would cast
    every weight again for every token."""
    was_training = model.training
    model.eval()
    if not isinstance(model, MoETransformer):
        hf_routing = side_module("hf_routing", "--model")
        hf_routing.set_replay(model, None)              # sampling routes freely (a Hugging Face MoE model)
    try:
        with autocast(model):
            yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def packed_linears(model):
    """On a CPU, for a whole generation: every linear layer of a Hugging Face model multiplies by its weight packed
    once for oneDNN, in the precision of the product (bf16 under autocast, else the weight's own). Decoding multiplies
    a few rows (one a sequence) by each weight. At that shape torch's default fp32 product (MKL's) is slow on a CPU,
    and oneDNN, given the weight packed, is much faster: the real model's generate time in benchmarks/results/speed.md.
    Under autocast the numbers are those autocast gives, without a reorder every call. The weights do not change
    while sampling. The packed copies (the weights' size in that precision) are dropped when the generation ends.
    Elsewhere nothing changes: the toy, a GPU, other dtypes."""
    pack = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if isinstance(model, MoETransformer) or next(model.parameters()).device.type != "cpu" or pack is None \
            or not torch.backends.mkldnn.is_available():
        yield
        return
    bf16 = torch.bfloat16 if getattr(model, "bf16", False) else None
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear
               and (bf16 or m.weight.dtype) in (torch.float32, torch.bfloat16)]
    for m in linears:
        dtype = bf16 or m.weight.dtype
        bias = None if m.bias is None else m.bias.detach().to(dtype)
        m.forward = functools.partial(packed_product, pack(m.weight.detach().to(dtype)), bias)
    try:
        yield
    finally:
        for m in linears:
            del m.forward                                  # the class's forward again


def packed_product(weight, bias, x):
    # The input in the packed weight's dtype: autocast casts it for F.linear, but this op is not on autocast's list.
    return torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), weight, bias, "none", [], "")


def autocast(model):
    """bf16 autocast where make_policy chose bf16 for the run (model.bf16, --dtype), and on CUDA for a model built
    without it (a benchmark's), as --dtype auto: the matrix products in bf16, the weights kept in fp32 for the
    optimiser, the log-probs computed in fp32 after the head; plain fp32 elsewhere."""
    device = next(model.parameters()).device.type
    return torch.autocast(device, dtype=torch.bfloat16, enabled=getattr(model, "bf16", device == "cuda"))


def forward(model, tokens, attention_mask, cache=None):
    """One forward pass for sampling, the toy MoE or a Hugging Face model alike: tokens [B, S] are the
    new tokens, attention_mask [B, all tokens so far] (left padding). Returns the fp32 logits of the
    last position [B, V] and the KV cache to pass to the next call."""
    if isinstance(model, MoETransformer):  # the toy: fixed-length prompts, so no padding to handle
        cache = [None] * model.cfg.n_layers if cache is None else cache
        return model(tokens, cache=cache)[0][:, -1].float(), cache
    positions = position_ids(attention_mask)[:, -tokens.shape[1]:]
    out = model(input_ids=tokens, attention_mask=attention_mask, position_ids=positions, cache=cache,
                use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].float(), out.cache


def position_ids(attention_mask):
    """[B, S]: with left padding, positions count only real tokens, so every prompt starts at position 0."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def left_pad(prompts, pad_id):
    P = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, P - len(p):], attention_mask[i, P - len(p):] = p, 1
    return tokens, attention_mask


def mask_logits(logits, world):
    """PAD is never a real token: it must not be sampled, and log-probs use the same distribution.
    Apply after dividing by the temperature: a finite minimum keeps 0 * log 0 = 0 in the entropy."""
    if world.pad_id not in world.eos_ids:
        logits[..., world.pad_id] = torch.finfo(logits.dtype).min
    return logits


def rewards_of(world, rollout, answers, group_size):
    """Task reward of every completion [N]; `answers` has one entry per prompt. A reward function that
    raises, or returns anything but a finite number, stops the run naming the prompt (a NaN reward would
    make every advantage of its group NaN)."""
    texts = [world.decode(c[m.bool()].tolist()) for c, m in zip(rollout.completions.cpu(), rollout.mask.cpu())]
    rewards = []
    for i, (text, done) in enumerate(zip(texts, rollout.finished.tolist())):
        try:
            reward = world.reward(text, answers[i // group_size], bool(done))
            problem = None if isinstance(reward, numbers.Real) and math.isfinite(reward) else \
                f"returned {reward!r}, not a finite number"
        except Exception as e:  # a user's reward function: say which prompt broke it
            problem = f"raised {type(e).__name__}: {e}"
        if problem:
            P = rollout.tokens.shape[1] - rollout.mask.shape[1]
            prompt = world.decode(rollout.tokens[i, :P][rollout.attention_mask[i, :P].bool()].tolist())
            raise UsageError(f"the reward function {problem} (prompt {prompt[-200:]!r}, completion {text[:200]!r})")
        rewards.append(float(reward))
    return torch.tensor(rewards, device=rollout.mask.device)


# ----------------------------------------------------------------------------------------------
# Log-probs of the sampled tokens, and the update's plumbing
# ----------------------------------------------------------------------------------------------

# Logits of this many (token, vocabulary) entries at a time: 64 MB in fp32. With Qwen3's 151,936-token
# vocabulary that is 110 tokens a chunk; the toy's whole batch is one chunk.
LOGITS_CHUNK = 2**24


def logprobs(model, world, rollout, temperature, routing=None, entropy=True):
    """Per-token log-probs of the sampled completion tokens under `model`, from logits / temperature
    (the sampling distribution), in one forward pass. Returns logp [N, T] (0 on padding), the entropy of
    the sampling distribution at each completion token [N, T] (no gradient; 0 on padding; None with
    entropy=False, which the update asks: it reads the rollout's), the router's
    choice at every input position [n_layers, N, P+T-1, k] (None for dense models) and the load-balancing
    loss. `routing` (same shape) replays recorded experts: Routing Replay.

    The full logits [N, T, V] are never held: with a real vocabulary they would be the largest tensor of
    the step (16 x 512 x 151,936 in fp32 is 5 GB, several copies at the peak). The head runs over chunks
    of completion tokens; with gradients each chunk but the last is recomputed in the backward instead of
    kept. The last is the first the backward needs, so keeping it adds nothing to the peak."""
    cut, start, end = needed_columns(rollout)
    with autocast(model):
        P, kept = cut.tokens.shape[1] - cut.mask.shape[1], cut.mask.bool()
        hidden, chosen, aux_loss = trunk(model, cut.tokens[:, :-1], cut.attention_mask[:, :-1],
                                         None if routing is None else routing[:, :, start:end - 1], prompt=P)
        hidden, targets = hidden[:, P - 1:][kept], cut.completions[kept]      # position P+t-1 predicts token t
        chunk = max(1, LOGITS_CHUNK // output_head(model).weight.shape[0])
        sizes = [len(targets) % chunk] * (len(targets) % chunk > 0) + [chunk] * (len(targets) // chunk)
        pieces = list(zip(hidden.split(sizes), targets.split(sizes)))        # the remainder first, a whole chunk last
        parts = [checkpoint(token_logprobs, model, world, h, y, temperature, entropy, use_reentrant=False)
                 if torch.is_grad_enabled() and i < len(pieces) - 1 else token_logprobs(model, world, h, y, temperature,
                                                                                         entropy)
                 for i, (h, y) in enumerate(pieces)]
    zeros, valid = torch.zeros(rollout.mask.shape, device=hidden.device), rollout.mask.bool()   # the same tokens
    logp = zeros.masked_scatter(valid, torch.cat([p[0] for p in parts]))
    entropy = zeros.masked_scatter(valid, torch.cat([p[1] for p in parts])) if entropy else None
    if chosen is not None:     # the routing of every input position; expert 0 on the columns cut (only padding):
        # replayed there (a wider minibatch) it routes tokens no counted position sees (masked, or after the answer),
        # and the routing metrics read completion tokens only. A value no expert has would break replay's indexing.
        chosen = F.pad(chosen, (0, 0, start, rollout.tokens.shape[1] - end))
    return logp, entropy, chosen, aux_loss


def needed_columns(rollout):
    """The rows' columns that hold a token: from the first prompt column that is not padding in every row to the end of
    the longest completion. The rollout batch is padded to its longest prompt and completion; a minibatch of it often
    needs fewer columns, and the rest would cost the update's forward and backward for nothing (the real model's
    completions run 12-64 tokens in one batch). Attention is causal, so the columns after the longest completion
    change nothing before them, and a Hugging Face model's attention mask hides the prompts' left padding (the toy's
    prompts are all of one length: nothing to cut there). So the cut changes no log-prob, only the logged
    load-balancing loss, which counted the padding. Returns (the rows cut, start, end): columns start .. end - 1 of
    rollout.tokens."""
    P = rollout.tokens.shape[1] - rollout.mask.shape[1]
    # Two host syncs a minibatch (the shapes must be known): nothing beside a forward and backward.
    start = int(rollout.attention_mask[:, :P].any(0).long().argmax()) if P else 0
    end = P + int(rollout.mask.sum(1).max())
    return Rollout(rollout.tokens[:, start:end], rollout.attention_mask[:, start:end], rollout.mask[:, :end - P],
                   rollout.finished), start, end


def token_logprobs(model, world, hidden, targets, temperature, entropy=True):
    """hidden [n, D] -> log-prob of each target token [n] and the entropy of the distribution [n] (None with
    entropy=False)."""
    logits = head_logits(model, hidden)
    all_logp = F.log_softmax(mask_logits(logits if temperature == 1 else logits / temperature, world), dim=-1)
    logp = all_logp.gather(-1, targets[:, None]).squeeze(-1)
    if not entropy:
        return logp, None
    with torch.no_grad():
        return logp, -(all_logp.exp() * all_logp).sum(-1)


@torch.no_grad()
def fixed_logprobs(model, world, rollout, temperature, chunks):
    """Log-probs of a whole rollout batch under a policy that the update does not change: the old policy
    (the weights that sampled the batch, before its first optimizer step) or the frozen reference. No
    gradient; one forward per chunk of rows to bound memory. Returns logp [N, T], the entropy of that
    policy's sampling distribution [N, T], and the routing of every position [L, N, P+T-1, k] (or None),
    recorded for Routing Replay and for measuring how routing drifts during the update."""
    if isinstance(model, AdaptersOff):
        with model.policy.disable_adapter():
            return fixed_logprobs(model.policy, world, rollout, temperature, chunks)
    parts = [logprobs(model, world, rollout[idx], temperature) for idx in minibatches(len(rollout.mask), chunks)]
    routing = None if parts[0][2] is None else torch.cat([p[2] for p in parts], 1)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), routing


@torch.no_grad()
def old_logprobs(policy, sampler, world, rollout, temperature, chunks, every_row=False):
    """The old policy's log-probs [N, T] (the weights that sampled the batch, before the update) and its routing
    [L, N, P+T-1, k] (None for dense models), for the minibatches after the first: the first minibatch's own forward
    pass gives them (the policy has not moved since it sampled), so its ratio is exactly 1.

    Where the sampler is the policy itself and no routing is to be recorded (a dense model), they are the log-probs
    the sampler kept (rollout.sampler_logp): the same weights and precision, equal up to rounding (a KV cache, other
    kernels). No pass runs: verl's bypass mode. Otherwise one pass without gradient, chunked as the minibatches: a bf16
    sampler differs from the learner (the rollout correction weighs the difference); MoE models record the experts
    chosen (Routing Replay, the routing metrics). The rows of the first minibatch
    then hold the sampler's log-probs and expert 0, never read; every_row=True scores them too (ppo.py's KL reward
    reads every row before the update)."""
    if sampler is policy and not has_routing(policy):
        return rollout.sampler_logp, None
    N = len(rollout.mask)
    skip = 0 if every_row else N // chunks                                  # the first minibatch's rows
    parts = [logprobs(policy, world, rollout[idx + skip], temperature, entropy=False)
             for idx in minibatches(N - skip, chunks - (skip > 0))] if skip < N else []
    logp = rollout.sampler_logp.clone()
    if parts:
        logp[skip:] = torch.cat([p[0] for p in parts])
    if not parts or parts[0][2] is None:
        return logp, None
    routing = torch.cat([p[2] for p in parts], 1)
    return logp, torch.cat([routing.new_zeros((routing.shape[0], skip, *routing.shape[2:])), routing], 1)


def has_routing(model):
    """Whether the model routes tokens to experts: the toy with more than one expert, a Hugging Face MoE model."""
    if isinstance(model, MoETransformer):
        return model.cfg.n_experts > 1
    return bool(side_module("hf_routing", "--model").routers(model))


def make_sampler(policy, args):
    """--sampler: the policy itself (its weights, in the run's precision), or a bf16 copy of its weights, without
    gradients, that refresh_sampler brings up to date after each update (half the policy's weights in memory more)."""
    if args.sampler == "policy":
        return policy
    sampler = copy.deepcopy(policy).to(torch.bfloat16).eval().requires_grad_(False)
    sampler.bf16 = False                                   # its weights are bf16 already: no autocast
    return sampler


@torch.no_grad()
def refresh_sampler(sampler, policy):
    """After an update: the policy's new weights into the sampler (cast to its dtype); nothing when they are one."""
    if sampler is not policy:
        for mine, theirs in zip(sampler.parameters(), policy.parameters()):
            if theirs.requires_grad:                          # with LoRA only the adapters change
                mine.copy_(theirs)


# --rollout-correction's modes: TRL 1.16's (GRPOConfig.vllm_importance_sampling_mode), and none.
ROLLOUT_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@torch.no_grad()
def rollout_weights(old_logp, sampler_logp, mask, mode, clip_max=3.0, clip_min=None):
    """The rollout correction (TRL's vllm_importance_sampling_*, verl's algorithm.rollout_correction): each completion
    token's weight in the loss, the importance ratio of the learner (at the weights that sampled) to the sampler,
    pi_old / pi_sampler. Per token (token_*) or one for the whole sequence, the product of its tokens' ratios
    (sequence_*); truncated (*_truncate: clamped to [clip_min, clip_max]) or masked (*_mask: 0 outside it). No
    gradient: it reweights the loss, as in both frameworks. old_logp, sampler_logp, mask [N, T] -> the weights [N, T]
    (token) or [N, 1] (sequence), and the completion tokens a mask set to 0 [N, T] (bool)."""
    level, _, kind = mode.partition("_")
    log_ratio = (old_logp - sampler_logp) * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True)
    ratio = log_ratio.exp()
    if kind == "truncate":
        return ratio.clamp(min=clip_min, max=clip_max), torch.zeros(mask.shape, dtype=torch.bool, device=mask.device)
    outside = (ratio > clip_max) | (ratio < (-math.inf if clip_min is None else clip_min))
    return ratio.masked_fill(outside, 0.0), outside.expand(mask.shape) & mask.bool()


def correction_mode(args):
    """--rollout-correction with auto resolved: TRL's default (sequence_mask) for a sampler that is not the policy."""
    if args.rollout_correction != "auto":
        return args.rollout_correction
    return "none" if args.sampler == "policy" else "sequence_mask"


class RolloutCorrection:
    """One step's rollout correction, minibatch by minibatch, and the gap between sampler and learner it measures:

        correction = RolloutCorrection(args, rollout, old_logp)      # old_logp from old_logprobs
        for idx in minibatches(...):
            ...
            weights = correction.weights(old, idx, first)    # each token's weight in the loss: 1.0 without one
        record |= correction.metrics()

    The gap is |log pi_learner - log pi_sampler| over the completion tokens whose learner log-probs at the sampling
    weights are known: the first minibatch's (its own forward pass), and every row after a separate pass; where the
    sampler is the policy no pass runs, so only the first minibatch's tokens are measured."""

    def __init__(self, args, rollout, old_logp):
        self.mode, self.clip_max, self.clip_min = correction_mode(args), args.rollout_correction_max, \
            args.rollout_correction_min
        self.sampler_logp, self.mask = rollout.sampler_logp, rollout.mask
        self.passed = old_logp is not rollout.sampler_logp           # a separate pass scored the later minibatches
        self.gaps, self.dropped = [], []

    def weights(self, old, idx, first):
        sampler_logp, mask = self.sampler_logp[idx], self.mask[idx]
        if first or self.passed:
            self.gaps.append((old - sampler_logp).abs()[mask.bool()])
        if self.mode == "none":
            return 1.0
        weights, dropped = rollout_weights(old, sampler_logp, mask, self.mode, self.clip_max, self.clip_min)
        self.dropped.append(dropped[mask.bool()])
        return weights

    def metrics(self):
        gaps = torch.cat(self.gaps) if self.gaps else torch.zeros(0)
        dropped = torch.cat(self.dropped) if self.dropped else torch.zeros(0, dtype=torch.bool)
        return {"sampler_logp_diff_mean": gaps.mean().item() if len(gaps) else None,
                "sampler_logp_diff_max": gaps.max().item() if len(gaps) else None,
                "correction_dropped_frac": dropped.float().mean().item() if len(dropped) else 0.0}


def trunk(model, tokens, attention_mask, routing=None, prompt=0):
    """The forward pass for scoring, without the vocabulary head: the final hidden states [B, S, D],
    the router's top-k choice [n_layers, B, S, k] (None for dense models) and the load-balancing loss
    (or None). `routing` (same shape) replays recorded experts: Routing Replay.

    `prompt`: the first columns that hold the prompt. Rows in a row that share their prompt (a group's G
    completions) share its forward pass: a dense Hugging Face model runs the prompt once, on the first row, and
    the rows' completions attend to its keys and values repeated for each (sharing_prompts). Gradients flow
    back through the repeat, summed, as through G copies. For real.py's minibatches (one group of 8, prompts of 39
    tokens, completions up to 64) that is a third less to compute; the completions then run in up to two sets by
    length (by_length), which saves a fifth more. Without it: the toy, MoE models (their routing
    is recorded position by position) and activation checkpointing (transformers then keeps no cache)."""
    if isinstance(model, MoETransformer):
        hidden, chosen, aux_loss = model.trunk(tokens, routing=routing)
        return hidden, (chosen if model.cfg.n_experts > 1 else None), aux_loss
    hf_routing = side_module("hf_routing", "--model")              # --model: the routers of a Hugging Face MoE
    positions = position_ids(attention_mask)
    hf_routing.set_replay(model, routing)
    body = model.get_base_model() if is_lora(model) else model      # a PeftModel's base_model is peft's wrapper
    shared = sharing_prompts(body, tokens, attention_mask, prompt) if prompt and not hf_routing.routers(model) else None
    B, S = tokens.shape
    if shared is None:
        with eager_attention(model, B * S * S):
            out = body.base_model(input_ids=tokens, attention_mask=attention_mask, position_ids=positions,
                                  use_cache=False)
        chosen, aux_loss = hf_routing.recorded_routing(model, tokens.shape)
        return out.last_hidden_state, chosen, aux_loss
    first, repeats, cache = shared
    embeds = body.get_input_embeddings()(tokens)             # once: one gradient of the embedding matrix, not two
    with eager_attention(model, B * S * S):
        head = body.base_model(inputs_embeds=embeds[first, :prompt], attention_mask=attention_mask[first, :prompt],
                               position_ids=positions[first, :prompt], cache=cache, use_cache=True)
        group = torch.repeat_interleave(torch.arange(len(first), device=tokens.device), repeats)   # each row's prompt
        rows_in_order, parts = [], []
        for rows, width in by_length(attention_mask[:, prompt:]):      # each its own width: less padding computed
            out = embeds.new_zeros(len(rows), 0, embeds.shape[-1])
            if width:
                bucket = type(cache)(config=body.config)
                for i, layer in enumerate(cache.layers):        # the prompt's keys and values, one copy a row
                    bucket.update(layer.keys[group[rows]], layer.values[group[rows]], i)
                out = body.base_model(inputs_embeds=embeds[rows, prompt:prompt + width],
                                      attention_mask=attention_mask[rows, :prompt + width],
                                      position_ids=positions[rows, prompt:prompt + width], cache=bucket,
                                      use_cache=True).last_hidden_state
            rows_in_order.append(rows)
            parts.append(F.pad(out, (0, 0, 0, S - prompt - width)))     # the columns cut: padding, never read
    completions = torch.cat(parts)[torch.argsort(torch.cat(rows_in_order))]
    return torch.cat([head.last_hidden_state.repeat_interleave(repeats, 0), completions], 1), None, None


def by_length(mask):
    """The rows of a right-padded mask [B, T] in at most two sets by their length, each with the columns it needs:
    [(rows, width)]. Two where the split (the shorter rows, then the longer) saves an eighth of the columns that one
    set of B rows at the longest width would compute: real.py's completions end after 8-64 tokens, and a
    minibatch's rows padded to the longest were a quarter padding."""
    lengths = mask.sum(1)
    order = torch.argsort(lengths, stable=True)
    widths = lengths[order].tolist()                                   # a host sync, as needed_columns'
    B = len(widths)
    area = lambda k: k * widths[k - 1] + (B - k) * widths[-1]          # the shorter k rows apart
    k = min(range(1, B), key=area, default=B)
    if B < 2 or area(k) > 7 * B * widths[-1] / 8:
        return [(order, widths[-1])]
    return [(order[:k], widths[k - 1]), (order[k:], widths[-1])]


def sharing_prompts(body, tokens, attention_mask, prompt):
    """Where rows in a row share their first `prompt` columns (tokens and padding): the first row of each run, how
    many rows it stands for, and the empty cache its forward pass fills; None where no two rows share one, or the
    model cannot share (activation checkpointing; sliding-window layers, whose caches keep only their window)."""
    from transformers import DynamicCache
    if getattr(body, "is_activation_checkpointing", False):
        return None
    same = (tokens[1:, :prompt] == tokens[:-1, :prompt]) & (attention_mask[1:, :prompt] == attention_mask[:-1, :prompt])
    starts = torch.cat([torch.ones(1, dtype=torch.bool, device=tokens.device), ~same.all(1)])
    first = starts.nonzero().squeeze(1)                              # a host sync, as needed_columns'
    if len(first) == len(tokens):
        return None
    cache = DynamicCache(config=body.config)
    if any(layer.is_sliding for layer in cache.layers):
        return None
    return first, torch.diff(first, append=torch.tensor([len(tokens)], device=first.device)), cache


def output_head(model):
    return model.head if isinstance(model, MoETransformer) else model.get_output_embeddings()


def head_logits(model, hidden):
    """The vocabulary head on final hidden states, as the model's own forward applies it, in fp32:
    Granite divides the logits by a constant and Gemma soft-caps them; check_scoring, when the model
    loads, checks that this gives the logits of its own forward."""
    logits = output_head(model)(hidden)
    config = getattr(model, "config", None)
    if getattr(config, "logits_scaling", None):
        logits = logits / config.logits_scaling
    if getattr(config, "final_logit_softcapping", None):
        logits = torch.tanh(logits / config.final_logit_softcapping) * config.final_logit_softcapping
    return logits.float()


def minibatches(n, count):
    """Contiguous index chunks of a rollout batch (whole groups stay together when count divides
    the number of prompts)."""
    return torch.arange(n).chunk(count)


def optimizer_step(model, optimizer, loss, max_grad_norm):
    """Backward, clip the gradient norm, step, unless the loss or the gradient is not finite: then
    the update is skipped (the weights stay as they were) and counted. Returns metrics."""
    optimizer.zero_grad(set_to_none=True)
    if not torch.isfinite(loss):
        return {"grad_norm": float("nan"), "skipped_updates": 1}
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm).item()
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "skipped_updates": 1}
    optimizer.step()
    return {"grad_norm": grad_norm, "skipped_updates": 0}


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp(min=1)


def frozen_copy(model):
    """The frozen reference policy for a KL term: a copy of the policy, or with LoRA the policy itself with its
    adapters off (the base it started from, which never changes), so no second copy of the weights."""
    if is_lora(model):
        return AdaptersOff(model)
    return copy.deepcopy(model).eval().requires_grad_(False)


@dataclass
class AdaptersOff:
    """A LoRA policy seen with its adapters disabled: the reference, for fixed_logprobs."""
    policy: typing.Any


def is_lora(model):
    """A model with LoRA adapters (extras/hf_models.add_lora); peft is imported only when --lora-r asks for it."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def check_replay(model):
    """--routing-replay stops before training unless the model's routing can really be replayed: the toy MoE, or a
    Hugging Face MoE model that passes extras/hf_routing.check_replay."""
    if not isinstance(model, MoETransformer):
        return side_module("hf_routing", "--model").check_replay(model)
    check(model.cfg.n_experts > 1, "--routing-replay needs a Mixture-of-Experts model (the toy with --n-experts 1 "
                                   "is dense)")


def trainable(model):
    """The parameters AdamW trains: all of them, or with LoRA only the adapters (and PPO's value head)."""
    return [p for p in model.parameters() if p.requires_grad]


# ----------------------------------------------------------------------------------------------
# The toy world: character tokenizer, tasks with a verifiable reward, the warm start
# ----------------------------------------------------------------------------------------------

TOY_VOCAB = ["<pad>", "<eos>"] + list("0123456789+=*,")
TOY_PAD, TOY_EOS = 0, 1
TOY_ID = {ch: i for i, ch in enumerate(TOY_VOCAB)}


def add_problems():
    """Zero-padded two-digit addition: '07+85=' -> '92'. All 10,000 problems."""
    return [(f"{a:02d}+{b:02d}=", str(a + b)) for a in range(100) for b in range(100)]


def progression_problems():
    """An arithmetic progression written out: '07+3*6=' (start 7, step 3, 6 terms) -> '07,10,13,16,19,22'.
    Two digits a term, steps 1-9, 1-8 terms, all terms <= 99: answers of 2 to 23 characters."""
    return [(f"{a:02d}+{d}*{k}=", ",".join(f"{a + d * j:02d}" for j in range(k)))
            for a in range(100) for d in range(1, 10) for k in range(1, 9) if a + d * (k - 1) <= 99]


CHAIN_LENGTH = 10   # --chain-length's default: 10 running totals, completions of 44 tokens
MAX_CHAIN_LENGTH = 110  # 9 x 110 = 990: the longest chain whose every step size still has a start


def chain_problems(length=CHAIN_LENGTH):
    """Running totals, written out: '123+7=' -> '130,137,...,193=193', the start plus the step (1-9) `length`
    times, three digits each, then '=' and the last total. Each total is the one before it plus the step, so a
    wrong total spoils the later ones and the answer. Every start and step whose totals stay under 1000:
    7,500-9,000 prompts for lengths up to 33; completions of 4 * length + 4 tokens, EOS included."""
    return [(f"{a:03d}+{d}=", ",".join(totals) + "=" + totals[-1])
            for d in range(1, 10) for a in range(1000 - d * length)
            for totals in [[f"{a + d * i:03d}" for i in range(1, length + 1)]]]


def chains_problems(longest=CHAIN_LENGTH):
    """Chains of every length from 1 to `longest`, the length in the prompt: '123+7*03=' -> '130,137,144=144'.
    One batch then holds answers of 8 to 4 * longest + 4 tokens, the mix DAPO's token-level loss is about."""
    return [(f"{p[:-1]}*{n:02d}=", a) for n in range(1, longest + 1) for p, a in chain_problems(n)]


def chain_reward(completion, answer, finished):
    """1 for exactly the final answer (after the first '=') followed by EOS, whatever the chain before it."""
    return float(finished and "=" in completion and completion.split("=", 1)[1] == answer.split("=", 1)[1])


def progression_ramble(prompt, length):
    """A completion that misses its stop: it keeps counting past the k-th term, with no EOS."""
    a, d = int(prompt[:2]), int(prompt[3])
    return ",".join(f"{(a + d * j) % 100:02d}" for j in range(length))[:length]


@dataclass
class ToyTask:
    problems: typing.Callable        # () -> [(prompt, answer)]; (length) -> ... when `sized`
    max_new_tokens: int              # the default completion limit (None: see toy_world)
    ramble: typing.Callable = None   # (prompt, length) -> a completion that never ends
    ramble_share: float = 0.0        # share of warm-start examples taught to ramble, without EOS
    reward: typing.Callable = None   # (completion, answer, finished) -> float (None: toy_reward, the whole answer)
    sized: bool = False              # --chain-length sets the length of its answers


# The length task plants truncation on purpose: after a plain warm start a model learns where to stop
# before it learns the digits, so nothing would ever be truncated and DAPO's length techniques would
# have nothing to act on. A quarter of its warm-start examples ramble to the limit instead.
# The chain task gives long answers (44 tokens by default) whose reward reads only their last four; chains
# mixes every length up to --chain-length.
TASKS = {"add": ToyTask(add_problems, max_new_tokens=8),
         "progression": ToyTask(progression_problems, max_new_tokens=32, ramble=progression_ramble,
                                 ramble_share=0.25),
         "chain": ToyTask(chain_problems, max_new_tokens=None, reward=chain_reward, sized=True),
         "chains": ToyTask(chains_problems, max_new_tokens=None, reward=chain_reward, sized=True)}
MAX_CHAINS_LENGTH = 99  # two digits in the prompt


@dataclass
class World:
    """What an algorithm needs to know about the task: prompts (as token ids) with their answers,
    how to read a completion, and the reward. The same for the toy tasks and for --model/--data."""
    train: list            # [(prompt_ids, answer)]
    eval: list             # [(prompt_ids, answer)], fixed and held out
    decode: typing.Callable
    reward: typing.Callable    # reward(completion_text, answer, finished) -> float
    eos_ids: tuple         # a completion ends at the first of these tokens (it is part of the completion)
    pad_id: int
    max_new_tokens: int
    tokenizer: typing.Any = None   # --model's Hugging Face tokenizer, exported with the model; None for the toy
    static_cache: bool = False     # --static-cache on a dense --model: generate samples with extras/static_decode

    def sample(self, n):
        """n random training prompts (with replacement), drawn from torch's generator."""
        idx = torch.randint(len(self.train), (n,)).tolist()
        return [self.train[i][0] for i in idx], [self.train[i][1] for i in idx]


def toy_reward(completion, answer, finished):
    """1 for exactly the answer followed by EOS, else 0."""
    return float(finished and completion == answer)


def split_eval(rows, n_held_out):
    """A fixed held-out set, the same for every seed: a seeded shuffle, the first rows held out."""
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(1234)).tolist()
    n_held_out = min(n_held_out, len(rows) // 5)
    if n_held_out == 0:  # too few rows to hold any out: evaluate on the training rows (the same list), and say so
        print(f"note: only {len(rows)} rows, too few to hold some out; evaluating on training rows", file=sys.stderr)
        rows = [rows[i] for i in perm]
        return rows, rows
    return [rows[i] for i in perm[n_held_out:]], [rows[i] for i in perm[:n_held_out]]


def toy_world(task, eval_size, max_new_tokens, chain_length=CHAIN_LENGTH):
    toy, encode = TASKS[task], lambda s: torch.tensor([TOY_ID[c] for c in s])
    rows = [(encode(p), a) for p, a in (toy.problems(chain_length) if toy.sized else toy.problems())]
    train, held_out = split_eval(rows, 500)  # the same 500 held out whatever --eval-size, so one base fits all
    decode = lambda ids: "".join(TOY_VOCAB[i] for i in ids if i > TOY_EOS)
    # Without a limit of its own (chain): the longest answer and EOS, a third more and 8, so that dapo.py's
    # overlong buffer (the last quarter of the limit) starts after the longest right answer, never on it.
    longest = max(len(a) for _, a in rows) + 1
    return World(train, held_out[:eval_size], decode, toy.reward or toy_reward, (TOY_EOS,), TOY_PAD,
                 max_new_tokens or toy.max_new_tokens or longest + longest // 3 + 8)


def toy_model_config(args, world):
    """64 positions, or more when --max-new-tokens asks for them (rotary positions: no table to learn)."""
    longest = max(p.numel() for p, _ in world.train) + world.max_new_tokens
    return MoEConfig(vocab_size=len(TOY_VOCAB), max_seq_len=max(64, longest), d_model=args.d_model,
                     n_layers=args.n_layers, n_experts=args.n_experts, top_k=args.top_k,
                     expert_hidden=args.expert_hidden)


def answer_batch(prompts, targets):
    """Prompts [B, P] and target token lists -> (answers [B, T] padded with -100, input tokens [B, P+T-1])."""
    answers = torch.nn.utils.rnn.pad_sequence(targets, batch_first=True, padding_value=-100)
    return answers, torch.cat([prompts, answers.clamp(min=0)], 1)[:, :-1]


def answer_loss(model, prompts, targets, aux_coef):
    """Supervised loss: cross-entropy on the answer tokens and EOS only (positions P-1 .. end predict answer[0]
    .. EOS), plus aux_coef times the load-balancing loss."""
    answers, tokens = answer_batch(prompts, targets)
    logits, _, aux_loss = model(tokens)
    return F.cross_entropy(logits[:, prompts.shape[1] - 1:].flatten(0, 1), answers.flatten(),
                           ignore_index=-100) + aux_coef * aux_loss


@torch.no_grad()
def teacher_forced_accuracy(model, rows):
    """Greedy accuracy on rows [(prompt_ids, answer)] in one forward pass: greedy decoding writes the answer
    and EOS exactly when each of their tokens is the argmax (PAD excluded) given the ones before it."""
    prompts = torch.stack([p for p, _ in rows])
    answers, tokens = answer_batch(prompts, [torch.tensor([TOY_ID[c] for c in a] + [TOY_EOS]) for _, a in rows])
    best = model(tokens)[0][:, prompts.shape[1] - 1:, 1:].argmax(-1) + 1
    return ((best == answers) | (answers == -100)).all(1).float().mean().item()


def warm_start(world, cfg, task, target=0.4, batch_size=256, lr=3e-3, ema=0.95, aux_coef=0.01, seed=0,
               max_steps=2000):
    """Supervised warm start: RL needs a policy that is right some of the time (from a random model
    it learns nothing). Cross-entropy on the answer and EOS only. It stops when the greedy accuracy of
    an exponential moving average (EMA) of the weights on the held-out prompts (world.eval; all 500 of
    them) reaches `target`, and returns that average. A fixed number of steps would stop on a steep,
    jagged part of the learning curve, where a CPU's rounding or the seed moves the base by 0.2; the
    average climbs smoothly (~0.01 a step), so every machine and seed stops at 0.40-0.42. Cached on disk, keyed
    by every setting and the CPU kernel set (other kernels sum in another order), so only the first run pays
    (benchmarks/results/bases.md). Cache folder: $RL_CACHE_DIR, default ~/.cache/llm-rl-reference."""
    key = json.dumps([dataclasses.asdict(cfg), target, batch_size, lr, ema, aux_coef, seed, max_steps,
                      task.ramble_share, world.max_new_tokens if task.ramble else None,
                      [(p.tolist(), a) for p, a in world.train[:50]], len(world.train), len(world.eval),
                      torch.backends.cpu.get_cpu_capability()])
    cache_dir = Path(os.environ.get("RL_CACHE_DIR", Path.home() / ".cache" / "llm-rl-reference"))
    path = cache_dir / f"base-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
    model = MoETransformer(cfg)
    if path.exists():
        model.load_state_dict(torch.load(path, weights_only=True))
        return model, path
    gen, ramble_gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    torch.manual_seed(seed)
    model = MoETransformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    average = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(ema))
    next_check = 1
    for step in range(1, max_steps + 1):
        warm_start_step(model, opt, average, world, task, gen, ramble_gen, batch_size, aux_coef)
        if step == next_check:
            # Teacher forcing checks the whole answer in one pass: the greedy reward (chain, whose reward reads
            # only the final answer: every total right too, so the base's greedy reward is at least this).
            accuracy = teacher_forced_accuracy(average.module, world.eval)
            if accuracy >= target:
                break
            # Each check is a forward pass over 500 prompts. The average climbs ~0.01 a step and rarely 0.02,
            # so no check is needed before the remaining gap could be closed at 0.02 a step: skip to there.
            next_check = step + max(1, int((target - accuracy) / 0.02))
    else:
        print(f"note: the warm start reached greedy accuracy {accuracy:.3f}, not {target}, in {max_steps} steps",
              file=sys.stderr)
    model = average.module
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two runs building the same base never share a file
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, path)  # atomic: another run never reads half a file
    return model, path


def warm_start_step(model, opt, average, world, task, gen, ramble_gen, batch_size=256, aux_coef=0.01):
    """One supervised step of the warm start: batch_size training prompts drawn with `gen`, the answer loss on their
    answers and EOS, AdamW with the gradient norm clipped at 1, then the moving average's update."""
    idx = torch.randint(len(world.train), (batch_size,), generator=gen).tolist()
    targets = [torch.tensor([TOY_ID[c] for c in world.train[i][1]] + [TOY_EOS]) for i in idx]
    if task.ramble:  # these examples never stop: a truncation habit for RL to unlearn
        for j in (torch.rand(batch_size, generator=ramble_gen) < task.ramble_share).nonzero().flatten().tolist():
            prompt = world.decode(world.train[idx[j]][0].tolist())
            targets[j] = torch.tensor([TOY_ID[c] for c in task.ramble(prompt, world.max_new_tokens)])
    loss = answer_loss(model, torch.stack([world.train[i][0] for i in idx]), targets, aux_coef)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    average.update_parameters(model)


def make_policy(args, device):
    """The policy, in training mode, and its world: the warm-started toy MoE (default), or a Hugging Face model with
    --model and --data (extras/hf_models.make_policy)."""
    check(args.dtype != "bf16" or device.type in ("cuda", "cpu"), "--dtype bf16 needs a CUDA device or the CPU")
    if args.model is not None:
        return side_module("hf_models", "--model").make_policy(args, device)
    world = toy_world(args.task, args.eval_size, args.max_new_tokens, args.chain_length)
    if args.reward:                                                  # yours, instead of the task's
        world.reward = side_module("rewards", "--reward").load_reward(args.reward)
    cfg = toy_model_config(args, world)
    # The warm start stops on all 500 held-out prompts whatever --eval-size: one base fits all.
    model, path = warm_start(toy_world(args.task, 500, args.max_new_tokens, args.chain_length), cfg,
                             TASKS[args.task])
    model.bf16 = uses_bf16(args, device)
    print(f"toy MoE ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters; {compute(model, device)}), "
          f"warm-started base: {path}")
    return training_mode(model.to(device), args.gradient_checkpointing), world


def uses_bf16(args, device):
    """--dtype auto: bf16 autocast on CUDA, and with --model on a CPU that computes bf16 natively (AVX512-BF16 or AMX:
    the real model's step 1.5x faster, benchmarks/results/speed.md) in torch's AVX-512 kernels (ATEN_CPU_CAPABILITY
    avx2 or default: bf16 attention fails on AMX); else fp32 (the toy gains nothing, emulated bf16 is slower)."""
    if args.dtype != "auto":
        return args.dtype == "bf16"
    native = torch.backends.cpu.get_cpu_capability() == "AVX512" and any(   # the kernels in use, beside the chip's
        getattr(torch.cpu, f"_is_{flag}_supported", lambda: False)() for flag in ("avx512_bf16", "amx_tile"))
    return device.type == "cuda" or (device.type == "cpu" and args.model is not None and native)


def compute(model, device):
    """How the run computes, for its first line: "cpu, 1 thread, fp32"."""
    threads = torch.get_num_threads()
    where = f"cpu, {threads} thread{'s' if threads > 1 else ''}" if device.type == "cpu" else str(device)
    return f"{where}, {'bf16 autocast' if model.bf16 else 'fp32'}"


def training_mode(model, gradient_checkpointing):
    """The update runs in training mode, the mode in which activation checkpointing acts, with every
    dropout probability (and Mixtral's router jitter) set to 0: with dropout the ratio of unchanged
    weights would not be 1. Sampling switches to eval mode on its own (sampling_mode)."""
    for module in [*model.modules(), *([model.config] if hasattr(model, "config") else [])]:
        for name, value in list(vars(module).items()):
            if isinstance(value, float) and ("dropout" in name or name == "jitter_noise" or name == "p"
                                             and isinstance(module, torch.nn.Dropout)):
                setattr(module, name, 0.0)
    if gradient_checkpointing and isinstance(model, MoETransformer):
        model.gradient_checkpointing = True
    elif gradient_checkpointing:
        model.activation_checkpointing_enable()  # transformers 5.24's name (gradient_checkpointing_enable: deprecated)
    return model.train()



# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model, world, batch_size=512):
    """Greedy on the fixed held-out set: the accuracy (mean reward) and the share of answers cut off at the length
    limit (a truncated answer scores 0, so accuracy / (1 - truncated) is the accuracy among finished answers). A run
    evaluates batch_size = its rollout batch (prompts x group size) at a time: the KV cache of the rollout's
    generation, no more (500 prompts of up to 512 new tokens at once would be tens of GB for a 0.6 B model).
    eval_correct says which problems it answered right: "0110...", one character a held-out prompt in world.eval's
    order, 1 where the reward is 1, so that two runs can be compared problem by problem (Run keeps it apart)."""
    rewards, truncated = [], 0.0
    for start in range(0, len(world.eval), batch_size):
        rows = world.eval[start:start + batch_size]
        rollout = generate(model, world, [p for p, _ in rows], 1, 1.0, greedy=True)
        rewards += rewards_of(world, rollout, [a for _, a in rows], 1).tolist()
        truncated += (~rollout.finished).sum().item()
    return {"eval_accuracy": sum(rewards) / len(world.eval), "eval_truncated_frac": truncated / len(world.eval),
            "eval_correct": "".join("1" if r == 1 else "0" for r in rewards)}


def rollout_metrics(rewards, rollout):
    """What the sampled completions looked like, and the entropy of the distribution they came from."""
    return {"reward_mean": rewards.mean().item(), "accuracy": (rewards == 1).float().mean().item(),
            "response_len_mean": rollout.mask.sum(1).mean().item(),
            "truncated_frac": 1 - rollout.finished.float().mean().item(),
            "entropy": masked_mean(rollout.entropy, rollout.mask).item()}


def quarters(mask):
    """The first and the last quarter of each completion's positions, as masks [N, T]: t < |o_i|/4 and, counted
    from the end the same way, |o_i| - 1 - t < |o_i|/4 (the first and the last ceil(|o_i|/4) tokens, EOS
    included; a completion of 1 to 4 tokens gives one token to each)."""
    t = torch.arange(mask.shape[1], device=mask.device)
    length = mask.sum(1, keepdim=True)
    return mask * (t < length / 4), mask * (length - 1 - t < length / 4)


def by_quarter(name, x, mask, stat=lambda x, m: masked_mean(x, m).item()):
    """{name_q1, name_q4}: stat(x, quarter), by default the mean, over the first and the last quarter of each
    completion (quarters)."""
    first, last = quarters(mask)
    return {f"{name}_q1": stat(x, first), f"{name}_q4": stat(x, last)}


def ratio_metrics(logp, old_logp, mask, routing, old_routing, aux_loss):
    """Per minibatch: the variance of the token ratios r_it and, for MoE models, what routing did to
    them (the GSPO paper's MoE argument): routing drift, the share of (token, layer) pairs whose top-k set
    changed since the rollout; expert drift, the share of chosen experts that are new (the paper's measure:
    with top-8 one new expert in 8 moves routing drift by a whole pair, expert drift by 1/8); and the mean
    |log r_it| of the tokens re-routed in any layer versus the others. The variance
    and the drift also over the first and the last quarter of each completion (_q1, _q4): where in a long
    answer the ratios and the routing move."""
    variance = lambda x, m: x[m.bool()].var().item() if m.sum() > 1 else float("nan")
    with torch.no_grad():
        valid = mask.bool()
        log_ratio = logp - old_logp
        ratio = log_ratio.exp()
        metrics = {"token_ratio_var": variance(ratio, mask), **by_quarter("token_ratio_var", ratio, mask, variance)}
        if routing is None:
            return metrics
        new_share = experts_new(routing, old_routing, mask.shape[1])                       # [L, N, T]
        changed = new_share > 0                        # k distinct experts: the set differs iff one is new
        rerouted, valid_log_ratio = changed.any(0)[valid], log_ratio[valid]                # in any layer
        mean_abs = lambda x: x.abs().mean().item() if len(x) else float("nan")
        drift = changed.float().mean(0)                                                    # [N, T], over layers
        new = new_share.mean(0)                                                            # [N, T], over layers
        return metrics | {"routing_drift": masked_mean(drift, mask).item(), **by_quarter("routing_drift", drift, mask),
                          "expert_drift": masked_mean(new, mask).item(),
                          "rerouted_token_frac": rerouted.float().mean().item(),
                          "abs_log_ratio_rerouted": mean_abs(valid_log_ratio[rerouted]),
                          "abs_log_ratio_other": mean_abs(valid_log_ratio[~rerouted]),
                          "load_balancing_loss": float("nan") if aux_loss is None else aux_loss.item()}


def experts_new(routing, old_routing, T):
    """[L, N, T]: the share of each token's k chosen experts that were not among the recorded k (the GSPO
    paper's measure: "about 10% of the activated experts" change after an update of a 48-layer MoE)."""
    chosen, recorded = routing[:, :, -T:], old_routing[:, :, -T:]
    return (chosen[..., :, None] != recorded[..., None, :]).all(-1).float().mean(-1)


def mean_metrics(per_minibatch):
    """Average metric dicts (one per minibatch) key by key over their finite values (a skipped
    update's NaN is left out); skipped_updates is a count, so it is summed."""
    out = {}
    for k in per_minibatch[0]:
        values = [m[k] for m in per_minibatch if k in m and math.isfinite(m[k])]
        if k == "skipped_updates":
            out[k] = sum(values)
        else:
            out[k] = sum(values) / len(values) if values else None   # None: every minibatch was skipped
    return out


def peak_memory_mb(device):
    """Peak memory of this process: allocated by torch on CUDA, resident set size elsewhere."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024    # Linux reports KiB


# ----------------------------------------------------------------------------------------------
# Command line: a dataclass of arguments becomes an argparse parser; seeds, devices
# ----------------------------------------------------------------------------------------------

def arg(default, help):
    """A dataclass field with its --help text: `lr: float = arg(1e-4, "AdamW learning rate")`."""
    return field(default=default, metadata={"help": help})


def parse_args(cls, doc, argv=None):
    """Build a parser from the dataclass `cls`: field `max_new_tokens` becomes `--max-new-tokens`, a bool defaulting
    to False a switch `--x`, one defaulting to True `--no-x`. `args.given` names the settings given (for --resume)."""
    script = Path(sys.argv[0]).name
    summary = "\n\n".join(doc.split("\n\n")[:2])      # the title and what it is; the rest of the guide is in the file
    parser = Parser(description=f"{summary}\n\nThe formula, how to run it and what to expect: the docstring at the top "
                                f"of {script}.", formatter_class=argparse.RawDescriptionHelpFormatter,
                    allow_abbrev=False,                           # --step 3 is a typo, not --steps 3
                    argument_default=argparse.SUPPRESS)           # a setting not given: the dataclass's default
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag, kind, help = "--" + f.name.replace("_", "-"), hints[f.name], f.metadata.get("help", "")
        if kind is bool:
            if f.default:
                parser.add_argument("--no-" + flag[2:], dest=f.name, action="store_false", help=help)
            else:
                parser.add_argument(flag, dest=f.name, action="store_true", help=help)
            continue
        if typing.get_origin(kind) is typing.Union:  # Optional[int] -> int
            kind = next(t for t in typing.get_args(kind) if t is not type(None))
        shown = "" if "default" in help else f" (default: {f.default})"  # a help text may say it better
        parser.add_argument(flag, dest=f.name, type=kind, help=help + shown)
    given = vars(parser.parse_args(argv))
    args = cls(**given)
    args.given = set(given)
    return args


class Parser(argparse.ArgumentParser):
    """argparse with one line for a mistake, not the usage block: an unknown flag named with the closest real ones."""

    def error(self, message):
        if message.startswith("unrecognized arguments: "):
            known = [option for action in self._actions for option in action.option_strings if option != "--help"]
            unknown = [word.split("=")[0] for word in message.split(": ", 1)[1].split() if word.startswith("--")]
            close = lambda flag: difflib.get_close_matches(flag, known, n=2, cutoff=0.7)
            message = "; ".join(f"unknown flag {flag}" + (f" (did you mean {' or '.join(close(flag))}?)"
                                                          if close(flag) else "") for flag in unknown) or message
        self.exit(2, f"error: {message}\n")


TOY_LR, MODEL_LR = 1e-4, 1e-6   # --lr's defaults, on the toy and with --model


def check_common_args(args, min_group_size=2):
    """Checks shared by every script (each script checks its own hyperparameters too), and the defaults that follow
    the model (--lr)."""
    for name in ("steps", "group_size", "prompts_per_step", "minibatches", "eval_size", "max_grad_norm"):
        check(getattr(args, name) > 0, f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    check(args.group_size >= min_group_size, f"--group-size must be at least 2 (advantages compare completions "
                                             f"within a group), got {args.group_size}")
    check(args.max_new_tokens is None or args.max_new_tokens > 0,
          f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    check(args.temperature > 0, f"--temperature must be positive, got {args.temperature}")
    # The learning rate follows the model: the toy learns at 1e-4; a pretrained model breaks there (SmolLM2-135M at
    # 1e-4: benchmarks/results/real.md's lr study), so with --model the GRPO paper's (and TRL's) 1e-6.
    if args.lr is None:
        args.lr = TOY_LR if args.model is None else MODEL_LR
    if getattr(args, "critic_lr", 0) is None:  # ppo.py's critic learns at the policy's rate unless told otherwise
        args.critic_lr = args.lr
    check(args.lr > 0, f"--lr must be positive, got {args.lr}")
    check(args.eval_every >= 0, f"--eval-every must be 0 (only at start and end) or positive, got {args.eval_every}")
    check(args.save_every >= 0, f"--save-every must be 0 (only at the end) or positive, got {args.save_every}")
    n = args.prompts_per_step * args.group_size
    check(n % args.minibatches == 0, f"--minibatches {args.minibatches} must divide the {n} completions per step "
                                     f"(--prompts-per-step x --group-size)")
    check(args.task in TASKS, f"unknown --task {args.task!r}; choose one of {', '.join(TASKS)}")
    longest = MAX_CHAINS_LENGTH if args.task == "chains" else MAX_CHAIN_LENGTH
    check(0 < args.chain_length <= longest, f"--chain-length must be between 1 and {longest}, got {args.chain_length}")
    check(args.n_experts > 0 and args.expert_hidden > 0, "--n-experts and --expert-hidden must be positive")
    check(args.n_experts == 1 or 0 < args.top_k <= args.n_experts,
          f"--top-k must be between 1 and --n-experts ({args.n_experts}), got {args.top_k}")
    check(args.data is None or args.model is not None, "--data needs --model (the toy model only knows the toy tasks)")
    check(not args.static_cache or args.model is not None, "--static-cache needs --model (a Hugging Face model)")
    if args.static_cache:     # its import checks transformers (5.24: the cache= keyword) and torch (2.6: set_stance)
        side_module("static_decode", "--static-cache")
    check(args.lora_r >= 0 and args.lora_alpha > 0,
          f"--lora-r must be 0 (off) or positive and --lora-alpha positive, got {args.lora_r} and {args.lora_alpha}")
    check(args.lora_r == 0 or args.model is not None, "--lora-r needs --model (the toy model is small: it trains "
                                                      "in full)")
    check(args.lora_r > 0 or not args.merge_lora, "--merge-lora needs --lora-r")
    check(args.lora_r > 0 or args.lora_alpha == type(args).lora_alpha, "--lora-alpha needs --lora-r")
    check(args.device in ("auto", "cpu", "cuda", "mps") or args.device.startswith("cuda:"),
          f"unknown --device {args.device!r}; use auto, cpu, cuda or mps")
    check(args.dtype in ("auto", "bf16", "fp32"), f"unknown --dtype {args.dtype!r}; use auto, bf16 or fp32")
    check(args.sampler in ("policy", "bf16"), f"unknown --sampler {args.sampler!r}; use policy or bf16")
    check(args.rollout_correction in ("auto", *ROLLOUT_CORRECTIONS),
          f"unknown --rollout-correction {args.rollout_correction!r}; use auto, {', '.join(ROLLOUT_CORRECTIONS)}")
    low, high = args.rollout_correction_min, args.rollout_correction_max
    check(high > 0 and (low is None or 0 <= low < high), f"--rollout-correction-min and -max must bound a range of "
                                                         f"positive ratios (0 <= min < max), got {low} and {high}")
    if not (args.print_verl or args.print_trl or args.export_verl_data):    # those write no run
        check_run_folder(args)
    set_threads(args)


def set_threads(args):
    """CPU threads follow the model, as --lr does. The first of: --threads; OMP_NUM_THREADS; else one on the toy (its
    matrices are too small to share: two threads spin waiting for each other; benchmarks/results/speed.md) and with
    --model every core, read from get_num_interop_threads, which torch.set_num_threads never changes: a program's
    imports and set_num_threads calls leave a run's count alone (--threads is how a program chooses)."""
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if args.threads is None and omp:
        check(omp.isdigit() and int(omp) > 0, f"OMP_NUM_THREADS must be a positive count, got {omp!r}")
        args.threads = int(omp)
    elif args.threads is None:
        args.threads = 1 if args.model is None else torch.get_num_interop_threads()
    check(args.threads > 0, f"--threads must be positive, got {args.threads}")
    torch.set_num_threads(args.threads)


def seed_everything(seed):
    # Every random draw in this project (prompts, sampling, init) goes through torch's generators.
    torch.manual_seed(seed)


def pick_device(name):
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    check(not name.startswith("cuda") or torch.cuda.is_available(),
          "--device cuda asked for, but CUDA is not available")
    check(name != "mps" or torch.backends.mps.is_available(), "--device mps asked for, but MPS is not available")
    return torch.device(name)


# ----------------------------------------------------------------------------------------------
# A run: metrics.jsonl, evaluation, progress bar, checkpoints and resuming
# ----------------------------------------------------------------------------------------------

def saved_state(obj):
    """What a checkpoint keeps of obj: its state_dict, or of a LoRA model only the tensors it trains (the adapters,
    PPO's value head): the frozen base is --model's, and --resume loads it again."""
    if is_lora(obj):
        return {name: p.detach() for name, p in obj.named_parameters() if p.requires_grad}
    return obj.state_dict()


def listed(items):
    """The items as "a, b and c": how a run's messages name the files and folders it wrote."""
    items = [str(item) for item in items]
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else items[0]


class RunStopped(Exception):
    """The run stopped on purpose (repeated non-finite updates, nothing left to learn from): message
    printed, exit code 1."""


# Settings a resumed run may change when given again; any other difference from the checkpoint's is refused.
RESUMABLE = {"steps", "out", "resume", "device", "threads", "dtype", "eval_every", "save_every",
             "gradient_checkpointing", "merge_lora"}
MAX_BAD_STEPS = 3  # stop after this many steps in a row with a non-finite loss or gradient


def check_run_folder(args):
    """--out and --resume, checked before anything is built, so a refusal is the run's one line. A resume takes its
    run's settings (--steps too) but those given again: any of RESUMABLE, others only as they were."""
    if not args.resume:
        check(not args.out or not (Path(args.out) / "checkpoint.pt").exists(),
              f"--out {args.out} already holds a run; continue it with --resume {args.out}, or choose another folder "
              f"(without --out, every run gets a new one)")
        return
    where = f"--resume {args.resume}"
    check(Path(args.resume).is_dir(), f"{where}: no such folder")
    check((Path(args.resume) / "checkpoint.pt").is_file(),
          f"{where}: no checkpoint.pt in that folder (to start a run there afresh: --out {args.resume})")
    check(not args.out or Path(args.out) == Path(args.resume),
          "--resume DIR continues in DIR; leave out --out (or give the same folder)")
    checkpoint = read_checkpoint(args, mmap=True)                   # mmap: the settings, not the weights, are read
    # A setting newer than the checkpoint (--lora-r, say) is missing from its args: that run had its default.
    saved = {f.name: f.default for f in dataclasses.fields(args)} | checkpoint["args"]
    given = getattr(args, "given", saved)            # parse_args says what was given; Args built in a program: all
    for name in {f.name for f in dataclasses.fields(args)} - set(given) - {"out", "resume", "threads"}:
        setattr(args, name, saved[name])
    differ = [f"--{k.replace('_', '-')} {saved[k]} in the checkpoint, {v} now"
              for k, v in dataclasses.asdict(args).items() if k not in RESUMABLE and saved[k] != v]
    check(not differ, f"{where}: settings differ from the checkpoint's: " + "; ".join(differ))
    read_run_metrics(args)
    check(checkpoint["step"] < args.steps, f"{where}: the checkpoint is at step {checkpoint['step']} already (--steps "
                                           f"{args.steps}); give a larger --steps to train on")


def read_checkpoint(args, mmap=False):
    """--resume DIR's checkpoint.pt, refused in one line unless this script wrote it."""
    where = f"--resume {args.resume}"
    try:  # weights_only: a checkpoint is data, never code to run
        checkpoint = torch.load(Path(args.resume) / "checkpoint.pt", map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:
        raise UsageError(f"{where}: cannot read checkpoint.pt ({(str(e).splitlines() or [type(e).__name__])[0]})") \
            from None
    check(isinstance(checkpoint, dict) and "algorithm" in checkpoint, f"{where}: checkpoint.pt is not one of ours")
    algorithm = Path(inspect.getfile(type(args))).stem               # the script whose Args these are
    check(checkpoint["algorithm"] == algorithm,
          f"{where}: the checkpoint is from {checkpoint['algorithm']}.py, not {algorithm}.py")
    return checkpoint


def read_run_metrics(args, quiet=False):
    """The rows of --resume DIR's metrics.jsonl, refused in one line unless they are JSON rows with a step. A last line
    cut off while it was written (a killed process) is dropped, with a note unless quiet."""
    where, path = f"--resume {args.resume}", Path(args.resume) / "metrics.jsonl"
    check(path.is_file(), f"{where}: no metrics.jsonl in that folder")
    # A row is written with its newline: text after the last newline is a row cut off by a killed process.
    *lines, torn = path.read_text().split("\n")
    try:
        rows = [json.loads(line) for line in lines]
    except json.JSONDecodeError as e:
        raise UsageError(f"{where}: metrics.jsonl is not valid JSON lines ({e.msg})") from None
    if torn:
        try:
            rows.append(json.loads(torn))  # whole, only its newline missing
        except json.JSONDecodeError:
            if not quiet:
                print(f"note: dropped the last line of metrics.jsonl, cut off while it was written: {torn[:60]!r}",
                      file=sys.stderr)
    check(rows and all(isinstance(r, dict) and "step" in r for r in rows), f"{where}: metrics.jsonl has no steps")
    return rows


def new_run_folder(algorithm, args):
    """runs/<script>-<task>-<date>-<time>: a new folder for every run, so that no run overwrites another."""
    stem = f"runs/{algorithm}-{args.task if args.model is None else 'hf'}-{time.strftime('%Y%m%d-%H%M%S')}"
    return next(f"{stem}{suffix}" for suffix in ["", *(f"-{i}" for i in range(2, 1000))]
                if not Path(f"{stem}{suffix}").exists())


def run_main(train, args):
    """Run `train(args)`: bad input ends with one line on stderr and exit code 2, a deliberate
    stop with exit code 1, Ctrl-C or SIGTERM after its checkpoint with 130 or 143. No tracebacks."""
    try:
        if args.print_verl or args.print_trl or args.export_verl_data:
            flag = "--print-verl" if args.print_verl else "--print-trl" if args.print_trl else "--export-verl-data"
            side_module("graduate", flag).graduate(Path(inspect.getfile(train)).stem, args)
        else:
            train(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except RunStopped as e:
        print(f"stopped: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


class Run:
    """The plumbing around a training loop, so the loop shows only the algorithm:

        run = Run("grpo", args, world, {"policy": policy, "optimizer": optimizer})
        for step in run.steps():     # resumes after the checkpoint's step; a progress bar
            ...
            run.log(record)          # evaluation when due, metrics.jsonl, checkpoint every --save-every
        run.finish()                 # last checkpoint, the policy exported to DIR/model, summary

    `state` maps names to everything with a state_dict (policy, optimizer, a critic...); the first
    entry is the policy. A checkpoint holds those, the step, every random generator's state and the
    arguments; it is written to a temporary file and renamed, so a crash never leaves half of one.
    Ctrl-C or SIGTERM finishes the current step, saves, exports, and stops; a second one stops at once."""

    def __init__(self, algorithm, args, world, state):
        self.algorithm, self.args, self.world, self.state = algorithm, args, world, state
        self.policy = next(iter(state.values()))
        self.out = Path(args.resume or args.out or new_run_folder(algorithm, args))
        self.metrics_path, self.checkpoint_path = self.out / "metrics.jsonl", self.out / "checkpoint.pt"
        self.correct_path = self.out / "eval_correct.jsonl"
        self.bad_steps, self.stop_signal = 0, None
        self.eval_batch = args.prompts_per_step * args.group_size     # no larger than a rollout batch
        if args.resume:
            self.start = self.load()
            self.history = [r for r in read_run_metrics(args, quiet=True) if r["step"] <= self.start]  # drop later
            self.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in self.history))
            correct = self.correct_path.read_text().splitlines() if self.correct_path.exists() else []
            self.correct_path.write_text("".join(line + "\n" for line in correct if line.endswith("}")  # not torn
                                             and json.loads(line)["step"] <= self.start))
            print(f"resuming {self.checkpoint_path} at step {self.start}, on to step {args.steps}")
        else:
            if self.metrics_path.exists():  # a run that stopped before its first checkpoint: nothing to resume
                rows = len(self.metrics_path.read_text().splitlines())
                print(f"note: {self.out} holds no checkpoint.pt, so no run to continue; its metrics.jsonl ({rows} "
                      f"rows) is replaced by this run's", file=sys.stderr)
            self.start, self.history = 0, []
            self.out.mkdir(parents=True, exist_ok=True)
            self.metrics_path.write_text("")
            self.correct_path.write_text("")
            self.write({"step": 0, **evaluate(self.policy, world, self.eval_batch)})
            which = "training" if world.eval is world.train else "held-out"      # split_eval: too few rows
            print(f"step 0: eval accuracy (greedy, {len(world.eval)} {which} prompts) "
                  f"{self.history[0]['eval_accuracy']:.3f}; metrics go to {self.metrics_path}")

    def steps(self):
        # Ctrl-C and SIGTERM (how clusters stop a job: preemption, time limits) finish the step and save.
        previous = {s: signal.signal(s, self.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.bar = tqdm(range(self.start + 1, self.args.steps + 1), desc=self.algorithm, initial=self.start,
                            total=self.args.steps)
            for step in self.bar:
                yield step
                if self.stop_signal:
                    exported = self.save(step, final=True)
                    self.bar.close()
                    print(f"{signal.Signals(self.stop_signal).name}: saved step {step} to "
                          f"{listed([self.checkpoint_path, *exported])}; continue with --resume {self.out} (on to "
                          f"step {self.args.steps}; add --steps N to end elsewhere)", file=sys.stderr)
                    raise SystemExit(128 + self.stop_signal)           # the shell's code for death by signal
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def on_signal(self, signum, frame):
        if self.stop_signal:  # the second one: stop now
            raise SystemExit(128 + signum)
        self.stop_signal = signum
        # Not print: the handler runs wherever the loop was, maybe inside tqdm's write to stderr, where a print
        # raises "reentrant call" and the save is lost. os.write goes around Python's buffered stderr.
        os.write(2, f"\n{signal.Signals(signum).name}: finishing this step, then saving (again: stop at once)\n"
                    .encode())

    def log(self, record):
        """Evaluate when due, write the step's record, watch for non-finite updates, save when due."""
        step, args = record["step"], self.args
        record["peak_memory_mb"] = peak_memory_mb(next(self.policy.parameters()).device)
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            record |= evaluate(self.policy, self.world, self.eval_batch)
        self.write(record)
        self.bar.set_postfix(reward=f"{record['reward_mean']:.2f}", acc=f"{record['accuracy']:.2f}",
                             eval=f"{self.last_eval():.2f}", refresh=False)
        self.bad_steps = self.bad_steps + 1 if record.get("skipped_updates") else 0
        if self.bad_steps >= MAX_BAD_STEPS:
            # Skipped updates leave the weights untouched: what is saved is the last good state.
            self.save(step, final=True)
            self.bar.close()
            raise RunStopped(f"non-finite loss or gradient in {self.bad_steps} steps in a row "
                             f"(steps {step - self.bad_steps + 1}-{step}); the last good state is saved "
                             f"in {self.checkpoint_path}")
        if args.save_every and step % args.save_every == 0:
            self.save(step)

    def write(self, record):
        """The step's record to metrics.jsonl; with an evaluation, the problems it answered right to
        eval_correct.jsonl, a line {"step", "correct"} an evaluation."""
        if "eval_correct" in record:
            with open(self.correct_path, "a") as f:
                f.write(json.dumps({"step": record["step"], "correct": record.pop("eval_correct")}) + "\n")
        self.history.append(record)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def last_eval(self):
        return next(r["eval_accuracy"] for r in reversed(self.history) if "eval_accuracy" in r)

    def save(self, step, final=False):
        """checkpoint.pt; when the run ends or stops (final), the policy exported to DIR/model too (export: the folders
        it wrote)."""
        checkpoint = {"algorithm": self.algorithm, "step": step, "args": dataclasses.asdict(self.args),
                      "rng": torch.get_rng_state(),
                      "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                      **{name: saved_state(obj) for name, obj in self.state.items()}}
        tmp = self.checkpoint_path.with_name(self.checkpoint_path.name + ".tmp")
        torch.save(checkpoint, tmp)
        os.replace(tmp, self.checkpoint_path)  # atomic: the old checkpoint stays until the new one is whole
        return self.export() if final else []

    def export(self):
        """DIR/model: the policy (never PPO's critic) as others load it: the toy as moe_model.save writes it, with its
        vocabulary (a token's id is its index), or a Hugging Face model (extras/hf_models.export: with LoRA, its
        adapters). Returns the folders written."""
        if not isinstance(self.policy, MoETransformer):
            return side_module("hf_models", "--model").export(self)
        with self.new_folder("model") as tmp:
            moe_model.save(self.policy, tmp)
            (tmp / "vocab.json").write_text(json.dumps(TOY_VOCAB) + "\n")
        return [self.out / "model"]

    @contextlib.contextmanager
    def new_folder(self, name):
        """DIR/name, written beside (the block writes DIR/name.tmp) and renamed when whole, as the checkpoint is:
        a second Ctrl-C during the export leaves no half folder under that name."""
        folder, tmp = self.out / name, self.out / f"{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        yield tmp
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)

    def load(self):
        """The checkpoint's state into the policy, the optimizer... and torch's generators; its step."""
        checkpoint = read_checkpoint(self.args)                    # check_run_folder saw that it fits
        for name, obj in self.state.items():
            if is_lora(obj):  # only the trained tensors are in the checkpoint; the base is --model's, loaded again
                check(set(checkpoint[name]) == set(saved_state(obj)), f"--resume {self.args.resume}: the adapters in "
                                                                      f"checkpoint.pt do not fit this model's")
                obj.load_state_dict(checkpoint[name], strict=False)
            else:
                obj.load_state_dict(checkpoint[name])
        torch.set_rng_state(checkpoint["rng"])
        if checkpoint["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(checkpoint["cuda_rng"])
        return checkpoint["step"]

    def finish(self):
        """Last checkpoint and DIR/model, then the run's summary: base and final eval accuracy, sampled accuracy,
        time per step by phase."""
        exported = self.save(self.history[-1]["step"], final=True)
        steps = [h for h in self.history if "step_time_s" in h]
        last = steps[-max(1, len(steps) // 10):]
        key = "sampled_accuracy" if "sampled_accuracy" in last[-1] else "accuracy"  # DAPO: over all it generated
        over = "the last step" if len(last) == 1 else f"the last {len(last)} steps"
        print(f"eval accuracy (greedy): base {self.history[0]['eval_accuracy']:.3f} -> final "
              f"{self.last_eval():.3f}; sampled accuracy over {over} {sum(h[key] for h in last) / len(last):.3f}")
        phases = ", ".join(f"{k[5:-2]} {sum(h[k] for h in steps) / len(steps):.3f}"
                           for k in steps[0] if k.startswith("time_"))
        print(f"time per step: {sum(h['step_time_s'] for h in steps) / len(steps):.3f} s ({phases}); "
              f"total {sum(h['step_time_s'] for h in steps):.0f} s; "
              f"{listed(['checkpoint', 'metrics', *(f'{folder.name}/' for folder in exported)])} in {self.out}")
