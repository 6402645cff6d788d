"""--static-cache: common.generate's sampling loop for a dense Hugging Face model, with a KV cache allocated once and a
decode step of fixed shapes, which on CUDA is compiled with torch.compile (inductor, whole graph) and captured as a CUDA
graph: one launch a token instead of hundreds of small kernels launched one by one from Python. Those launches, not the
GPU, bound generate's loop there (25 ms a token for a 360M model whose weights stream in 0.15 ms). The approach is
PyTorch's gpt-fast's. Elsewhere the same code runs eagerly, and it samples what generate samples: the same tokens for
the same seed, the same entropies, every completion ending where it ends there (tests/test_static_decode.py).
common.generate calls decode() when world.static_cache is set (hf_models.make_policy, --static-cache with a dense
--model); MoE models and the toy keep generate's loop. For models whose layers all attend to the whole sequence
(Llama, SmolLM2, Qwen3...): sliding-window layers keep a cache of another shape, untested here.

What the compiled step avoids, each step, that a plain torch.compile of the model would do:
- casting the cache: under bf16 autocast with fp32 weights, RoPE's fp32 cos/sin promote the keys to fp32, so a cache
  that takes the keys as they come is fp32 and autocast casts all of it to bf16 for attention every step. Here the
  cache is held in the dtype attention computes in (ComputeDtypeLayer): each new key is cast once, when written;
- copying the KV heads: transformers' SDPA attention repeats each KV head for its query heads (repeat_kv, a copy of
  the whole cache) when compiling; decode_attention instead lays a token's query heads out along the query axis of
  their KV head, as transformers itself does when not compiling, and attends to the cache as it is;
- recompiling: a run has one graph for sampling and one for greedy decoding (its evaluations), however many calls:
  the temperature is a tensor (a new float would be a new graph); a greedy batch is padded to the fewest rows of the
  model's caches that hold it, else gets a cache of its own rows (no random numbers are drawn, so extra rows change
  nothing), so an evaluation's smaller last batch takes the graph and cache of its full ones, and no evaluation
  allocates more rows than its batch has; the cache grows in steps of LENGTH_STEP;
- checking guards: after a call's first step (which checks them, compiling if needed) the rest of the call's steps
  have the same shapes, model and settings, so torch.compiler.set_stance(skip_guard_eval_unsafe=True) skips all
  but the guards that tell its graphs apart.
"""
import contextlib
import functools
import weakref

import torch
import torch.nn.functional as F
import transformers

import common

MIN_TRANSFORMERS = (5, 24)  # the model's `cache=` keyword (past_key_values before)
MIN_TORCH = (2, 6)          # torch.compiler.set_stance and its skip_guard_eval_unsafe (decode's later steps)


def check_versions():
    """A one-line error for a transformers too old for the `cache=` keyword (before 5.24 the model takes it in its
    **kwargs and ignores it, and --static-cache would sample from an empty cache) or a torch without set_stance."""
    from packaging.version import Version
    for name, module, least in (("transformers", transformers, MIN_TRANSFORMERS), ("torch", torch, MIN_TORCH)):
        common.check(Version(module.__version__).release[:2] >= least,
                     f"--static-cache needs {name} >= {'.'.join(map(str, least))} (installed: {module.__version__}): "
                     f"pip install -U {name}")


check_versions()          # on import (--static-cache imports this module): before the imports an older one lacks
from transformers.cache_utils import StaticLayer  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

NAME = "static_decode"      # decode_attention's name among transformers' attention implementations
# model -> {rows: StaticCache}, reused from call to call: the captured graph reads and writes the cache where it was
# first allocated, and a new cache would be a new graph to record. It stays allocated through the update.
CACHES = weakref.WeakKeyDictionary()
LENGTH_STEP = 64  # a cache too short for a batch grows to the next multiple of this: few sizes, so few graphs, a run
# The backend that compiles the step off CUDA: None runs it eagerly (a CPU gains nothing from a graph of one token's
# small kernels); the tests set "aot_eager" or "inductor" to check on a CPU what CUDA compiles.
CPU_BACKEND = None


