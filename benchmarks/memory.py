"""Memory: what fits where, with no download. Qwen3 models of real width and vocabulary, built from their
configs with random weights, on the README's example step; the log-prob path's promise; grpo.py against TRL.

    python benchmarks/memory.py                         # all parts: about 2 h on 2 busy CPU cores, 18 GB of RAM
    python benchmarks/memory.py --only logprobs,trl     # parts: table, logprobs, trl
    python benchmarks/memory.py --device cuda --out benchmarks/results/memory-cuda.md

Each finished measurement is kept in benchmarks/runs/memory/ and reused; --rerun measures again.

1. table: one step of `python grpo.py --model Qwen/Qwen3-0.6B --data train.jsonl --max-new-tokens 512
   --prompts-per-step 8 --group-size 8` (4 minibatches): 64 completions of 512 tokens after prompts of
   150 tokens (an assumption), 16 completions per minibatch. Parts: (a) fp32 weights, grads and AdamW
   moments; (b) the old-log-prob pass (no gradient); (c) one minibatch's forward and backward, with and
   without --gradient-checkpointing. On CPU each model is built with 1-3 layers (the MoE also with fewer
   experts), each in a fresh process, under bf16 autocast as on CUDA, and extrapolated linearly to full
   depth; peaks are the kernel's resettable high-water mark (VmHWM after writing 5 to
   /proc/self/clear_refs), with MALLOC_MMAP_THRESHOLD_=65536 so freed tensors leave the resident set.
   --device cuda measures each model at full depth with torch.cuda.max_memory_allocated, generation too.
2. logprobs: forward + backward of common.logprobs, 16 completions x 512 tokens, on a tiny Qwen3 with the
   151,936-token vocabulary, against the former full-logits path (measured at 2 and 4 completions).
3. trl: whole-process peak resident memory of grpo.py and of TRL's GRPOTrainer (on CPU, fp32, whatever
   --device says), tiny Qwen3 with the real vocabulary, 8 completions of 256 tokens, one optimizer step.
"""
import argparse
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "benchmarks" / "runs" / "memory"
REUSED = []                                   # measurements taken from RUNS, not run again
sys.path.insert(0, str(ROOT))
import common  # noqa: E402  (the repository root is not a package)

GiB = 2**30
PROMPT, COMPLETION, COMPLETIONS, MINIBATCHES = 150, 512, 64, 4      # the README's example step
VOCAB, PAD, EOS = 151936, 151643, 151645                            # Qwen3's vocabulary, <|endoftext|>, <|im_end|>
# From each model's config.json on the Hugging Face Hub (Qwen/Qwen3-0.6B, -1.7B, -4B, -30B-A3B); all have
# head_dim 128 and the 151,936-token vocabulary.
MODELS = {
    "Qwen3-0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, tie_word_embeddings=True),
    "Qwen3-1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, tie_word_embeddings=True),
    "Qwen3-4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, tie_word_embeddings=True),
    "Qwen3-30B-A3B": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, tie_word_embeddings=False),
}
# (layers, experts) built on CPU. 128 experts do not fit in 24 GB even in one layer, so the MoE is built with
# 8 and 16 (top-8 of 8 sends every token to every expert: the same activations as top-8 of 128), 1 and 2 layers
# each, and extrapolated in both.
POINTS = {"Qwen3-0.6B": [(1, None), (2, None), (3, None)], "Qwen3-1.7B": [(1, None), (2, None)],
          "Qwen3-4B": [(1, None), (2, None)], "Qwen3-30B-A3B": [(1, 8), (2, 8), (1, 16), (2, 16)]}
WHOLE_PASS_CHECKED = "Qwen3-0.6B"     # where (b) is also measured over all 4 chunks (the cheapest model)
PARTS = ["a", "b", "c", "c_copies", "c_ckpt"]
CARDS, CUDA_CONTEXT = (24, 40, 80), 0.5 * GiB
WORLD = common.World(train=[], eval=[], decode=None, reward=None, eos_ids=(EOS,), pad_id=PAD,
                     max_new_tokens=COMPLETION)


