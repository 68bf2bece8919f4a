"""Reads ``docker/Dockerfile`` and ``.dockerignore`` the way Docker does, for tests.

There is no Docker engine on the build machines, so the tests check the image
by reading its instructions: the stages, the final stage's environment,
entrypoint, ports, volumes and user, and which files the build context holds.
Only the subset of the syntax the project's Dockerfile uses is supported
(comments, line continuations, ``ARG`` defaults in ``FROM``, exec-form JSON
arrays, ``ENV key=value ...``); anything else is an error, not a guess.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    """Upper case, e.g. ``RUN``."""
    arguments: str
    """The rest of the logical line, continuations joined."""

    def exec_form(self) -> list[str]:
        """The JSON-array form (``["a", "b"]``) of ENTRYPOINT, CMD or VOLUME."""
        value = json.loads(self.arguments)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{self.keyword} {self.arguments}: not a JSON array of strings")
        return value


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def env(self, base_env: dict[str, str]) -> dict[str, str]:
        """The environment after this stage's ENV instructions, over ``base_env``."""
        env = dict(base_env)
        for instruction in self.all("ENV"):
            for item in shlex.split(instruction.arguments):
                key, sep, value = item.partition("=")
                if not sep:
                    raise ValueError(f"ENV {instruction.arguments}: use the key=value form")
                env[key] = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), ""), value)
        return env


def _logical_lines(text: str) -> list[str]:
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1].strip() + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    if pending:
        raise ValueError("the Dockerfile ends inside a line continuation")
    return lines


def parse_dockerfile(path: Path = DOCKERFILE) -> list[Stage]:
    """The stages of ``path``, in order, with ``ARG`` defaults substituted in FROM."""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(path.read_text()):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        rest = rest.strip()
        if keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif keyword == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else ""
            stages.append(Stage(base=base, name=name))
        elif not stages:
            raise ValueError(f"{keyword} before the first FROM")
        else:
            stages[-1].instructions.append(Instruction(keyword, rest))
    return stages


# --- .dockerignore -------------------------------------------------------------------


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    # Docker's rules: '**' spans any number of directories, '*' and '?' stay
    # inside one path element, and a pattern also matches everything below a
    # directory it matches.
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + "(?:/.*)?")


def dockerignore_rules(path: Path = DOCKERIGNORE) -> list[tuple[bool, re.Pattern[str]]]:
    """``(excludes, pattern)`` pairs in file order; the last match wins."""
    rules = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        pattern = line.lstrip("!").strip().strip("/")
        rules.append((not include, _pattern_regex(pattern)))
    return rules


def in_build_context(relative: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether the file ``relative`` (to the repository root) reaches the build."""
    excluded = False
    for excludes, pattern in rules:
        if pattern.fullmatch(relative):
            excluded = excludes
    return not excluded
