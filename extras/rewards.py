"""Rewards beyond the toy's: your own (--reward FILE.py:NAME, load_reward) and the answer reward for real data (the
default with --data, answer_reward): a completion's final answer read the way math data sets write it and compared
exactly with the reference. Imported only when --reward or --data asks for it.
"""
import hashlib
import importlib.util
import inspect
import os
import re
import sys
from fractions import Fraction
from pathlib import Path

from common import UsageError, check


def load_reward(spec):
    """--reward FILE.py:NAME: the function NAME(completion, answer, finished) -> float in FILE.py. FILE.py is
    imported as a module of its own, under a name made from its path (so that its functions pickle and its
    dataclasses work), with its folder searched for its helpers while it is imported."""
    path, _, name = spec.rpartition(":")
    check(path and name, f"--reward {spec}: give FILE.py:NAME, a file and the name of the function in it")
    check(os.path.isfile(path), f"--reward {spec}: no such file {path}")
    file = Path(path).resolve()
    # Its folder is searched, but a module already imported is never looked for again: a helper there named
    # like one (common.py, json.py) would silently be that module.
    for helper in [*file.parent.glob("*.py"), *file.parent.glob("*/__init__.py")]:
        helper_name = helper.parent.name if helper.name == "__init__.py" else helper.stem
        loaded = getattr(sys.modules.get(helper_name), "__file__", None)
        itself = loaded is not None and Path(loaded).resolve() == helper.resolve()  # e.g. the project's common.py
        check(helper_name not in sys.modules or itself or helper == file,
              f"--reward {spec}: rename {helper}: an import of {helper_name} would get the already loaded "
              f"{loaded or 'built-in module'}, not that file")
    module_name = "reward_" + hashlib.sha256(str(file).encode()).hexdigest()[:16]
    saved_path = sys.path[:]
    sys.path.insert(0, str(file.parent))
    try:
        module_spec = importlib.util.spec_from_file_location(module_name, file)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # where dataclasses and pickle look a function's module up
        module_spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise UsageError(f"--reward {spec}: importing {path} raised {type(e).__name__}: {e}") from None
    finally:
        sys.path[:] = saved_path
    reward = getattr(module, name, None)
    check(callable(reward), f"--reward {spec}: {path} has no function {name}")
    try:
        inspect.signature(reward).bind("completion", "answer", True)
    except (TypeError, ValueError):
        raise UsageError(f"--reward {spec}: {name} must take three arguments (completion, answer, finished)") from None
    return reward


# The default reward with --data: read a completion's final answer the way math RL data sets write it,
# compare it with the reference exactly, as numbers where either reads as a number (fractions.Fraction:
# 0.5 == 1/2 == \frac{1}{2}, but 0.333 != 1/3; the references are exact, a tolerance would reward
# rounding), else as normalised LaTeX strings.

# A plain number: thousands commas only in groups of exactly three (1,000 but not 1,2,3), an optional decimal
# part, or a bare decimal part (.5). No exponents: 1e3 is not read as 1000 (math data sets never write one,
# and 1e999999999 would be a billion-digit integer to build).
NUMBER = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+"
SIGNED = rf"[-+]?(?:{NUMBER})"
# In running text a minus is a sign only where it cannot be a subtraction (10-3 ends with 3, x = -3 with -3),
# and a number never starts inside another one (1.2.5 does not end with .5). A fraction is one number: 3/4,
# and a \frac of two numbers (\frac{3}{4}, \frac{-2}{3}, \dfrac12).
FRACTION = rf"\\[dt]?frac(?:\{{{SIGNED}\}}|\d){{2}}"
NUMBER_IN_TEXT = rf"(?:(?<![\w)}}\]])-)?(?:{FRACTION}|(?<![\d.])(?:{NUMBER})(?:/(?:{NUMBER}))?)"
# LaTeX's thousands separators, read as commas: 10{,}000, 10,\!000 and 10\,000 (a thin space between digits).
COMMAS = r"\{,\}|,\\!|(?<=\d)\\,(?=\d)"
# LaTeX's text and font commands: their content is read as it stands (\text{(A)} is (A)).
TEXT = r"\\(?:text|textbf|textit|emph|underline|mathrm|mathbf|mbox)\{([^{}]*)\}"
# The units dropped after a number, in any case, squared or cubed (5 cm^2, 36 square feet), and degrees
# (90^\circ). A word may be glued to the number (5cm); a single letter only stands apart, after a space or in
# \text{} (7 m^3, 5\mathrm{m}), as 2m is 2 times m. Only these: 5\text{ or more} is not 5. normalise drops $, \%.
UNITS = (r"(?:(?:square|sq\.?|cubic)\s*)?(?:dollars?|cents?|percent|degrees?|seconds?|minutes?|mins?|hours?|hrs?|"
         r"days?|weeks?|months?|years?|units?|miles?|mph|km/h|feet|foot|ft|inch(?:es)?|yards?|"
         r"(?:centi|milli|kilo)?(?:meters?|metres?)|mm|cm|km|ounces?|oz|pounds?|lbs?|(?:kilo)?grams?|kg|"
         r"liters?|litres?|ml|gallons?|cups?)")
