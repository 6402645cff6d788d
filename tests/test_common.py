"""common.py: sampling, log-probs, padding, rewards and ratio metrics, on the toy model and on tiny Hugging Face
models built locally."""
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_NO_STEPS

import common
import grpo
import gspo
import ppo
from extras import hf_models, rewards
from moe_model import MoEConfig, MoETransformer

ROOT = Path(__file__).resolve().parent.parent


def toy():
    world = common.toy_world("add", 50, None)
    torch.manual_seed(0)
    return MoETransformer(MoEConfig(vocab_size=len(common.TOY_VOCAB))), world


def test_rollout_mask_covers_tokens_up_to_and_including_eos():
    model, world = toy()
    torch.manual_seed(1)
    prompts, _ = world.sample(8)
    rollout = common.generate(model, world, prompts, 4, temperature=1.0)
    completions, mask = rollout.completions, rollout.mask.bool()
    assert completions.shape[0] == 32 and completions.shape[1] <= world.max_new_tokens
    for row, m, done in zip(completions, mask, rollout.finished):
        n = int(m.sum())
        assert m[:n].all() and not m[n:].any()                       # a prefix
        assert (row[n:] == world.pad_id).all()                       # padding after it
        assert (row[:n] != world.pad_id).all()                       # PAD is never sampled
        eos = (row[:n] == world.eos_ids[0]).nonzero().flatten().tolist()
        assert eos == ([n - 1] if done else [])                      # only EOS is the last kept token


def test_logprobs_are_those_of_the_sampling_distribution():
    model, world = toy()
    torch.manual_seed(2)
    prompts, _ = world.sample(4)
    rollout = common.generate(model, world, prompts, 2, temperature=0.7)
    logp, entropy, _, _ = common.logprobs(model, world, rollout, temperature=0.7)
    # Independent: full forward, then each completion token's log-prob at logits / 0.7, PAD excluded.
    logits, _, _ = model(rollout.tokens)
    P, T = rollout.tokens.shape[1] - rollout.mask.shape[1], rollout.mask.shape[1]
    z = logits[:, P - 1:P - 1 + T].clone()
    z[..., world.pad_id] = -float("inf")
    expected = F.log_softmax(z / 0.7, -1).gather(-1, rollout.completions[..., None]).squeeze(-1)
    m = rollout.mask.bool()
    assert torch.allclose(logp[m], expected[m], atol=1e-5) and (logp[~m] == 0).all()
    p = F.softmax(z / 0.7, -1)
    expected_entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
    assert torch.allclose(entropy[m], expected_entropy[m], atol=1e-5) and (entropy[~m] == 0).all()
    assert torch.allclose(rollout.entropy, entropy, atol=1e-5)       # as measured while sampling


def test_greedy_generation_with_cache_matches_argmax_of_full_forward():
    model, world = toy()
    prompts, _ = world.sample(6)
    rollout = common.generate(model, world, prompts, 1, 1.0, greedy=True)
    logits, _, _ = model(rollout.tokens)
    P = rollout.tokens.shape[1] - rollout.mask.shape[1]
    z = logits[:, P - 1:-1].clone()
    z[..., world.pad_id] = -float("inf")
    m = rollout.mask.bool()
    assert torch.equal(z.argmax(-1)[m], rollout.completions[m])


@pytest.mark.parametrize("which", ["toy", "hf_moe"])
def test_generation_without_the_cache_samples_the_same_tokens(which, request):
    """The KV cache only saves work: with the same seed, recomputing every prefix draws the same samples."""
    if which == "toy":
        model, world = toy()
        prompts, _ = world.sample(4)
    else:
        model, tokenizer = hf_models.load_hf(str(request.getfixturevalue(which)), torch.device("cpu"))
        world = common.World([], [], None, None, (tokenizer.eos_token_id,), tokenizer.pad_token_id, 6)
        prompts = [torch.tensor(tokenizer(p)["input_ids"]) for p in ("1+2?", "what is 12+34? ok", "7*8=")]
    rollouts = []
    for use_cache in (True, False):
        torch.manual_seed(3)
        rollouts.append(common.generate(model, world, prompts, 3, 1.0, use_cache=use_cache))
    assert rollouts[0].mask.sum() > 6
    assert torch.equal(rollouts[0].tokens, rollouts[1].tokens) and torch.equal(rollouts[0].mask, rollouts[1].mask)