def config(name, layers=None, experts=None, **tiny):
    from transformers import Qwen3Config, Qwen3MoeConfig
    shape = MODELS[name] | {k: v for k, v in (("num_hidden_layers", layers), ("num_experts", experts)) if v} | tiny
    return (Qwen3MoeConfig if "num_experts" in shape else Qwen3Config)(**dict(
        vocab_size=VOCAB, head_dim=128, max_position_embeddings=40960, pad_token_id=PAD, eos_token_id=EOS) | shape)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def random_rollout(n, device):
    """n sequences as sampled: random ids below PAD (the log-prob path masks PAD), no padding, no EOS."""
    tokens = torch.randint(PAD, (n, PROMPT + COMPLETION), device=device)
    mask = torch.ones(n, COMPLETION, device=device)
    return common.Rollout(tokens, torch.ones_like(tokens), mask, torch.zeros(n, dtype=torch.bool, device=device))


# ---------------------------------------------------------------------------------------------------
# Measuring one model (in a child process of its own, so nothing earlier stays in the resident set)

def memory_now(device):
    return torch.cuda.memory_allocated() if device == "cuda" else proc_status("VmRSS")


def proc_status(field):
    line = next(s for s in Path("/proc/self/status").read_text().splitlines() if s.startswith(field + ":"))
    return int(line.split()[1]) * 1024                                     # the kernel reports kB


def peak_extra(device, fn):
    """Peak memory above the level before `fn` while it runs: torch's allocator peak on CUDA; on CPU the
    high-water mark of the resident set, reset to the current level by writing 5 to /proc/self/clear_refs."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")
    before = memory_now(device)
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() if device == "cuda" else proc_status("VmHWM")) - before


def update(model, batch, kept):
    """One minibatch of the update: log-probs, a loss, backward. Records in `kept` the bf16 tensors of a
    weight's size that autograd saves for the backward: autocast's bf16 copies of the weights."""
    sizes = {p.numel() for p in model.parameters()}

    def pack(t):
        if t.dtype == torch.bfloat16 and t.numel() in sizes:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):    # checkpointed regions use their own hooks
        logp = common.logprobs(model, WORLD, batch, 1.0)[0]
    # The loss's form does not change the memory: GRPO's adds only [16, 512] tensors.
    ((logp * torch.rand_like(logp)).sum() / batch.mask.sum()).backward()


def measure(name, layers, experts, device):
    """Parts (a), (b), (c) of one step, in bytes, on the model `name` cut to `layers` layers (and `experts`)."""
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM  # noqa: F401 (imported
    if device == "cpu":                  # before part a); CUDA's setting: bf16 autocast over fp32 master weights
        common.autocast = lambda device: torch.autocast("cpu", dtype=torch.bfloat16)
    torch.manual_seed(0)
    base = memory_now(device)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config(name, layers, experts))
    model = common.training_mode(common.watch_routers(model), False)      # as common.load_hf and make_policy
    # AdamW's moments appear at its first step: a step on zero gradients allocates what a real one does.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0, fused=True)   # as grpo.py
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    out = {"params": n_params(model), "a": memory_now(device) - base}
    # (b) and (c) are measured above the level before them, and AdamW's moments take no part in them: freed,
    # so that the largest models here fit 24 GB of RAM. The gradients stay (see below).
    del optimizer
    with torch.no_grad(), common.autocast(torch.device(device)):        # the KV cache's dtypes, for its estimate
        cache = model(input_ids=torch.ones(1, 2, dtype=torch.long, device=device), use_cache=True).past_key_values
    out["kv_bytes"] = cache.layers[0].keys.element_size() + cache.layers[0].values.element_size()
    rollout = random_rollout(COMPLETIONS, device)
    if device == "cuda":                 # generation: 8 prompts x 8 completions of 512 tokens (random weights
        prompts = list(rollout.tokens[::8, :PROMPT])                    # almost never sample EOS)
        out["gen"] = peak_extra(device, lambda: common.generate(model, WORLD, prompts, 8, 1.0))
    # The old-log-prob pass runs its 4 chunks one after another and frees each, so on CPU one chunk shows its
    # peak at a quarter of the time (checked against the whole pass on the cheapest model).
    rows, chunks = (COMPLETIONS, MINIBATCHES) if device == "cuda" else (COMPLETIONS // MINIBATCHES, 1)
    out["b"] = peak_extra(device, lambda: common.fixed_logprobs(model, WORLD, rollout[:rows], 1.0, chunks))
    if device == "cpu" and name == WHOLE_PASS_CHECKED:
        out["b_whole"] = peak_extra(device, lambda: common.fixed_logprobs(model, WORLD, rollout, 1.0, MINIBATCHES))
    for part, checkpointing in (("c", False), ("c_ckpt", True)):
        # The gradients stay allocated (zeroed in place), so (a) + (c) bounds grpo.py's loop, which frees
        # them before each backward and allocates them as the activations are freed.
        for p in model.parameters():
            p.grad.zero_()
        common.training_mode(model, checkpointing)
        kept = {}
        out[part] = peak_extra(device, lambda: update(model, rollout[:COMPLETIONS // MINIBATCHES], kept))
        out[part + "_copies"] = sum(kept.values())
    return out


def extrapolate(points, depth, experts=None):
    """The value at full depth from measurements [(layers, experts, value)]: a least-squares line in the layer
    count; for an MoE built with two expert counts, one line for each, extrapolated linearly to `experts`."""
    lines = {}
    for layers, e, value in points:
        lines.setdefault(e, []).append((layers, value))
    at = {}
    for e, line in lines.items():
        mean_l, mean_v = (sum(x) / len(line) for x in zip(*line))
        spread = sum((layers - mean_l) ** 2 for layers, _ in line)
        slope = sum((layers - mean_l) * (value - mean_v) for layers, value in line) / spread if spread else 0.0
        at[e] = mean_v + slope * (depth - mean_l)
    if len(at) == 1:
        return at.popitem()[1]
    (e0, v0), (e1, v1) = sorted(at.items())
    return v0 + (experts - e0) * (v1 - v0) / (e1 - e0)


def fits(total):
    """Per card: yes with 10% to spare for the allocator's fragmentation, tight within the card, else no."""
    need = total + CUDA_CONTEXT
    return ", ".join(f"{gb} GB: {'yes' if need <= 0.9 * gb * GiB else 'tight' if need <= gb * GiB else 'no'}"
                     for gb in CARDS)


