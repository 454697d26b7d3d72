"""Packaging: the license, the metadata and the constraints file that pins every install."""

from __future__ import annotations

import tomllib
from importlib.metadata import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, sep, pinned = line.partition("==")
        assert sep and pinned, f"constraints.txt: '{line}' is not name==version"
        pins[canonicalize_name(name)] = pinned
    return pins


def test_constraints_pin_every_runtime_and_dev_dependency_within_its_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    pins = _pins()
    for text in declared:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is not pinned in constraints.txt"
        assert requirement.specifier.contains(pins[name]), (
            f"constraints.txt pins {requirement.name}=={pins[name]}, outside '{text}'"
        )


def test_license_and_metadata():
    assert (ROOT / "LICENSE").read_text().split()[:3] == ["Apache", "License", "Version"]
    meta = metadata("kvgate")
    assert meta["License-Expression"] == "Apache-2.0"
    assert "Typing :: Typed" in meta.get_all("Classifier")
    assert (ROOT / "kvgate" / "py.typed").exists()