LETTER_UNITS = r"[mg]"
APART = r"(?:(?<=\s)|(?<=\\[,;: ]))"  # after a space, LaTeX's too (\, \; \: \ )
UNIT = (rf"(?:(?<![a-zA-Z]){UNITS}|{APART}{LETTER_UNITS})(?:\^\{{?[23]\}}?)?\s*$"
        rf"|\^\{{?\\circ\}}?$|\u00b0$|\\degree$")
# A `####` line may start with an answer phrase (#### The answer is 72); no other words are dropped.
ANSWER_PHRASE = r"^\s*(?:the\s+)?(?:final\s+)?answer\b\s*(?:is\b)?\s*:?"
# A brace that holds part of an expression: a power's, an index's, a root's, a repeating decimal's, and each
# argument of a \frac or \binom. Others (\emph{42}, {"answer": 42}) only format or wrap a number.
EXPRESSION_BRACE = r"(?<!\\)(?:(\^|_|\\sqrt(?:\[[^\]]*\])?|\\overline|\\[dt]?frac|\\binom)\s*)?\{|(?<!\\)\}"


def marked_answer(text):
    """The content of the last \\boxed{...} or \\fbox{...} (braces matched), else the line after the last `####`
    (GSM8K), less an answer phrase before it (#### The answer is 72); None if the text has neither."""
    boxes = list(re.finditer(r"\\(?:boxed|fbox)\s*\{", text))
    if boxes:
        start, depth = boxes[-1].end(), 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
        return ""  # an unclosed last box is a malformed answer, not a reason to go back to an abandoned one
    lines = re.findall(r"####(.*)", text)  # `.` stops at the end of the line
    return re.sub(ANSWER_PHRASE, "", lines[-1], flags=re.I).strip() if lines else None


def inside_expression(text):
    """Whether the end of text lies inside an expression's braces (\\sqrt{2, 10^{-3, \\frac{x}{2), not only
    inside braces that format or wrap it (\\emph{42, {"answer": 42)."""
    opened, closed = [], False  # for each brace still open: whether it holds part of an expression
    for m in re.finditer(EXPRESSION_BRACE, text):
        if m[0] == "}":
            closed = opened.pop() if opened else False
        else:  # a brace right after a closing one opens the same command's next argument: \frac{x}{2
            opened.append(bool(m[1]) or (closed and text[m.start() - 1:m.start()] == "}"))
    return any(opened)


