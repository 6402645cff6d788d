"""The shape the design promises: each loss function copies alone, and a toy run never imports a side module."""
import difflib
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINIER

import cispo
import dapo
import grpo
import gspo
import ppo
import sapo
from extras import hf_models, rewards

ROOT = Path(__file__).resolve().parent.parent


def random_batch(per_token_advantages, seed=0):
    """logp, old_logp [4, 6] with ratios of about exp(+-0.3) (some clip, some not), completions of 6, 4, 2 and 5
    tokens, and advantages [4] or [4, 6]."""
    g = torch.Generator().manual_seed(seed)
    old_logp = -torch.rand(4, 6, generator=g) * 3
    logp = old_logp + 0.3 * torch.randn(4, 6, generator=g)
    mask = (torch.arange(6) < torch.tensor([6, 4, 2, 5])[:, None]).float()
    advantages = torch.randn(4, 6, generator=g) if per_token_advantages else torch.tensor([1.2, -0.7, 0.4, -1.5])
    return logp, old_logp, advantages, mask


CASES = [(grpo.policy_loss, {}), (grpo.policy_loss, {"ref_logp": "ref", "beta": 0.04}),
         (gspo.policy_loss, {}), (gspo.policy_loss, {"clip_eps_low": 0.05, "clip_eps_high": 0.05}),
         (gspo.policy_loss_token, {"per_token": True}), (dapo.policy_loss, {}),
         (dapo.policy_loss, {"token_level": False}), (ppo.policy_loss, {"per_token": True}),
         (cispo.policy_loss, {"ratio_cap": 1.2}),
         (cispo.policy_loss, {"ratio_cap": 1.2, "clip_eps_low": 0.2, "ref_logp": "ref", "beta": 0.04}),
         (sapo.policy_loss, {"tau_pos": 4.0, "tau_neg": 5.0}),
         (sapo.policy_loss, {"tau_neg": 3.0, "ref_logp": "ref", "beta": 0.04})]


@pytest.mark.parametrize("loss_fn, kwargs", CASES, ids=[f"{f.__module__}.{f.__name__}{kw}" for f, kw in CASES])
def test_each_policy_loss_copied_alone_with_only_torch_gives_the_script_s_result(loss_fn, kwargs):
    namespace = {"torch": torch}                                        # nothing from the project in scope
    exec(inspect.getsource(loss_fn), namespace)
    copied = namespace[loss_fn.__name__]
    kwargs = dict(kwargs)
    logp, old_logp, advantages, mask = random_batch(kwargs.pop("per_token", False))
    if kwargs.get("ref_logp") == "ref":
        kwargs["ref_logp"] = old_logp - 0.1
    results = []
    for fn in (loss_fn, copied):
        x = logp.clone().requires_grad_(True)
        loss, metrics = fn(x, old_logp, advantages, mask, **kwargs)
        loss.backward()
        results.append((loss, x.grad, metrics))
    (loss, grad, metrics), (copied_loss, copied_grad, copied_metrics) = results
    assert torch.equal(loss, copied_loss) and torch.equal(grad, copied_grad) and grad.abs().sum() > 0
    assert metrics.keys() == copied_metrics.keys()
    assert torch.equal(metrics.pop("clipped"), copied_metrics.pop("clipped"))
    assert metrics == copied_metrics and 0 < metrics["clip_frac"] < 1     # some tokens clipped, not all


def test_ppo_value_loss_copied_alone_with_only_torch_gives_the_script_s_result():
    namespace = {"torch": torch}
    exec(inspect.getsource(ppo.value_loss), namespace)
    values, old_values, returns, mask = random_batch(per_token_advantages=True)
    results = []
    for fn in (ppo.value_loss, namespace["value_loss"]):
        x = values.clone().requires_grad_(True)
        loss = fn(x, old_values, returns, mask, 0.2)
        loss.backward()
        results.append((loss, x.grad))
    (loss, grad), (copied_loss, copied_grad) = results
    assert torch.equal(loss, copied_loss) and torch.equal(grad, copied_grad) and grad.abs().sum() > 0


