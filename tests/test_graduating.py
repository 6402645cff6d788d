"""The mapping table of docs/ (TRL's and verl's names for each setting) and ppo.py's verl defaults, checked against the installed verl
and TRL: `pip install --no-deps verl==0.9.1 trl==1.16.0` is enough (CI does it), and `pip install datasets==5.2.0`
runs the printed TRL program; without them those checks skip."""
import ast
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml

import cispo
import common
import dapo
import grpo
import gspo
import ppo
import sapo
from extras import graduate, hf_models

# The mapping table: the section of docs/ whose table starts "| here | TRL | verl |", which README.md links to; the
# messages below call it README's table.
DOCS = Path(__file__).resolve().parent.parent / "docs"
# Values in the table that stand for the user's numbers, not for a literal setting.
PLACEHOLDERS = {"P", "G", "L_max", "L_cache", "R", "A"}
# One table key, with or without a value: `epsilon`, `rollout.n=G`, `+reward.reward_kwargs.max_resp_len=L_max`.
KEY = re.compile(r"(\+?[A-Za-z_][\w.]*)(?:=(.+))?")


def table_cells(column):
    """The backticked keys of one column (1: TRL, 2: verl) of the table, row by row."""
    section = next(part for path in sorted(DOCS.glob("*.md")) for part in path.read_text().split("\n## ")
                   if "\n| here | TRL | verl |\n" in part)
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| here")]
    cells = [re.split(r"(?<!\\)\|", row)[column + 1] for row in rows]
    return [[m.groups() for m in map(KEY.fullmatch, re.findall(r"`([^`]+)`", cell)) if m] for cell in cells]


def spelt_out(key):
    return re.sub(r"^(actor|rollout)\.", r"actor_rollout_ref.\1.", key)


def verl_keys():
    """Every verl key of the table, spelt out: `actor.` and `rollout.` under `actor_rollout_ref.`, and a key
    without a dot continuing the one before it in its cell (`actor.clip_ratio_low=0.2`, `clip_ratio_high`)."""
    keys = []
    for cell in table_cells(2):
        parent = None
        for key, value in cell:
            if "." not in key:
                assert parent, f"README's verl column: `{key}` has no key before it to continue"
                key = f"{parent}.{key}"
            parent = key.rpartition(".")[0]
            keys.append((key.startswith("+"), spelt_out(key.lstrip("+")), value))
    return keys


def test_the_table_names_what_it_should():
    # The parser reads what the rows hold (a parser that found nothing would pass everything below).
    keys = verl_keys()
    assert (False, "actor_rollout_ref.actor.kl_loss_coef", None) in keys
    assert (False, "actor_rollout_ref.actor.clip_ratio_high", "0.28") in keys
    assert (True, "reward.reward_kwargs.overlong_buffer_cfg.len", "L_cache") in keys
    assert ("mask_truncated_completions", None) in sum(table_cells(1), [])
    assert (False, "actor_rollout_ref.model.target_modules", "all-linear") in keys
    assert ("peft_config", 'LoraConfig(r=R, lora_alpha=A, target_modules="all-linear")') in sum(table_cells(1), [])


@pytest.fixture(scope="module")
def verl():
    """verl's configuration, flattened (`a.b.c` -> default) over every generated trainer config (FSDP,
    Megatron, VeOmni, TorchTitan), and the text of its Python sources."""
    spec = importlib.util.find_spec("verl")     # finds the package without importing it (its dependencies are absent)
    if spec is None:
        pytest.skip("verl is not installed (pip install --no-deps verl==0.9.1)")
    root = Path(spec.origin).parent

    def flatten(tree, prefix=""):
        for name, value in tree.items():
            yield prefix + name, value
            if isinstance(value, dict):
                yield from flatten(value, f"{prefix}{name}.")

    config = {}
    for path in sorted((root / "trainer" / "config").glob("_generated_*.yaml")):
        for key, value in flatten(yaml.safe_load(path.read_text())):
            config.setdefault(key, value)
    assert config, f"no _generated_*.yaml in {root / 'trainer' / 'config'}"
    sources = [path.read_text() for path in root.rglob("*.py")]
    return config, sources


