"""Real models in and out: --model (a Hugging Face causal LM: a local folder, a Hub id or a FILE.gguf), --data (a JSONL
file of {"prompt", "answer"} rows), --lora-r, and the export of the trained policy to DIR/model (or DIR/adapter).
common.make_policy and Run.export import it only when --model asks for it; the toy never does.
"""
import contextlib
import copy
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import urllib.parse
import urllib.request
import warnings
from decimal import Decimal
from pathlib import Path

import torch

import common
from common import UsageError, World, check, split_eval
from extras import hf_routing, rewards


def make_policy(args, device):
    """--model with --data: the policy in training mode and its world (common.make_policy for the toy)."""
    check(args.data is not None, "--model needs --data (a JSONL file of {\"prompt\", \"answer\"} rows)")
    rows = read_jsonl(args.data)  # before loading the model: a broken file should fail fast
    reward = rewards.load_reward(args.reward) if args.reward else None
    lora = lora_config(args) if args.lora_r else None     # peft missing: say so before loading the model
    bf16 = common.uses_bf16(args, device)
    # LoRA freezes the base: in bf16 on CUDA it stays in the checkpoint's dtype (bf16: 2 bytes a parameter, not 16 with
    # fp32 weights, gradients and AdamW's two moments); elsewhere fp32 (a CPU's autocast casts fp32 weights as it goes).
    model, tokenizer = load_hf(args.model, device, "auto" if lora and bf16 and device.type == "cuda" else torch.float32)
    world = hf_world(tokenizer, model, rows, args.data, args.eval_size, args.max_new_tokens)
    world.reward = reward or world.reward
    world.static_cache = args.static_cache and not hf_routing.routers(model)  # an MoE model keeps generate's loop
    model = common.training_mode(add_lora(model, lora, args.seed) if lora else model, args.gradient_checkpointing)
    check_scoring(model, args.model)
    model.bf16 = bf16
    print(f"{args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, lr {args.lr}; "
          f"{common.compute(model, device)}")
    return model, world


@torch.no_grad()
def check_scoring(model, name):
    """One short forward, two ways: the log-prob path (trunk and head apart, training mode) must give the
    model's own logits in eval mode. It would not for a head transform this code does not know, or for
    dropout or noise that training_mode could not turn off; better to stop than to train on wrong ratios."""
    tokens = torch.arange(1, 9, device=next(model.parameters()).device)[None] % model.config.vocab_size
    model.eval()
    expected = model(input_ids=tokens).logits.float()
    model.train()
    got = common.head_logits(model, common.trunk(model, tokens, torch.ones_like(tokens))[0])
    check(torch.allclose(got, expected, rtol=1e-4, atol=1e-4),
          f"--model {name}: its logits cannot be reproduced from its hidden states and output embeddings "
          f"(largest difference {(got - expected).abs().max().item():.2g}); this model is not supported")