@pytest.mark.parametrize("name, banner", [("cispo.py", "    # CISPO"), ("sapo.py", "    # SAPO")])
def test_cispo_and_sapo_are_grpo_py_with_their_own_loss_alone(name, banner):
    # After the docstring, `diff grpo.py cispo.py` shows the loss's flags, policy_loss, the flags' checks and the
    # call, nothing else; at most 85 changed lines, the script at most 300.
    text = (ROOT / name).read_text()
    assert len(text.splitlines()) <= 300
    grpo_code = (ROOT / "grpo.py").read_text().split('"""', 2)[2].splitlines()
    code = text.split('"""', 2)[2].splitlines()
    at = lambda start, line=0: next(i for i, x in enumerate(code) if i >= line and x.startswith(start))
    regions = [(at(banner), at("def compute_advantages")), (at("def policy_loss"), at("def train")),
               (at("    common.check_common_args") + 1, at("    device = ")),
               (at("            loss, metrics = policy_loss("), at("            metrics |= common.by_quarter"))]
    changed = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, grpo_code, code, autojunk=False).get_opcodes():
        if tag != "equal":
            assert any(start <= j1 and j2 <= end for start, end in regions), code[j1:j2] or grpo_code[i1:i2]
            changed += (i2 - i1) + (j2 - j1)
    assert 0 < changed <= 85, changed


def test_a_default_toy_run_imports_no_side_module_and_no_transformers(tmp_path):
    # In a process of its own: this test session has imported extras/ and transformers already.
    code = ("import json, sys, grpo\n"
            f"grpo.main({TINIER + ['--out', str(tmp_path / 'run')]!r})\n"
            "side = [m for m in sys.modules if m.split('.')[0] in ('extras', 'transformers', 'peft')]\n"
            "print(json.dumps(sorted(side)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=os.environ, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == []
    assert (tmp_path / "run" / "model").is_dir()                        # the run went to its end


def test_the_readme_s_copy_table_gives_each_file_s_lines():
    # Rows of README's "Copy, read, test" table: | `path` ... | lines | needed for |
    text = (ROOT / "README.md").read_text().split("\n## Copy, read, test\n")[1].split("\n## ")[0]
    rows = re.findall(r"^\| `([^`]+)`[^|]* \| ([\d,]+) \|", text, re.M)
    assert len(rows) >= 4, "README's copy table not read"
    for path, lines in rows:
        assert int(lines.replace(",", "")) == len((ROOT / path).read_text().splitlines()), f"README: {path} has {lines}"
    # Every file of extras/ has its row, with what it brings
    named = {path for path, _ in rows}
    assert {f"extras/{path.name}" for path in (ROOT / "extras").glob("*.py")} <= named, "a file of extras/ unnamed"
    assert {"grpo.py", "common.py", "moe_model.py"} <= named


def test_the_docs_gsm8k_conversion_gives_rows_the_scripts_read_and_score(tmp_path):
    code = re.search(r"```python\n# to_jsonl.py:.*?\n(.*?)```", (ROOT / "docs" / "models.md").read_text(), re.S).group(1)
    gsm8k = [{"question": "Tom has 3 boxes of 12 eggs. How many eggs?", "answer": "3 * 12 = 36 eggs.\n#### 36"},
             {"question": "What is 1,000 + 200?", "answer": "1,000 + 200 = 1,200\n#### 1,200"}]
    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps(row) + "\n" for row in gsm8k))
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "gsm8k.jsonl")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    (tmp_path / "train.jsonl").write_text(out.stdout)
    rows = hf_models.read_jsonl(str(tmp_path / "train.jsonl"))
    assert rows == [(row["question"], row["answer"]) for row in gsm8k]
    assert rewards.answer_reward("So he has 36 eggs.", rows[0][1], True) == 1.0
    assert rewards.answer_reward("The answer is 1200.", rows[1][1], True) == 1.0
    assert rewards.answer_reward("The answer is 1100.", rows[1][1], True) == 0.0


def test_the_project_s_files_speak_to_its_users_alone():
    # Words about how the project was made, which a user cannot see or use: tracking numbers, notes outside the
    # repository, a machine's lending terms, how long someone had.
    words = re.compile(r"\bissues? \d+|\.\./shared|\$OUT\b|device calls?\b|\d[ -]?h(our)? budget|budget it was "
                       r"given|\blent (for|to)\b|over sessions|test session|work session", re.IGNORECASE)
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    found = [f"{name}:{n}: {line.strip()[:80]}" for name in tracked if name.endswith((".py", ".md", ".sh", ".txt", "run"))
             for n, line in enumerate((ROOT / name).read_text().splitlines(), 1) if words.search(line)
             and name != "tests/test_layout.py"]
    assert found == []
