"""The Dockerfile's contract, read from the file: no container engine runs here
(scripts/docker-smoke.sh builds and runs the image where one does)."""

from __future__ import annotations

import fnmatch
import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASES = ("python:3.12-slim", "python:3.11-slim")


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions in order, continuation lines joined and comments dropped."""
    instructions: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last_from = max(i for i, ins in enumerate(instructions) if ins.keyword == "FROM")
    return instructions[last_from:]


def env_of(stage: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in stage:
        if ins.keyword == "ENV":
            env.update(word.split("=", 1) for word in shlex.split(ins.args))
    return env


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return parse_dockerfile((ROOT / "Dockerfile").read_text())


def test_every_stage_builds_on_a_slim_python(instructions: list[Instruction]):
    bases = [ins.args.split()[0] for ins in instructions if ins.keyword == "FROM"]
    assert len(bases) >= 2, "multi-stage: a build stage and a runtime stage"
    assert all(base in BASES for base in bases), bases


def test_runtime_stage_runs_as_an_unprivileged_user(instructions: list[Instruction]):
    users = [ins.args for ins in final_stage(instructions) if ins.keyword == "USER"]
    assert users, "the runtime stage must switch user"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    # Numeric, so Kubernetes' runAsNonRoot can check it.
    assert user.isdigit()


def test_runtime_stage_serves_on_8080_with_a_health_check(instructions: list[Instruction]):
    stage = final_stage(instructions)
    exposed = [port for ins in stage if ins.keyword == "EXPOSE" for port in ins.args.split()]
    assert "8080" in exposed or "8080/tcp" in exposed
    checks = [ins.args for ins in stage if ins.keyword == "HEALTHCHECK"]
    assert len(checks) == 1
    assert "/healthz" in checks[0]
    assert "curl" not in checks[0] and "wget" not in checks[0], "neither exists in slim images"
    env = env_of(stage)
    assert env["KVGATE_HOST"] == "0.0.0.0"
    assert env["KVGATE_PORT"] == "8080"


def test_entrypoint_is_kvgate_and_the_default_is_the_demo(instructions: list[Instruction]):
    stage = final_stage(instructions)
    (entrypoint,) = [json.loads(ins.args) for ins in stage if ins.keyword == "ENTRYPOINT"]
    assert entrypoint == ["kvgate"]
    (command,) = [json.loads(ins.args) for ins in stage if ins.keyword == "CMD"]
    assert command[0] == "demo"


def test_dependencies_install_from_constraints_before_the_source_is_copied(
    instructions: list[Instruction],
):
    steps = [(ins.keyword, ins.args) for ins in instructions]
    deps = next(
        i for i, (kw, args) in enumerate(steps) if kw == "RUN" and "-c constraints.txt" in args
    )
    source = next(i for i, (kw, args) in enumerate(steps) if kw == "COPY" and "kvgate" in args)
    assert deps < source
    copied_before = " ".join(args for kw, args in steps[:deps] if kw == "COPY")
    assert "constraints.txt" in copied_before
    assert "kvgate" not in copied_before.replace("/opt/kvgate", "")


def _dockerignored(path: str) -> bool:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    return any(fnmatch.fnmatch(path, pattern.removeprefix("**/")) for pattern in patterns)


def test_every_copied_path_exists_and_is_in_the_build_context(instructions: list[Instruction]):
    sources: list[str] = []
    for ins in instructions:
        if ins.keyword != "COPY":
            continue
        words = [w for w in ins.args.split() if not w.startswith("--")]
        if "--from=" in ins.args:
            continue
        sources.extend(words[:-1])
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
        assert not _dockerignored(source), f"COPY {source}: excluded by .dockerignore"


def test_install_check_copies_what_the_dockerfile_copies(instructions: list[Instruction]):
    copied = {
        word
        for ins in instructions
        if ins.keyword == "COPY" and "--from=" not in ins.args
        for word in ins.args.split()[:-1]
    }
    script = (ROOT / "scripts" / "install-check.sh").read_text()
    (line,) = [ln for ln in script.splitlines() if ln.startswith("cp -R ")]
    assert set(line.split()[2:-1]) == copied