def test_toy_model_gets_the_positions_long_completions_need():
    args = type("Args", (), {"d_model": 64, "n_layers": 2, "n_experts": 8, "top_k": 2, "expert_hidden": 128})
    assert common.toy_model_config(args, common.toy_world("add", 50, None)).max_seq_len == 64
    assert common.toy_model_config(args, common.toy_world("add", 50, 100)).max_seq_len == 6 + 100


def test_fixed_logprobs_in_chunks_match_one_pass_and_record_routing():
    model, world = toy()
    prompts, _ = world.sample(4)
    rollout = common.generate(model, world, prompts, 4, 1.0)
    logp, _, routing, _ = common.logprobs(model, world, rollout, 1.0)
    old_logp, old_entropy, old_routing = common.fixed_logprobs(model, world, rollout, 1.0, chunks=4)
    assert torch.allclose(old_logp, logp, atol=1e-6) and torch.equal(old_routing, routing)
    assert old_entropy.shape == logp.shape
    T = rollout.mask.shape[1]
    assert common.experts_new(routing, old_routing, T).sum() == 0                    # the same experts chosen
    changed = old_routing.clone()
    changed[0, :, -T:] = (changed[0, :, -T:] + 1) % 8                               # layer 0 of 2: each expert +1
    new = common.experts_new(changed, old_routing, T)
    assert new[1].sum() == 0 and ((new[0] == 0.5) | (new[0] == 1)).all()  # top-2, each +1: 1 or 2 of 2 new
    assert ((new > 0).float().mean(0) == 0.5).all()          # routing drift: half the (token, layer) pairs re-routed


@pytest.mark.parametrize("text, answer, reward", [
    ("so the answer is \\boxed{42}.", "42", 1.0),
    ("\\boxed{41} no wait, \\boxed{42}", "42", 1.0),
    ("3 + 4 = 7", "7", 1.0),
    ("it is 1,234 exactly", "1234", 1.0),
    ("7.0", "7", 1.0),
    ("3 + 4 = 8", "7", 0.0),
    ("no idea", "7", 0.0),
])
def test_final_answer_reward(text, answer, reward):
    assert rewards.answer_reward(text, answer, finished=True) == reward


def test_toy_reward_needs_the_exact_answer_and_eos():
    assert common.toy_reward("92", "92", True) == 1.0
    assert common.toy_reward("92", "92", False) == 0.0
    assert common.toy_reward("921", "92", True) == 0.0


def test_chain_problems_write_every_running_total_then_the_answer():
    rows = dict(common.chain_problems(3))
    assert rows["123+7="] == "130,137,144=144" and rows["000+1="] == "001,002,003=003"
    assert rows["972+9="] == "981,990,999=999" and "973+9=" not in rows            # every total under 1000
    assert len(rows) == sum(1000 - 3 * d for d in range(1, 10)) == 8865
    for n in (1, 10, 24, 110):                                     # 4 tokens a total, the answer's 3 and EOS
        assert {len(a) + 1 for _, a in common.chain_problems(n)} == {4 * n + 4}
    longest = dict(common.chain_problems(110))                     # step 9 stays under 1000 from 000-009 only
    assert [p for p in longest if p.endswith("+9=")] == [f"{a:03d}+9=" for a in range(10)]
    assert longest["009+9="].endswith(",990,999=999")
    world = common.toy_world("chain", 16, None, 2)
    assert world.reward is common.chain_reward and world.max_new_tokens == 12 + 4 + 8  # answer + EOS, a third, 8
    prompt, answer = world.eval[0]
    a, d = int(world.decode(prompt.tolist())[:3]), int(world.decode(prompt.tolist())[4])
    assert answer == f"{a + d:03d},{a + 2 * d:03d}={a + 2 * d:03d}"


