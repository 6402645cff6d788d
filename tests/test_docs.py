"""The documentation keeps in step with the code: docs/models.md's metrics table names every key a run writes to
metrics.jsonl and no key that none writes; every relative link of README.md and docs/*.md reaches a file (and a
heading, given an #anchor); README.md stays short enough to read in ten minutes, in plain sentences."""
import fnmatch
import json
import re
from pathlib import Path

import pytest
from conftest import TINIER, read_metrics, run

import cispo
import dapo
import grpo
import gspo
import ppo
import sapo

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "docs" / "models.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md",
         ROOT / "benchmarks" / "METHODS.md"]
# Tiny toy runs that between them log every key: each script, and grpo with a KL reference (kl_ref) and Routing
# Replay (the MoE keys are logged with or without it).
RUNS = {"grpo": (grpo, []), "gspo": (gspo, []), "dapo": (dapo, []), "ppo": (ppo, []), "cispo": (cispo, []),
        "sapo": (sapo, []),
        "grpo --routing-replay --beta 0.04": (grpo, ["--routing-replay", "--beta", "0.04"])}


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """{run: the keys of all its metrics.jsonl rows}."""
    keys = {}
    for name, (script, extra) in RUNS.items():
        out = tmp_path_factory.mktemp("run")
        code, _ = run(script, TINIER + ["--out", str(out)] + extra)
        assert code == 0, name
        keys[name] = set().union(*read_metrics(out))
    return keys


def table_names():
    """The first column of docs/models.md's metrics table, as key names (`time_*_s` stays a pattern), each row's
    `a`, `b` + `_q1`, `_q4` spelt out as a_q1, a_q4, b_q1, b_q4."""
    section = MODELS.read_text().split("\n## Metrics\n")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    names = set()
    for row in rows:
        cell = re.split(r"(?<!\\)\|", row)[1]
        stems, _, suffixes = cell.partition(" + ")
        stems, suffixes = re.findall(r"`([^`]+)`", stems), re.findall(r"`([^`]+)`", suffixes)
        names |= {stem + suffix for stem in stems for suffix in suffixes} if suffixes else set(stems)
    return names


def test_the_table_is_read():
    names = table_names()
    assert {"step", "grad_norm", "clip_frac_q4", "explained_variance_q1", "time_*_s", "value_loss"} <= names
    assert not any(name.startswith("_") for name in names)


def test_every_logged_key_has_its_line(logged):
    names = table_names()
    for run_name, keys in logged.items():
        missing = sorted(k for k in keys if not any(fnmatch.fnmatchcase(k, name) for name in names))
        assert not missing, f"{run_name} logs {missing}: give each a line in docs/models.md's metrics table"


def test_every_line_names_a_logged_key(logged):
    every = set().union(*logged.values())
    stale = sorted(name for name in table_names() if not fnmatch.filter(every, name))
    assert not stale, f"docs/models.md's metrics table names {stale}, which no run logs"


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)            # a # in code is no heading
    return {slug(m[1]) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def links(page):
    """The relative targets of a page's [text](target) links: (path, anchor)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    targets = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"^\[[^\]]+\]: (\S+)", text, re.M)   # [a](t), [a]: t
    for target in targets:
        if not re.match(r"[a-z]+:", target):                                    # http:, https:, mailto:
            path, _, anchor = target.partition("#")
            yield path, anchor


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_work(page):
    found = list(links(page))
    assert found, f"{page.name}: no relative links read"
    for path, anchor in found:
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.relative_to(ROOT)}: the link to {path} reaches no file"
        if anchor and target.suffix == ".md":
            assert anchor in anchors(target), f"{page.relative_to(ROOT)}: {path}#{anchor} is no heading there"


def prose_sentences(text):
    """The sentences of a Markdown page's prose: code blocks, indented commands, tables, headings and pictures left
    out, each paragraph joined into one line before it is split at a full stop, question or exclamation mark."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    lines = [line for line in text.splitlines()
             if not line.startswith(("    ", "|", "#", "![")) and line.strip()]
    prose = " ".join(re.sub(r"^- ", "", line) for line in lines)
    return [s for s in re.split(r"(?<=[.?!])\s+(?=[A-Z`(\[])", prose) if len(s.split()) > 1]


def test_prose_sentences_are_split_as_a_reader_reads_them():
    text = "# Title\n\nOne two three. Four five\nsix seven.\n\n    python x.py   # a command. Not prose\n| a | b. c |\n"
    assert prose_sentences(text) == ["One two three.", "Four five six seven."]


