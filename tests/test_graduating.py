"""README.md's "Graduating to TRL or verl" table and ppo.py's verl defaults, checked against the installed verl
and TRL: `pip install --no-deps verl==0.9.1 trl==1.16.0` is enough (CI does it); without them those checks skip."""
import ast
import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest
import torch
import yaml

import dapo
import ppo

README = Path(__file__).resolve().parent.parent / "README.md"
# Values in the table that stand for the user's numbers, not for a literal setting.
PLACEHOLDERS = {"P", "G", "L_max", "L_cache", "R", "A"}
# One table key, with or without a value: `epsilon`, `rollout.n=G`, `+reward.reward_kwargs.max_resp_len=L_max`.
KEY = re.compile(r"(\+?[A-Za-z_][\w.]*)(?:=(.+))?")


def table_cells(column):
    """The backticked keys of one column (1: TRL, 2: verl) of the table, row by row."""
    section = README.read_text().split("## Graduating to TRL or verl")[1].split("\n## ")[0]
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


def test_every_trl_name_of_the_table_is_in_trl():
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
            assert f"'{choice}'" in fields[name].metadata["help"], f"README: {name}={value}"
    # The defaults the table states.
    assert fields["loss_type"].default == "dapo" and fields["gradient_checkpointing"].default is True


def test_dapo_sequence_mean_divides_by_every_completion_masked_ones_too():
    # --no-token-level-loss with --overlong-filtering: row 1 is masked out entirely, and still counts in
    # the mean over sequences (GRPO's 1/G; TRL's loss_type="grpo", verl's seq-mean-token-mean over the
    # minibatch). On-policy (ratio 1) each row's loss is -A: (-1.5 + 0 - 0.6) / 3 rows, not / 2 kept.
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1], [-0.4, -0.9, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    loss, _ = dapo.policy_loss(logp, logp, torch.tensor([1.5, -1.0, 0.6]), mask, token_level=False)
    assert loss.item() == pytest.approx(-0.7)