def is_read(name, source):
    return re.search(rf"""\.{name}\b|\(["']{name}["']|\[["']{name}["']\]""", source)


def test_every_verl_key_of_the_table_is_in_verl(verl):
    config, sources = verl
    for plus, key, value in verl_keys():
        if plus:
            # `+` adds a key the configuration does not have, under a section it has; the code must read it:
            # all the added names in one file (the DAPO reward manager reads reward_kwargs.overlong_buffer_cfg.len).
            assert key not in config, f"README: +{key} is in verl's configuration: drop the +"
            section = key
            while section and section not in config:
                section = section.rpartition(".")[0]
            assert section and isinstance(config[section], dict), f"README: +{key} is under no section of verl's"
            added = key[len(section) + 1:].split(".")
            assert any(all(is_read(name, source) for name in added) for source in sources), \
                f"README: no verl source reads {'.'.join(added)} of +{key}"
            continue
        assert key in config, f"README's table names {key}, which no verl configuration has"
        default = config[key]
        if value is None or value in PLACEHOLDERS:
            continue
        if value in ("True", "False"):
            assert isinstance(default, bool), f"README: {key}={value}, but its default is {default!r}"
        elif re.fullmatch(r"[\d.e-]+", value):
            assert isinstance(default, (int, float)) and not isinstance(default, bool), \
                f"README: {key}={value}, but its default is {default!r}"
        else:  # a mode's name: verl's code must know it
            assert any(f'"{value}"' in s or f"'{value}'" in s for s in sources), \
                f"README: {key}={value}, a value no verl source names"


def test_the_verl_defaults_ppo_py_names(verl):
    # "algorithm.lam=1.0, ... (here --lam 0.95, ...)": verl's defaults, then ppo.py's, in the same order.
    config, _ = verl
    verls = re.findall(r"\b((?:actor|algorithm|critic)\.[\w.]+)=([\d.]+)\b", ppo.__doc__)
    ours = re.findall(r"--([\w-]+) ([\d.]+)", re.search(r"\(here\s+(--[^)]*)\)", ppo.__doc__).group(1))
    assert len(verls) == 5 and len(ours) == 4, (verls, ours)
    for key, value in verls:
        default = config[spelt_out(key)]
        assert default == pytest.approx(float(value)), f"ppo.py: {key}={value}, verl has {default}"
    # ppo.py's own defaults, and the README's row that sets verl to them.
    readme = {key: value for _, key, value in verl_keys()}
    for (key, _), (flag, value) in zip(verls, ours):
        assert getattr(ppo.Args(), flag.replace("-", "_")) == pytest.approx(float(value)), f"ppo.py: --{flag}"
        assert readme.get(spelt_out(key)) == value, f"README's ppo.py row: {key} should be set to {value}"


def trainer_arguments(trl_root):
    """The arguments of GRPOTrainer.__init__, read from its source (importing it needs TRL's dependencies)."""
    tree = ast.parse((trl_root / "trainer" / "grpo_trainer.py").read_text())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GRPOTrainer")
    init = next(n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {a.arg for a in init.args.args + init.args.kwonlyargs}


def test_every_trl_name_of_the_table_is_in_trl(tmp_path):
    pytest.importorskip("trl", reason="trl is not installed (pip install --no-deps trl==1.16.0)")
    import trl.rewards
    from trl import GRPOConfig
    fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    arguments = trainer_arguments(Path(trl.rewards.__file__).parent.parent)
    assert {"model", "args", "peft_config"} <= arguments
    for name, value in sum(table_cells(1), []):
        assert name in fields or hasattr(trl.rewards, name) or name in arguments, \
            f"README's table names {name}, which TRL lacks"
        if value and value.startswith("LoraConfig("):   # peft's LoraConfig: its keywords must be its fields
            peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
            call = ast.parse(value).body[0].value
            unknown = {k.arg for k in call.keywords} - {f.name for f in dataclasses.fields(peft.LoraConfig)}
            assert not unknown, f"README: LoraConfig has no {unknown}"
            continue
        if value and value.startswith('"'):   # a choice: its help text lists the choices, quoted
            choice = value.strip('"')
            if name == "lr_scheduler_type":   # transformers' choices, not TRL's
                from transformers import SchedulerType
                assert choice in {s.value for s in SchedulerType}, f"README: {name}={value}"
                continue
            assert f"'{choice}'" in fields[name].metadata["help"], f"README: {name}={value}"
    # The defaults the table states. Activation checkpointing is on through TRL's default for its old name, which
    # transformers 5.25 warns of: why the printed config names activation_checkpointing.
    assert fields["loss_type"].default == "dapo"
    with pytest.warns(FutureWarning, match="`gradient_checkpointing` is deprecated"):
        assert GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False).activation_checkpointing is True