def run_child(spec, rerun):
    """One measurement in a fresh process, malloc returning freed blocks to the system; its result dict. The
    table's take hours on CPU: a finished one is kept in benchmarks/runs/memory/ and not run again unless --rerun."""
    path = RUNS / (re.sub(r"[^A-Za-z0-9.]+", "-", json.dumps(spec)).strip("-") + ".json")
    if path.exists() and not rerun:
        REUSED.append(json.loads(path.read_text()))
        return REUSED[-1]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536"))
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    result = json.loads(done.stdout.splitlines()[-1]) | {"seconds": time.perf_counter() - start}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result) + "\n")
    return result


def table(device, rerun):
    from transformers import AutoModelForCausalLM
    gb = lambda x: f"{x / GiB:.2f}"
    lines = ["| model | parameters | (a) weights + grads + AdamW | generation: bf16 weight copies + KV cache | "
             "(b) old log-probs | (c) update | (c) with checkpointing | peak | fits | peak, checkpointing | "
             "fits, checkpointing |", "|" + " --- |" * 11]
    raw = ["| model | layers | experts | parameters | (a) | (a) / parameter | (b) | (c) | bf16 copies kept | "
           "(c) with checkpointing |", "|" + " --- |" * 10]
    for name, shape in MODELS.items():
        with torch.device("meta"):                    # the full model's size, nothing allocated
            params = n_params(AutoModelForCausalLM.from_config(config(name)))
        depth, experts = shape["num_hidden_layers"], shape.get("num_experts")
        points = [(depth, experts)] if device == "cuda" else POINTS[name]
        if device == "cuda" and 16 * params > torch.cuda.get_device_properties(0).total_memory:
            lines.append(f"| {name} | {params / 1e9:.2f} B | {gb(16 * params)} (16 B/param): more than this card |"
                         + " |" * 8)
            continue
        results = []
        for layers, e in points:
            results.append(run_child({"measure": [name, layers, e, device]}, rerun))
            print(f"  {name}, {layers} layers, {e} experts: {results[-1]}", flush=True)
        if any("error" in r for r in results):
            lines.append(f"| {name} | {params / 1e9:.2f} B | failed: {results[-1].get('error')} |" + " |" * 8)
            continue
        for (layers, e), r in zip(points, results):
            whole = f" (whole pass: {gb(r['b_whole'])})" if "b_whole" in r else ""
            raw.append(f"| {name} | {layers} | {e or '—'} | {r['params'] / 1e6:.0f} M | {gb(r['a'])} | "
                       f"{r['a'] / r['params']:.2f} B | {gb(r['b'])}{whole} | {gb(r['c'])} | {gb(r['c_copies'])} | "
                       f"{gb(r['c_ckpt'])} |")
        at = {part: lambda n, part=part: extrapolate([(l, e, r[part]) for (l, e), r in zip(points, results)], n,
                                                     experts) for part in PARTS}
        est = {part: at[part](depth) for part in PARTS}
        if device == "cpu":                           # the fitted cost of one layer (at the full expert count)
            layer = {part: at[part](1) - at[part](0) for part in PARTS}
            tokens = COMPLETIONS // MINIBATCHES * (PROMPT + COMPLETION - 1)     # the trunk's positions per minibatch
            per_token = lambda part: f" ({layer[part] / 2**10 / tokens:.1f} KiB/token)"
            with torch.device("meta"):
                layer_params = params - n_params(AutoModelForCausalLM.from_config(config(name, depth - 1)))
            line = [(l, r["c"]) for (l, e), r in zip(points, results) if e == points[0][1]]
            check = f" ({len(line)} points: (c) within {gb(max(abs(v - at['c'](l)) for l, v in line))} of the line)"
            raw.append(f"| {name}, fit | per layer{check if len(line) > 2 else ''} | {experts or '—'} | "
                       f"{layer_params / 1e6:.0f} M | {gb(layer['a'])} | {layer['a'] / layer_params:.2f} B | "
                       f"{gb(layer['b'])} | {gb(layer['c'])}{per_token('c')} | {gb(layer['c_copies'])} | "
                       f"{gb(layer['c_ckpt'])}{per_token('c_ckpt')} |")
        # Generation keeps autocast's bf16 copies of the weights it casts (one autocast context for the whole
        # generation, common.sampling_mode): those the update keeps for its backward, and the vocabulary head's;
        # and the KV cache of 64 x 662 positions, in the dtypes measured above.
        kv = COMPLETIONS * (PROMPT + COMPLETION) * depth * shape["num_key_value_heads"] * 128 * results[0]["kv_bytes"]
        copies = est["c_copies"] + 2 * VOCAB * shape["hidden_size"]
        gen = results[0]["gen"] if device == "cuda" else copies + kv
        gen_text = gb(gen) if device == "cuda" else f"{gb(gen)} ({gb(copies)} + {gb(kv)})"
        peak = {part: est["a"] + max(gen, est["b"], est[part]) for part in ("c", "c_ckpt")}
        lines.append(f"| {name} | {params / 1e9:.2f} B | {gb(est['a'])} ({est['a'] / params:.1f} B/param) | "
                     f"{gen_text} | {gb(est['b'])} | {gb(est['c'])} | {gb(est['c_ckpt'])} | {gb(peak['c'])} | "
                     f"{fits(peak['c'])} | {gb(peak['c_ckpt'])} | {fits(peak['c_ckpt'])} |")
        print(lines[-1], flush=True)
    return lines, raw