def last_number(text):
    """The last number of running text, read whole (3/4, \\frac{3}{4}, -\\frac12), or None: also when it is only
    a piece of a larger expression, as no answer scores 0 where a piece of one could score 1. A piece is inside an
    expression's braces (\\sqrt{2}, 10^{-3}), next to an operator (x^2, 3 \\times 10^5, 2\\sqrt{3}, 2\\pi,
    \\sqrt{3}/2), or glued, with no space, to a letter, digit or } before it (1e3, \\frac{1}{2}3) or to a letter,
    digit or ! after it (2x, \\frac123, 5!), unless that is a listed unit (5cm)."""
    text = re.sub(TEXT, r" \1", text.replace("\u2212", "-"))  # \text{is 5} -> is 5, apart; U+2212 is a minus
    text = re.sub(r"\\(?:text)?color\{[^{}]*\}", "", text)  # {\color{red}42} and \textcolor{red}{42} are 42
    text = re.sub(COMMAS, ",", text)
    text = re.sub(rf"(?<![a-zA-Z\\])({UNITS}|{LETTER_UNITS})\^\{{?[23]\}}?", r"\1", text, flags=re.I)  # 5 cm^2: 5
    numbers = list(re.finditer(NUMBER_IN_TEXT, text))
    if not numbers:
        return None
    before, after = text[:numbers[-1].start()], text[numbers[-1].end():]
    operator = (re.search(r"(?:[\^_/]|\\sqrt|\\[dt]?frac)\s*$", before)
                or re.match(r"\s*(?:[\^_/](?!\{?\\circ)|\\sqrt|\\[dt]?frac|\\pi\b)", after))  # 90^\circ is 90
    glued = (re.search(r"[a-zA-Z}]$|\d *$", before)  # 1 2 is not 2 either
             or re.match(rf"(?!{UNITS}\b)[a-zA-Z\d!]", after, flags=re.I))
    return None if inside_expression(before) or operator or glued else numbers[-1][0]


def final_answer(text):
    """The final answer: the last box, else the `####` line, else the last number; None if none. An empty box
    gives "", which never scores."""
    marked = marked_answer(text)
    return last_number(text) if marked is None else marked


def normalise(s):
    """An answer as a string with its LaTeX dressing removed, so that equal answers compare equal."""
    s = re.sub(r"\s+|\\[,;:! ]", "", s.replace("\u2212", "-"))  # spaces, LaTeX's too (\, \; \: \! \ ); U+2212
    s = re.sub(TEXT, r"\1", s)  # \text{(A)} -> (A)
    s = re.sub(r"\\(?:left|right)(?![a-zA-Z])", "", s)  # \left( -> (, but \rightarrow stays
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\?[$%]", "", s)  # $5, \$5, 50\% -> 5, 5, 50: a percentage is its number (GSM8K's convention)
    s = re.sub(r"([\^_])\{(\w)\}", r"\1\2", s)  # x^{2} -> x^2 (the same in LaTeX; x^{10} is not x^10)
    s = s.replace("{,}", ",")  # 1{,}000, LaTeX's thousands comma
    return s[:-1] if s.endswith(".") else s  # a sentence's full stop: 42. -> 42


def to_number(s):
    """The answer's value as a Fraction when it is a number (1,000  .5  -3  \\$5  50\\%  1/2  \\frac{1}{2}
    \\dfrac12  x = 5  5\\text{ cm}^2  18 dollars), else None."""
    s = re.sub(r"^\s*\\?[a-zA-Z]\w*\s*=", "", s)  # x = 5 -> 5
    s = re.sub(COMMAS, ",", re.sub(TEXT, r" \1", s))  # a word in \text{} stands apart: 5\text{m} is 5 m
    s = re.sub(UNIT, "", s, flags=re.I)  # 18\ \text{dollars}, 5\,\text{ cm}^2 -> 18, 5
    if re.search(r"[\d.,]\s+[\d.]", s):  # a space ends a number: 1 2 is not 12, nor is 100, 200 one number
        return None
    s = normalise(s)
    # \frac{a}{b}, and its single-digit shorthand \frac12, as a/b; only when it is the whole answer
    s = re.sub(r"^([-+]?)\\frac(\{[^{}]*\}|\d)(\{[^{}]*\}|\d)$",
               lambda m: f"{m[1]}{m[2].strip('{}')}/{m[3].strip('{}')}", s)
    m = re.fullmatch(rf"({SIGNED})(?:/({SIGNED}))?", s)
    if not m:
        return None
    try:
        return Fraction(m[1].replace(",", "")) / Fraction((m[2] or "1").replace(",", ""))
    except (ValueError, ZeroDivisionError):  # x/0, and integers past Python's 4300-digit limit
        return None


