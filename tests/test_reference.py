"""docs/config-reference.md is generated from trainloop/config/compose.py and conf/, and kept current."""

from __future__ import annotations

import ast
import re

from omegaconf import OmegaConf

from helpers import REPO, compose, warm
from trainloop.config.compose import CONFIG_DIR
from trainloop.tools.reference import DOCS_FILE, field_docs, render


def test_committed_reference_is_current():
    assert DOCS_FILE == REPO / "docs" / "config-reference.md"
    assert DOCS_FILE.read_text() == render(), (
        "docs/config-reference.md is stale: run `python -m trainloop.reference --write` and commit it")


def test_reference_lists_every_key_option_and_preset():
    text = render()
    keys = [k for k in _flat_keys(OmegaConf.to_container(compose()))]
    assert len(keys) > 50
    for key in keys:
        assert f"| `{key}` |" in text, f"{key} is missing from the reference"
    for group in sorted(p for p in CONFIG_DIR.iterdir() if p.is_dir()):
        heading = "presets" if group.name == "preset" else group.name
        section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
        for option in group.glob("*.yaml"):
            assert f"| `{option.stem}` |" in section, f"{group.name}={option.stem} is missing"


def test_readme_lists_every_option_of_every_group():
    """README's "Configuring a run" table names each option of each group in conf/ (issue 33, item 8),
    and its presets table each preset."""
    readme = (REPO / "README.md").read_text()

    def table(header: str) -> dict[str, str]:
        return dict(re.findall(r"^\| `(\w+)` \| (.*) \|$", readme.split(header, 1)[1].split("\n\n", 1)[0],
                               flags=re.MULTILINE))

    groups, presets = table("\n| group | options |\n"), table("\n| preset | what |\n")
    def listed(group: str, option: str) -> bool:
        return option in presets if group == "preset" else f"`{option}`" in groups.get(group, "")

    missing = [f"{group.name}={option.stem}" for group in sorted(p for p in CONFIG_DIR.iterdir() if p.is_dir())
               for option in sorted(group.glob("*.yaml")) if not listed(group.name, option.stem)]
    assert not missing, f"README's table of groups and options (or of presets) lacks {missing}"