def load_hf(name, device, dtype=torch.float32):
    """AutoModelForCausalLM + AutoTokenizer from a local folder or a Hub id; trust_remote_code stays off. The
    weights in fp32 (the optimizer's master weights), or in the checkpoint's dtype with dtype="auto". Hub kernels
    stay off too: with the `kernels` package (a dependency of transformers 5.25) model.train() on a GPU swaps in
    layers downloaded from the Hub, which fails offline and is not the arithmetic this code checks."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    path = os.path.expanduser(name)
    if path.endswith(".gguf"):
        path = gguf_folder(name)
    elif not os.path.isdir(path):  # a Hub id is "org/name" or, older, "name" (gpt2); anything else must exist
        check(not os.path.exists(path), f"--model {name}: not a folder")
        check(not name.startswith((".", "/", "~")) and name.count("/") <= 1,
              f"--model {name}: no such folder (and not a Hub id: those look like org/name, or gpt2)")
    else:
        check(os.path.isfile(os.path.join(path, "config.json")),
              f"--model {name}: no config.json in that folder, so not a Hugging Face model")
    # A Hub id with the Hub out of reach: its copy in the Hugging Face cache, else one line at once (without this,
    # huggingface_hub retries for about 25 s and prints a warning each time before the same failure).
    offline = not os.path.isdir(path) and hub_unreachable()
    name = path
    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=False, local_files_only=bool(offline))
        model = AutoModelForCausalLM.from_pretrained(name, trust_remote_code=False, dtype=dtype, use_kernels=False,
                                                     local_files_only=bool(offline))
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=False, local_files_only=bool(offline))
    except OSError as e:
        if offline:        # what a Hub id with the Hub out of reach and not in the cache raises
            raise UsageError(f"--model {name}: no such folder, not in the Hugging Face cache, and the Hub cannot be "
                             f"reached ({offline})") from None
        raise UsageError(f"--model {name}: cannot load a causal LM ({str(e).splitlines()[0]})") from None
    except (ValueError, KeyError) as e:
        raise UsageError(f"--model {name}: cannot load a causal LM ({str(e).splitlines()[0]})") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    # The config as the checkpoint has it, for save_hf: loading in fp32 rewrote the model's dtype to float32,
    # and training_mode will set its dropout to 0.
    model.original_config = config
    return hf_routing.watch_routers(model.to(device)), tokenizer


def hub_unreachable(timeout=5):
    """Why the Hugging Face Hub cannot be reached (HF_HUB_OFFLINE set, or no connection to its host, a few seconds at
    most), or None when it can or a proxy stands between (one NO_PROXY does not bypass: huggingface_hub finds out)."""
    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    url, proxies = urllib.parse.urlparse(constants.ENDPOINT), urllib.request.getproxies()
    if (proxies.get(url.scheme) or proxies.get("all")) and not urllib.request.proxy_bypass(url.hostname):
        return None
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
        return None
    except OSError as e:
        return f"{url.hostname}: {e.strerror or e}"


def gguf_folder(name):
    """--model FILE.gguf (llama.cpp's format: quantized weights and the tokenizer in one file) as a Hugging Face folder.
    transformers reads it (with the `gguf` package) and dequantizes every weight to fp32, which takes tens of seconds
    (23 s for SmolLM2-135M's Q4_1 file on 2 cores), so it is done once and the folder (fp32 safetensors, config,
    tokenizer) cached like the toy's base, keyed by the file's contents: $RL_CACHE_DIR, default
    ~/.cache/llm-rl-reference. The weights are the quantized values, not the original model's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = Path(name).expanduser()
    check(path.is_file(), f"--model {name}: no such file")
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError:
        raise UsageError(f"--model {name}: reading a GGUF file needs the gguf package: pip install gguf") from None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    cache_dir = Path(os.environ.get("RL_CACHE_DIR", Path.home() / ".cache" / "llm-rl-reference"))
    folder = cache_dir / f"gguf-{digest.hexdigest()[:16]}"
    if (folder / "config.json").is_file():
        return str(folder)
    print(f"converting {name} to a Hugging Face folder, once: {folder}", file=sys.stderr)
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                     use_kernels=False)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # a broken or unsupported file raises many kinds; any of them means: cannot use it
        raise UsageError(f"--model {name}: cannot load this GGUF file ({str(e).splitlines()[0]})") from None
    # save_pretrained refuses a model that says it is quantized; its weights are plain fp32 tensors by now.
    model.hf_quantizer = None
    del model.config.quantization_config
    tmp = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")  # two runs converting the same file never share one
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return str(folder)


def lora_config(args):
    """--lora-r: peft's LoRA on every linear layer but the vocabulary head ("all-linear"): attention and MLP, and
    in a Mixture-of-Experts layer the router and the experts (peft 0.21 adapts Qwen3-MoE's fused expert weights).
    No dropout, as everywhere in the update (training_mode)."""
    try:
        from peft import LoraConfig
    except ImportError:
        raise UsageError("--lora-r needs peft, which is not installed: pip install peft") from None
    return LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")


def add_lora(model, config, seed):
    """The model wrapped in a peft PeftModel: LoRA adapters W + (alpha / r) B A on the layers of `config`, with B = 0,
    so it starts as the base. The base weights are frozen in the dtype they were loaded in; the adapters are fp32
    (peft's autocast_adapter_dtype) and the only trainable parameters."""
    from peft import get_peft_model
    torch.manual_seed(seed)        # A is drawn at random: the same seed, the same adapters (and run)
    with quiet_peft():
        return get_peft_model(model, config)


@contextlib.contextmanager
def quiet_peft():
    with warnings.catch_warnings():  # peft's presets name expert layers that some families (Qwen3-MoE) call otherwise,
        warnings.filterwarnings("ignore", "The following (rank|alpha)_pattern keys did not match")
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")     # and it asks an old name
        yield


def merged_lora(name, adapter):
    """--merge-lora: the base --model, loaded again on the CPU in its checkpoint's dtypes, with the adapters of the
    folder `adapter` (the run's export) added into its weights. Not a copy of the policy: that would be a second
    model on the GPU, where a large MoE model has no room for it. peft computes each B A in fp32 on the CPU and
    adds it into W in W's dtype (a bf16 W is rounded once more, as the bf16 export would round it anyway)."""
    from peft import PeftModel
    base, _ = load_hf(name, torch.device("cpu"), "auto")
    with quiet_peft():
        return PeftModel.from_pretrained(base, adapter).merge_and_unload()


def loaded_dtypes(config):
    """name -> the dtype from_pretrained(dtype="auto") gives each tensor of the model of `config`: config.json's dtype
    (fp32 when it names none), but fp32 for a tensor its model class makes in fp32 or keeps in fp32 whatever the
    checkpoint's dtype (_keep_in_fp32_modules_strict): DeepSeek-V3's router weight and e_score_correction_bias, which
    bf16 would round (4.3738 to 4.375: a bias of 0.0012 less can change which experts a token gets). The rule is
    from_pretrained's, applied to the model built on the meta device: the dtypes without the weights."""
    from transformers import AutoModelForCausalLM
    dtype = config.dtype or torch.float32
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype)  # it rewrites config.dtype
    kept = "|".join(p.replace("*", ".*") for p in shell._get_dtype_plan(dtype))     # transformers' patterns, as it
    return {name: torch.float32 if kept and re.search(kept, name) else t.dtype       # matches them (5.24)
            for name, t in shell.state_dict().items()}