def test_chains_mix_every_length_up_to_the_longest_with_the_length_in_the_prompt():
    rows = common.chains_problems(3)
    assert dict(rows)["123+7*02="] == "130,137=137" and dict(rows)["123+7*03="] == "130,137,144=144"
    assert len(rows) == sum(len(common.chain_problems(n)) for n in (1, 2, 3))
    assert [p for p, _ in rows if p.startswith("995+")] == ["995+1*01=", "995+2*01=", "995+3*01=", "995+4*01=",
                                                            "995+1*02=", "995+2*02=", "995+1*03="]
    world = common.toy_world("chains", 16, None, 24)
    assert {len(a) + 1 for _, a in world.train} == {4 * n + 4 for n in range(1, 25)}    # 8 to 100 tokens
    assert world.max_new_tokens == 100 + 33 + 8 and world.reward is common.chain_reward


def test_chain_reward_reads_only_the_final_answer():
    answer = "130,137,144=144"
    assert common.chain_reward(answer, answer, True) == 1.0
    assert common.chain_reward("130,999,144=144", answer, True) == 1.0   # the chain earns nothing
    assert common.chain_reward("=144", answer, True) == 1.0
    assert common.chain_reward(answer, answer, False) == 0.0             # no EOS
    for wrong in ("130,137,144=145", "130,137,144=1440", "130,137,144=144=144", "130,137,144", "144", ""):
        assert common.chain_reward(wrong, answer, True) == 0.0, wrong


def test_rewards_of_scores_each_completion_against_its_own_prompts_answer():
    # 2 prompts x 3 completions: rows 0-2 answer prompt 0, rows 3-5 prompt 1 (i // G, not i % P).
    calls = []
    def reward(completion, answer, finished):
        calls.append((completion, answer, finished))
        return 0.5 * len(calls)
    world = common.World([], [], lambda ids: "".join(map(str, ids)), reward, eos_ids=(1,), pad_id=0,
                         max_new_tokens=1)
    tokens = torch.tensor([[5, 10 + i] for i in range(6)])           # one prompt token, one completion token
    finished = torch.tensor([True, False, True, True, False, False])
    rollout = common.Rollout(tokens, torch.ones_like(tokens), torch.ones(6, 1), finished)
    rewards = common.rewards_of(world, rollout, ["a", "b"], group_size=3)
    assert calls == [("10", "a", True), ("11", "a", False), ("12", "a", True),
                     ("13", "b", True), ("14", "b", False), ("15", "b", False)]
    assert rewards.tolist() == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]


def test_two_optimizer_steps_start_each_from_a_fresh_gradient():
    # loss = c . w has the constant gradient c, so SGD with lr 1 moves w by -c each step; a gradient
    # left over from the first step would make the second step's gradient 2c.
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    model = torch.nn.ParameterList([w])
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    c = torch.tensor([0.5, -0.25])                                   # norm 0.56, under the clip of 1
    for expected in ([0.5, 2.25], [0.0, 2.5]):
        metrics = common.optimizer_step(model, optimizer, (c * w).sum(), max_grad_norm=1.0)
        assert w.tolist() == expected and metrics == {"grad_norm": pytest.approx(0.5590170), "skipped_updates": 0}


