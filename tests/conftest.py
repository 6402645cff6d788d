import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# One thread for every test and every subprocess a test starts (set before torch is imported): the toy and the tiny
# Hugging Face models are too small to share cores, and two tests side by side would otherwise spin for each other.
os.environ["OMP_NUM_THREADS"] = "1"

# Tiny runs on the toy task: 4 prompts x 4 completions a step in 2 minibatches, 16 prompts evaluated every 2 steps.
TINY_NO_STEPS = ["--prompts-per-step", "4", "--group-size", "4", "--minibatches", "2", "--eval-size", "16",
                 "--eval-every", "2"]
TINY = ["--steps", "3"] + TINY_NO_STEPS
# Smaller still, where a run only has to get going: 2 steps of 2 prompts, 8 prompts evaluated at start and end.
TINIER = ["--steps", "2", "--prompts-per-step", "2", "--group-size", "4", "--minibatches", "2", "--eval-size", "8"]
# The chain task with 2 totals ('123+7=' -> '130,137=137', 12 tokens): a quick warm start, shared with the
# learning tests and the long experiment's quick form.
CHAIN = ["--task", "chain", "--chain-length", "2"]
# A --reward FILE.py:counter scoring 1, 2, 3, ... in call order: no two in a group are equal, so every advantage is
# nonzero whatever the samples (a tiny run can sample no correct answer at all, and then has nothing to learn).
COUNTER_REWARD = "calls = 0\ndef counter(completion, answer, finished):\n    global calls\n    calls += 1\n" \
                 "    return float(calls)\n"


