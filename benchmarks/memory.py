"""Memory: what fits where, with no download. Qwen3 models of real width and vocabulary, built from
their configs with random weights, on the README's example step; the log-prob path's promise; and
grpo.py against TRL's GRPOTrainer.

    python benchmarks/memory.py                    # all parts, about 70 min on 2 CPU cores (24 GB of RAM)
    python benchmarks/memory.py --only logprobs,trl                    # parts: table, logprobs, trl
    python benchmarks/memory.py --device cuda --out benchmarks/results/memory-cuda.md

1. table: one step of `python grpo.py --model Qwen/Qwen3-0.6B --data train.jsonl --max-new-tokens 512
   --prompts-per-step 8 --group-size 8` (4 minibatches): 64 completions of 512 tokens after prompts
   of 150 tokens (an assumption), 16 completions per minibatch. Parts: (a) fp32 weights, grads and
   AdamW moments; (b) the old-log-prob pass over the 64 completions in 4 chunks (no gradient);
   (c) one minibatch's forward and backward, with and without --gradient-checkpointing. On CPU each
   model is built with 1-3 layers (the MoE also with fewer experts), each in a fresh process, under
   bf16 autocast as on CUDA, and extrapolated linearly to its full depth. Peaks come from the
   kernel's resettable high-water mark (VmHWM after writing 5 to /proc/self/clear_refs), with
   MALLOC_MMAP_THRESHOLD_=65536 so that freed tensors leave the resident set at once.
   --device cuda measures every model at full depth with torch.cuda.max_memory_allocated instead,
   generation included.
2. logprobs: forward + backward of common.logprobs for 16 completions x 512 tokens on a tiny Qwen3
   with the 151,936-token vocabulary, against the former full-logits path (at 2 and 4 completions).
3. trl: whole-process peak resident memory of grpo.py and of TRL's GRPOTrainer (always on CPU,
   fp32) on a tiny Qwen3 with the real vocabulary: 8 completions of 256 tokens, one optimizer step.
"""
import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
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
# (layers, experts) built on CPU. 128 experts do not fit in 24 GB even at one layer, so the MoE is measured
# with 8 and 16 (top-8 of 8 is every expert: the same activations as top-8 of 128) and the cost of one more
# expert per layer is extrapolated too.
POINTS = {"Qwen3-0.6B": [(1, None), (2, None), (3, None)], "Qwen3-1.7B": [(1, None), (2, None)],
          "Qwen3-4B": [(1, None), (2, None)], "Qwen3-30B-A3B": [(1, 8), (2, 8), (1, 16)]}
PARTS = ["a", "b", "c", "c_ckpt"]
MODELS_CHECKED_WHOLE = "Qwen3-0.6B"
CARDS = (24, 40, 80)
CUDA_CONTEXT = 0.5 * GiB


def config(name, layers=None, experts=None, **tiny):
    from transformers import Qwen3Config, Qwen3MoeConfig
    shape = MODELS[name] | {k: v for k, v in (("num_hidden_layers", layers), ("num_experts", experts)) if v} | tiny
    cls = Qwen3MoeConfig if "num_experts" in shape else Qwen3Config
    return cls(**dict(vocab_size=VOCAB, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
                      pad_token_id=PAD, eos_token_id=EOS) | shape)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def random_rollout(n, device, completion=COMPLETION):
    """n sampled-looking sequences: random ids below PAD (the log-prob path masks PAD), no padding, no EOS."""
    tokens = torch.randint(PAD, (n, PROMPT + completion), device=device)
    mask = torch.ones(n, completion, device=device)
    return common.Rollout(tokens, torch.ones_like(tokens), mask, torch.zeros(n, dtype=torch.bool, device=device))


WORLD = common.World([], [], None, None, (EOS,), PAD, COMPLETION)


# ---------------------------------------------------------------------------------------------------
# Measuring one model (a child process each, so nothing earlier stays in the resident set)

