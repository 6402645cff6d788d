"""Rewards on real data: the default answer reward (a table of cases), the end ids a completion stops at, your
own reward function (--reward), and a GSM8K-style file end to end."""
import itertools
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import TINIER, read_metrics, run

import common
import grpo
from extras import hf_models, rewards

ROOT = Path(__file__).resolve().parent.parent
GSM8K_STYLE = ROOT / "tests" / "data" / "gsm8k_style.jsonl"


@pytest.mark.parametrize("completion, answer, finished, reward", [
    # Known failures of the old checker
    ("so the total is \\boxed{1,000}", "1000", True, 1.0),
    ("so the total is \\boxed{1,000}", "1,000", True, 1.0),
    ("\\boxed{\\frac{1}{2}}", "2", True, 0.0),         # the old one read the inner {2}
    ("\\boxed{\\frac{1}{2}}", "1/2", True, 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", True, 1.0),
    ("the answer is .5", "0.5", True, 1.0),
    ("the answer is .5", "5", True, 0.0),
    ("\\boxed{1,2,3}", "123", True, 0.0),               # not a thousands comma: compared as strings
    ("\\boxed{1,2,3}", "1, 2, 3", True, 1.0),
    ("the terms are 1,2,3", "123", True, 0.0),          # the last number is 3
    ("the terms are 1,2,3", "3", True, 1.0),
    ("\\boxed{42}", "42", False, 0.0),                  # truncated: never scores
    ("#### 72", "72", False, 0.0),
    # Must stay 0
    ("7 ... no, 8", "7", True, 0.0),
    ("it is 5. \\boxed{}", "5", True, 0.0),             # an empty box is the answer, and it is empty
    ("\\boxed{}", "", True, 0.0),                       # empty matches nothing, not even empty
    ("Natalia sold clips to 48 of her friends in April, and then half as many in May.", "72", True, 0.0),
    ("\\boxed{5} hmm, or rather \\boxed{6}", "5", True, 0.0),
    ("\\boxed{\\text{(A)}}", "(B)", True, 0.0),
    ("\\boxed{\\text{yes}}", "no", True, 0.0),
    ("no idea", "7", True, 0.0),
    ("\\boxed{5", "5", True, 0.0),                      # an unclosed box: no answer, not an earlier number
    # GSM8K lines; a reference may be a line or a box itself
    ("48 / 2 = 24 and 48 + 24 = 72\n#### 72", "72", True, 1.0),
    ("#### 72\nThat took 3 steps.", "72", True, 1.0),   # the line, not the last number
    ("#### 1,000", "1000", True, 1.0),
    ("\\boxed{72}", "#### 72", True, 1.0),
    ("\\boxed{6}", "so it is \\boxed{6}", True, 1.0),
    # Boxes, dollars, percent, signs, fractions
    ("\\fbox{12}", "12", True, 1.0),
    ("It costs \\boxed{\\$5}.", "$5", True, 1.0),
    ("\\boxed{\\$1,000}", "1000", True, 1.0),
    ("\\boxed{\\$\\text{1,000}}", "1000", True, 1.0),
    ("\\boxed{50\\%}", "50", True, 1.0),
    ("the temperature fell to -3 degrees", "-3", True, 1.0),
    ("x = 10-3", "-3", True, 0.0),                      # a subtraction: the last number is 3
    ("\\boxed{-3}", "3", True, 0.0),
    ("\\boxed{+3}", "3", True, 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", True, 1.0),
    ("\\boxed{-\\dfrac{3}{4}}", "-0.75", True, 1.0),
    ("\\boxed{\\tfrac12}", "0.5", True, 1.0),
    ("\\boxed{1/2}", "1/3", True, 0.0),
    ("\\boxed{0.333}", "\\frac{1}{3}", True, 0.0),      # exact comparison, no tolerance
    ("\\boxed{7.0}", "7", True, 1.0),
    ("so it is 42.", "42", True, 1.0),
    ("\\boxed{42.}", "42", True, 1.0),
    ("\\boxed{5\\text{ cm}}", "5", True, 1.0),
    ("\\boxed{90^\\circ}", "90", True, 1.0),
    ("\\boxed{10{,}000}", "10000", True, 1.0),
    ("1e3", "1000", True, 0.0),                         # no scientific notation
    ("The answer is 3/4.", "3/4", True, 1.0),          # a fraction in running text is one number
    ("so each gets 6/8 of it", "0.75", True, 1.0),
    ("12/4 = 3", "3", True, 1.0),
    # Strings: nested braces, LaTeX dressing, whitespace
    ("\\boxed{\\text{(A)}}", "(A)", True, 1.0),
    ("\\boxed{x^{2}}", "x^2", True, 1.0),               # x^{2} and x^2 are the same in LaTeX...
    ("\\boxed{x^{10}}", "x^10", True, 0.0),             # ...but x^10 is x^1 followed by 0
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", True, 1.0),
    ("\\boxed{\\dfrac{\\pi}{2}}", "$\\frac{\\pi}{2}$", True, 1.0),
    ("\\boxed{ \\left( 1, 2 \\right) }", "(1,2)", True, 1.0),
    ("\\boxed{\\mathrm{B}}", " B ", True, 1.0),
    # The last number is read whole or not at all: a piece of a LaTeX expression is no answer
    ("The answer is $\\frac{1}{2}$.", "2", True, 0.0),
    ("The answer is $\\frac{1}{2}$.", "1/2", True, 1.0),
    ("so x = \\frac{3}{4}", "4", True, 0.0),
    ("so x = \\frac{3}{4}", "0.75", True, 1.0),
    ("-\\frac12", "12", True, 0.0),
    ("-\\frac12", "-1/2", True, 1.0),
    ("so it is \\dfrac{5}{2}", "2", True, 0.0),
    ("so it is \\tfrac{5}{2}", "2.5", True, 1.0),
    ("\\boxed{-\\frac{3}{4}}", "-0.75", True, 1.0),
    ("the ratio is $\\frac{x}{2}$", "2", True, 0.0),    # a \frac of more than numbers
    ("$\\frac{1}{2}^2$", "1/2", True, 0.0),
    ("$2\\frac{1}{2}$ cups", "1/2", True, 0.0),         # a mixed number
    ("x = 2-\\frac12", "-1/2", True, 0.0),              # a subtraction, as 10-3
    ("$\\sqrt{2}$", "2", True, 0.0),
    ("2\\sqrt{3}", "3", True, 0.0),
    ("$\\sqrt[3]{8}$", "8", True, 0.0),
    ("\\sqrt2", "2", True, 0.0),
    ("the radius is 2\\sqrt{x}", "2", True, 0.0),
    ("it is 2\\pi", "2", True, 0.0),
    ("x^2", "2", True, 0.0),
    ("a_1", "1", True, 0.0),
    ("$10^{-3}$", "-3", True, 0.0),
    ("3 \\times 10^5", "5", True, 0.0),
    ("3.2 \\times 10^{-4}", "-4", True, 0.0),
    ("2^{10} = 1024", "1024", True, 1.0),               # the power is not last
    ("the angle is 90^\\circ", "90", True, 1.0),        # degrees, not a power
    ("the area is $5\\text{ cm}^2$", "2", True, 0.0),
    ("the numbers are 3 4", "4", True, 0.0),
    ("the total is 10{,}000", "0", True, 0.0),          # LaTeX's thousands comma, in running text too
    ("the total is 10{,}000", "10000", True, 1.0),
    ("the total is 10,\\!000", "10000", True, 1.0),
    ("\\text{The answer is 5}", "5", True, 1.0),
    # A number next to a `/` it is not part of, or glued to a letter, digit or `}` before it or to a letter, digit
    # or `!` after it, is a piece too (found in a review)
    ("The answer is $\\sqrt{3}/2$.", "2", True, 0.0),
    ("The angle is $\\pi/2$.", "2", True, 0.0),
    ("The answer is 1/x", "1", True, 0.0),
    ("It is $\\frac{1}{2}x$.", "1/2", True, 0.0),
    ("x = \\frac123", "1/2", True, 0.0),
    ("so x=\\frac{1}{2}3", "3", True, 0.0),
    ("So y = 2x", "2", True, 0.0),
    ("The answer is 3 + 2i", "2", True, 0.0),
    ("The answer is 5!", "5", True, 0.0),
    ("1e3", "3", True, 0.0),                            # no scientific notation, and not its exponent either
    ("The mass is 6.02e23", "23", True, 0.0),
    ("so it is 2m", "2", True, 0.0),
    ("I have 5 apples", "5", True, 1.0),                # a word after a space is no part of the number
    ("The answer is 5%.", "5", True, 1.0),
    ("so it is 42, I think", "42", True, 1.0),
    ("The rope is 5cm long.", "5", True, 1.0),          # a listed unit may be glued
    ("The area is $36\\text{ cm}^2$.", "36", True, 1.0),  # a unit's power is the unit's
    # Only braces opened by \sqrt, ^, _ or a \frac make a piece: formatting and JSON braces do not
    ('{"answer": 42}', "42", True, 1.0),
    ('```json\n{"answer": 42}\n```', "42", True, 1.0),
    ("so the answer is \\emph{42}", "42", True, 1.0),
    ("The answer is \\textit{42}.", "42", True, 1.0),
    ("The answer is \\underline{42}", "42", True, 1.0),
    ("The answer is {\\color{red}42}", "42", True, 1.0),
    ("The answer is \\textcolor{red}{42}", "42", True, 1.0),
    ("\\boxed{\\emph{42}}", "42", True, 1.0),
    ("$0.\\overline{3}$", "3", True, 0.0),             # a repeating decimal
    ("so \\binom{10}{3}", "3", True, 0.0),
    # LaTeX's thin space between digit groups is a thousands comma; a \frac's numerator may be signed
    ("The total is $10\\,000$.", "0", True, 0.0),
    ("The total is $10\\,000$.", "10000", True, 1.0),
    ("\\boxed{1\\,000}", "1000", True, 1.0),
    ("\\boxed{1\\,2}", "12", True, 0.0),
    ("the answer is \\frac{-2}{3}", "-2/3", True, 1.0),
    ("the answer is \\frac{-2}{3}", "3", True, 0.0),
    # U+2212, the minus sign
    ("The answer is \u22125", "5", True, 0.0),
    ("The answer is \u22125", "-5", True, 1.0),
    ("\\boxed{\u22127}", "-7", True, 1.0),
    ("#### \u221212", "12", True, 0.0),
    # A space ends a number, and a number equals only a number
    ("\\boxed{100200}", "100, 200", True, 0.0),
    ("\\boxed{1 2}", "12", True, 0.0),
    ("\\boxed{12}", "1 2", True, 0.0),
    ("\\boxed{3 4}", "34", True, 0.0),
    ("\\boxed{1 2}", "1 2", True, 1.0),                 # the same string
    # Units: only the listed ones are dropped
    ("\\boxed{5\\text{ or more}}", "5", True, 0.0),
    ("\\boxed{5\\text{ apples}}", "5", True, 0.0),
    ("\\boxed{18\\ \\text{dollars}}", "18", True, 1.0),
    ("\\boxed{5 \\text{ cm}^2}", "5", True, 1.0),
    ("\\boxed{5\\text{ hours}}", "5", True, 1.0),
    ("\\boxed{12\\,\\mathrm{kg}}", "12", True, 1.0),
    ("\\boxed{7 m^3}", "7", True, 1.0),
    ("\\boxed{90\u00b0}", "90", True, 1.0),
    ("\\boxed{50 \\text{ percent}}", "50", True, 1.0),
    ("\\boxed{9}", "9\\text{ units}", True, 1.0),
    ("\\boxed{9\\text{ sq units}}", "9", True, 1.0),
    ("\\boxed{36 \\text{ square feet}}", "36", True, 1.0),
    ("\\boxed{8 \\text{ cubic inches}}", "8", True, 1.0),
    ("\\boxed{12\\text{ meters}}", "12", True, 1.0),
    ("\\boxed{4\\text{ centimetres}}", "4", True, 1.0),
    ("\\boxed{150\\text{ mph}}", "150", True, 1.0),
    ("\\boxed{60 \\text{ km/h}}", "60", True, 1.0),
    ("\\boxed{3 \\text{ liters}}", "3", True, 1.0),
    ("\\boxed{2 \\text{ foot}}", "2", True, 1.0),
    ("\\boxed{3 \\text{ yards}}", "3", True, 1.0),
    ("\\boxed{16 \\text{ ounces}}", "16", True, 1.0),
    ("\\boxed{2\\text{ cups}}", "2", True, 1.0),
    ("\\boxed{500 \\text{ grams}}", "500", True, 1.0),
    ("\\boxed{5cm}", "5", True, 1.0),
    ("\\boxed{30\\degree}", "30", True, 1.0),
    ("\\boxed{18 Dollars}", "18", True, 1.0),           # any case
    ("#### 18 Dollars", "18", True, 1.0),
    # ... a single-letter unit only after a space or in \text{} or \mathrm{}: 2m is 2 times m
    ("\\boxed{5 \\text{ m}}", "5", True, 1.0),
    ("\\boxed{5\\mathrm{m}}", "5", True, 1.0),
    ("\\boxed{-3 m}", "-3", True, 1.0),
    ("\\boxed{2m}", "2", True, 0.0),
    ("\\boxed{2}", "2m", True, 0.0),
    ("\\boxed{3g}", "3", True, 0.0),
    ("\\boxed{3g}", "3g", True, 1.0),
    # x = 5 is 5; a `####` line drops an answer phrase before its number, and no other words
    ("\\boxed{x=5}", "5", True, 1.0),
    ("\\boxed{y = -2}", "-2", True, 1.0),
    ("\\boxed{x = 5, y = 3}", "5", True, 0.0),
    ("#### 18 dollars", "18", True, 1.0),
    ("#### 45 minutes", "45", True, 1.0),
    ("#### The answer is 72", "72", True, 1.0),
    ("#### Answer: 72", "72", True, 1.0),
    ("#### The final answer is: 72", "72", True, 1.0),
    ("#### final answer 72", "72", True, 1.0),
    ("#### less than 5", "5", True, 0.0),
    ("#### at most 18", "18", True, 0.0),
    ("#### not 72", "72", True, 0.0),
    ("#### approximately 7", "7", True, 0.0),
    ("#### The answer is not 72", "72", True, 0.0),
    ("#### 5 \\text{ cm}^2", "5", True, 1.0),
    ("#### 5 or more", "5", True, 0.0),
    ("#### x^2", "2", True, 0.0),
    ("#### x^2", "x^2", True, 1.0),
    ("#### 2x+1", "1", True, 0.0),
    ("\\boxed{2x+1}", "#### 2x+1", True, 1.0),
])
def test_answer_reward(completion, answer, finished, reward):
    assert rewards.answer_reward(completion, answer, finished) == reward


def test_json_number_answers_are_read_exactly(tmp_path):
    path = tmp_path / "numbers.jsonl"
    path.write_text('{"prompt": "a", "answer": 0.00001}\n{"prompt": "b", "answer": 1e-05}\n'
                    '{"prompt": "c", "answer": 2.50}\n{"prompt": "d", "answer": 72}\n')
    rows = hf_models.read_jsonl(str(path))
    assert [a for _, a in rows] == ["0.00001", "0.00001", "2.50", "72"]   # floats would print 1e-05, 1e-05, 2.5
    assert [rewards.answer_reward("\\boxed{0.00001}", a, True) for _, a in rows] == [1.0, 1.0, 0.0, 0.0]
    assert rewards.answer_reward("\\boxed{2.5}", rows[2][1], True) == 1.0


@pytest.mark.parametrize("answer, shown", [("1e999999999", r"1E\+999999999"),   # a billion digits written out
                                           ("1" + "0" * 4999, "1" + "0" * 4999)])   # past json's int() limit
def test_a_json_answer_too_large_to_write_out_stops_with_one_line(tmp_path, answer, shown):
    path = tmp_path / "huge.jsonl"
    path.write_text('{"prompt": "a", "answer": %s}\n' % answer)
    with pytest.raises(common.UsageError, match=rf"line 1: the answer {shown} is too large or too small"):
        hf_models.read_jsonl(str(path))


def test_a_completion_stops_at_the_first_of_any_end_id(hf_chat):
    """The chat model ends a turn with <|im_end|>, which is not the tokenizer's EOS."""
    args = grpo.Args(model=str(hf_chat), data=str(GSM8K_STYLE), max_new_tokens=12, eval_size=2)
    policy, world = common.make_policy(args, torch.device("cpu"))
    tokenizer = hf_models.load_hf(str(hf_chat), torch.device("cpu"))[1]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end != tokenizer.eos_token_id and set(world.eos_ids) == {tokenizer.eos_token_id, im_end}
    torch.manual_seed(0)
    rollout = common.generate(policy, world, [p for p, _ in world.train[:4]], 8, 1.0)
    ended_with = []
    for row, mask, finished in zip(rollout.completions, rollout.mask.bool(), rollout.finished):
        n = int(mask.sum())
        ends = [i for i, t in enumerate(row[:n].tolist()) if t in world.eos_ids]
        assert ends == ([n - 1] if finished else []) and (row[n:] == world.pad_id).all()
        if finished:
            ended_with.append(row[n - 1].item())
    assert im_end in ended_with                                       # some turns ended with <|im_end|>
    texts = [world.decode(c[m.bool()].tolist()) for c, m in zip(rollout.completions, rollout.mask)]
    assert not any("im_end" in t for t in texts)                      # a special token, not text


def write(folder, name, code):
    path = folder / name
    path.write_text(code)
    return path


def test_your_own_reward_replaces_the_toy_one(tmp_path):
    reward = write(tmp_path, "mine.py", "def length(completion, answer, finished):\n"
                                        "    return len(completion) / 8\n")
    grpo.main(TINIER + ["--reward", f"{reward}:length", "--out", str(tmp_path / "run")])
    rows = read_metrics(tmp_path / "run")
    # The decoded text leaves out the EOS that ends a finished completion (and counts in its length).
    for r in rows[1:]:
        assert r["reward_mean"] == pytest.approx((r["response_len_mean"] - 1 + r["truncated_frac"]) / 8)


@pytest.mark.parametrize("spec, code, message", [
    ("nofile.py:f", None, "--reward nofile.py:f: no such file nofile.py"),
    ("{dir}/r.py", "def f(c, a, d):\n    return 1.0\n", "give FILE.py:NAME"),
    ("{dir}/r.py:g", "def f(c, a, d):\n    return 1.0\n", "r.py has no function g"),
    ("{dir}/r.py:f", "def f(completion, answer):\n    return 1.0\n",
     "f must take three arguments (completion, answer, finished)"),
    ("{dir}/r.py:f", "import not_a_module\n", "importing {dir}/r.py raised ModuleNotFoundError"),
])
def test_a_bad_reward_stops_before_training_with_one_line(tmp_path, capsys, spec, code, message):
    if code is not None:
        write(tmp_path, "r.py", code)
    spec, message = spec.format(dir=tmp_path), message.format(dir=tmp_path)
    exit_code, err = run(grpo, TINIER + ["--reward", spec, "--out", str(tmp_path / "run")], capsys)
    assert exit_code == 2 and err.count("\n") == 1 and message in err
    assert not (tmp_path / "run").exists()                            # stopped before the run started


@pytest.mark.parametrize("returned, shown", [("'1'", "returned '1', not a finite number"),
                                             ("None", "returned None, not a finite number"),
                                             ("float('nan')", "returned nan, not a finite number")])
def test_a_reward_that_returns_a_non_number_stops_naming_the_prompt(tmp_path, capsys, returned, shown):
    reward = write(tmp_path, "r.py", f"def f(completion, answer, finished):\n    return {returned}\n")
    exit_code, err = run(grpo, TINIER + ["--reward", f"{reward}:f", "--out", str(tmp_path / "run")], capsys)
    assert exit_code == 2 and err.count("\n") == 1
    assert f"error: the reward function {shown} (prompt '" in err


@pytest.mark.parametrize("reward", [None, "format"])
def test_gsm8k_style_data_end_to_end(hf_chat, tmp_path, reward):
    extra = []
    if reward:
        code = readme_rewards()["my_rewards.py"]
        extra = ["--reward", f"{write(tmp_path, 'my_rewards.py', code)}:boxed_and_right"]
    grpo.main(["--model", str(hf_chat), "--data", str(GSM8K_STYLE), "--max-new-tokens", "16", "--eval-size", "2",
               "--steps", "2", "--prompts-per-step", "2", "--group-size", "3", "--minibatches", "2",
               "--out", str(tmp_path / "run")] + extra)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    # An untrained model never writes a right boxed answer: 0 by default, -0.5 with the format penalty.
    assert all(r["reward_mean"] == (-0.5 if reward else 0.0) for r in rows[1:])
    assert all(math.isfinite(r[k]) for r in rows[1:] for k in ("entropy", "grad_norm", "response_len_mean"))


def test_the_docstrings_examples():
    """rewards.answer_reward's docstring states the rules with examples: each of its `a` = `b` = ... chains scores 1
    as a boxed answer against any other of the chain, and what it calls not numbers reads as no number."""
    doc = " ".join(rewards.answer_reward.__doc__.split())
    chains = [re.findall(r"`([^`]+)`", c) for c in re.findall(r"`[^`]+`(?: \(U\+2212\))?(?: = `[^`]+`)+", doc)]
    assert len(chains) >= 10 and ["\u22125", "-5"] in chains and ["x = 5", "5"] in chains
    for chain in chains:
        for got, want in itertools.permutations(chain, 2):
            assert rewards.answer_reward(f"so \\boxed{{{got}}}", want, True) == 1.0, (got, want)
    not_numbers = re.findall(r"`([^`]+)`", re.search(r"not numbers: (.*?)\. ", doc)[1])
    assert not_numbers == ["1,2,3", "1 2", "100, 200", "1e3", "2m"]
    assert all(rewards.to_number(x) is None for x in not_numbers)


def readme_rewards():
    """The reward examples of docs/models.md ("Your own reward"), by the file name on their first line."""
    blocks = re.findall(r"```python\n# (\S+\.py):.*?\n(.*?)```", (ROOT / "docs" / "models.md").read_text(), re.S)
    assert {name for name, _ in blocks} >= {"my_rewards.py", "verified.py"}
    return {name: code for name, code in blocks}


def test_the_readme_format_reward():
    namespace = {}
    exec(readme_rewards()["my_rewards.py"], namespace)
    f = namespace["boxed_and_right"]
    assert f("so \\boxed{72}", "#### 72", True) == 1.0 and f("so 72", "72", True) == 0.5
    assert f("so \\boxed{71}", "72", True) == 0.0 and f("so \\boxed{72}", "72", False) == 0.0


def test_the_readme_math_verify_reward():
    pytest.importorskip("math_verify")
    namespace = {}
    exec(readme_rewards()["verified.py"], namespace)
    f = namespace["math_verify_reward"]
    assert f("so \\boxed{\\frac{1}{2}}", "0.5", True) == 1.0 and f("so \\boxed{3}", "0.5", True) == 0.0
    assert f("so \\boxed{0.5}", "0.5", False) == 0.0
