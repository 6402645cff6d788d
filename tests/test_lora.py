"""--lora-r: peft's LoRA adapters on a frozen base. Only the adapters train, are checkpointed and exported
(DIR/adapter, and with --merge-lora the merged model in DIR/model); the reference is the base with the adapters off."""
import importlib.util
import os
import signal
import sys

import pytest
import torch
from conftest import COUNTER_REWARD, TINIER, read_metrics, run

import cispo
import common
import dapo
import grpo
import gspo
import ppo
import sapo
from extras import hf_models, hf_routing

# Without peft only the refusals run.
needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="peft is not installed (pip install peft)")


def lora_argv(source, data, tmp_path, *extra):
    """A tiny --lora-r run on `source`, rewarded by a counter so that every group has advantages
    whatever the samples; a large --lr so that 2 steps move the adapters well away from the base."""
    (tmp_path / "counter.py").write_text(COUNTER_REWARD)
    return ["--model", str(source), "--data", str(data), "--reward", f"{tmp_path / 'counter.py'}:counter",
            "--max-new-tokens", "6", "--eval-size", "5", "--steps", "2", "--prompts-per-step", "2",
            "--group-size", "3", "--minibatches", "2", "--lr", "3e-2", "--lora-r", "4", *extra]


def capture_runs(monkeypatch):
    """The Run objects the scripts make, to look at their policies after the run."""
    runs, init = [], common.Run.__init__
    monkeypatch.setattr(common.Run, "__init__", lambda self, *a, **k: (init(self, *a, **k), runs.append(self))[0])
    return runs


@pytest.fixture(scope="module")
def lora_run(hf_moe, tmp_path_factory):
    """grpo.py with LoRA on the tiny Qwen3-MoE, with a KL reference, Routing Replay and --merge-lora: its folder,
    its policy and its world."""
    tmp_path = tmp_path_factory.mktemp("lora-run")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(f'{{"prompt": "what is {a}+{b}?{" ok" * (a % 3)}", "answer": {a + b}}}\n'
                            for a in range(6) for b in range(5)))
    with pytest.MonkeyPatch.context() as monkeypatch:
        runs = capture_runs(monkeypatch)
        code, _ = run(grpo, lora_argv(hf_moe, data, tmp_path, "--beta", "0.04", "--routing-replay", "--merge-lora",
                                      "--out", str(tmp_path / "run")))
    assert code == 0
    return tmp_path / "run", runs[0].policy, runs[0].world


def base_model(source):
    from transformers import AutoModelForCausalLM
    return common.training_mode(hf_routing.watch_routers(AutoModelForCausalLM.from_pretrained(source)), False)


@torch.no_grad()
def logprobs(model, tokens):
    model.eval()
    return torch.log_softmax(model(input_ids=tokens).logits.float(), -1)


TOKENS = torch.tensor([[5, 9, 12, 20, 7, 30, 3, 11]])