def memory_now(device):
    if device == "cuda":
        return torch.cuda.memory_allocated()
    return proc_status("VmRSS")


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
        return torch.cuda.max_memory_allocated() - before
    return proc_status("VmHWM") - before


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
    """Parts (a), (b), (c) of one step on the model `name` cut to `layers` layers (and `experts` experts)."""
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM  # noqa: F401 (imported here,
    if device == "cpu":                    # not inside part a); CUDA's setting: bf16 autocast over fp32 weights
        common.autocast = lambda device: torch.autocast("cpu", dtype=torch.bfloat16)
    torch.manual_seed(0)
    base = memory_now(device)
    with torch.device(device):
        model = common.training_mode(AutoModelForCausalLM.from_config(config(name, layers, experts)), False)
    # AdamW's moments appear at its first step: one step on zero gradients allocates what a real one does.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0, fused=True)   # as grpo.py
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    out = {"params": n_params(model), "a": memory_now(device) - base}
    with torch.no_grad(), common.autocast(torch.device(device)):        # dtypes of the KV cache (for the estimate)
        cache = model(input_ids=torch.ones(1, 2, dtype=torch.long, device=device), use_cache=True).past_key_values
    out["kv_bytes"] = cache.layers[0].keys.element_size() + cache.layers[0].values.element_size()
    rollout = random_rollout(COMPLETIONS, device)
    if device == "cuda":                   # generation, measured: 8 prompts x 8 completions of 512 tokens
        prompts = list(rollout.tokens[::8, :PROMPT])
        out["gen"] = peak_extra(device, lambda: common.generate(model, WORLD, prompts, 8, 1.0))
    # The old-log-prob pass runs its 4 chunks one after another and frees each: one chunk shows its peak
    # (checked on the cheapest model against the whole pass) at a quarter of the CPU time.
    out["b"] = peak_extra(device, lambda: common.fixed_logprobs(model, WORLD, rollout[:16], 1.0, 1))
    if name == MODELS_CHECKED_WHOLE or device == "cuda":
        out["b_whole"] = peak_extra(device, lambda: common.fixed_logprobs(model, WORLD, rollout, 1.0, MINIBATCHES))
    for part, checkpointing in (("c", False), ("c_ckpt", True)):
        # The gradients stay allocated (zeroed in place): a + c then bounds grpo.py's loop, which frees them
        # before each backward and fills them as the activations are freed.
        optimizer.zero_grad(set_to_none=False)
        common.training_mode(model, checkpointing)
        kept = {}
        out[part] = peak_extra(device, lambda: update(model, rollout[:COMPLETIONS // MINIBATCHES], kept))
        out[part + "_copies"] = sum(kept.values())
    return out


def extrapolate(points, depth, experts=None):
    """The value at full depth from measurements [(layers, experts, value)]: a least-squares line in the
    layer count (at the first expert count measured) and, for an MoE measured with fewer experts, the
    cost of one more expert in one layer (the two expert counts at equal depth) times the missing experts."""
    e0 = points[0][1]
    line = [(layers, value) for layers, e, value in points if e == e0]
    mean_l = sum(layers for layers, _ in line) / len(line)
    mean_v = sum(value for _, value in line) / len(line)
    spread = sum((layers - mean_l) ** 2 for layers, _ in line)
    slope = sum((layers - mean_l) * (value - mean_v) for layers, value in line) / spread if spread else 0.0
    estimate = mean_v + slope * (depth - mean_l)
    other = [p for p in points if p[1] != e0]
    if experts is not None and other:
        layers, e1, v1 = other[0]
        v0 = next(value for l0, e, value in points if e == e0 and l0 == layers)
        estimate += depth * (experts - e0) * (v1 - v0) / (layers * (e1 - e0))
    return estimate


def fits(total):
    """Per card: yes with 10% to spare for the allocator's fragmentation, tight within the card, else no."""
    verdict = lambda gb: "yes" if total + CUDA_CONTEXT <= 0.9 * gb * GiB else "tight" if total + CUDA_CONTEXT <= \
        gb * GiB else "no"
    return ", ".join(f"{gb} GB: {verdict(gb)}" for gb in CARDS)


def run_child(spec):
    """Run one measurement in a fresh process (malloc returns freed blocks to the system) and return its result."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    return json.loads(done.stdout.splitlines()[-1])


def table(device):
    from transformers import AutoModelForCausalLM
    gb = lambda x: f"{x / GiB:.1f}"
    lines = ["| model | parameters | (a) weights + grads + AdamW | generation: bf16 copies + KV cache | "
             "(b) old log-probs | (c) update | (c) with checkpointing | peak | fits | peak with checkpointing | "
             "fits, with checkpointing |", "|" + " --- |" * 11]
    raw = ["| model | layers | experts | parameters | (a) | (a) / parameter | (b) | (c) | bf16 copies kept | "
           "(c) with ckpt | bf16 copies kept, ckpt |", "|" + " --- |" * 11]
    for name, shape in MODELS.items():
        with torch.device("meta"):                  # the full model's size without allocating it
            params = n_params(AutoModelForCausalLM.from_config(config(name)))
        depth, experts = shape["num_hidden_layers"], shape.get("num_experts")
        points = [(depth, experts)] if device == "cuda" else POINTS[name]
        results = []
        for layers, e in points:
            if device == "cuda" and 16 * params > torch.cuda.get_device_properties(0).total_memory:
                results = []
                break
            start = time.perf_counter()
            results.append(run_child({"measure": [name, layers, e, device]}))
            print(f"  {name}, {layers} layers{f', {e} experts' if e else ''}: {results[-1]} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
        if not results or any("error" in r for r in results):
            why = results[-1]["error"] if results else f"{16 * params / GiB:.0f} GiB of weights + grads + AdamW"
            lines.append(f"| {name} | {params / 1e9:.2f} B | {gb(16 * params)} (16 B/param) | not measured: {why} |"
                         + " |" * 7)
            continue
        for (layers, e), r in zip(points, results):
            raw.append(f"| {name} | {layers} | {e or '—'} | {r['params'] / 1e6:.0f} M | {gb(r['a'])} | "
                       f"{r['a'] / r['params']:.2f} B | {gb(r['b'])} | {gb(r['c'])} | {gb(r['c_copies'])} | "
                       f"{gb(r['c_ckpt'])} | {gb(r['c_ckpt_copies'])} |")
        est = {part: extrapolate([(l, e, r[part]) for (l, e), r in zip(points, results)], depth, experts)
               for part in PARTS}
        # Generation keeps autocast's bf16 copy of every weight (one context for the whole generation) and the
        # KV cache of 64 x 662 positions: keys in fp32 (Qwen3's q/k norm has fp32 weights), values in bf16.
        kv = COMPLETIONS * (PROMPT + COMPLETION) * depth * shape["num_key_value_heads"] * 128 * results[0]["kv_bytes"]
        gen = results[0]["gen"] if device == "cuda" else 2 * params + kv
        gen_text = gb(gen) if device == "cuda" else f"{gb(gen)} ({gb(2 * params)} + {gb(kv)})"
        peak = {part: est["a"] + max(gen, est["b"], est[part]) for part in ("c", "c_ckpt")}
        lines.append(f"| {name} | {params / 1e9:.2f} B | {gb(est['a'])} ({est['a'] / params:.1f} B/param) | "
                     f"{gen_text} | {gb(est['b'])} | {gb(est['c'])} | {gb(est['c_ckpt'])} | {gb(peak['c'])} | "
                     f"{fits(peak['c'])} | {gb(peak['c_ckpt'])} | {fits(peak['c_ckpt'])} |")
        print(lines[-1], flush=True)
    return lines, raw


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
    """Peak extra memory (bytes) of one forward + backward: the project's path at 16 completions, the
    full-logits path at 2 and 4. The project's own precision: fp32 on CPU, bf16 autocast on CUDA."""
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


def logprob_lines(device):
    r = run_child({"logprobs": device})
    if "error" in r:
        return [f"Not measured: {r['error']}"]
    full_16 = extrapolate([(2, None, r["full_2"]), (4, None, r["full_4"])], 16)
    verdict = "under" if r["chunked"] < 1.5e9 else "**over**"
    return [f"Tiny Qwen3 (hidden 64, 2 layers, {r['params'] / 1e6:.1f} M parameters, vocabulary 151,936), "
            f"forward + backward of the log-prob path, {'fp32' if device == 'cpu' else 'bf16 autocast'} on "
            f"{device}, completions of 512 tokens after {PROMPT} prompt tokens.", "",
            "| log-prob path | completions | peak extra memory |", "| --- | --- | --- |",
            f"| `common.logprobs` (head over chunks of tokens, recomputed in the backward) | 16 | "
            f"{r['chunked'] / 1e9:.2f} GB |",
            f"| former path (full fp32 logits [N, T, V]) | 2 | {r['full_2'] / 1e9:.2f} GB |",
            f"| former path | 4 | {r['full_4'] / 1e9:.2f} GB |",
            f"| former path, extrapolated linearly | 16 | {full_16 / 1e9:.1f} GB |", "",
            f"The promise (about 1.5 GB at most for 16 x 512 tokens): {r['chunked'] / 1e9:.2f} GB, {verdict}."]


# ---------------------------------------------------------------------------------------------------
# grpo.py against TRL's GRPOTrainer: whole-process peak resident memory

def build_tiny_qwen3(folder):
    """A tiny Qwen3 (hidden 64, 2 layers) with the 151,936-token vocabulary and a word-level tokenizer whose
    vocabulary covers every id (t3 ... t151935; decode joins them with spaces), plus 16 prompts of 32 words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {f"t{i}": i for i in range(3, VOCAB)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
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
    """One optimizer step of TRL's GRPOTrainer on 1 prompt x 8 completions of 256 tokens; prints the mean
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


def max_rss(cmd, log):
    """Run `cmd` to completion; its peak resident set (bytes) as `/usr/bin/time -v` reports it (wait4's)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
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
    runs = {"grpo.py": (ours, False), "grpo.py --gradient-checkpointing": (ours + ["--gradient-checkpointing"], True),
            "TRL GRPOTrainer (default: gradient_checkpointing=True)": (None, True),
            "TRL GRPOTrainer, gradient_checkpointing=False": (None, False)}
    lines = [f"Tiny Qwen3 (hidden 64, 2 layers, vocabulary 151,936, random weights), 1 prompt of 32 tokens x 8 "
             f"completions of at most 256 tokens, one optimizer step, beta 0, fp32 on CPU; TRL {trl.__version__}. "
             "Each run is a process of its own; its peak resident set is what `/usr/bin/time -v` reports.", "",
             "| run | peak resident memory | mean completion length |", "| --- | --- | --- |"]
    for name, (cmd, checkpointing) in runs.items():
        out, log = Path(tmp) / name.split()[0], Path(tmp) / "log.txt"
        cmd = cmd + ["--out", str(out)] if cmd else [sys.executable, __file__, "--trl-child", str(folder),
                                                     str(int(checkpointing))]
        peak = max_rss(cmd, log)
        length = (json.loads((out / "metrics.jsonl").read_text().splitlines()[1])["response_len_mean"] if
                  name.startswith("grpo") else json.loads(log.read_text().splitlines()[-1])["length"])
        lines.append(f"| {name} | {peak / 1e9:.2f} GB | {length:.1f} |")
        print(lines[-1], flush=True)
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--only", default="table,logprobs,trl", help="parts to run, comma-separated")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "memory.md"))
    parser.add_argument("--child", help=argparse.SUPPRESS)                  # one measurement, in a fresh process
    parser.add_argument("--trl-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(measure(*spec["measure"]) if "measure" in spec else logprob_check(spec["logprobs"])))
        return
    if args.trl_child:
        return trl_run(args.trl_child[0], args.trl_child[1] == "1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    import transformers
    start, parts = time.perf_counter(), args.only.split(",")
    cpu = next((s.split(":", 1)[1].strip() for s in Path("/proc/cpuinfo").read_text().splitlines()
                if s.startswith("model name")), platform.processor())
    ram = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20           # MemTotal, in kB
    machine = (f"{os.cpu_count()} CPU cores ({cpu}), {ram:.0f} GiB RAM" if args.device == "cpu" else
               f"{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).total_memory / GiB:.0f} GiB")
    lines = [f"# Memory ({args.device}: {machine}; torch {torch.__version__}, transformers {transformers.__version__})",
             "", f"Regenerate: `python benchmarks/memory.py{'' if args.device == 'cpu' else ' --device cuda'}`.", ""]
    with tempfile.TemporaryDirectory() as tmp:
        if "table" in parts:
            main_lines, raw = table(args.device)
            lines += ["## The README's example step: what fits where", "", *main_lines, "", *raw, ""]
        if "logprobs" in parts:
            lines += ["## The log-prob path", "", *logprob_lines(args.device), ""]
        if "trl" in parts:
            lines += ["## grpo.py vs TRL's GRPOTrainer, peak memory at equal work", "", *trl_lines(tmp), ""]
    lines.append(f"This run took {(time.perf_counter() - start) / 60:.0f} min.")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
