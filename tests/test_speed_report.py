"""benchmarks/speed.py's threads section: written from the figures of the machine that measured them, on hand-made
timings (the benchmark itself is not run)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import speed  # noqa: E402

ALONE = {"1 thread (the default)": [0.10, 0.12, 0.11], "2 threads (--threads 2)": [0.05, 0.06, 0.04]}
SIDE = {"1 thread (the default)": [0.12, 0.132], "2 threads (--threads 2)": [0.5, 0.55]}
OLD = """# Speed (cpu)

## Threads: the toy alone and beside other work

On 2 cores of an AMD EPYC, nothing else running (`python benchmarks/speed.py --only threads`).

| threads | alone, each round | two runs side by side, each | side by side / alone |
| 1 thread (the default) | 0.092 | 0.087, 0.087 | 0.9× |

On 2 cores of an Intel Xeon with AMX (`python grpo.py --steps 80`, medians of 3): 1 thread 0.089 s/step alone.

## Generation, 16 prompts × 8 completions: the KV cache

| size |
"""


def test_the_threads_block_gives_the_measuring_machine_s_figures():
    block = speed.threads_block(4, "Intel Xeon Processor", 150, 60, 3, ALONE, SIDE)
    assert block == [
        "On 4 cores of an Intel Xeon Processor, nothing else running (`python benchmarks/speed.py --only threads`).",
        "", "`python grpo.py` on `add` alone (150 steps, 3 rounds alternating) and two at once on two cores (60 steps "
            "each): seconds per step, the median after 3 warm-up steps.", "",
        "| threads | alone, each round | two runs side by side, each | side by side / alone |",
        "| --- | --- | --- | --- |",
        "| 1 thread (the default) | 0.100, 0.120, 0.110 | 0.120, 0.132 | 1.2× |",       # 0.132 / 0.11
        "| 2 threads (--threads 2) | 0.050, 0.060, 0.040 | 0.500, 0.550 | 11.0× |",     # 0.55 / 0.05
        "", "Alone, one thread takes 2.20× the time of two; beside another run, one thread slows 1.2×, two threads "
            "11.0×."]                                                                # 0.11 / 0.05
    assert speed.threads_block(2, "a CPU", 150, 60, 3, ALONE, SIDE)[0].startswith("On 2 cores of a CPU, nothing")


def test_the_section_replaces_this_cpu_s_block_and_keeps_the_others(tmp_path):
    path = tmp_path / "speed.md"
    path.write_text(OLD)
    xeon = OLD.split("\n\n")[4]
    # On the AMD EPYC again: its block replaced, the Xeon's kept after it, word for word.
    epyc = speed.threads_block(2, "AMD EPYC", 150, 60, 3, ALONE, SIDE)
    assert speed.threads_section(path, epyc) == [speed.THREADS, "", *epyc, "", xeon, ""]
    # On a third CPU: both kept. Without a file: this machine's block alone.
    other = speed.threads_block(8, "Intel Xeon Platinum", 150, 60, 3, ALONE, SIDE)
    amd = "\n\n".join(OLD.split("\n\n")[2:4])
    assert speed.threads_section(path, other) == [speed.THREADS, "", *other, "", amd, "", xeon, ""]
    assert speed.threads_section(tmp_path / "none.md", other) == [speed.THREADS, "", *other, ""]


def test_regenerating_the_section_writes_no_other_machine_s_figures(tmp_path, monkeypatch):
    # main, its measurement replaced by hand-made timings, on the machine of the file's one block: the file holds the
    # new figures, the other parts as they were, and no figure of a machine it was not run on.
    path = tmp_path / "speed.md"
    path.write_text(OLD.replace("2 cores of an AMD EPYC", "4 cores of an Intel Xeon Processor").replace(
        "\nOn 2 cores of an Intel Xeon with AMX (`python grpo.py --steps 80`, medians of 3): 1 thread 0.089 s/step "
        "alone.\n", ""))
    monkeypatch.setattr(speed, "threads_table", lambda steps, side, rounds, tmp: speed.threads_block(
        4, "Intel Xeon Processor", steps, side, rounds, ALONE, SIDE))
    speed.main(["--only", "threads", "--out", str(path)])
    text = path.read_text()
    section = text.split(f"\n{speed.THREADS}\n")[1].split("\n## ")[0]
    assert section.strip().splitlines() == speed.threads_block(4, "Intel Xeon Processor", 150, 60, 3, ALONE, SIDE)
    assert "## Generation, 16 prompts × 8 completions: the KV cache\n\n| size |" in text        # other parts kept
    assert "AMD" not in text and "0.089" not in text and "AMX" not in text