def answer_reward(completion, answer, finished):
    """The default reward, 1 or 0 by the rules below; `--reward FILE.py:NAME` replaces it (docs/models.md).

    1 when the completion ended and its final answer equals `answer`, else 0; a truncated completion scores 0, as on the
    toy. The final answer is the last `\\boxed{...}` or `\\fbox{...}` (nested braces matched), else the line after the
    last `####` (GSM8K's format) less an answer phrase before it (`#### The answer is 72`, `#### Final answer: 72`, in
    any case; no other words go: `#### less than 5` is not 5), else the last number.

    That number is read whole or not at all: `3/4`, `\\frac{3}{4}`, `\\frac{-2}{3}` and `-\\frac12` are one number, and
    when it is only a piece of an expression there is no answer, which scores 0. A piece is inside the braces of
    `\\sqrt`, `^`, `_`, `\\overline` or an argument of `\\frac` or `\\binom` (`\\sqrt{2}`, `10^{-3}`; other braces, as
    in `\\emph{42}` or `{"answer": 42}`, do not count); next to `^`, `_`, `/`, `\\sqrt`, `\\frac` or a `\\pi` after it
    (`x^2`, `3 \\times 10^5`, `2\\sqrt{3}`, `\\sqrt{3}/2`, `2\\frac12`, `2\\pi`); right after another number and a space
    (`3 4`); or glued, with no space, to a letter, digit or `}` before it (`1e3`, `\\frac{1}{2}3`) or to a letter, digit
    or `!` after it (`2x`, `\\frac123`, `5!`) unless that is a listed unit (`5cm`). `5 apples`, `5%`, `42.` and `42,`
    stay numbers.

    `answer` may be written the same ways (a whole GSM8K solution ending in `#### 72` works); a JSON number in the file
    is read exactly (`0.00001` and `1e-05` as 0.00001, not as the string `1e-05`). Numbers compare exactly, as numbers,
    and a number equals only a number: `1,000` = `1{,}000` = `1\\,000` = `1000`, `.5` = `0.5` = `1/2` = `\\frac{1}{2}` =
    `\\dfrac12`, `\u22125` (U+2212) = `-5`, `$5` = `5`, `50\\%` = `50`, `42.` = `42`, `x = 5` = `5`, `90^\\circ` =
    `90\u00b0` = `90\\degree` = `90`; not numbers: `1,2,3`, `1 2`, `100, 200`, `1e3`, `2m`.

    A unit after a number, in any case, in words or in `\\text{}` or `\\mathrm{}`, squared or cubed or after square, sq,
    sq. or cubic (`18 Dollars`, `5\\text{ cm}^2`, `36 square feet`), is dropped if it is one of: dollar(s), cent(s),
    percent, degree(s); second(s), minute(s), min(s), hour(s), hr(s), day(s), week(s), month(s), year(s); unit(s),
    mile(s), foot, feet, ft, inch(es), yard(s), meter(s) and metre(s) with or without centi, milli or kilo, mm, cm, km,
    m; mph, km/h; ounce(s), oz, pound(s), lb(s), gram(s), kilogram(s), kg, g; liter(s), litre(s), ml, gallon(s), cup(s).
    A word may be glued to the number (`5cm`); the letters m and g count only apart from it, after a space or in
    `\\text{}` (`7 m^3`, `5\\mathrm{m}`), as `2m` is 2 times m. Any other unit makes a string (`5\\text{ or more}`).

    Other answers compare as strings without whitespace, `$`, `\\text{}` and the like, `\\left` and `\\right`
    (`\\text{(A)}` = `(A)`, `x^{2}` = `x^2`). An empty box never scores. The cases: `tests/test_rewards.py`."""
    if not finished:
        return 0.0
    got, want = final_answer(completion), marked_answer(str(answer))
    want = str(answer).strip() if want is None else want
    if got is None or not normalise(got) or not normalise(want):  # an empty answer matches nothing
        return 0.0
    x, y = to_number(got), to_number(want)
    if x is not None or y is not None:  # a number equals only a number: \boxed{1 2} is not 12
        return float(x == y)
    return float(normalise(got) == normalise(want))
