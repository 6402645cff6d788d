import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@pytest.fixture(scope="session", autouse=True)
def test_cache():
    """Warm-started toy bases of the tests go to a git-ignored folder of the repository, not the user's
    cache; they are keyed by every setting, so keeping them between runs only saves time."""
    os.environ["RL_CACHE_DIR"] = str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "rl-bases")


def build_tiny_hf(folder, kind, tied=False):
    """A tiny Hugging Face causal LM and character tokenizer, built offline from a config."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3MoeConfig

    chars = list(dict.fromkeys("0123456789+-*=?,. abcdefghijklmnopqrstuvwxyzQAW"))
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"] + chars)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>")
    common = dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                  pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=tied)
    if kind == "moe":
        config = Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                decoder_sparse_step=1, mlp_only_layers=[])
    else:
        config = Qwen3Config(**common)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
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


def pytest_configure(config):
    config.addinivalue_line("markers", 'slow: long tests (real learning); skip them with -m "not slow"')


@pytest.fixture(scope="session")
def hf_tied(tmp_path_factory):
    return build_tiny_hf(tmp_path_factory.mktemp("tiny-qwen3-tied"), "dense", tied=True)