NOTES = """\
All figures in GiB. Peak = (a) + the largest of generation, (b) and (c): the phases of a step run one after another and
free what they allocate, while the weights, gradients and AdamW moments stay allocated throughout (grpo.py sets the
gradients to None only at the next backward). (c) was measured with the gradients already allocated, so it bounds
grpo.py's loop from above. Fits: peak + 0.5 GiB of CUDA context within 90% of the card (the rest for the allocator's
fragmentation): yes; within the card: tight.

How these figures were made: **nothing here ran on a GPU; the CUDA figures were not measured** (`--device cuda`
measures them). Every model was built from its config with random weights and the layers (and experts) of the table
below, its passes run under `torch.autocast("cpu", dtype=torch.bfloat16)` (this benchmark replaces `common.autocast`,
fp32 on CPU, to copy the CUDA setting), and each part was extrapolated linearly to full depth (the MoE also from 8 and
16 experts to 128). Sequences: prompts of 150 tokens (assumed) + 512 completion tokens, every completion at the limit,
no padding. (b) was measured on one of its 4 chunks, which run one after another (the whole pass, on Qwen3-0.6B, in
brackets). Generation was not run on CPU (512 sampled tokens at these widths take hours); its column is an estimate:
the bf16 weight copies autocast holds for the whole generation (one context, `common.sampling_mode`: those the update
keeps for its backward, plus the vocabulary head's) and the KV cache of 64 x 662 positions, in the dtypes measured:
keys in fp32, values in bf16 (Qwen3's q/k RMSNorm multiplies by an fp32 weight, so the keys leave autocast in fp32: 6
bytes per key-value pair, not 4).

What the measurements show (the fit rows below):
- Under bf16 autocast a layer still keeps much in fp32 for the backward: the RMSNorms, q/k norms and rotary embedding
  compute in fp32 in the model's own code and save fp32 tensors, and autocast's bf16 casts of their outputs are saved
  besides (KiB per token and layer in the fit rows).
- With checkpointing a layer keeps its fp32 input, 4 B x hidden size per token (4 KiB at 0.6B width).
- "bf16 copies kept": autograd keeps autocast's bf16 copy of every linear layer's weight for the backward (2 B per
  parameter) without checkpointing, none with it; the vocabulary head is recomputed chunk by chunk, so never. Under
  no_grad autocast still caches them while its context is open: (b) grows by 2 B per parameter of each layer.
- The MoE's experts run in fp32: transformers' grouped_mm path is not autocast-enabled and casts its input to the
  weights' dtype, so their activations are fp32 and no bf16 copies are made of them. The number of experts hardly
  changes (b) and (c): top-8 of 8 and of 16 differ only in the weights."""

