"""--static-cache: common.generate's sampling loop for a dense Hugging Face model, with a KV cache allocated once and a
decode step of fixed shapes, which on CUDA is compiled with torch.compile's "reduce-overhead" mode: captured once as a
CUDA graph and replayed, one launch a token instead of hundreds of small kernels launched one by one from Python. Those
launches, not the GPU, bound generate's loop there (issue 37: 25 ms a token for a 360M model whose weights stream in
0.15 ms). The approach is PyTorch's gpt-fast's. Elsewhere the same code runs eagerly, and it samples what generate
samples: the same tokens for the same seed, the same entropies, every completion ending where it ends there
(tests/test_static_decode.py). common.generate calls decode() when world.static_cache is set (hf_models.make_policy,
--static-cache with a dense --model); MoE models and the toy keep generate's loop. For models whose layers all attend
to the whole sequence (Llama, SmolLM2, Qwen3...): sliding-window layers keep a cache of another shape, untested here.
"""
import functools
import weakref

import torch
import torch.nn.functional as F
from transformers import StaticCache

import common

# model -> {rows: StaticCache}, reused from call to call: the captured graph reads and writes the cache where it was
# first allocated, and a new cache would be a new graph to record. It stays allocated through the update.
CACHES = weakref.WeakKeyDictionary()
LENGTH_STEP = 64  # a cache too short for a batch grows to the next multiple of this: few sizes, so few graphs, a run


@torch.no_grad()
def decode(model, world, tokens, attention_mask, temperature, greedy=False):
    """What common.generate's loop makes of the left-padded prompts tokens, attention_mask [N, P]: the token of each
    step (a list of [N], PAD after a row's end) and, when sampling, the entropy of each step's distribution."""
    N, P = tokens.shape
    cache = static_cache(model, N, P + world.max_new_tokens)
    # The attention mask of the whole rollout, at the cache's length from the start: the prompts' left padding, then 1
    # wherever a completion may go (a slot not yet written is hidden by the causal mask, as a later token is).
    mask = F.pad(attention_mask, (0, cache.get_max_length() - P), value=1)
    positions = common.position_ids(attention_mask)              # as common.forward counts them
    eos_ids = torch.tensor(world.eos_ids, device=tokens.device)
    # The prompts in one eager pass, as their length changes from batch to batch: the cache's first P slots.
    logits = model(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                   logits_to_keep=1).logits[:, -1].float()
    alive = torch.ones(N, dtype=torch.bool, device=tokens.device)
    token, alive, entropy = sample(logits, alive, world, eos_ids, temperature, greedy)
    new, entropies, position = [token], [entropy], positions[:, -1] + 1
    step = compiled_step() if tokens.device.type == "cuda" else decode_step
    for _ in range(world.max_new_tokens - 1):
        # One host sync a token, as in generate: stop once every completion has ended. Checking every k tokens would
        # save syncs but draw random numbers for steps generate never takes, and its later samples would differ.
        if not alive.any():
            break
        # A CUDA graph's outputs live in its own memory, which its next replay overwrites: keep copies.
        token, position, alive, entropy = [x if x is None else x.clone() for x in
                                           step(model, cache, token, mask, position, alive, world, eos_ids,
                                                temperature, greedy)]
        new.append(token)
        entropies.append(entropy)
    return new, [] if greedy else entropies


def decode_step(model, cache, token, mask, position, alive, world, eos_ids, temperature, greedy):
    """One token for every row, in shapes that never change: the last token in at its position, the next sampled.
    Ended rows go on through it (they write PAD), as in generate, rather than leave the batch."""
    logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=position[:, None], cache=cache,
                   use_cache=True).logits[:, -1].float()
    token, alive, entropy = sample(logits, alive, world, eos_ids, temperature, greedy)
    return token, position + 1, alive, entropy


def sample(logits, alive, world, eos_ids, temperature, greedy):
    """generate's choice of the next token, without its host syncs: a captured graph cannot stop to ask the host."""
    logits = common.mask_logits(logits / temperature, world)                   # PAD is never sampled
    if greedy:
        token, entropy = logits.argmax(-1), None
    else:
        logp = F.log_softmax(logits, dim=-1)
        # torch.multinomial(p, 1) as ATen computes it: argmax of p / q, q ~ Exp(1) from the same generator, so the
        # same draws and tokens for the same seed; without its checks of p, which read p back on the host.
        token = (logp.exp() / torch.empty_like(logp).exponential_(1)).argmax(-1)
        entropy = -(logp.exp() * logp).sum(-1)
    token = torch.where(alive, token, world.pad_id)                             # an ended row writes PAD
    return token, alive & ~torch.isin(token, eos_ids), entropy


def static_cache(model, rows, length):
    """The model's cache for `rows` rows, emptied, at least `length` tokens long (allocated again when shorter)."""
    caches = CACHES.setdefault(model, {})
    if rows not in caches or caches[rows].get_max_length() < length:
        caches.pop(rows, None)                                                  # freed before a longer one is made
        caches[rows] = StaticCache(model.config, max_cache_len=-(-length // LENGTH_STEP) * LENGTH_STEP)
    caches[rows].reset()
    return caches[rows]


@functools.cache
def compiled_step():
    """decode_step compiled, once a process: mode="reduce-overhead"'s CUDA graphs, with eager's random numbers
    (fallback_random), which compiled code would otherwise draw its own way, so the same seed samples the same."""
    return torch.compile(decode_step, options={"triton.cudagraphs": True, "fallback_random": True})