@torch.no_grad()
def decode(model, world, tokens, attention_mask, temperature, greedy=False):
    """What common.generate's loop makes of the left-padded prompts tokens, attention_mask [N, P]: the token of each
    step (a list of [N], PAD after a row's end) and, when sampling, the entropy of each step's distribution and the
    log-prob of each sampled token (lists of [N]; empty when greedy)."""
    N, P = tokens.shape
    compiled = tokens.device.type == "cuda" or CPU_BACKEND is not None
    rows = N                                                           # eager: no graph to share, so no padding
    if greedy and compiled:                 # the smallest cache that holds the batch, and its graph; else its own
        rows = min((r for r in CACHES.get(model, {}) if r >= N), default=N)
    if rows > N:                                  # copies of the last row, their tokens dropped at the end
        tokens, attention_mask = (torch.cat([x, x[-1:].expand(rows - N, -1)]) for x in (tokens, attention_mask))
    device = tokens.device
    cache = static_cache(model, rows, P + world.max_new_tokens, compute_dtype(model, device))
    # The attention mask of the whole rollout, at the cache's length from the start: the prompts' left padding, then 1
    # wherever a completion may go (a slot not yet written is hidden by the causal mask, as a later token is).
    mask = F.pad(attention_mask, (0, cache.get_max_length() - P), value=1)
    positions = common.position_ids(attention_mask)              # as common.forward counts them
    eos_ids = torch.tensor(world.eos_ids, device=device)
    temperature = torch.tensor(float(temperature), device=device)   # a tensor: every temperature, one graph
    alive = torch.arange(rows, device=device) < N                # a padding row has ended before it begins
    step = decode_step
    if compiled:
        step = compiled_step("inductor" if device.type == "cuda" else CPU_BACKEND)
    with attention(model), contextlib.ExitStack() as later_steps:
        # The prompts in one eager pass, as their length changes from batch to batch: the cache's first P slots.
        logits = model(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                       logits_to_keep=1).logits[:, -1].float()
        token, alive, entropy, chosen = sample(logits, alive, world, eos_ids, temperature, greedy)
        new, entropies, chosens, position = [token], [entropy], [chosen], positions[:, -1] + 1
        for t in range(world.max_new_tokens - 1):
            # One host sync a token, as in generate: stop once every completion has ended. Checking every k tokens
            # would save syncs but draw random numbers for steps generate never takes, and its later samples differ.
            if not alive.any():
                break
            if t == 1 and step is not decode_step:   # the first step chose (or compiled) the graph; the rest reuse it
                later_steps.enter_context(torch.compiler.set_stance(skip_guard_eval_unsafe=True))
            # A CUDA graph's outputs live in its own memory, which its next replay overwrites: keep copies.
            token, position, alive, entropy, chosen = [x if x is None else x.clone() for x in
                                                       step(model, cache, token, mask, position, alive, world,
                                                            eos_ids, temperature, greedy)]
            new.append(token)
            entropies.append(entropy)
            chosens.append(chosen)
    return [t[:N] for t in new], *(([] if greedy else x) for x in (entropies, chosens))


def decode_step(model, cache, token, mask, position, alive, world, eos_ids, temperature, greedy):
    """One token for every row, in shapes that never change: the last token in at its position, the next sampled.
    Ended rows go on through it (they write PAD), as in generate, rather than leave the batch."""
    logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=position[:, None], cache=cache,
                   use_cache=True).logits[:, -1].float()
    token, alive, entropy, chosen = sample(logits, alive, world, eos_ids, temperature, greedy)
    return token, position + 1, alive, entropy, chosen


def sample(logits, alive, world, eos_ids, temperature, greedy):
    """generate's choice of the next token, without its host syncs: a captured graph cannot stop to ask the host."""
    logits = common.mask_logits(logits / temperature, world)                   # PAD is never sampled
    if greedy:
        token, entropy, chosen = logits.argmax(-1), None, None
    else:
        logp = F.log_softmax(logits, dim=-1)
        # generate's draw: one uniform number a row, the same draws and tokens for the same seed.
        token = common.inverse_cdf(logp.exp(), torch.rand(len(logp), 1, dtype=torch.float64, device=logp.device))
        entropy = -(logp.exp() * logp).sum(-1)
        chosen = logp.gather(-1, token[:, None]).squeeze(1)                     # the sampled token's log-prob
    token = torch.where(alive, token, world.pad_id)                             # an ended row writes PAD
    return token, alive & ~torch.isin(token, eos_ids), entropy, chosen