def save_hf(model, tokenizer, folder):
    """The policy as from_pretrained loads it: save_pretrained (safetensors, config.json, generation_config.json)
    and the tokenizer, each tensor in the dtype the checkpoint the run started from loads it in (loaded_dtypes).
    load_hf trains fp32 master weights; a bf16 checkpoint is exported in bf16 (half the size, what from_pretrained
    gives back), rounded once, but for the tensors its model keeps in fp32; one in fp32 in fp32."""
    dtypes = loaded_dtypes(model.original_config)
    cast = {}  # tensor -> its copy; tied weights (embeddings and head) stay one tensor, which is written once
    state = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in cast:
            cast[tensor.data_ptr()] = tensor.to("cpu", dtypes[name])
        state[name] = cast[tensor.data_ptr()]
    model.save_pretrained(folder, state_dict=state)
    model.original_config.save_pretrained(folder)  # over save_pretrained's, which has the fp32 weights' dtype
    tokenizer.save_pretrained(folder)


def read_jsonl(path):
    check(os.path.isfile(path), f"--data {path}: no such file")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                # Exact numbers: 0.00001 stays 0.00001, not 1e-05, and an integer past int()'s digit limit
                # meets the size check below instead of raising.
                row = json.loads(line, parse_float=Decimal, parse_int=Decimal)
            except json.JSONDecodeError as e:
                raise UsageError(f"--data {path}, line {n}: not valid JSON ({e.msg})") from None
            check(isinstance(row, dict) and "prompt" in row and "answer" in row,
                  f"--data {path}, line {n}: each line needs a \"prompt\" and an \"answer\" field")
            check(isinstance(row["prompt"], str) and row["prompt"].strip(),
                  f"--data {path}, line {n}: \"prompt\" must be a non-empty string")
            answer = row["answer"]
            if isinstance(answer, Decimal):  # written out in full, as to_number reads no exponents: 1e-5 -> 0.00001
                check(abs(answer.adjusted()) < 1000, f"--data {path}, line {n}: the answer {answer} is too large "
                                                     f"or too small to write out")
                answer = format(answer, "f")
            rows.append((row["prompt"], str(answer)))
    check(rows, f"--data {path}: the file holds no rows")
    return rows


def hf_world(tokenizer, model, rows, data, eval_size, max_new_tokens):
    def encode(prompt):
        if tokenizer.chat_template:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                   add_generation_prompt=True)
        return torch.tensor(tokenizer(prompt, add_special_tokens=not tokenizer.chat_template)["input_ids"])
    rows = [(encode(p), a) for p, a in rows]
    max_new_tokens = max_new_tokens or 256
    max_context = getattr(model.config, "max_position_embeddings", None) or 10**9
    for n, (ids, _) in enumerate(rows, 1):
        check(len(ids) + max_new_tokens <= max_context,
              f"--data {data}, row {n}: prompt of {len(ids)} tokens + --max-new-tokens {max_new_tokens} "
              f"is longer than the model's context of {max_context} tokens")
    train, held_out = split_eval(rows, eval_size)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    # A chat model often ends its turn with another token than the tokenizer's EOS (Qwen: <|im_end|>); its
    # generation config lists every end id. Stopping on one id only would run every completion to the limit.
    ends = getattr(model.generation_config, "eos_token_id", None)
    ends = [] if ends is None else [ends] if isinstance(ends, int) else list(ends)
    eos_ids = tuple(dict.fromkeys([tokenizer.eos_token_id, *ends]))
    return World(train, held_out, decode, rewards.answer_reward, eos_ids, tokenizer.pad_token_id, max_new_tokens,
                 tokenizer)


def export(run):
    """A run's DIR/model: the policy as from_pretrained loads it, with its tokenizer (save_hf). With LoRA, DIR/adapter
    instead: the adapters and the tokenizer, for PeftModel.from_pretrained(base, "DIR/adapter"); and with --merge-lora
    also DIR/model, the base with the adapters merged in (merged_lora, on the CPU). Returns the folders written."""
    if not common.is_lora(run.policy):
        with run.new_folder("model") as tmp:
            save_hf(run.policy, run.world.tokenizer, tmp)
        return [run.out / "model"]
    with run.new_folder("adapter") as tmp:
        run.policy.save_pretrained(tmp)
        run.world.tokenizer.save_pretrained(tmp)
    if not run.args.merge_lora:  # a model/ left by an earlier --merge-lora export of this run is stale: it goes
        shutil.rmtree(run.out / "model", ignore_errors=True)
        return [run.out / "adapter"]
    with run.new_folder("model") as tmp:
        save_hf(merged_lora(run.args.model, run.out / "adapter"), run.world.tokenizer, tmp)
    return [run.out / "adapter", run.out / "model"]
