"""The size of the house at two revisions: modules and lines per top-level package, the largest
file and the largest function, read with `ast` from git (the base) and from the working tree.

    python -m bench.house [--base 72fff8d] [--head REV] [--out bench/results/house.json] [--doc]

Without --head the second side is the working tree as it is now, uncommitted changes included.
--doc (with --head: two commits, so anyone can measure them again) rewrites the table in the design
docs (docs/design/README.md, between its markers); tests/unit/test_house_doc.py measures the two
revisions the table names again and fails where the table says otherwise.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
PACKAGES = ("appliance", "audit", "serve", "finetune", "installer", "tui", "bench", "tests")
DEFAULT_BASE = "72fff8d"  # the tree before the round of work that split the largest modules
RESULTS = PROJECT / "bench" / "results" / "house.json"
DOC = PROJECT / "docs" / "design" / "README.md"
# The design docs' table between its markers; the first names the revisions it measured.
DOC_TABLE = re.compile(r"<!-- size table: python -m bench\.house --base (\S+) --head (\S+) --doc -->\n"
                       r".*?<!-- size table: end -->", re.S)


@dataclass
class Largest:
    """The largest file or function seen so far: where it is and how many lines it spans."""

    where: str = ""
    lines: int = 0

    def offer(self, where: str, lines: int) -> None:
        if lines > self.lines:
            self.where, self.lines = where, lines


@dataclass
class Package:
    modules: int = 0
    lines: int = 0


@dataclass
class House:
    """One revision's measures."""

    revision: str
    packages: dict[str, Package] = field(default_factory=dict)
    largest_file: Largest = field(default_factory=Largest)
    largest_function: Largest = field(default_factory=Largest)

    def add(self, path: str, source: str) -> None:
        package = self.packages.setdefault(path.split("/", 1)[0], Package())
        lines = len(source.splitlines())
        package.modules += 1
        package.lines += lines
        self.largest_file.offer(path, lines)
        for qualname, span in _function_spans(ast.parse(source, filename=path)):
            self.largest_function.offer(f"{path}:{qualname}", span)


def _function_spans(tree: ast.AST, prefix: str = "") -> list[tuple[str, int]]:
    """Every function and method with its qualified name and its length in lines (decorators
    included), nested ones too."""
    spans: list[tuple[str, int]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                spans.append((name, (node.end_lineno or node.lineno) - first + 1))
            spans.extend(_function_spans(node, f"{name}."))
        else:
            spans.extend(_function_spans(node, prefix))
    return spans


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                          cwd=PROJECT).stdout


def measure_revision(revision: str) -> House:
    """The house as committed at `revision`, its files read through one `git cat-file --batch`."""
    house = House(revision=_git("rev-parse", "--short", revision).strip())
    paths = [path for path in _git("ls-tree", "-r", "--name-only", revision, "--", *PACKAGES).splitlines()
             if path.endswith(".py")]
    asked = "".join(f"{revision}:{path}\n" for path in paths).encode()
    batch = subprocess.run(["git", "cat-file", "--batch"], input=asked, capture_output=True, check=True,
                           cwd=PROJECT).stdout
    at = 0
    for path in paths:  # each answer: "<object> blob <size>\n", the bytes, "\n"
        header_end = batch.index(b"\n", at)
        size = int(batch[at:header_end].split()[2])
        house.add(path, batch[header_end + 1:header_end + 1 + size].decode())
        at = header_end + 1 + size + 1
    return house


def measure_worktree() -> House:
    """The house as it stands on disk: tracked files and untracked ones git does not ignore."""
    house = House(revision="working tree")
    listed = _git("ls-files", "--cached", "--others", "--exclude-standard", "--", *PACKAGES)
    for path in sorted(set(listed.splitlines())):
        file = PROJECT / path
        if path.endswith(".py") and file.is_file():  # a file deleted but not yet committed is gone
            house.add(path, file.read_text())
    return house


def table(base: House, head: House) -> str:
    """Both sides side by side, a row per package, then the largest file and function."""
    rows = [f"| package | modules {base.revision} | modules {head.revision} | lines {base.revision} "
            f"| lines {head.revision} |", "|---|---:|---:|---:|---:|"]
    for name in PACKAGES:
        before, after = base.packages.get(name, Package()), head.packages.get(name, Package())
        rows.append(f"| `{name}/` | {before.modules} | {after.modules} | {before.lines:,} "
                    f"| {after.lines:,} |")
    for label, attribute in (("largest file", "largest_file"), ("largest function", "largest_function")):
        before, after = getattr(base, attribute), getattr(head, attribute)
        rows.append(f"\n{label}: `{before.where}` {before.lines:,} lines -> `{after.where}` "
                    f"{after.lines:,} lines")
    return "\n".join(rows)


def doc_table(base: House, head: House) -> str:
    """The design docs' table of two commits, between markers that name them."""
    return (f"<!-- size table: python -m bench.house --base {base.revision} --head {head.revision} --doc -->\n\n"
            f"{table(base, head)}\n\n<!-- size table: end -->")


def write_doc(base: House, head: House, doc: Path = DOC) -> None:
    text = doc.read_text()
    if len(DOC_TABLE.findall(text)) != 1:
        raise SystemExit(f"{doc}: no single size table between its markers (see DOC_TABLE in bench/house.py)")
    doc.write_text(DOC_TABLE.sub(lambda _: doc_table(base, head), text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--base", default=DEFAULT_BASE, help="the earlier revision")
    parser.add_argument("--head", help="the later revision (default: the working tree)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    parser.add_argument("--doc", action="store_true", help=f"rewrite the table in {DOC.relative_to(PROJECT)}")
    args = parser.parse_args()
    if args.doc and not args.head:
        parser.error("--doc needs --head REV: the docs' table names two commits, which anyone can measure again")
    base = measure_revision(args.base)
    head = measure_revision(args.head) if args.head else measure_worktree()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"base": asdict(base), "head": asdict(head)}, indent=2) + "\n")
    print(table(base, head))
    if args.doc:
        write_doc(base, head)


if __name__ == "__main__":
    main()
