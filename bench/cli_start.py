"""CLI start-up: the common commands that need no running appliance (`appliance --help`, `status`
on a state directory where nothing runs, `data add` of 30 chat rows measured with the demo model's
tokenizer, `data list`, `finetune status`) against `python -c pass`, whole processes, taking turns
over N rounds in the same run; medians of wall and CPU seconds, and each command's ratio to the
bare interpreter.

With --before REV the same two commands as of REV take their turns too: REV is checked out in a
temporary git worktree and run by this virtualenv's Python with the worktree first on PYTHONPATH,
beside a copy of the installed metadata that carries REV's own `appliance.commands` entry points
(the root reads them). Both revisions start the same way: `python -c "from appliance.cli import
main; main()" ARGS`, which is what the console script does.

Run: .venv/bin/python -m bench.cli_start [--rounds 20] [--before 72fff8d]  (after ./bootstrap.sh --no-start)
Writes bench/results/cli_start.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from importlib.metadata import distribution
from pathlib import Path

from appliance.home import Home

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "cli_start.json"
MAIN = "import sys; sys.argv[0] = 'appliance'; from appliance.cli import main; main()"
NOTHING_RUNS = "down (supervisord is not running)"


@dataclass
class Timed:
    """One command line to time, and its samples."""

    name: str
    argv: list[str]
    env: dict[str, str]
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)

    def run(self) -> subprocess.CompletedProcess[str]:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        # In a neutral directory: `python -c` puts the working directory first on sys.path.
        done = subprocess.run(self.argv, env=self.env, cwd=tempfile.gettempdir(), capture_output=True, text=True,
                              timeout=120, check=False)
        self.wall_s.append(time.perf_counter() - started)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.cpu_s.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        return done

    def medians(self) -> dict[str, float]:
        return {"wall_s": round(statistics.median(self.wall_s), 4), "cpu_s": round(statistics.median(self.cpu_s), 4)}


def appliance_paths(label: str, tree: Path, state: Path, extra_path: list[Path], rows: Path) -> list[Timed]:
    """The commands as the code in `tree` runs them (`data add` replaces the same dataset each time)."""
    env = {**os.environ, "APPLIANCE_HOME": str(state), "COLUMNS": "100",
           "PYTHONPATH": os.pathsep.join(map(str, [tree, *extra_path]))}
    demo = str(Home.from_env().demo_model)
    commands = [["--help"], ["status"], ["data", "add", str(rows), "--name", "faq", "--model", demo, "--replace"],
                ["data", "list"], ["finetune", "status"]]
    return [Timed(f"{label}appliance {' '.join(args[:2]) if args[0] == 'data' else ' '.join(args)}",
                  [sys.executable, "-c", MAIN, *args], env) for args in commands]


def chat_rows(path: Path, count: int = 30) -> Path:
    """`count` chat rows, as a day-one user adds them."""
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is the code for item {i}?"},
        {"role": "assistant", "content": f"The code for item {i} is ZEBRA."}]}) + "\n" for i in range(count)))
    return path


@contextmanager
def earlier_tree(rev: str) -> Iterator[tuple[Path, Path]]:
    """REV in a temporary worktree, and a directory with the installed metadata carrying REV's entry points."""
    scratch = Path(tempfile.mkdtemp(prefix="cli-start-"))
    tree, meta = scratch / "tree", scratch / "meta"
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(tree), rev], cwd=ROOT, check=True)
    try:
        installed = distribution("appliance")
        info = meta / f"appliance-{installed.version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(installed.read_text("METADATA") or "Name: appliance\n")
        groups = tomllib.loads((tree / "pyproject.toml").read_text())["project"]["entry-points"]
        (info / "entry_points.txt").write_text("".join(
            f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in points.items()) + "\n"
            for group, points in groups.items()))
        yield tree, meta
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
        shutil.rmtree(scratch, ignore_errors=True)


def measure(paths: list[Timed], rounds: int) -> None:
    """One untimed round (bytecode caches), then `rounds` rounds, each starting one path later."""
    for path in paths:
        done = path.run()
        if done.returncode != 0:
            raise SystemExit(f"{path.name}: exit {done.returncode}: {done.stderr[-2000:]}")
        if path.argv[3:] == ["status"] and done.stdout.strip() != NOTHING_RUNS:
            raise SystemExit(f"{path.name}: printed {done.stdout!r}, not {NOTHING_RUNS!r}")
        path.wall_s.clear()
        path.cpu_s.clear()
    for turn in range(rounds):
        for path in paths[turn % len(paths):] + paths[:turn % len(paths)]:
            path.run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--before", metavar="REV", help="also time the CLI as of this revision")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cli-start-home-") as state, \
            (earlier_tree(options.before) if options.before else nullcontext()) as earlier:
        yardstick = Timed("python -c pass", [sys.executable, "-c", "pass"], dict(os.environ))
        data = chat_rows(Path(state) / "rows.jsonl")
        now = appliance_paths("", ROOT, Path(state) / "home", [], data)
        before = appliance_paths("before: ", earlier[0], Path(state) / "home", [earlier[1]], data) if earlier else []
        load = os.getloadavg()
        measure([yardstick, *now, *before], options.rounds)
    bare = yardstick.medians()
    rows = {path.name: {**path.medians(),
                        "wall_ratio": round(statistics.median(path.wall_s) / bare["wall_s"], 2),
                        "cpu_ratio": round(statistics.median(path.cpu_s) / bare["cpu_s"], 2)}
            for path in [*now, *before]}
    report = {"bench": "cli_start", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "host_cpus": len(os.sched_getaffinity(0)), "load_average_1m": [round(load[0], 2),
                                                                                round(os.getloadavg()[0], 2)],
              "rounds": options.rounds, "yardstick": {"python -c pass": bare}, "rows": rows}
    if before:
        report["before"] = {"commit": options.before, "speedup_wall": {
            now_path.name: round(statistics.median(old.wall_s) / statistics.median(now_path.wall_s), 2)
            for now_path, old in zip(now, before, strict=True)}}
    print(json.dumps(report, indent=2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