def test_dapo_sequence_mean_divides_by_every_completion_masked_ones_too():
    # --no-token-level-loss with --overlong-filtering: row 1 is masked out entirely, and still counts in
    # the mean over sequences (GRPO's 1/G; TRL's loss_type="grpo", verl's seq-mean-token-mean over the
    # minibatch). On-policy (ratio 1) each row's loss is -A: (-1.5 + 0 - 0.6) / 3 rows, not / 2 kept.
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1], [-0.4, -0.9, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    loss, _ = dapo.policy_loss(logp, logp, torch.tensor([1.5, -1.0, 0.6]), mask, token_level=False)
    assert loss.item() == pytest.approx(-0.7)


# --print-verl and --print-trl: the printed settings, composed in verl's own config and built in TRL.
MODEL_AND_DATA = ["--model", "Qwen/Qwen3-0.6B", "--data", "train.jsonl", "--max-new-tokens", "512"]
SETTINGS = [(grpo, []), (grpo, ["--beta", "0.04", "--clip-eps", "0.1", "--routing-replay", "--lora-r", "8",
                                "--gradient-checkpointing", "--reward", "mine.py:score"]),
            (gspo, []), (gspo, ["--token-level", "--group-size", "4", "--minibatches", "2"]),
            (dapo, []), (dapo, ["--no-clip-higher", "--no-token-level-loss", "--no-dynamic-sampling",
                                "--overlong-filtering", "--overlong-buffer", "64"]),
            (ppo, []), (ppo, ["--lora-r", "8", "--epochs", "3"]),
            (cispo, []), (cispo, ["--ratio-cap", "1.2", "--clip-eps-low", "0.2", "--beta", "0.04"]),
            (sapo, []), (sapo, ["--tau-pos", "1.5", "--tau-neg", "2.0", "--beta", "0.04", "--routing-replay"]),
            (grpo, ["--sampler", "bf16", "--rollout-correction", "token_mask", "--rollout-correction-min", "0.5"]),
            (cispo, ["--rollout-correction", "sequence_truncate", "--rollout-correction-max", "2.0"])]


def printed(script, flags, capsys, what="--print-verl"):
    script.main([*MODEL_AND_DATA, *flags, what])
    return capsys.readouterr().out


def config_call(code):
    """The `GRPOConfig(...)` call of a printed TRL program."""
    return re.search(r"^config = (GRPOConfig\(.*?^\))", code, re.S | re.M).group(1)


def overrides(text):
    """The overrides of a printed verl command (the lines after `python3 -m verl.trainer.main_ppo`)."""
    lines = [line.strip().rstrip("\\").strip() for line in text.split("verl.trainer.main_ppo")[1].splitlines()]
    return [line for line in lines if line]


@pytest.fixture(scope="module")
def verl_config():
    hydra = pytest.importorskip("hydra", reason="hydra-core is not installed (pip install hydra-core)")
    spec = importlib.util.find_spec("verl")
    if spec is None:
        pytest.skip("verl is not installed (pip install --no-deps verl==0.9.1)")
    folder = str(Path(spec.origin).parent / "trainer" / "config")

    def composed(keys):
        with hydra.initialize_config_dir(config_dir=folder, version_base=None):
            return hydra.compose(config_name="ppo_trainer", overrides=keys)
    return composed


@pytest.mark.parametrize("script, flags", SETTINGS)
def test_the_printed_verl_overrides_compose_in_verls_config(script, flags, verl_config, capsys):
    args = common.parse_args(script.Args, script.__doc__, [*MODEL_AND_DATA, *flags])
    common.check_common_args(args, min_group_size=1)                   # and the defaults that follow the model
    config = verl_config(overrides(printed(script, flags, capsys)))     # a key verl lacks raises here
    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    assert config.data.train_batch_size == args.prompts_per_step and rollout.n == args.group_size
    assert actor.ppo_mini_batch_size * args.minibatches == args.prompts_per_step
    assert actor.optim.lr == args.lr and config.data.max_response_length == 512
    assert actor.optim.weight_decay == 0.0 and actor.optim.clip_grad == args.max_grad_norm   # AdamW(weight_decay=0)
    assert config.trainer.n_gpus_per_node * config.trainer.nnodes == 1
    rows = actor.ppo_mini_batch_size * rollout.n                     # verl's mini-batch in completions
    assert rows % actor.ppo_micro_batch_size_per_gpu == 0 and rollout.log_prob_micro_batch_size_per_gpu
    assert config.actor_rollout_ref.model.path == "Qwen/Qwen3-0.6B"
    assert config.algorithm.adv_estimator == ("gae" if script is ppo else "grpo")
    if script in (grpo, ppo):
        low = high = args.clip_eps
    elif script is cispo:  # verl clamps the weight to [1 - low, 1 + high]: low 1 is no floor
        low, high = 1.0 if args.clip_eps_low is None else args.clip_eps_low, pytest.approx(args.ratio_cap - 1)
    elif script is sapo:   # no clip: verl's defaults, unread by its SAPO loss
        low = high = 0.2
        assert (actor.tau_pos, actor.tau_neg) == (args.tau_pos, args.tau_neg)
    else:
        low, high = args.clip_eps_low, args.clip_eps_high if script is gspo or args.clip_higher else args.clip_eps_low
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (low, high)
    token_mean = script in (ppo, cispo) or script is dapo and args.token_level_loss
    assert actor.loss_agg_mode == ("token-mean" if token_mean else "seq-mean-token-mean")
    assert actor.policy_loss.loss_mode == {gspo: "gspo", cispo: "cispo", sapo: "sapo"}.get(script, "vanilla")
    assert actor.use_kl_loss == (script in (grpo, cispo, sapo) and args.beta > 0)
    assert config.actor_rollout_ref.model.lora_rank == args.lora_r
    assert config.reward.custom_reward_function.name == "verl_reward"
    correction, mode = config.algorithm.rollout_correction, common.correction_mode(args)
    assert correction.rollout_is == (None if mode == "none" else mode.split("_")[0]) and not correction.bypass_mode
    if mode != "none":      # one bound truncates, "low_high" masks (verl masks between two bounds only)
        assert correction.rollout_is_threshold == (f"{args.rollout_correction_min}_{args.rollout_correction_max}"
                                                   if mode.endswith("mask") else args.rollout_correction_max)
    if script is dapo:
        assert config.algorithm.filter_groups.enable == args.dynamic_sampling
        assert config.algorithm.filter_groups.metric == "reward"        # after the overlong penalty, as dapo.py
        assert (config.reward.reward_manager.name == "dapo") == args.overlong_shaping
    if script is ppo:
        assert config.algorithm.use_kl_in_reward and config.algorithm.kl_ctrl.kl_coef == args.beta_kl
        assert actor.ppo_epochs == config.critic.ppo_epochs == args.epochs
        assert config.critic.model.path == "Qwen/Qwen3-0.6B" and config.critic.model.lora_rank == args.lora_r
        assert config.critic.optim.weight_decay == 0.0 and config.critic.optim.clip_grad == args.max_grad_norm


def test_the_printed_verl_command_finds_its_reward_as_verl_loads_it(capsys):
    # verl loads custom_reward_function.path as a file (verl.utils.import_utils.load_extern_object), in a process
    # started where the printed command says to run it; importing the package itself needs verl's dependencies, so its
    # loader is taken from its file.
    spec = importlib.util.find_spec("verl")
    if spec is None:
        pytest.skip("verl is not installed (pip install --no-deps verl==0.9.1)")
    text = printed(grpo, [], capsys)
    key = "reward.custom_reward_function.path="
    path = next(line[len(key):] for line in overrides(text) if line.startswith(key))
    folder = re.search(r"# run from (\S+):", text).group(1)
    loader = Path(spec.origin).parent / "utils" / "import_utils.py"
    code = (f"import importlib.util\n"
            f"spec = importlib.util.spec_from_file_location('verl_import_utils', {str(loader)!r})\n"
            f"utils = importlib.util.module_from_spec(spec)\n"
            f"spec.loader.exec_module(utils)\n"
            f"reward = utils.load_extern_object(module_path={path!r}, object_name='verl_reward')\n"
            f"print(reward('llm-rl-reference', 'So the answer is 12.', '12'), reward('x', 'So it is 13.', '12'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=folder, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1.0", "0.0"]


def test_a_changed_flag_changes_the_printed_value(capsys):
    assert "actor_rollout_ref.rollout.n=8" in overrides(printed(grpo, [], capsys))
    assert "actor_rollout_ref.rollout.n=4" in overrides(printed(grpo, ["--group-size", "4"], capsys))
    assert "actor_rollout_ref.actor.clip_ratio_high=0.3" in overrides(printed(dapo, ["--clip-eps-high", "0.3"], capsys))
    assert "num_generations=4," in printed(gspo, ["--group-size", "4"], capsys, "--print-trl")
    assert "epsilon_high=0.3," in printed(dapo, ["--clip-eps-high", "0.3"], capsys, "--print-trl")
    assert "actor_rollout_ref.actor.clip_ratio_high=2.0" in overrides(printed(cispo, ["--ratio-cap", "3"], capsys))
    assert "epsilon_high=3.0," in printed(cispo, ["--ratio-cap", "3"], capsys, "--print-trl")
    assert "actor_rollout_ref.actor.tau_neg=2.5" in overrides(printed(sapo, ["--tau-neg", "2.5"], capsys))
    assert "sapo_temperature_neg=2.5," in printed(sapo, ["--tau-neg", "2.5"], capsys, "--print-trl")


def test_on_the_toy_the_printed_rate_is_a_pretrained_model_s_unless_given(capsys):
    # The printed run trains MODEL, a pretrained model: --model's default rate, said so, not the toy's 1e-4.
    note = "# the learning rate is 1e-6, --model's default; the toy's 1e-4 would break a pretrained model\n"
    for what, key in (("--print-trl", "    learning_rate={},\n"), ("--print-verl", "actor.optim.lr={} \\\n")):
        grpo.main([what])
        toy = capsys.readouterr().out
        assert toy.startswith(note) and key.format(1e-06) in toy and "0.0001" not in toy
        grpo.main([what, "--lr", "3e-05"])                              # given: the user's, with no note
        given = capsys.readouterr().out
        assert key.format(3e-05) in given and "learning rate is" not in given
    ppo.main(["--print-verl"])
    assert "critic.optim.lr=1e-06 \\\n" in capsys.readouterr().out     # the critic's follows the policy's
    # With --model: its rate, no note; a complete copy lacks no file, and only --data's program reads with hf_models.
    for flags in ([], ["--data", "d.jsonl"]):
        grpo.main(["--model", "m", *flags, "--print-trl", "--print-verl"])
        text = capsys.readouterr().out
        assert "learning_rate=1e-06," in text and "learning rate is" not in text and "lacks" not in text
        assert ("from extras import graduate, hf_models\n" in text) == bool(flags)


def test_what_verl_lacks_is_a_comment_never_a_key(capsys):
    text = printed(grpo, ["--routing-replay"], capsys)
    assert "# --routing-replay: verl replays experts only in its Megatron and VeOmni engines" in text
    assert not any("router_replay" in key for key in overrides(text))
    assert "# --overlong-filtering" in printed(dapo, ["--overlong-filtering"], capsys)
    assert "# --clip-eps-low: TRL's cispo caps the weight from above only" in \
        printed(cispo, ["--clip-eps-low", "0.2"], capsys, "--print-trl")
    assert printed(ppo, [], capsys, "--print-trl").strip() == \
        "# TRL 1.16 has no PPO trainer (removed in 1.0); verl has one: python ppo.py ... --print-verl"


@pytest.mark.parametrize("script, flags", [s for s in SETTINGS if s[0] is not ppo])
def test_the_printed_grpo_config_builds_in_trl_with_the_scripts_values(script, flags, capsys):
    pytest.importorskip("trl", reason="trl is not installed (pip install --no-deps trl==1.16.0)")
    from trl import GRPOConfig
    args = common.parse_args(script.Args, script.__doc__, [*MODEL_AND_DATA, *flags])
    common.check_common_args(args, min_group_size=1)
    code = printed(script, flags, capsys, "--print-trl")
    with warnings.catch_warnings(record=True) as caught:  # no warning: every name as the pinned versions spell it
        warnings.simplefilter("always")
        config = eval(config_call(code), {"GRPOConfig": GRPOConfig, "gpu": torch.cuda.is_available()})
    assert not caught, [f"{w.category.__name__}: {w.message}" for w in caught]
    assert config.activation_checkpointing == config.gradient_checkpointing == args.gradient_checkpointing
    if script is cispo:    # epsilon_high is the cap itself; epsilon, unread, stays TRL's
        eps_low, eps_high = 0.2, args.ratio_cap
    elif script is sapo:   # no clip: TRL's defaults, unread by its SAPO loss
        eps_low, eps_high = 0.2, None
        assert (config.sapo_temperature_pos, config.sapo_temperature_neg) == (args.tau_pos, args.tau_neg)
    else:
        eps_low = args.clip_eps if script is grpo else args.clip_eps_low
        eps_high = (args.clip_eps if script is grpo else args.clip_eps_high if script is gspo or args.clip_higher
                    else args.clip_eps_low)
    assert config.num_generations == args.group_size and config.epsilon == eps_low
    assert config.epsilon_high == eps_high
    assert config.beta == (args.beta if script in (grpo, cispo, sapo) else 0.0)
    assert config.use_bias_correction_kl == (config.beta == 0)         # the scripts' KL: k3, not weighted by r
    assert config.loss_type == ("bnpo" if script is dapo and args.token_level_loss else
                                script.__name__ if script in (cispo, sapo) else "grpo")
    assert config.lr_scheduler_type == "constant" and config.weight_decay == 0.0
    assert config.importance_sampling_level == ("sequence" if script is gspo else "token")
    assert config.generation_batch_size == args.prompts_per_step * args.group_size
    assert config.steps_per_generation == args.minibatches and config.learning_rate == args.lr
    mode = common.correction_mode(args)                                 # TRL's rollout correction, as here
    assert config.vllm_importance_sampling_correction == (mode != "none")
    if mode != "none":
        assert config.vllm_importance_sampling_mode == mode
        assert (config.vllm_importance_sampling_clip_max, config.vllm_importance_sampling_clip_min) == \
               (args.rollout_correction_max, args.rollout_correction_min)
    assert ("peft_config=LoraConfig(r=8" in code) == bool(args.lora_r)
    shaping = script is dapo and args.overlong_shaping           # dapo.py's buffer: a quarter of the limit by default
    assert shaping == (f"get_soft_overlong_punishment(512, {shaping and (args.overlong_buffer or 128)})" in code)


def test_the_printed_trl_program_trains_in_bf16_on_a_gpu_and_in_fp32_on_the_cpu(capsys):
    # Whichever machine runs the tests, the printed config is read both ways: its keywords, with `gpu` true and false.
    code = printed(grpo, [], capsys, "--print-trl")
    assert any(line.startswith("gpu = torch.cuda.is_available()") for line in code.splitlines())
    for gpu in (True, False):
        kwargs = eval(config_call(code), {"GRPOConfig": dict, "gpu": gpu})
        assert (kwargs["bf16"], kwargs["use_cpu"]) == (gpu, not gpu), f"gpu={gpu}"


@pytest.mark.parametrize("script, fixture, chat", [
    (grpo, "hf_dense", False), (dapo, "hf_chat", True),
    pytest.param(cispo, "hf_dense", False, marks=pytest.mark.slow), pytest.param(sapo, "hf_chat", True,
                                                                                  marks=pytest.mark.slow)])
def test_the_printed_trl_program_trains_as_printed_on_the_cpu(script, fixture, chat, request, jsonl, tmp_path,
                                                              capsys):
    # The printed program, run unchanged in a process of its own, offline, on the CPU, on a tiny model without and
    # with a chat template (dapo.py's adds TRL's overlong punishment): one generation, two optimizer steps. A random
    # model scores 0 on every answer (advantage 0, no update), so a reward of your own (--reward) that differs between
    # completions gives the steps a gradient.
    pytest.importorskip("trl", reason="trl is not installed (pip install --no-deps trl==1.16.0)")
    for name in ("accelerate", "datasets", "pandas"):   # what GRPOTrainer needs that --no-deps left out
        pytest.importorskip(name, reason=f"{name} is not installed: TRL's trainer needs it (pip install peft "
                                         f"datasets==5.2.0, as .ci/run)")
    model = request.getfixturevalue(fixture)
    (tmp_path / "mine.py").write_text("def score(completion, answer, finished):\n"
                                      "    return float(sum(map(ord, completion)) % 5)\n")
    script.main(["--model", str(model), "--data", str(jsonl), "--eval-size", "5", "--steps", "1",
                 "--prompts-per-step", "2", "--group-size", "4", "--minibatches", "2", "--max-new-tokens", "8",
                 "--reward", f"{tmp_path / 'mine.py'}:score", "--print-trl"])
    (tmp_path / "train_trl.py").write_text(capsys.readouterr().out)
    # Run where the program's imports resolve (it says to run from the repository; output_dir is relative: here
    # tmp_path), and tell from its namespace what it trained on and its trainer's last log (the training summary).
    code = ("import json, runpy\n"
            "trainer = runpy.run_path('train_trl.py', run_name='__main__')['trainer']\n"
            "print(json.dumps([type(trainer.train_dataset[0]['prompt']).__name__, trainer.state.log_history[-1]]))")
    # One thread: a model this small gains nothing from more, and on a busy machine their waits cost seconds (4.5 s
    # of training with 2 threads on 2 shared cores, 0.05 s with one).
    env = os.environ | {"PYTHONPATH": str(graduate.ROOT), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
                        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    prompt, log = json.loads(out.stdout.splitlines()[-1])
    assert prompt == ("list" if chat else "str")                      # chat turns only where there is a template
    assert log["step"] == 2 and log["reward_std"] > 0                 # the reward differed within groups
    checkpoint = tmp_path / "runs" / "trl" / "checkpoint-2"          # saved at max_steps = --steps x --minibatches
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 2
    from safetensors.torch import load_file
    before, after = load_file(Path(model) / "model.safetensors"), load_file(checkpoint / "model.safetensors")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[name], after[name]) for name in before), "no weight changed"