def compute_dtype(model, device):
    """The dtype attention computes in: autocast's (bf16 with --dtype bf16), else the weights' (fp32 as make_policy
    loads them)."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else model.dtype


class ComputeDtypeLayer(StaticLayer):
    """transformers' StaticLayer holding keys and values in `dtype`, each new one cast as it is written: under bf16
    autocast a cache of half the size, which attention reads as it is (autocast would otherwise cast the whole fp32
    cache to bf16 each step, to the same values as this cast gives: the same tokens)."""

    def __init__(self, max_cache_len, dtype):
        super().__init__(max_cache_len)
        self.kv_dtype = dtype

    def update(self, key_states, value_states, *args, **kwargs):
        return super().update(key_states.to(self.kv_dtype), value_states.to(self.kv_dtype), *args, **kwargs)


def static_cache(model, rows, length, dtype):
    """The model's cache for `rows` rows in `dtype`, emptied, at least `length` tokens long (allocated again when
    shorter or in another dtype)."""
    caches = CACHES.setdefault(model, {})
    cache = caches.get(rows)
    if cache is None or cache.get_max_length() < length or cache.kv_dtype != dtype:
        caches.pop(rows, None)                                                  # freed before a longer one is made
        cache = transformers.StaticCache(model.config, max_cache_len=-(-length // LENGTH_STEP) * LENGTH_STEP)
        cache.layers = [ComputeDtypeLayer(layer.max_cache_len, dtype) if type(layer) is StaticLayer else layer
                        for layer in cache.layers]                 # a sliding-window layer is left as it is
        cache.kv_dtype, caches[rows] = dtype, cache
    cache.reset()
    return cache


def decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' SDPA attention, but for one query token with grouped KV heads its query heads are laid out along
    the query axis of their KV head, [B, H, 1, D] -> [B, H_kv, H / H_kv, D], and attend to the cache's KV heads
    as they are: what transformers' own SDPA path does when not compiling (its pack_gqa); compiled, it copies each KV
    head H / H_kv times instead (repeat_kv). SDPA's enable_gqa would avoid the copy too, but with a mask CUDA runs it
    on the math kernel only. The prompts' pass, and every model without grouped heads, take transformers' path."""
    groups = getattr(module, "num_key_value_groups", 1)
    B, H, Q, D = query.shape
    if Q != 1 or groups == 1 or (attention_mask is not None and attention_mask.shape[1] != 1):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    out = F.scaled_dot_product_attention(query.reshape(B, H // groups, groups, D), key, value, attn_mask=attention_mask,
                                         dropout_p=dropout, scale=scaling)     # the mask [B, 1, 1, L] broadcasts
    return out.reshape(B, 1, H, D), None                                        # [B, Q, H, D], as transformers'


@contextlib.contextmanager
def attention(model):
    """decode_attention for the model's SDPA layers while decode runs (registered once, with SDPA's masks), then the
    model as it was: its training forward and its saved config never see it."""
    config = model.config
    if config._attn_implementation != "sdpa":
        yield
        return
    register_attention()
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


@functools.cache
def register_attention():
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    transformers.AttentionInterface.register(NAME, decode_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


@functools.cache
def compiled_step(backend):
    """decode_step compiled, once a process and backend: as one graph (fullgraph: a break would split the CUDA graph,
    so it raises instead), for fixed shapes (dynamic=False: a second batch size gets its own graph rather than one of
    symbolic shapes), with inductor's CUDA graphs ("reduce-overhead") and eager's random numbers (fallback_random),
    which compiled code would otherwise draw its own way, so the same seed samples the same."""
    options = {"triton.cudagraphs": True, "fallback_random": True} if backend == "inductor" else None
    return torch.compile(decode_step, backend=backend, fullgraph=True, dynamic=False, options=options)