def test_left_padding_does_not_change_hf_logprobs(hf_dense):
    model, tokenizer = hf_models.load_hf(str(hf_dense), torch.device("cpu"))
    world = common.World([], [], None, None, (tokenizer.eos_token_id,), tokenizer.pad_token_id, 6)
    short = torch.tensor(tokenizer("what is 1+2?")["input_ids"])
    long = torch.tensor(tokenizer("what is 12+34? ok ok ok")["input_ids"])
    torch.manual_seed(0)
    both = common.generate(model, world, [short, long], 1, 1.0)
    alone = common.Rollout(*[x[:1] for x in (both.tokens, both.attention_mask, both.mask, both.finished)])
    # The short prompt's row without the left padding.
    pad = len(long) - len(short)
    alone.tokens, alone.attention_mask = alone.tokens[:, pad:], alone.attention_mask[:, pad:]
    logp_batched = common.logprobs(model, world, both, 1.0)[0][0]
    logp_alone = common.logprobs(model, world, alone, 1.0)[0][0]
    m = both.mask[0].bool()
    assert torch.allclose(logp_batched[m], logp_alone[m], atol=1e-5)


def test_hf_cached_generation_with_left_padding_matches_a_full_forward(hf_dense):
    model, tokenizer = hf_models.load_hf(str(hf_dense), torch.device("cpu"))
    world = common.World([], [], None, None, (tokenizer.eos_token_id,), tokenizer.pad_token_id, 8)
    prompts = [torch.tensor(tokenizer(p)["input_ids"]) for p in ("1+2?", "what is 12+34? ok ok", "7*8=")]
    rollout = common.generate(model, world, prompts, 1, 1.0, greedy=True)
    P, T = rollout.tokens.shape[1] - rollout.mask.shape[1], rollout.mask.shape[1]
    # Independent: one forward over the whole padded sequence, positions from the attention mask.
    positions = (rollout.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=rollout.tokens, attention_mask=rollout.attention_mask, position_ids=positions).logits
    greedy = logits[:, P - 1:P - 1 + T].argmax(-1)
    m = rollout.mask.bool()
    assert m.sum() > 3 and torch.equal(greedy[m], rollout.completions[m])


def test_ratio_metrics_split_rerouted_tokens_from_the_others():
    L, N, T, P = 2, 2, 3, 3                                          # positions P + T - 1 = 5
    old_routing = torch.stack([torch.zeros(L, N, P + T - 1), torch.ones(L, N, P + T - 1)], -1).long()
    routing = old_routing.clone()
    routing[1, 0, P - 1 + 1] = torch.tensor([0, 2])                  # row 0, token 1, layer 1: {0,1} -> {0,2}
    routing[0, 1, P - 1 + 0] = torch.tensor([1, 0])                  # row 1, token 0: same set, other order
    routing[0, 1, P - 1 + 2] = torch.tensor([5, 6])                  # row 1, token 2: padding, not counted
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    log_ratio = torch.tensor([[0.1, -0.5, 0.2], [0.3, -0.1, 9.0]])
    m = common.ratio_metrics(log_ratio, torch.zeros(N, T), mask, routing, old_routing, torch.tensor(1.5))
    assert m["routing_drift"] == pytest.approx(1 / 10)               # 1 of 5 tokens x 2 layers
    assert m["rerouted_token_frac"] == pytest.approx(1 / 5)
    assert m["abs_log_ratio_rerouted"] == pytest.approx(0.5)
    assert m["abs_log_ratio_other"] == pytest.approx((0.1 + 0.2 + 0.3 + 0.1) / 4)
    assert m["token_ratio_var"] == pytest.approx(torch.tensor([0.1, -0.5, 0.2, 0.3, -0.1]).exp().var().item())
    assert m["load_balancing_loss"] == 1.5


def test_expert_drift_counts_new_experts_where_routing_drift_counts_changed_sets():
    old_routing = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]]).expand(1, 1, 2, 4)   # 1 layer, 1 row, 2 tokens, top-4
    routing = torch.tensor([[0, 1, 2, 7], [3, 2, 1, 0]]).expand(1, 1, 2, 4)       # 1 of 4 new; the same set
    m = common.ratio_metrics(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), routing, old_routing, None)
    assert m["expert_drift"] == pytest.approx((1 / 4 + 0) / 2)
    assert m["routing_drift"] == pytest.approx((1 + 0) / 2)