def test_readme_is_a_map_of_docs():
    """README stays a map (issue 34, item 8): at most about 300 lines, the test command CI runs
    verbatim, and a link to every page under docs/."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300, f"README.md has {len(readme.splitlines())} lines: move detail to docs/"
    ci_command = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"```bash\n{ci_command}\n```" in readme, f"README's quick start lacks .ci/run's command {ci_command!r}"
    linked = {target.split("#")[0] for _, target in _links(readme)}
    unlinked = [f"docs/{p.name}" for p in sorted((REPO / "docs").glob("*.md")) if f"docs/{p.name}" not in linked]
    assert not unlinked, f"README.md links no page {unlinked}"


def test_relative_links_resolve():
    """Every relative link in README.md and docs/*.md names a file that exists, and its #anchor
    (if any) a heading of that file, as GitHub spells heading anchors."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken, checked = [], 0
    for page in pages:
        for text, target in _links(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.is_file():
                broken.append(f"{page.relative_to(REPO)}: [{text}]({target}): no file {path}")
            elif anchor and anchor not in _anchors(file.read_text()):
                broken.append(f"{page.relative_to(REPO)}: [{text}]({target}): no heading #{anchor} in {path or page.name}")
            checked += 1
    assert checked >= 40 and not broken, "\n".join(broken) or f"only {checked} links found"


def test_anchors_follow_github():
    assert _anchors("# A b\n```bash\n# not a heading\n```\n## Which layout? `--suggest`\n## A b\n") == [
        "a-b", "which-layout---suggest", "a-b-1"]


def _links(markdown: str) -> list[tuple[str, str]]:
    """[text](target) links outside code fences and code spans."""
    prose = re.sub(r"```.*?```", "", markdown, flags=re.DOTALL)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    return re.findall(r"\[([^\]]*)\]\(([^)\s]+)\)", prose)


def _anchors(markdown: str) -> list[str]:
    """The anchors GitHub gives the headings: lower case, punctuation dropped, spaces as hyphens,
    a repeated one numbered."""
    seen: dict[str, int] = {}
    anchors = []
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"```.*?```", "", markdown, flags=re.DOTALL), flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.append(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_troubleshooting_names_the_objectives_that_chunk_the_loss():
    from trainloop.objectives import OBJECTIVES

    text = (REPO / "docs" / "troubleshooting.md").read_text()
    said = re.search(r"\*\*A large vocabulary: `trainer.loss_chunk_tokens=N`\*\* \(objective=([^)]*)\)", text)
    assert said, "docs/troubleshooting.md has no 'A large vocabulary' paragraph naming its objectives"
    readers = {name for name, row in OBJECTIVES.items() if row.chunks_loss}
    assert set(re.findall(r"\w+", said[1].replace(" or ", " "))) == readers
    refused = re.search(r"an objective that does not read it \(objective=([^)]*?),? for now\)", text)
    assert refused and set(re.findall(r"\w+", refused[1].replace(" or ", " "))) == set(OBJECTIVES) - readers


def test_every_key_and_option_is_described():
    undocumented = [row.split("|")[1].strip() for row in render().splitlines()
                    if row.startswith("| `") and not row.rstrip(" |").split("|")[-1].strip()]
    assert not undocumented, (f"no description for {undocumented}: add a trailing comment to the field "
                              "in trainloop/config/compose.py, or a leading comment to the conf/ file")


def test_descriptions_come_from_trailing_or_preceding_comments():
    source = '''
@dataclass
class Example:
    size: int = 4  # blocks in the model
    # the name of a file,
    # on a local disk
    path: Optional[str] = None
    plain: bool = False

    # not a field's description
'''
    docs = field_docs(source)
    assert docs["Example", "size"] == ("int", "blocks in the model")
    assert docs["Example", "path"] == ("Optional[str]", "the name of a file, on a local disk")
    assert docs["Example", "plain"] == ("bool", "")


def test_cli_writes_and_checks(tmp_path):
    out = tmp_path / "ref.md"
    warm(1, ["--write", str(out)], module="trainloop.reference")
    assert out.read_text() == render()
    assert warm(1, ["--check", str(out)], module="trainloop.reference", check=False).returncode == 0
    out.write_text(out.read_text().replace("| `trainer.max_steps` |", "| `trainer.steps` |"))
    stale = warm(1, ["--check", str(out)], module="trainloop.reference", check=False)
    assert stale.returncode == 1 and "stale" in stale.stderr


def test_troubleshooting_quotes_trainloop_as_it_speaks():
    """The bold code fragments in docs/troubleshooting.md are trainloop's own message text."""
    quotes = re.findall(r"\*\*`([^`]+)`\*\*", (REPO / "docs" / "troubleshooting.md").read_text())
    assert len(quotes) >= 20
    messages = [text for path in sorted((REPO / "trainloop").rglob("*.py"))
                for text in _string_literals(path.read_text())]
    missing = [quote for quote in quotes if not any(quote in text for text in messages)]
    assert not missing, f"docs/troubleshooting.md quotes messages trainloop no longer has: {missing}"


def _string_literals(source: str):
    """Every string in the code, implicit concatenations joined, f-string fields as {}."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value
        elif isinstance(node, ast.JoinedStr):
            yield "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)


def _flat_keys(node: dict, prefix: str = ""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _flat_keys(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def test_the_objective_layout_table_is_read_from_the_declarations():
    """One row per objective, one column per layout, each cell what validate says of that objective on that
    layout (a refusal quoted, else yes): since issue 59, yes in every cell."""
    from trainloop.objectives import OBJECTIVES
    from trainloop.tools.reference import LAYOUTS, matrix

    table = [line for line in matrix() if line.startswith("| `")]
    assert table == [f"| `{name}` | " + " | ".join(["yes"] * len(LAYOUTS)) + " |" for name in OBJECTIVES], table
