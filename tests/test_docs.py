"""The documentation keeps in step with the code: docs/models.md's metrics table names every key a run writes to
metrics.jsonl and no key that none writes; every relative link of README.md and docs/*.md reaches a file (and a
heading, given an #anchor); README.md stays short enough to read in one sitting."""
import fnmatch
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
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
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
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
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


def test_the_readme_reads_in_one_sitting():
    assert len((ROOT / "README.md").read_bytes()) <= 16_000, "README.md over 16,000 bytes: move reference detail"