def test_quarters_are_the_first_and_last_quarter_of_each_completion():
    mask = torch.zeros(5, 8)
    for i, n in enumerate([1, 3, 4, 5, 8]):
        mask[i, :n] = 1
    first, last = common.quarters(mask)
    # ceil(n / 4) tokens at each end: n = 1 -> the one token is both; 3, 4 -> one each; 5 -> two; 8 -> two.
    assert [row.nonzero().flatten().tolist() for row in first] == [[0], [0], [0], [0, 1], [0, 1]]
    assert [row.nonzero().flatten().tolist() for row in last] == [[0], [2], [3], [3, 4], [6, 7]]


def test_ratio_variance_and_routing_drift_by_quarter():
    L, N, T, P = 2, 2, 4, 1                                          # positions P + T - 1 = 4, all completion
    old_routing = torch.stack([torch.zeros(L, N, T), torch.ones(L, N, T)], -1).long()
    routing = old_routing.clone()
    routing[:, 0, 3] = torch.tensor([0, 2])                          # row 0, last token: both layers re-routed
    routing[1, 1, 0] = torch.tensor([0, 2])                          # row 1, first token: layer 1 only
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    ratios = torch.tensor([[2.0, 1.0, 1.0, 4.0], [1.0, 1.0, 7.0, 7.0]])  # 7: padding, never counted
    m = common.ratio_metrics(ratios.log(), torch.zeros(N, T), mask, routing, old_routing, None)
    # First quarter: token 0 of both rows (ratios 2, 1); last: row 0 token 3 and row 1 token 1 (ratios 4, 1).
    assert m["token_ratio_var_q1"] == pytest.approx(0.5)            # mean 1.5, (0.25 + 0.25) / 1
    assert m["token_ratio_var_q4"] == pytest.approx(4.5)            # mean 2.5, (2.25 + 2.25) / 1
    assert m["token_ratio_var"] == pytest.approx(22 / 15)           # 2, 1, 1, 4, 1, 1: mean 5/3, 66/9 / 5
    # Drift per token is the share of its 2 layers re-routed: row 1 token 0 -> 0.5, row 0 token 3 -> 1.
    assert m["routing_drift_q1"] == pytest.approx((0.5 + 0) / 2)
    assert m["routing_drift_q4"] == pytest.approx((1 + 0) / 2)
    assert m["routing_drift"] == pytest.approx((0.5 + 1) / 6)


def test_hf_models_load_without_hub_kernels(hf_dense):
    # transformers 5.25 turns Hub kernels on by default; on a GPU model.train() then downloads layers (it failed
    # offline on an H200: "Kernel repository 'kernels-community/rotary' could not verify publisher trust status").
    model, _ = hf_models.load_hf(str(hf_dense), torch.device("cpu"))
    assert not getattr(model, "use_kernels", False)
    model.train()
    assert not getattr(model, "use_kernels", False)


def test_the_learning_rate_follows_the_model(capsys):
    def resolved(script, *flags):
        args = common.parse_args(script.Args, script.__doc__, list(flags))
        common.check_common_args(args, min_group_size=1)
        return args
    assert resolved(grpo).lr == 1e-4                                   # the toy's
    assert resolved(grpo, "--model", "m", "--data", "d").lr == 1e-6    # a pretrained model's: the GRPO paper's
    assert resolved(gspo, "--model", "m", "--data", "d", "--lr", "1e-5").lr == 1e-5
    assert (resolved(ppo, "--model", "m", "--data", "d").critic_lr, resolved(ppo).critic_lr) == (1e-6, 1e-4)
    assert resolved(ppo, "--lr", "1e-5", "--critic-lr", "2e-5").critic_lr == 2e-5
    grpo.main(["--model", "m", "--data", "d", "--print-verl"])
    assert "actor_rollout_ref.actor.optim.lr=1e-06 \\" in capsys.readouterr().out