def same(a, b):
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def test_the_readme_table_says_what_the_scripts_print(capsys):
    # Every verl key of README's table is printed by some setting, with the table's value where it gives one
    # (Routing Replay's in a comment); every TRL name of the table appears in some printed code.
    verl_texts = [printed(script, flags, capsys) for script, flags in SETTINGS]
    values = {}
    for key, _, value in (line.lstrip("+").partition("=") for text in verl_texts for line in overrides(text)):
        values.setdefault(key, []).append(value)
    comments = "\n".join(line for text in verl_texts for line in text.splitlines() if line.startswith("#"))
    for plus, key, value in verl_keys():
        if "router_replay" in key:
            assert re.sub(r"^actor_rollout_ref\.", "", key) in comments, f"README's table: {key} in no comment"
            continue
        assert key in values, f"README's table: {key} is printed by no setting"
        if value is not None and value not in PLACEHOLDERS:
            assert any(same(value, v) for v in values[key]), f"README's table: {key}={value}, printed {values[key]}"
    trl_text = "\n".join(printed(script, flags, capsys, "--print-trl") for script, flags in SETTINGS)
    for name, value in sum(table_cells(1), []):
        assert name in trl_text, f"README's table: TRL's {name} is in no printed code"


def test_export_verl_data_writes_the_scripts_split_as_verls_parquet(jsonl, tmp_path, capsys):
    parquet = pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed (pip install pyarrow)")
    grpo.main(["--model", "m", "--data", str(jsonl), "--eval-size", "5", "--export-verl-data", str(tmp_path)])
    train, held_out = common.split_eval(hf_models.read_jsonl(str(jsonl)), 5)
    for name, rows in (("train", train), ("test", held_out)):
        table = parquet.read_table(tmp_path / f"{name}.parquet").to_pylist()
        assert [(r["prompt"], r["reward_model"]["ground_truth"]) for r in table] == \
            [([{"role": "user", "content": p}], a) for p, a in rows]
        assert {r["data_source"] for r in table} == {"llm-rl-reference"}


