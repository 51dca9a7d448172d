"""The docs stay maps that are true to the tree: ARCHITECTURE short and naming files that exist,
BENCHMARKS' targets naming scripts that exist, the README's set-up commands the ones CI runs."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
BENCHMARKS = ROOT / "docs" / "BENCHMARKS.md"
README = ROOT / "README.md"


def _section(text: str, heading: str) -> str:
    """The lines of a `## heading` section, up to the next `## ` heading."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def _table_rows(section: str) -> list[list[str]]:
    rows = [line.strip().strip("|").split("|") for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row] for row in rows[1:]]  # the header row goes


def _module_paths(cell: str) -> list[str]:
    """`a/b.py`, `c.py` -> a/b.py, a/c.py: a bare name lives beside the first path of its cell."""
    names = re.findall(r"`([^`]+)`", cell)
    base = Path(names[0]).parent
    return [names[0]] + [name if "/" in name else str(base / name) for name in names[1:]]


def test_architecture_is_short():
    assert len(ARCHITECTURE.read_text().split()) <= 2500


def test_architecture_module_table_names_what_exists_in_a_few_words():
    rows = _table_rows(_section(ARCHITECTURE.read_text(), "Modules"))
    assert len(rows) > 30
    for module, what in rows:
        assert len(what.split()) <= 25, module
        for path in _module_paths(module):
            pattern = path.replace("<op>", "*")  # kernels/<op>/: one folder per op
            assert list(ROOT.glob(pattern)), f"ARCHITECTURE.md names {path}, which is not in the tree"


def test_architecture_keeps_the_headings_the_code_cites():
    # engine/config.py and the README cite it by name
    assert "\n## What exact means\n" in ARCHITECTURE.read_text()


def test_benchmarks_opens_with_targets_whose_scripts_exist():
    text = BENCHMARKS.read_text()
    assert text.index("\n## Targets\n") < text.index("<!-- section:")  # the table comes first
    rows = _table_rows(_section(text, "Targets"))
    assert len(rows) > 20
    scripts = {s for row in rows for s in re.findall(r"benchmarks/[\w.]+", row[-1])}
    assert scripts
    for script in scripts:
        assert (ROOT / script).is_file(), f"BENCHMARKS.md's targets name {script}, which is not in the tree"


def _readme_commands() -> list[str]:
    return [line for line in README.read_text().splitlines() if line.startswith("python3 -m venv")]


def test_readme_set_up_commands_are_what_ci_runs():
    install, tests = _readme_commands()
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m venv")]
    assert len(ci) == 1
    assert ci[0].replace("pip install -q ", "pip install ") == tests  # CI only quietens pip
    assert install == tests.replace('-e ".[test]" && python -m pytest -q', "-e . && hcw chat")


def test_readme_screenshot_exists():
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.svg)\)", README.read_text())
    assert images
    for image in images:
        assert (ROOT / unquote(image)).is_file(), image