CAVEATS = """\
## How far the CPU estimate can be off

On CUDA the same Python code runs the same autocast rules, so the tensors kept for the backward are the same; what
differs: (1) the caching allocator keeps freed blocks reserved and fragments: `nvidia-smi` shows more than
`max_memory_allocated`, typically 5-20% (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` reduces it); the 90% rule
above stands for it. (2) The CUDA context and cuBLAS/cuDNN handles take about 0.5 GiB outside torch's counters, and
kernels' workspaces (cuBLAS, SDPA) add tens to hundreds of MiB at moments. (3) SDPA: here CPU's flash kernel ran (no
padding, so transformers passes no mask); CUDA picks flash or memory-efficient attention, also without the [B, heads,
S, S] scores, but left-padded prompts of unequal length pass a mask, and a fall-back to the math kernel would
materialise the scores (16 x heads x 661 x 661 per layer). (4) oneDNN and cuBLAS may save slightly different
tensors for the backward (the MoE's experts take transformers' fp32 grouped_mm path on both, unless a hub kernel
replaces it); the per-layer slopes above can be checked with a `--device cuda` run.
(5) Generation was estimated, not measured: the KV cache grows by concatenation, one layer at a time, so the
estimate misses at most one layer's cache, and the prefill over 64 x 150 tokens adds one layer's activations."""


# ---------------------------------------------------------------------------------------------------
# The log-prob path: chunked head against the full logits

def full_logits_logprobs(model, rollout):
    """The log-prob path before the chunked head (git history): the model's own forward returns the fp32
    logits [N, T, V]; / temperature, log_softmax, gather, and the entropy from exp()."""
    T = rollout.mask.shape[1]
    logits = model(input_ids=rollout.tokens[:, :-1], attention_mask=rollout.attention_mask[:, :-1],
                   logits_to_keep=T).logits.float()
    all_logp = torch.nn.functional.log_softmax(common.mask_logits(logits / 1.0, WORLD), dim=-1)   # [N, T, V]
    with torch.no_grad():
        -(all_logp.exp() * all_logp).sum(-1)                             # the entropy
    return all_logp.gather(-1, rollout.completions[..., None]).squeeze(-1)