def test_verl_and_trl_score_as_the_project_does(tmp_path):
    assert graduate.verl_reward("llm-rl-reference", "So the answer is 12.", "12") == 1.0
    assert graduate.verl_reward("llm-rl-reference", "So the answer is 13.", "12") == 0.0
    (tmp_path / "mine.py").write_text("def score(completion, answer, finished):\n    return float(len(completion))\n")
    assert graduate.verl_reward("x", "abc", "1", reward=f"{tmp_path / 'mine.py'}:score") == 3.0
    # TRL's call: chat completions, the dataset's column, the token ids up to the end token. Limit 3 tokens: the
    # third answer is right but was cut off, as its 3 ids say.
    chat = [[{"role": "assistant", "content": c}] for c in ("12", "I think 7", "It is 12")]
    reward = graduate.trl_reward(3)
    assert reward(chat, answer=["12", "8", "12"], completion_ids=[[1, 2], [3, 4], [5, 6, 7]], prompts=None) == \
        [1.0, 0.0, 0.0]
    assert reward.__name__ == "answer_reward"
    mine = graduate.trl_reward(3, f"{tmp_path / 'mine.py'}:score")
    assert mine(chat[:1], answer=["1"], completion_ids=[[1]]) == [2.0] and mine.__name__ == "score"