def test_threads_follow_the_model_and_the_user_s_choice_wins(monkeypatch):
    def threads(*flags):
        args = common.parse_args(grpo.Args, grpo.__doc__, list(flags))
        common.check_common_args(args)
        assert torch.get_num_threads() == args.threads                  # and torch uses them
        return args.threads
    monkeypatch.setattr(torch, "get_num_interop_threads", lambda: 4)   # torch's own default: every core, say 4
    monkeypatch.delenv("OMP_NUM_THREADS")
    try:
        assert threads() == 1                                           # the toy: one
        assert threads("--model", "m", "--data", "d") == 4              # a real model: torch's default
        assert threads("--threads", "3") == 3                           # the flag wins over both
        torch.set_num_threads(2)        # by a program that calls main(): --threads is how it chooses, not this
        assert threads() == 1 and threads("--model", "m", "--data", "d") == 4
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert threads() == 2 and threads("--model", "m", "--data", "d") == 2 and threads("--threads", "1") == 1
    finally:
        torch.set_num_threads(1)


def test_a_model_run_s_threads_do_not_depend_on_when_a_program_sets_torch_s(tmp_path):
    # A program that sets torch's count before importing a script, and one that sets it after: each in a process of
    # its own, as a user's shell has it (no OMP_NUM_THREADS). --model gets torch's default, every core, in both; the
    # program's count (the default + 1, whatever this machine has) in neither.
    resolve = ("args = common.parse_args(grpo.Args, '', ['--model', 'm', '--data', 'd']); "
               "common.check_common_args(args); print(default, args.threads, torch.get_num_threads())")
    first = "import torch; default = torch.get_num_threads(); torch.set_num_threads(default + 1); import common, grpo; "
    after = "import torch, common, grpo; default = torch.get_num_threads(); torch.set_num_threads(default + 1); "
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    runs = [subprocess.Popen([sys.executable, "-c", code + resolve], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for code in (first, after)]
    printed = [run.communicate() for run in runs]
    assert all(run.returncode == 0 for run in runs), [err for _, err in printed]
    (default, *threads), (default_too, *threads_too) = (out.split() for out, _ in printed)
    assert default == default_too and threads == threads_too == [default, default]


@pytest.mark.parametrize("device, model, native, kernels, dtype, bf16", [
    ("cpu", None, True, "AVX512", "auto", False),          # the toy stays fp32
    ("cpu", "m", True, "AVX512", "auto", True),            # a real model on a CPU with native bf16
    ("cpu", "m", False, "AVX512", "auto", False),          # emulated bf16 is slower than fp32
    ("cpu", "m", True, "AVX2", "auto", False),             # the chip has it, the kernels in use do not
    ("cpu", "m", True, "DEFAULT", "auto", False),
    ("cpu", "m", True, "AVX512", "fp32", False),
    ("cpu", None, False, "DEFAULT", "bf16", True),         # asked for: given
    ("cuda", None, False, "AVX2", "auto", True),           # as before on CUDA, the toy too
])
def test_bf16_where_the_hardware_computes_it(device, model, native, kernels, dtype, bf16, monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: kernels)
    assert common.uses_bf16(grpo.Args(model=model, dtype=dtype), torch.device(device)) == bf16


def test_each_cpu_kernel_set_warm_starts_a_base_of_its_own(tmp_path, monkeypatch, capsys):
    # Other kernels (ATEN_CPU_CAPABILITY=avx2, say) sum in another order: a run on them starts from a base built on
    # them, as on a CPU that has no more. A tiny warm start of one step, built once a kernel set, then found.
    monkeypatch.setenv("RL_CACHE_DIR", str(tmp_path))
    world, cfg = common.toy_world("add", 500, None), MoEConfig(vocab_size=len(common.TOY_VOCAB), d_model=8,
                                                                n_layers=1, n_experts=2, expert_hidden=8)
    paths = []
    for kernels in ("AVX512", "AVX2", "AVX512"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: kernels)
        paths.append(common.warm_start(world, cfg, common.TASKS["add"], max_steps=1)[1])
    assert paths[0] != paths[1] and paths[2] == paths[0] and sorted(tmp_path.iterdir()) == sorted(paths[:2])
    assert capsys.readouterr().err.count("note: the warm start reached") == 2       # built twice, found once


@pytest.mark.parametrize("kernels", ["avx2", "default"])
def test_torch_s_avx2_or_plain_kernels_keep_a_real_model_in_fp32(kernels):
    # The kernels torch runs are chosen as it starts: a process of its own, whatever this CPU has.
    code = ("import torch, common, grpo; "
            "print(common.uses_bf16(grpo.Args(model='m', dtype='auto'), torch.device('cpu')))")
    env = os.environ | {"ATEN_CPU_CAPABILITY": kernels}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "False\n", done.stderr


@pytest.mark.parametrize("device, chosen, bf16", [
    ("cuda", None, True),               # built without make_policy (a benchmark's model): CUDA's bf16, as --dtype auto
    ("cpu", None, False),               # and fp32 on a CPU, as the toy's --dtype auto
    ("cuda", False, False),             # --dtype fp32
    ("cpu", True, True),                # --dtype bf16, or auto with --model on a CPU with native bf16
])
def test_autocast_follows_the_run_s_choice_else_bf16_on_cuda_only(device, chosen, bf16, monkeypatch):
    asked = []
    monkeypatch.setattr(torch, "autocast", lambda device_type, dtype, enabled: asked.append((device_type, enabled)))
    model = torch.nn.Linear(1, 1)
    monkeypatch.setattr(model, "parameters", lambda: iter([types.SimpleNamespace(device=torch.device(device))]))
    if chosen is not None:
        model.bf16 = chosen
    common.autocast(model)
    assert asked == [(device, bf16)]


def test_bf16_autocast_computes_the_trunk_in_bf16_and_the_log_probs_in_fp32(hf_dense):
    model, tokenizer = hf_models.load_hf(str(hf_dense), torch.device("cpu"))
    world = common.World([], [], None, None, (tokenizer.eos_token_id,), tokenizer.pad_token_id, 6)
    prompts = [torch.tensor(tokenizer(p)["input_ids"]) for p in ("1+2?", "what is 12+34?")]
    torch.manual_seed(0)
    rollout = common.generate(model, world, prompts, 2, 1.0)
    fp32 = common.logprobs(model, world, rollout, 1.0)[0]
    seen = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    model.bf16 = True
    bf16 = common.logprobs(model, world, rollout, 1.0)[0]
    assert set(seen) == {torch.bfloat16} and bf16.dtype == torch.float32 and next(model.parameters()).dtype == torch.float32
    m = rollout.mask.bool()
    assert 0 < (bf16 - fp32)[m].abs().max() < 0.1                       # bf16's rounding, nothing more


def test_the_routing_recorded_on_columns_cut_is_never_read(hf_moe):
    # Recorded in two chunks, the first without the long prompt (so cut to fewer columns), then replayed on the whole
    # batch, which needs them all: whatever the cut columns hold, the same log-probs and routing metrics.
    model, tokenizer = hf_models.load_hf(str(hf_moe), torch.device("cpu"))
    world = common.World([], [], None, None, (tokenizer.eos_token_id,), tokenizer.pad_token_id, 12)
    texts = ["1+2?", "9-3?", "what is 12+34? ok ok ok", "7*8="]
    torch.manual_seed(0)
    rollout = common.generate(model, world, [torch.tensor(tokenizer(t)["input_ids"]) for t in texts], 2, 1.0)
    old_logp, _, recorded = common.fixed_logprobs(model, world, rollout, 1.0, chunks=2)
    other = recorded.clone()
    for rows in common.minibatches(len(rollout.mask), 2):
        _, start, end = common.needed_columns(rollout[rows])
        cut = torch.ones(other.shape[2], dtype=torch.bool)
        cut[start:end - 1] = False
        other[:, rows[:, None], cut] = torch.tensor([3, 1])               # other experts than the padding's 0
    assert (other != recorded).sum() > 0 and common.needed_columns(rollout)[1] == 0
    (logp, _, routing, _), (logp_other, _, routing_other, _) = (
        common.logprobs(model, world, rollout, 1.0, routing=r) for r in (recorded, other))
    assert torch.allclose(logp, logp_other, atol=1e-6) and torch.allclose(logp, old_logp, atol=1e-5)
    metrics = common.ratio_metrics(logp, old_logp, rollout.mask, routing, recorded, None)
    assert metrics == pytest.approx(common.ratio_metrics(logp, old_logp, rollout.mask, routing, other, None),
                                    rel=0, abs=0, nan_ok=True)
    assert metrics["routing_drift"] == 0                                   # replayed: the recorded experts


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_minibatch_cut_to_its_columns_gives_the_same_log_probs_and_routing(kind, hf_dense, hf_moe):
    model, tokenizer = hf_models.load_hf(str(hf_dense if kind == "dense" else hf_moe), torch.device("cpu"))
    world = common.World([], [], None, None, (tokenizer.eos_token_id,), tokenizer.pad_token_id, 12)
    texts = ["1+2?", "what is 12+34? ok ok ok", "7*8=", "9-3?"]
    prompts = [torch.tensor(tokenizer(p)["input_ids"]) for p in texts]
    torch.manual_seed(0)
    rollout = common.generate(model, world, prompts, 2, 1.0)
    lengths = rollout.mask.sum(1)
    rollout.mask[2:4], lengths[2:4] = 0, 3                              # rows 2-3 end early: a shorter minibatch
    rollout.mask[2:4, :3] = 1
    rows = torch.tensor([0, 1, 4, 5, 6, 7])                             # without the longest prompt's rows (2-3)
    cut, start, end = common.needed_columns(rollout[rows])
    P = rollout.tokens.shape[1] - rollout.mask.shape[1]
    assert start == P - max(len(prompts[i // 2]) for i in rows.tolist()) > 0
    assert end == P + int(lengths[rows].max()) and cut.tokens.shape[1] == end - start
    mine = common.logprobs(model, world, rollout[rows], 1.0)
    whole = lambda r: (r, 0, r.tokens.shape[1])
    original, common.needed_columns = common.needed_columns, whole
    try:
        every = common.logprobs(model, world, rollout[rows], 1.0)
    finally:
        common.needed_columns = original
    m = rollout.mask[rows].bool()
    assert torch.allclose(mine[0], every[0], atol=1e-5) and (mine[0][~m] == 0).all()
    assert torch.allclose(mine[1], every[1], atol=1e-5)
    if kind == "moe":                       # the routing of every position the cut kept, at the same place
        assert mine[2].shape == every[2].shape and torch.equal(mine[2][:, :, start:end - 1],
                                                               every[2][:, :, start:end - 1])
        replayed = common.logprobs(model, world, rollout[rows], 1.0, routing=every[2])   # Routing Replay, cut too
        assert torch.allclose(replayed[0], mine[0], atol=1e-5) and torch.equal(replayed[2], mine[2])


@pytest.mark.parametrize("steps, over", [(1, "the last step"), (20, "the last 2 steps")])    # the last tenth
def test_a_run_s_summary_names_the_steps_its_sampled_accuracy_is_over(steps, over, tmp_path, capsys):
    grpo.main(TINY_NO_STEPS + ["--steps", str(steps), "--eval-every", "0", "--save-every", "0", "--out", str(tmp_path)])
    assert f"; sampled accuracy over {over} " in capsys.readouterr().out