@needs_peft
def test_only_the_adapters_train_and_the_base_stays_bitwise(lora_run, hf_moe):
    out, policy, _ = lora_run
    trained = {name for name, p in policy.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert all(p.dtype == torch.float32 for p in common.trainable(policy))
    # The adapters moved (B starts at 0)...
    assert all(p.abs().sum() > 0 for n, p in policy.named_parameters() if ".lora_B." in n)
    # ...the base did not: peft keeps it as each wrapped layer's base_layer, and the router and the attention and
    # expert weights are all there, each equal to the checkpoint's.
    source = base_model(hf_moe).state_dict()
    frozen = {n.removeprefix("base_model.model.").replace("base_layer.", ""): p
              for n, p in policy.state_dict().items() if "lora_" not in n}
    assert frozen.keys() == source.keys()
    assert all(torch.equal(p, source[n]) for n, p in frozen.items())


@needs_peft
def test_the_checkpoint_holds_the_adapters_and_their_optimizer_state_only(lora_run, hf_moe):
    out, policy, _ = lora_run
    checkpoint = torch.load(out / "checkpoint.pt", weights_only=True)
    adapters = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert set(checkpoint["policy"]) == adapters
    assert len(checkpoint["optimizer"]["param_groups"][0]["params"]) == len(adapters)    # AdamW holds only them
    assert len(checkpoint["optimizer"]["state"]) == len(adapters)
    assert all(torch.equal(checkpoint["policy"][n], p) for n, p in policy.named_parameters() if p.requires_grad)


@needs_peft
def test_the_reference_with_the_adapters_off_is_the_initial_policy(lora_run, hf_moe):
    out, policy, world = lora_run
    rollout = common.generate(policy, world, [p for p, _ in world.train[:2]], 3, 1.0)
    ref_logp = common.fixed_logprobs(common.frozen_copy(policy), world, rollout, 1.0, 2)[0]
    base = base_model(hf_moe)
    base.bf16 = policy.bf16                     # computed as the run computes (bf16 on a CPU with native bf16)
    base_logp = common.fixed_logprobs(base, world, rollout, 1.0, 2)[0]
    assert torch.equal(ref_logp, base_logp)
    policy_logp = common.fixed_logprobs(policy, world, rollout, 1.0, 2)[0]
    assert not torch.allclose(policy_logp, base_logp)                          # the adapters are back on
    assert [r["kl_ref"] > 0 for r in read_metrics(out)[1:]] == [True, True]    # the KL term saw them apart


@needs_peft
def test_the_adapter_export_loads_with_peft_and_gives_the_run_s_log_probs(lora_run, hf_moe):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out, policy, _ = lora_run
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_moe), out / "adapter")
    assert torch.equal(logprobs(loaded, TOKENS), logprobs(policy, TOKENS))
    assert not torch.allclose(logprobs(loaded, TOKENS), logprobs(base_model(hf_moe), TOKENS))
    tokenizer = AutoTokenizer.from_pretrained(out / "adapter")
    assert tokenizer("what is 2+3?")["input_ids"] == AutoTokenizer.from_pretrained(hf_moe)("what is 2+3?")["input_ids"]


@needs_peft
def test_merge_lora_exports_a_model_that_auto_model_loads(lora_run):
    from transformers import AutoModelForCausalLM
    out, policy, _ = lora_run
    merged = AutoModelForCausalLM.from_pretrained(out / "model", local_files_only=True)
    # W + (alpha / r) B A added once into W: the same log-probs up to fp32 rounding.
    assert (logprobs(merged, TOKENS) - logprobs(policy, TOKENS)).abs().max() < 1e-5


@needs_peft
def test_routing_replay_sees_the_top_k_of_a_router_that_peft_wraps(tiny_moe):
    model = hf_models.add_lora(tiny_moe("qwen3_moe"), hf_models.lora_config(grpo.Args(lora_r=4)), seed=0)
    routers = hf_routing.routers(model)
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    assert [g.base_layer for g in gates] == routers                # peft wraps the router: replay works inside
    common.check_replay(model)                                     # recorded, replayed exactly, others differ
    tokens = torch.arange(1, 17)[None] % 40
    with torch.no_grad():
        _, before, _ = common.trunk(model, tokens, torch.ones_like(tokens))
        for gate in gates:                                         # the router's own adapter reroutes tokens
            torch.nn.init.normal_(gate.lora_B["default"].weight, std=1.0)
        free, after, _ = common.trunk(model, tokens, torch.ones_like(tokens))
        replayed = common.trunk(model, tokens, torch.ones_like(tokens), before)[0]
        replayed_now = common.trunk(model, tokens, torch.ones_like(tokens), after)[0]
    assert not torch.equal(after, before)
    assert torch.equal(replayed_now, free)                         # the adapted router's own choice, replayed exactly
    assert not torch.equal(replayed, free)                         # the old experts, not the new choice


@needs_peft
def test_the_adapters_are_fp32_on_a_bf16_base(tiny_moe):
    model = hf_models.add_lora(tiny_moe("qwen3_moe").to(torch.bfloat16), hf_models.lora_config(grpo.Args(lora_r=4)), 0)
    assert {p.dtype for p in common.trainable(model)} == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}


@needs_peft
@pytest.mark.parametrize("script", [grpo, gspo, dapo, ppo, cispo, sapo])
def test_every_script_trains_lora_adapters_end_to_end(script, hf_dense, jsonl, tmp_path):
    code, _ = run(script, lora_argv(hf_dense, jsonl, tmp_path, "--out", str(tmp_path / "run")))
    assert code == 0
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["skipped_updates"] == 0 for r in rows[1:])
    checkpoint = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert checkpoint["policy"] and all(".lora_" in n for n in checkpoint["policy"])
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "run" / "model").exists()                  # no --merge-lora: the adapters only


