"""--static-cache (extras/static_decode.py): the rollouts of generate's own loop, token for token, and the same run.
On a CPU its decode step runs eagerly; the CUDA graph it is captured as on a GPU is benchmarks/gpu_check.sh's."""
import pytest
import torch
from conftest import read_metrics

import common
import grpo
from extras import hf_models, static_decode

PROMPTS = ("1+2?", "what is 12+34? ok ok", "7*8=", "abc")


def tiny(folder, max_new_tokens=12):
    model, tokenizer = hf_models.load_hf(str(folder), torch.device("cpu"))
    world = common.World([], [], None, None, (tokenizer.eos_token_id,), tokenizer.pad_token_id, max_new_tokens)
    return common.training_mode(model, False), world, lambda texts: [torch.tensor(tokenizer(t)["input_ids"])
                                                                     for t in texts]


def both_ways(model, world, prompts, temperature=1.0, greedy=False, group_size=3):
    """generate's rollout by its own loop, then by extras/static_decode, from the same seed."""
    rollouts = []
    for static in (False, True):
        world.static_cache = static
        torch.manual_seed(3)
        rollouts.append(common.generate(model, world, prompts, group_size, temperature, greedy=greedy))
    return rollouts


def assert_same(ours, theirs):
    assert torch.equal(ours.tokens, theirs.tokens) and torch.equal(ours.attention_mask, theirs.attention_mask)
    assert torch.equal(ours.mask, theirs.mask) and torch.equal(ours.finished, theirs.finished)
    assert (ours.entropy is None) == (theirs.entropy is None)
    assert ours.entropy is None or torch.allclose(ours.entropy, theirs.entropy, atol=1e-5)


@pytest.mark.parametrize("temperature, greedy", [(1.0, False), (0.7, False), (1.0, True)])
def test_the_same_seed_gives_the_same_rollout_token_for_token(hf_dense, temperature, greedy):
    model, world, encode = tiny(hf_dense)
    today, static = both_ways(model, world, encode(PROMPTS), temperature, greedy)
    assert_same(static, today)
    lengths, P = today.mask.sum(1), today.tokens.shape[1] - today.mask.shape[1]
    assert len(set(today.attention_mask[:, :P].sum(1).tolist())) > 1                  # left padding
    assert today.finished.any() and not today.finished.all()      # some ended early (at several steps), some ran out
    assert len(set(lengths[today.finished].tolist())) > 1 and (lengths[~today.finished] == 12).all()


def test_a_lora_policy_samples_the_same(hf_dense):
    model, world, encode = tiny(hf_dense)
    lora = hf_models.lora_config(type("Args", (), {"lora_r": 4, "lora_alpha": 32.0}))
    model = common.training_mode(hf_models.add_lora(model, lora, seed=0), False)
    with torch.no_grad():                                  # adapters that change the model (B starts at 0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    today, static = both_ways(model, world, encode(PROMPTS))
    assert_same(static, today)
    assert today.finished.any() and not today.finished.all()


def test_both_stop_at_the_same_step_when_every_completion_has_ended(hf_dense):
    model, world, encode = tiny(hf_dense)
    today, static = both_ways(model, world, encode(PROMPTS[:2]), greedy=True)
    assert_same(static, today)
    assert today.finished.all() and today.mask.shape[1] < 12


def test_the_cache_is_kept_grown_and_reused_between_calls(hf_dense):
    model, world, encode = tiny(hf_dense)
    short, long = PROMPTS, ["what is 12+34? " + "ok " * 17, "1+2?"]       # 12 new tokens: 32 and 78 positions
    sizes = []
    for prompts, group_size in ((short, 3), (long, 6), (short, 3), (short, 2)):     # 12 rows, 12, 12, then 8
        assert_same(*both_ways(model, world, encode(prompts), group_size=group_size)[::-1])
        sizes.append({rows: cache.get_max_length() for rows, cache in static_decode.CACHES[model].items()})
    assert sizes == [{12: 64}, {12: 128}, {12: 128}, {12: 128, 8: 64}]     # grown once, then kept; one a batch size


def test_the_decode_step_traces_as_one_graph(hf_dense, monkeypatch):
    """What torch.compile captures on CUDA, traced here without a GPU (aot_eager: the same graph, run by eager
    kernels): a graph break would split the CUDA graph; and the same tokens."""
    model, world, encode = tiny(hf_dense)
    step = torch.compile(static_decode.decode_step, backend="aot_eager", fullgraph=True)    # a break would raise
    monkeypatch.setattr(static_decode, "decode_step", step)                                 # what a CPU calls
    today, static = both_ways(model, world, encode(PROMPTS))
    assert_same(static, today)


def test_the_flag_reaches_generate_for_dense_models_only(hf_dense, hf_moe, jsonl):
    argv = ["--data", str(jsonl), "--static-cache", "--eval-size", "5", "--max-new-tokens", "8"]
    with pytest.raises(common.UsageError, match="--static-cache needs --model"):             # the toy's own loop
        common.check_common_args(common.parse_args(grpo.Args, "", ["--static-cache"]))
    for folder, expected in ((hf_dense, True), (hf_moe, False)):                   # an MoE model keeps generate's loop
        args = common.parse_args(grpo.Args, "", ["--model", str(folder), *argv])
        common.check_common_args(args)
        assert common.make_policy(args, torch.device("cpu"))[1].static_cache is expected


def test_a_grpo_run_with_the_flag_is_the_same_run(tmp_path, hf_dense, jsonl):
    runs = []
    for flag in ([], ["--static-cache"]):
        out = tmp_path / f"run{len(runs)}"
        grpo.main(["--model", str(hf_dense), "--data", str(jsonl), "--max-new-tokens", "8", "--eval-size", "5",
                   "--steps", "2", "--prompts-per-step", "2", "--group-size", "3", "--minibatches", "2",
                   "--out", str(out), *flag])
        runs.append((read_metrics(out, timings=False), (out / "eval_correct.jsonl").read_text()))
    (today, today_correct), (static, static_correct) = runs
    assert len(today) == len(static) == 3 and today_correct == static_correct     # the evaluations got the same right
    # The same samples, so the same run; the entropy, from logits over the static cache's longer (masked) rows, to
    # float rounding.
    assert all(ours == pytest.approx(theirs, rel=1e-5) for ours, theirs in zip(static, today))