def read_metrics(out, timings=True):
    """The rows of out/metrics.jsonl. timings=False leaves out the wall-clock times and the peak memory,
    which differ between two runs of the same computation."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    if timings:
        return rows
    return [{k: v for k, v in r.items() if not k.startswith("time_") and k not in ("step_time_s", "peak_memory_mb")}
            for r in rows]


def run(script, argv, capsys=None):
    """script.main(argv) in this process: the exit code (0 when it returned) and, given capsys, its stderr."""
    try:
        script.main(argv)
        code = 0
    except SystemExit as stop:
        code = stop.code
    return code, (capsys.readouterr().err if capsys else "")


@pytest.fixture(scope="session", autouse=True)
def test_cache():
    """Warm-started toy bases of the tests go to a git-ignored folder of the repository, not the user's
    cache; they are keyed by every setting, so keeping them between runs only saves time."""
    os.environ["RL_CACHE_DIR"] = str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "rl-bases")


def build_tiny_hf(folder, kind, tied=False, chat=False, context=128):
    """A tiny Hugging Face causal LM and character tokenizer, built offline from a config. chat=True: a
    chat template whose turns end with <|im_end|>, which is not the tokenizer's EOS but is listed, as in
    Qwen's checkpoints, among the end ids of the model's generation config."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast, Qwen3Config,
                              Qwen3MoeConfig)

    chars = list(dict.fromkeys("0123456789+-*=?,. abcdefghijklmnopqrstuvwxyzQAW#"))
    specials = ["<pad>", "<eos>", "<unk>"] + (["<|im_start|>", "<|im_end|>"] if chat else [])
    vocab = {t: i for i, t in enumerate(specials + chars)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>", additional_special_tokens=specials[3:])
    if chat:
        tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>"
                                   "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
    common = dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=context,
                  pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=tied)
    if kind == "moe":
        config = Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                decoder_sparse_step=1, mlp_only_layers=[])
    else:
        config = Qwen3Config(**common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if chat:
        model.generation_config = GenerationConfig(eos_token_id=[vocab["<|im_end|>"], 1], pad_token_id=0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def hf_dense(tmp_path_factory):
    return build_tiny_hf(tmp_path_factory.mktemp("tiny-qwen3"), "dense")


@pytest.fixture(scope="session")
def hf_moe(tmp_path_factory):
    return build_tiny_hf(tmp_path_factory.mktemp("tiny-qwen3-moe"), "moe")


@pytest.fixture
def jsonl(tmp_path):
    """A small data file whose prompts have different lengths."""
    rows = [{"prompt": f"what is {a}+{b}?" + " ok" * (a % 3), "answer": a + b} for a in range(6) for b in range(5)]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pytest_collection_modifyitems(items):
    """The long tests first, with them the ones marked `first` (see pytest_configure)."""
    items.sort(key=lambda item: not (item.get_closest_marker("slow") or item.get_closest_marker("first")))


def pytest_configure(config):
    config.addinivalue_line("markers", 'slow: long tests (real learning); skip them with -m "not slow"')
    config.addinivalue_line("markers", "first: builds a base that takes a minute, which later tests of its file find "
                                       "cached (two workers building it side by side each lost that minute)")
    # With pytest-xdist (-n 2), tests go out one at a time, the long ones first, to whichever worker is free: the
    # workers end together. In xdist's default chunks one worker was given every long test and ran 150 s alone.
    # --maxschedchunk is pytest-xdist 3.2's (requirements.txt); an older one would leave this unread.
    if config.pluginmanager.hasplugin("xdist") and config.getoption("maxschedchunk", None) is None:
        config.option.maxschedchunk = 1


@pytest.fixture(scope="session")
def hf_tied(tmp_path_factory):
    return build_tiny_hf(tmp_path_factory.mktemp("tiny-qwen3-tied"), "dense", tied=True)


def moe_configs():
    """Tiny configs of six Hugging Face Mixture-of-Experts families (DeepSeek-V3 also with one expert group),
    8 experts top-2, 2 layers."""
    from transformers import (DeepseekV3Config, GraniteMoeConfig, MixtralConfig, OlmoeConfig, Qwen2MoeConfig,
                              Qwen3MoeConfig)
    base = dict(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    return {
        "qwen3_moe": Qwen3MoeConfig(**base, head_dim=8, intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=16, decoder_sparse_step=1, mlp_only_layers=[],
                                    norm_topk_prob=True),
        "qwen2_moe": Qwen2MoeConfig(**base, intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                    decoder_sparse_step=1),
        "mixtral": MixtralConfig(**base, head_dim=8, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2),
        "olmoe": OlmoeConfig(**base, intermediate_size=16, num_experts=8, num_experts_per_tok=2),
        "granitemoe": GraniteMoeConfig(**base, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
                                       logits_scaling=2.0),
        # Sigmoid scores, a correction bias and group-limited top-k: top-k of the router logits is not the choice.
        "deepseek_v3": DeepseekV3Config(**base | {"num_key_value_heads": 4}, intermediate_size=64,
                                        moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                        topk_group=2, first_k_dense_replace=0, n_shared_experts=1, q_lora_rank=None,
                                        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
    } | {  # one group: its group top-k, over [tokens, 1, experts], must not be taken for the choice
        "deepseek_v3_one_group": DeepseekV3Config(**base | {"num_key_value_heads": 4}, intermediate_size=64,
                                                  moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                                                  n_group=1, topk_group=1, first_k_dense_replace=0,
                                                  n_shared_experts=1, q_lora_rank=None, kv_lora_rank=16,
                                                  qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)}


MOE_FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "granitemoe", "deepseek_v3"]


@pytest.fixture
def tiny_moe():
    """Build one of the six families (random weights, routers watched, training mode), as load_hf would."""
    def build(family, gradient_checkpointing=False):
        import torch
        from transformers import AutoModelForCausalLM

        import common
        from extras import hf_routing
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(moe_configs()[family])
        for router in hf_routing.routers(model):
            if hasattr(router, "e_score_correction_bias"):       # DeepSeek-V3: a bias that changes the choice
                router.e_score_correction_bias.normal_(0, 0.1)
        return common.training_mode(hf_routing.watch_routers(model), gradient_checkpointing)
    return build


@pytest.fixture(scope="session")
def hf_chat(tmp_path_factory):
    return build_tiny_hf(tmp_path_factory.mktemp("tiny-qwen3-chat"), "dense", chat=True, context=512)
