"""The docs check: what the README and docs/ say must stay true of the tree.

- the settings tables are the ones the settings generate (`python -m otel_straggler.settings_doc`);
- every relative link resolves to a file, and every #anchor to a heading of that file;
- every command the README's quick start quotes is a make target or one of our console scripts;
- the README's verdict table lists every verdict of the contract, and the verdict it quotes is the
  one recorded beside its picture (scripts/readme_images.sh writes both)."""
import re
from pathlib import Path

import pytest

from otel_straggler import contract
from otel_straggler.settings_doc import table

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)


def prose(markdown: str) -> str:
    """The text outside code blocks and code spans, where a link is a link."""
    return INLINE_CODE.sub("", FENCE.sub("", markdown))


def anchor_of(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but - and _ dropped,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[`*]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        anchor = anchor_of(heading)
        count = seen.get(anchor, 0)
        result.add(anchor if count == 0 else f"{anchor}-{count}")
        seen[anchor] = count + 1
    return result


def relative_links(page: Path) -> list[str]:
    return [target for target in LINK.findall(prose(page.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE)]  # http:, mailto:, ...


def section(markdown: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", markdown, re.MULTILINE | re.DOTALL)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def test_settings_tables_are_the_generated_ones():
    assert table("rank") in (REPO / "docs" / "instrumentation.md").read_text()
    assert table("detector") in (REPO / "docs" / "detector.md").read_text()


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with that anchor")
    assert broken == []


def test_anchors_follow_githubs_rules():
    assert anchor_of("On a GPU") == "on-a-gpu"
    assert anchor_of("`otel-straggler report EVIDENCE_DIR`") == "otel-straggler-report-evidence_dir"
    assert anchor_of("What it costs, and what it catches") == "what-it-costs-and-what-it-catches"


def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (REPO / "Makefile").read_text(), re.MULTILINE))


def console_scripts() -> set[str]:
    pyproject = (REPO / "pyproject.toml").read_text()
    scripts = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[|\Z)", pyproject, re.MULTILINE | re.DOTALL)
    return set(re.findall(r"^([\w.-]+)\s*=", scripts.group(1), re.MULTILINE)) if scripts else set()


def quick_start_commands() -> list[str]:
    text = section(README.read_text(), "Quick start")
    block = re.search(r"^```(?:sh|bash|console)?\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert block, "the quick start has no code block"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    inline = [span.strip("`") for span in INLINE_CODE.findall(FENCE.sub("", text))]
    return [command for command in commands if command] + [
        span for span in inline if span.split()[0] in {"make", *console_scripts()}]


def test_quick_start_commands_exist():
    commands = quick_start_commands()
    assert "make demo" in commands
    missing = []
    for command in commands:
        words = command.split()
        if words[0] == "make":
            missing += [f"{command}: no make target {word}" for word in words[1:]
                        if "=" not in word and word not in make_targets()]
        elif words[0] not in console_scripts():
            missing.append(f"{command}: neither make nor a console script of pyproject.toml")
    assert missing == []


def test_readme_lists_every_verdict_of_the_contract():
    text = section(README.read_text(), "What you get")
    listed = set(re.findall(r"^\| `([a-z_]+)` \|", text, re.MULTILINE))
    verdicts = {value for name, value in vars(contract).items() if name.startswith("VERDICT_") and isinstance(value, str)
                and name != "VERDICT_EVENT_NAME"}
    assert listed == verdicts


def test_the_verdict_the_readme_quotes_is_the_recorded_run():
    record = (REPO / "docs" / "images" / "demo-run.txt").read_text()
    quoted = re.search(r"^```\n(.*?)^```", README.read_text(), re.MULTILINE | re.DOTALL).group(1)
    for line in quoted.splitlines():
        assert line in record


def test_the_design_is_cited_from_the_repository_only():
    """Code and docs cite docs/architecture.md (and the other docs), never a design document
    that is not in the repository."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    cited = []
    for path in root.rglob("*"):
        if (path.is_file() and path.suffix in {".py", ".c", ".md", ".yml", ".yaml", ".toml", ".sh"}
                and not {".git", ".services", "build", "node_modules"} & set(path.parts)
                and path != pathlib.Path(__file__).resolve()):
            text = path.read_text(errors="replace")
            # [D] so that `grep -r` for the name does not find this pattern itself
            cited += [f"{path.relative_to(root)}: {m.group(0)}" for m in re.finditer(r"[D]ESIGN(\.md)?\s*§", text)]
    assert cited == []