@needs_peft
def test_resume_with_lora_equals_one_uninterrupted_run(hf_dense, jsonl, tmp_path):
    argv = lora_argv(hf_dense, jsonl, tmp_path, "--eval-every", "1")        # the split run evaluates at step 1
    # A reward by length: the counter's count is not checkpointed, so a resumed run would score otherwise.
    length = "def length(completion, answer, finished):\n    return float(len(completion))\n"
    (tmp_path / "length.py").write_text(length)
    argv[argv.index("--reward") + 1] = f"{tmp_path / 'length.py'}:length"
    run(grpo, argv + ["--out", str(tmp_path / "long")])
    run(grpo, argv + ["--steps", "1", "--out", str(tmp_path / "split")])
    run(grpo, argv + ["--resume", str(tmp_path / "split")])
    assert read_metrics(tmp_path / "split", timings=False) == read_metrics(tmp_path / "long", timings=False)
    long = torch.load(tmp_path / "long" / "checkpoint.pt", weights_only=True)
    split = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=True)
    assert long["policy"].keys() == split["policy"].keys()
    assert all(torch.equal(long["policy"][k], split["policy"][k]) for k in long["policy"])


def test_lora_without_peft_stops_with_one_line(hf_dense, jsonl, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "peft", None)                 # import peft raises ImportError
    code, err = run(grpo, lora_argv(hf_dense, jsonl, tmp_path, "--out", str(tmp_path / "run")), capsys)
    assert code == 2 and err.strip() == "error: --lora-r needs peft, which is not installed: pip install peft"