def test_the_readme_reads_in_ten_minutes():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 10_000, "README.md over 10,000 bytes: move reference detail to docs/ or benchmarks/"
    words = sorted(len(sentence.split()) for sentence in prose_sentences(text))
    assert len(words) > 30, "README's prose was not read"
    assert words[len(words) // 2] <= 20, f"README's median sentence is {words[len(words) // 2]} words: split them"


# The figures README.md and the docstrings quote, each held to the results file that holds it: regenerating a result
# that moves a figure fails here until the words follow.
RESULTS = ROOT / "benchmarks" / "results"
README = " ".join((ROOT / "README.md").read_text().split())       # one line: a figure may wrap anywhere


def table(path, heading):
    """The first Markdown table under `heading` (a line starting with it) of a results file, as a list of
    {column: cell} dicts."""
    text = path.read_text().split("\n" + heading, 1)[1]
    lines = [line for line in text.split("\n\n| ", 1)[1].join(["| ", ""]).split("\n\n")[0].splitlines()]
    cells = lambda line: [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
    head = cells(lines[0])
    return [dict(zip(head, cells(line))) for line in lines[2:] if line.startswith("|")]


def spread_record(arm):
    """A script's default run, seed 0, on the AMD EPYC's own kernels: the run README and the docstrings quote."""
    records = [json.loads(line) for line in (RESULTS / "spread.jsonl").read_text().splitlines()]
    found = [r for r in records if r["arm"] == arm and r["seed"] == 0 and r["kernels"] == "own"
             and r["cpu"] == "AMD EPYC"]
    assert len(found) == 1, f"spread.jsonl: {len(found)} records of {arm}, seed 0, own kernels, AMD EPYC"
    return found[0]


def test_the_table_reader_reads_a_table(tmp_path):
    page = tmp_path / "r.md"
    page.write_text("# t\n\n## a\n\nwords\n\n| x | y \\| z |\n| --- | --- |\n| 1 | 2 |\n| 3 | 4 |\n\nafter\n")
    assert table(page, "## a") == [{"x": "1", "y \\| z": "2"}, {"x": "3", "y \\| z": "4"}]


@pytest.mark.parametrize("script", [grpo, gspo, dapo, ppo, cispo, sapo], ids=lambda m: m.__name__)
def test_each_docstring_s_what_to_expect_is_its_default_run(script):
    record = spread_record(script.__name__)
    doc = " ".join(script.__doc__.split())
    assert doc.count("What to expect:") == 1
    assert (f"from {record['base']:.3f} to {record['final']:.3f} in {record['steps']} steps" in doc), \
        f"{script.__name__}.py's What to expect: spread.jsonl has {record['base']} -> {record['final']}"


def test_the_readme_s_run_is_the_default_run_of_spread_md():
    record = spread_record("grpo")
    assert (f"eval accuracy (greedy): base {record['base']:.3f} -> final {record['final']:.3f}; sampled accuracy "
            f"over the last {record['steps'] // 10} steps {record['sampled_end']:.3f}") in README
    pooled = {row["runs pooled"].split(":")[0]: row["final"].split(" (")[0]
              for row in table(RESULTS / "spread.md", "## Finals pooled")}
    assert (f"{pooled['grpo on AMD EPYC']} on an AMD EPYC and {pooled['grpo on Intel Xeon Processor']} on an Intel "
            f"Xeon") in README
    mean, largest = re.search(r"one evaluation moves ([\d.]+) from the one before on average, ([\d.]+) at most",
                              (RESULTS / "spread.md").read_text()).groups()
    assert f"one evaluation moves {mean} from the one before on average, and up to {largest}" in README


def test_the_readme_s_real_model_figures_are_real_md_s():
    arms = {row["arm"]: row for row in table(RESULTS / "real.md", "## bf16 autocast")}
    text = " ".join((RESULTS / "real.md").read_text().split())
    faster = text[text.index("## The faster code"):]                 # grpo.py as it is now: the arm of its own
    assert "grpo bf16 fast (1 thread of an AMD EPYC (bf16 autocast)" in faster and "**It holds" in faster
    final, seeds = re.search(r"Final held-out accuracy ([\d.]+ ± [\d.]+) \((\d+) seeds\)", faster).groups()
    base = re.search(r"Its base scores ([\d.]+)", faster).group(1)
    assert f"from {base} to {final} ({seeds} seeds, bf16 on an AMD EPYC)" in README
    per_step = lambda arm: arms[arm]["completions/step"].split(" ±")[0]
    assert f"It samples {per_step('dapo bf16')} completions a step, the others {per_step('grpo bf16')} " in README
    pairs = {(row["arm A"], row["arm B"]): row for row in table(RESULTS / "real.md", "### Each arm against each other (bf16")}
    for a, b, words in [("gspo bf16", "dapo bf16", "above gspo (+{})"), ("dapo bf16", "cispo bf16", "cispo (+{})")]:
        row = pairs[(a, b)]
        assert row["stands"] == "**yes**", f"real.md: {a} against {b} no longer stands on one CPU"
        assert words.format(row["A − B, final held-out"].lstrip("+-")) in README
    for other in ("dapo bf16", "gspo bf16", "cispo bf16"):     # "ppo ends below dapo, gspo and cispo"
        assert pairs[(other, "ppo bf16")]["stands"] == "**yes**", f"real.md: {other} against ppo no longer stands"


def test_the_readme_s_ratio_to_trl_is_speed_md_s():
    text = " ".join((RESULTS / "speed.md").read_text().split())
    section = text[text.index("## The real model: grpo.py against TRL"):]
    machine = re.match(r"## The real model: grpo.py against TRL (\d+ cores of an [\w ]+?),", section).group(1)
    bf16, fp32 = re.search(r"grpo.py does ([\d.]+)× TRL's steps per second in bf16 and ([\d.]+)× in fp32",
                           section).groups()
    assert (f"grpo.py does {bf16}× the steps per second of TRL's GRPOTrainer, both in bf16 on {machine} ({fp32}× "
            f"both in fp32; `python benchmarks/speed.py --only real-trl`)") in README


def test_the_readme_s_toy_claims_are_study_md_s():
    length = {row["run"]: row for row in table(RESULTS / "study.md", "## length:")}
    (on, on_sd), (off, off_sd) = [map(int, length[run]["steps to < 2% truncated"].split(" ± "))
                                  for run in ("dapo (all four)", "all off (= grpo)")]
    seeds = int(length["dapo (all four)"]["seeds"])
    assert f"under 2% {off - on} ± {round((on_sd ** 2 / seeds + off_sd ** 2 / seeds) ** 0.5)} steps sooner" in README
    main = {row["run"]: row for row in table(RESULTS / "study.md", "## main:")}
    ratio = float(main["ppo"]["s/step"].split(" ±")[0]) / float(main["grpo"]["s/step"].split(" ±")[0])
    assert f"its step takes {ratio:.1f}× GRPO's" in README
