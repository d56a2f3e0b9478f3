"""The documentation stays true to the code: every verb and flag `quark --help` lists is in the CLI
page, every relative link (and its #anchor) between the project's Markdown files resolves, the
README stays a front page, and measured figures live in bench/README.md only."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from qvisor.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
CLI_PAGE = ROOT / "docs" / "cli.md"
README_MAX_LINES = 200

# the Markdown a reader follows: the front page, docs/, and the READMEs beside the code
DOCS = sorted([ROOT / "README.md", ROOT / "SECURITY.md", *(ROOT / "docs").glob("*.md"),
               *(ROOT / "tests").rglob("README.md"), ROOT / "bench" / "README.md"])
# pages that must not state measured figures (bench/README.md is where they live)
FIGURE_FREE = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "tests" / "README.md"])

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
# a ratio ("1.3x"), a date ("2026-12-06") or an approximate figure ("~20 ms") is something measured
_FIGURE = re.compile(r"\b\d+(?:\.\d+)?x\b|\b20\d\d-\d\d-\d\d\b|~\s?\d")


def _verbs(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    """Every verb (and sub-verb, as `tsor status`) with its parser."""
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                path = f"{prefix}{name}"
                out[path] = sub
                out.update(_verbs(sub, path + " "))
    return out


def _flag(action: argparse.Action) -> str:
    """The flag as the page must name it: the long form where there is one."""
    longs = [o for o in action.option_strings if o.startswith("--")]
    return (longs or action.option_strings)[0]


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [_flag(a) for a in parser._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _rows(page: str) -> list[str]:
    return [line for line in page.splitlines() if line.startswith("| `")]


def _row_of(rows: list[str], verb: str) -> str | None:
    """The table row whose first cell documents `verb` (a cell may hold several: `pause ID`, `resume ID`)."""
    for row in rows:
        first = row.split(" | ")[0]
        if re.search(r"`" + re.escape(verb) + r"[ `]", first):
            return row
    return None


def test_every_verb_of_quark_help_has_a_row_in_the_cli_page():
    rows = _rows(CLI_PAGE.read_text())
    verbs = _verbs(build_parser())
    assert {"create", "run", "exec", "tsor status", "snapshot create"} <= set(verbs)
    missing = [v for v, sub in verbs.items() if _row_of(rows, v) is None
               and not any(isinstance(a, argparse._SubParsersAction) for a in sub._actions)]
    assert not missing, f"docs/cli.md has no row for: {missing}"


def test_every_flag_of_every_verb_is_in_its_row():
    rows = _rows(CLI_PAGE.read_text())
    missing = []
    for verb, sub in _verbs(build_parser()).items():
        row = _row_of(rows, verb)
        if row is None:
            continue   # a verb that only groups sub-verbs (tsor, snapshot); theirs are checked
        missing += [f"{verb} {flag}" for flag in _options(sub) if not re.search(re.escape(flag) + r"\b", row)]
    assert not missing, f"flags missing from their verb's row in docs/cli.md: {missing}"


def test_every_global_flag_is_in_the_cli_page():
    page = CLI_PAGE.read_text()
    missing = [f for f in _options(build_parser()) if f"`{f}" not in page]
    assert not missing, f"global flags missing from docs/cli.md: {missing}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    anchors = set()
    for m in re.finditer(r"^#{1,6} (.+)$", text, re.M):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        anchors.add(base if n == 0 else f"{base}-{n}")   # GitHub numbers repeated headings
    return anchors


def _links(path: Path) -> list[str]:
    text = _CODE.sub("", _FENCE.sub("", path.read_text()))
    return _LINK.findall(text)


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_their_anchors_resolve(page: Path):
    broken = []
    for target in _links(page):
        if re.match(r"[a-z]+:", target):
            continue   # https:, mailto: — not ours to check offline
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_docs_map_in_the_readme_names_every_page():
    readme = (ROOT / "README.md").read_text()
    unlisted = [p.name for p in (ROOT / "docs").glob("*.md") if f"(docs/{p.name})" not in readme]
    assert not unlisted, f"README's documentation table misses: {unlisted}"


def test_the_readme_stays_a_front_page():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; topics belong in docs/"


@pytest.mark.parametrize("page", FIGURE_FREE, ids=lambda p: str(p.relative_to(ROOT)))
def test_measured_figures_live_in_bench_readme_only(page: Path):
    # link targets (bench/README.md's dated headings) and code are not prose
    text = _LINK.sub("", _FENCE.sub("", page.read_text()))
    found = [f"line {text[:m.start()].count(chr(10)) + 1}: {m.group(0)!r}" for m in _FIGURE.finditer(text)]
    assert not found, f"{page.relative_to(ROOT)} states figures; link bench/README.md instead: {found}"


def test_every_section_of_the_host_config_is_in_the_cli_page():
    from qlib import hostconfig
    page = CLI_PAGE.read_text()
    missing = [s for s in hostconfig.SECTIONS if f"| `{s}" not in page]
    assert not missing, f"docs/cli.md's /etc/quark/config.yaml table misses: {missing}"


def test_code_comments_point_to_measurements_instead_of_stating_them():
    """A docstring or comment names where a figure is measured (bench/README.md), so the code
    never carries a ratio or a dated figure that goes stale. A setting sized from a measurement
    (the RuntimeClass's overhead) may date it on the line that cites its bench/README.md section."""
    ratio = re.compile(r"\b\d+\.\d+x\b")
    date = re.compile(r"\b20\d\d-\d\d-\d\d\b")
    found = []
    for pkg in ("qvisor", "qkernel", "tsor", "shim", "cni", "qlib", "deploy"):
        for path in sorted((ROOT / pkg).rglob("*")):
            if path.suffix in (".py", ".c", ".yaml", ".toml") and "pb" not in path.parts:
                for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                    if ratio.search(line) or (date.search(line) and "bench/README.md" not in line):
                        found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "figures in code; point to bench/README.md instead:\n" + "\n".join(found)