def test_where_verl_and_trl_differ_in_the_correction_the_printouts_say_so(capsys):
    # verl masks between two bounds only: without --rollout-correction-min, a # line and no key, never a wrong one.
    flags = ["--sampler", "bf16"]
    verl = printed(grpo, flags, capsys)
    assert "rollout_is=" not in verl and "# --rollout-correction sequence_mask: verl masks the ratios outside two " \
                                         "bounds only" in verl
    assert "defaults to 2.0 and TRL's vllm_importance_sampling_clip_max to 3.0" not in verl
    verl = printed(grpo, [*flags, "--rollout-correction", "token_truncate"], capsys)
    assert "algorithm.rollout_correction.rollout_is=token" in verl and "rollout_is_threshold=3.0" in verl
    assert "defaults to 2.0 and TRL's vllm_importance_sampling_clip_max to 3.0" in verl
    trl = printed(grpo, flags, capsys, "--print-trl")
    assert "vllm_importance_sampling_mode='sequence_mask'" in trl and "TRL applies it only where vLLM samples" in trl
    # The policy as the sampler: no correction; both say what the frameworks do with vLLM's log-probs instead.
    assert "bypass_mode=True" in printed(grpo, [], capsys)
    assert "vllm_importance_sampling_correction=False" in printed(grpo, [], capsys, "--print-trl")