def logprob_check(device):
    """Peak extra memory of one forward + backward: the project's path at 16 completions, the full-logits
    path at 2 and 4. In the project's own precision: fp32 on CPU, bf16 autocast on CUDA."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = common.training_mode(AutoModelForCausalLM.from_config(config(
            "Qwen3-0.6B", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)), False)
    backward = lambda logp: (logp * torch.rand_like(logp)).sum().backward()
    out = {"params": n_params(model), "chunked": peak_extra(device, lambda: backward(common.logprobs(
        model, WORLD, random_rollout(16, device), 1.0)[0]))}
    for n in (2, 4):
        model.zero_grad(set_to_none=True)
        out[f"full_{n}"] = peak_extra(device, lambda: backward(full_logits_logprobs(model, random_rollout(n, device))))
    return out


def logprob_lines(device, rerun):
    r = run_child({"logprobs": device}, rerun)
    if "error" in r:
        return [f"Not measured: {r['error']}"]
    full_16 = extrapolate([(2, None, r["full_2"]), (4, None, r["full_4"])], 16)
    return [f"Tiny Qwen3 (hidden 64, 2 layers, {r['params'] / 1e6:.1f} M parameters, vocabulary 151,936), one forward "
            f"+ backward of the log-prob path, {'fp32' if device == 'cpu' else 'bf16 autocast'} on {device}, "
            f"completions of 512 tokens after {PROMPT} prompt tokens; peak memory above the level before.", "",
            "| log-prob path | completions | peak extra memory |", "| --- | --- | --- |",
            f"| `common.logprobs` (head over chunks of tokens, recomputed in the backward) | 16 | "
            f"{r['chunked'] / 1e9:.2f} GB |",
            f"| former path (fp32 logits [N, T, V], log_softmax, exp for the entropy) | 2 | "
            f"{r['full_2'] / 1e9:.2f} GB |",
            f"| former path | 4 | {r['full_4'] / 1e9:.2f} GB |",
            f"| former path, extrapolated linearly | 16 | {full_16 / 1e9:.1f} GB |", "",
            f"The promise, about 1.5 GB at most for 16 x 512 tokens: {r['chunked'] / 1e9:.2f} GB, "
            f"{'kept' if r['chunked'] < 1.5e9 else '**broken**'}."]


# ---------------------------------------------------------------------------------------------------
# grpo.py against TRL's GRPOTrainer: whole-process peak resident memory

def build_tiny_qwen3(folder):
    """A tiny Qwen3 (hidden 64, 2 layers) with the 151,936-token vocabulary and a word-level tokenizer whose
    vocabulary covers every id (t3 ... t151935; decode joins them with spaces), plus 16 prompts of 32 words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config
    core = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2} | {f"t{i}": i for i in range(3, VOCAB)},
                                      unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(folder)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1,
        bos_token_id=1)).save_pretrained(folder)
    rows = [{"prompt": " ".join(f"t{i}" for i in torch.randint(3, VOCAB, (32,)).tolist()), "answer": "7"}
            for _ in range(16)]
    (Path(folder) / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def trl_run(folder, checkpointing):
    """One optimizer step of TRL's GRPOTrainer, 1 prompt x 8 completions of 256 tokens; prints the mean
    completion length TRL logs."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    reward = lambda prompts, completions, answer, **kw: [common.answer_reward(c, a, True)
                                                         for c, a in zip(completions, answer)]
    args = GRPOConfig(output_dir=str(Path(folder) / "trl"), per_device_train_batch_size=8, num_generations=8,
                      max_completion_length=256, max_steps=1, steps_per_generation=1, loss_type="grpo", beta=0.0,
                      use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1, seed=0,
                      disable_tqdm=True, gradient_checkpointing=checkpointing)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(folder), reward_funcs=reward, args=args,
                          train_dataset=load_dataset("json", data_files=str(Path(folder) / "data.jsonl"),
                                                     split="train"),
                          processing_class=AutoTokenizer.from_pretrained(folder))
    trainer.train()
    print(json.dumps({"length": next(m["completions/mean_length"] for m in trainer.state.log_history
                                     if "completions/mean_length" in m)}))


def max_rss(cmd, log, env):
    """Run `cmd` to completion; its peak resident set in bytes, as `/usr/bin/time -v` reports it (wait4's)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, **env))
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{Path(log).read_text()[-3000:]}")
    return usage.ru_maxrss * 1024                                          # Linux reports KiB


def trl_lines(tmp):
    try:
        import trl
    except ImportError:
        return ["Skipped: trl is not installed (`pip install -r benchmarks/requirements.txt`)."]
    folder = Path(tmp) / "qwen3-tiny"
    build_tiny_qwen3(folder)
    ours = [sys.executable, "grpo.py", "--model", str(folder), "--data", str(folder / "data.jsonl"), "--device",
            "cpu", "--prompts-per-step", "1", "--group-size", "8", "--max-new-tokens", "256", "--minibatches", "1",
            "--steps", "1", "--eval-size", "1"]
    theirs = [sys.executable, __file__, "--trl-child", str(folder)]
    runs = {"grpo.py": ours, "grpo.py --gradient-checkpointing": ours + ["--gradient-checkpointing"],
            "TRL GRPOTrainer (its default, gradient_checkpointing=True)": theirs + ["1"],
            "TRL GRPOTrainer, gradient_checkpointing=False": theirs + ["0"]}
    lines = [f"Tiny Qwen3 (hidden 64, 2 layers, vocabulary 151,936, random weights), 1 prompt of 32 tokens x 8 "
             f"completions of at most 256 tokens, one optimizer step, beta 0, fp32 on CPU; TRL {trl.__version__}. "
             "Each run is a process of its own; its peak resident set is what `/usr/bin/time -v` reports: as users "
             "run it, and with MALLOC_MMAP_THRESHOLD_=65536, which makes malloc give every freed block of 64 KiB or "
             "more back at once (glibc's default keeps some in its heap, so that figure shifts with the order of "
             "allocations and from run to run).", "",
             "| run | peak resident memory | with MALLOC_MMAP_THRESHOLD_=65536 | mean completion length |",
             "| --- | --- | --- | --- |"]
    for i, (name, cmd) in enumerate(runs.items()):
        peaks = []
        for env in ({}, {"MALLOC_MMAP_THRESHOLD_": "65536"}):
            out, log = Path(tmp) / f"run{i}-{len(peaks)}", Path(tmp) / f"run{i}-{len(peaks)}.log"
            peaks.append(max_rss(cmd + (["--out", str(out)] if cmd[1] == "grpo.py" else []), log, env))
        length = (json.loads((out / "metrics.jsonl").read_text().splitlines()[1])["response_len_mean"]
                  if cmd[1] == "grpo.py" else json.loads(log.read_text().splitlines()[-1])["length"])
        lines.append(f"| {name} | {peaks[0] / 1e9:.2f} GB | {peaks[1] / 1e9:.2f} GB | {length:.1f} |")
        print(lines[-1], flush=True)
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--only", default="table,logprobs,trl", help="parts to run, comma-separated")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "memory.md"))
    parser.add_argument("--rerun", action="store_true", help="measure again what benchmarks/runs/memory/ holds")
    parser.add_argument("--child", help=argparse.SUPPRESS)                  # one measurement, in a fresh process
    parser.add_argument("--trl-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        return print(json.dumps(measure(*spec["measure"]) if "measure" in spec else logprob_check(spec["logprobs"])))
    if args.trl_child:
        return trl_run(args.trl_child[0], args.trl_child[1] == "1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    import transformers
    start, parts = time.perf_counter(), args.only.split(",")
    cpu = next(s.split(":", 1)[1].strip() for s in Path("/proc/cpuinfo").read_text().splitlines()
               if s.startswith("model name"))
    ram = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20           # MemTotal, in kB
    machine = (f"{os.cpu_count()} CPU cores ({cpu}), {ram:.0f} GiB RAM" if args.device == "cpu" else
               f"{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).total_memory / GiB:.0f} GiB")
    lines = [f"# Memory ({args.device}: {machine}; torch {torch.__version__}, transformers {transformers.__version__})",
             "", f"Regenerate: `python benchmarks/memory.py{'' if args.device == 'cpu' else ' --device cuda'}`.", ""]
    with tempfile.TemporaryDirectory() as tmp:
        if "table" in parts:
            main_lines, raw = table(args.device, args.rerun)
            lines += ["## The README's example step: what fits where", "",
                      "`python grpo.py --model Qwen/Qwen3-0.6B --data train.jsonl --max-new-tokens 512 "
                      "--prompts-per-step 8 --group-size 8` (--minibatches 4): 64 completions per step, 16 per "
                      "minibatch, fp32 master weights, grads and AdamW moments, bf16 autocast.", "", *main_lines, "",
                      *(NOTES.split("\n") if args.device == "cpu" else []), "",
                      "### Measured points" + (" and the fitted cost of one layer" if args.device == "cpu" else ""),
                      "",
                      *raw, "", *CAVEATS.split("\n"), ""]
        if "logprobs" in parts:
            lines += ["## The log-prob path", "", *logprob_lines(args.device, args.rerun), ""]
        if "trl" in parts:
            lines += ["## grpo.py vs TRL's GRPOTrainer, peak memory at equal work", "", *trl_lines(tmp), ""]
    took = (time.perf_counter() - start) / 60
    earlier = sum(r.get("seconds", 0) for r in REUSED) / 60
    reused = (f", reusing {len(REUSED)} measurements kept from earlier runs in benchmarks/runs/memory/ "
              f"({earlier:.0f} min): {took + earlier:.0f} min of measuring in all" if REUSED else "")
    lines.append(f"This run took {took:.0f} min{reused}.")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