@pytest.mark.parametrize("argv, message", [
    (["--lora-r", "4"], "--lora-r needs --model"),
    (["--merge-lora"], "--merge-lora needs --lora-r"),
    (["--lora-alpha", "16"], "--lora-alpha needs --lora-r"),
    (["--lora-r", "-1"], "--lora-r must be 0 (off) or positive"),
])
def test_lora_settings_that_cannot_work_stop_with_one_line(argv, message, capsys):
    code, err = run(grpo, ["--steps", "1"] + argv, capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


@needs_peft
def test_ppo_s_lora_critic_is_its_own_adapters_and_head_on_the_policy_s_frozen_base(hf_moe, jsonl, tmp_path,
                                                                                    monkeypatch):
    runs = capture_runs(monkeypatch)
    assert run(ppo, lora_argv(hf_moe, jsonl, tmp_path, "--out", str(tmp_path / "run")))[0] == 0
    policy, critic = runs[0].state["policy"], runs[0].state["critic"]
    frozen = lambda model: {n: p for n, p in model.named_parameters() if not p.requires_grad}
    # The same tensors, not copies: the critic costs no second base. It replaced the vocabulary head (untied in
    # this model) with its value head: the one frozen tensor of the policy that it lacks.
    shared = frozen(critic)
    assert shared and all(p is frozen(policy)[n] for n, p in shared.items())
    assert set(frozen(policy)) - set(shared) == {"base_model.model.lm_head.weight"}
    trained = dict(p for p in critic.named_parameters() if p[1].requires_grad)
    assert set(trained) == {n for n in dict(policy.named_parameters()) if ".lora_" in n} | \
        {"base_model.model.lm_head.weight", "base_model.model.lm_head.bias"}       # its adapters and the value head
    assert trained["base_model.model.lm_head.weight"].shape == (1, 32)
    policy_adapters = dict(policy.named_parameters())
    assert all(p.abs().sum() > 0 and not torch.equal(p, policy_adapters[n])       # both trained, each its own way
               for n, p in trained.items() if ".lora_B." in n)
    checkpoint = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert set(checkpoint["critic"]) == set(trained) and len(checkpoint["critic_optimizer"]["state"]) == len(trained)
    assert (tmp_path / "run" / "adapter").is_dir() and not (tmp_path / "run" / "adapter" / "critic").exists()


@needs_peft
def test_ctrl_c_exports_the_adapters(hf_dense, jsonl, tmp_path, monkeypatch, capsys):
    real_generate = common.generate

    def generate_then_ctrl_c(*args, **kw):
        if not kw.get("greedy"):                                    # during step 1's rollout
            os.kill(os.getpid(), signal.SIGINT)
        return real_generate(*args, **kw)

    monkeypatch.setattr(common, "generate", generate_then_ctrl_c)
    code, err = run(grpo, lora_argv(hf_dense, jsonl, tmp_path, "--merge-lora", "--out", str(tmp_path / "run")), capsys)
    out = tmp_path / "run"
    assert code == 130 and f"SIGINT: saved step 1 to {out / 'checkpoint.pt'}, {out / 'adapter'} and {out / 'model'}; " \
                           f"continue" in err
    assert (out / "adapter" / "adapter_model.safetensors").is_file() and (out / "model" / "model.safetensors").is_file()


@needs_peft
def test_merge_lora_merges_into_a_base_loaded_again_on_the_cpu_not_into_a_copy_of_the_policy(hf_dense, jsonl,
                                                                                              tmp_path, monkeypatch):
    """A copy of the policy would be a second model on its GPU: the export loads --model on the CPU instead."""
    import copy
    runs, loads, copied = capture_runs(monkeypatch), [], []
    load_hf, deepcopy = hf_models.load_hf, copy.deepcopy
    monkeypatch.setattr(hf_models, "load_hf", lambda name, device, *a: loads.append((device.type, *a)) or
                        load_hf(name, device, *a))
    monkeypatch.setattr(copy, "deepcopy", lambda x, *a: copied.append(x) or deepcopy(x, *a))
    assert run(grpo, lora_argv(hf_dense, jsonl, tmp_path, "--merge-lora", "--out", str(tmp_path / "run")))[0] == 0
    policy = runs[0].policy
    assert loads == [("cpu", torch.float32), ("cpu", "auto")]          # the policy's base, then the export's
    assert not any(x is policy or x is policy.base_model for x in copied)
    assert common.is_lora(policy) and any(".lora_B." in n for n, _ in policy.named_parameters())   # not merged
    from transformers import AutoModelForCausalLM
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model")
    assert (logprobs(merged, TOKENS) - logprobs(policy, TOKENS)).abs().max() < 1e-5
    assert not torch.allclose(logprobs(merged, TOKENS), logprobs(base_model(hf_dense), TOKENS))


@needs_peft
def test_a_resumed_merge_lora_run_merges_again_so_its_model_is_never_stale(hf_dense, jsonl, tmp_path, capsys):
    # A resume continues the run with its own settings: --merge-lora included, so DIR/model is the resumed policy's.
    out = tmp_path / "run"
    assert run(grpo, lora_argv(hf_dense, jsonl, tmp_path, "--merge-lora", "--steps", "1", "--out", str(out)))[0] == 0
    assert f"checkpoint, metrics, adapter/ and model/ in {out}" in capsys.readouterr().out
    from transformers import AutoModelForCausalLM
    first = logprobs(AutoModelForCausalLM.from_pretrained(out / "model"), TOKENS)
    assert run(grpo, lora_argv(hf_dense, jsonl, tmp_path, "--resume", str(out)))[0] == 0   # on to step 2
    assert f"checkpoint, metrics, adapter/ and model/ in {out}" in capsys.readouterr().out
    second = logprobs(AutoModelForCausalLM.from_pretrained(out / "model"), TOKENS)
    assert not torch.allclose(first, second)                        # step 2's merge, not step 1's left behind


def test_a_checkpoint_from_before_the_lora_settings_resumes_with_them_at_their_defaults(tmp_path, capsys):
    """A missing setting in an old checkpoint's arguments is its default, not a difference."""
    assert run(grpo, TINIER + ["--steps", "1", "--out", str(tmp_path)])[0] == 0
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    for name in ("lora_r", "lora_alpha", "merge_lora", "clip_eps"):
        del checkpoint["args"][name]
    torch.save(checkpoint, tmp_path / "checkpoint.pt")
    code, err = run(grpo, TINIER + ["--resume", str(tmp_path), "--clip-eps", "0.3"], capsys)
    assert code == 2 and "settings differ from the checkpoint's: --clip-eps 0.2 in the checkpoint, 0.3 now" in err
    assert run(grpo, TINIER + ["--resume", str(tmp_path)])[0] == 0
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
