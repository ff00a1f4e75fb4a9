"""One RL run (appliance.rl.runs.RunSpec): K answers per task generated through the gateway under the
run's service identity, each executed in the sandbox against the task's tests, and a failing answer
corrected for up to R more rounds with its parsed error fed back.

Generation and execution overlap: answers are requested `rl.generation_concurrency` at a time, and
each goes to the run's execution queue as soon as it arrives, where the sandbox workers (as many as
the queue holds, up to `execution.workers`) take it; a verdict back starts the next round at once.

Everything lands in the run's store (finetune.rl.store) as it happens, so a killed run resumes where
it was: answers are not asked for again, executions not run again once their verdict is stored.
Attempts go to the artifact store in sealed, content-addressed segments (finetune.rl.trajectories).
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import httpx

from appliance import login
from appliance.artifacts import artifact_store
from appliance.errors import ApplianceError, ArtifactStoreError, Invalid, Unavailable
from appliance.home import Home
from appliance.jobs import CANCEL_FILE
from appliance.local_gateway import client_options
from appliance.rl.attempts import Attempt, attempt_key
from appliance.rl.executions import STORE_FILE
from appliance.rl.progress import RECENT_STEPS, PolicyProgress, RunProgress, write_progress
from appliance.rl.runs import Run, progressed, run_dir
from appliance.rl.tasks import Task
from appliance.settings import RlSettings, Settings
from finetune.rl.execute import Verdict, not_run
from finetune.rl.executor import WorkerPool, executor_alive
from finetune.rl.store import Generation, RunStore
from finetune.rl.tasks import load
from finetune.rl.trajectories import TrajectoryWriter

log = logging.getLogger("appliance.rl-loop")
SYSTEM = ("You are a careful programmer. Answer with the complete program in one fenced code block "
          "and nothing else.")
FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
TAGS = {"python": ("python", "py", "python3"), "c": ("c",)}  # a fenced block's language tags
STACK_LINES = 12
TICK_S = 0.1
RETRY_STATUSES = {429, 502, 503, 504}
REQUEST_REFUSED = {400, 413, 422}  # this request only (too long, say): recorded as the attempt's error


class RunCancelled(ApplianceError):
    """The run was asked to stop; what it did is kept."""


@dataclass(frozen=True)
class Step:
    """The next answer one sample of one task needs."""

    task: Task
    sample: int
    round: int
    messages: list[dict[str, str]]

    @property
    def key(self) -> str:
        return attempt_key(self.task.id, self.sample, self.round)


def first_messages(task: Task) -> list[dict[str, str]]:
    ask = (f"Complete this Python function; answer with the whole function in one ```python block.\n\n{task.prompt}"
           if task.entry_point else
           f"Write a {'C' if task.language == 'c' else 'Python'} program for this task; answer with the whole "
           f"program in one ```{task.language} block.\n\n{task.prompt}")
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask}]


def extract_code(completion: str, task: Task) -> str:
    """The program in an answer: its first fenced block (one in the task's language first), else the
    whole answer; a function-completion task's prompt goes first when the answer lacks the function."""
    blocks: list[tuple[str, str]] = FENCE.findall(completion)
    tagged = [code for tag, code in blocks if tag.lower() in TAGS[task.language]]
    code = (tagged or [code for _, code in blocks] or [completion])[0]
    if task.entry_point and not re.search(rf"^\s*def\s+{re.escape(task.entry_point)}\s*\(", code, re.M):
        code = task.prompt + code
    return code


def feedback(verdict: Verdict) -> str:
    """The parsed error of a failing execution: the failing assertion, the exception and a trimmed
    stack, for the next round's prompt."""
    lines = verdict.stderr.strip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
    parts = [f"Your program failed: {verdict.reason}; {verdict.tests_passed} of {verdict.tests_total} tests passed."]
    if starts:
        trace = lines[starts[-1]:]
        assertion = next((line.strip() for line in reversed(trace) if line.strip().startswith("assert ")), None)
        if assertion:
            parts.append(f"Failing assertion: {assertion}")
        parts.append(f"Exception: {trace[-1].strip()}")
        parts.append("Stack (last lines):\n" + "\n".join(trace[-STACK_LINES:]))
    elif lines:
        parts.append("Error output (last lines):\n" + "\n".join(lines[-STACK_LINES:]))
    parts.append("Fix the program and answer with the whole corrected program in one fenced code block.")
    return "\n".join(parts)


@dataclass(frozen=True)
class Reward:
    """An answer's reward and its terms."""

    total: float
    efficiency: float
    length_penalty: float


def reward(verdict: Verdict, task: Task, rl: RlSettings, *, tokens: int | None = None,
           max_tokens: int = 1) -> Reward:
    """Share of tests passed, plus, for an answer that passes them all, the efficiency term (the
    share of its time limit left unused, weighted), less the length penalty (the share of
    `max_tokens` the answer used, weighted). An answer that ran no test earns nothing."""
    if verdict.tests_total == 0:
        return Reward(0.0, 0.0, 0.0)
    passed = verdict.tests_passed / verdict.tests_total
    spare = max(0.0, 1 - verdict.wall_s / task.time_limit_s) if verdict.status == "passed" else 0.0
    efficiency = round(rl.efficiency_weight * spare, 4)
    length = round(rl.length_penalty * min(1.0, (tokens or 0) / max_tokens), 4)
    return Reward(round(passed + efficiency - length, 4), efficiency, length)


class Generator:
    """Chat completions through the gateway, as the run's service identity."""

    def __init__(self, settings: Settings, home: Home, model: str) -> None:
        self.settings, self.home, self.model = settings, home, model
        self._http = httpx.Client(**client_options(settings, home), timeout=settings.rl.gateway_timeout_s)
        self._token: login.CachedToken | None = None
        self._lock = threading.Lock()

    def _bearer(self) -> str:
        with self._lock:
            if self._token is None or self._token.expires_at - login.MARGIN_S < time.time():
                self._token = login.service_token(self.settings, self.home)
            return self._token.access_token

    def generate(self, step: Step, max_tokens: int, temperature: float, seed: int) -> Answer:
        """The answer, or one with `refused` saying why the gateway refused this request (a context
        too long, say); what `chat` raises otherwise."""
        body = {"model": self.model, "messages": step.messages, "max_tokens": max_tokens,
                "temperature": temperature, "seed": seed}
        answered = self.chat(body, f"task {step.task.id}")
        if isinstance(answered, Refused):
            return Answer("", "", None, refused=answered.reason)
        return answer_of(answered)

    def chat(self, body: dict[str, Any], what: str) -> httpx.Response | Refused:
        """One chat completion's response (200), or why the gateway refused this request: its
        status was one of REQUEST_REFUSED, or the model's tool call failed the request's schema (502
        invalid_tool_call). Unavailable while the gateway or Keycloak stay unreachable or busy past
        `rl.give_up_s` (the run waits and resumes); Invalid when the gateway refuses the run itself
        (no such model, not allowed, a service identity it rejects)."""
        give_up_s = self.settings.rl.give_up_s
        deadline = time.monotonic() + give_up_s
        refreshed = False
        while True:
            try:
                response = self._http.post("/v1/chat/completions", json=body,
                                           headers={"Authorization": f"Bearer {self._bearer()}"})
            except httpx.HTTPError as exc:
                problem, wait_s = f"gateway unreachable: {exc}", 2.0
            except login.KeycloakUnreachable as exc:  # restarting, say (a refused login is not retried)
                problem, wait_s = f"no token for the service identity: {exc.message}", 2.0
            else:
                if response.status_code == 200:
                    return response
                problem = f"gateway answered {response.status_code}: {response.text[:300]}"
                if response.status_code == 401 and not refreshed:  # expired early: one fresh token
                    self._token, refreshed = None, True
                    continue
                if response.status_code in REQUEST_REFUSED or _invalid_tool_call(response):
                    return Refused(problem, response.headers.get("x-request-id"))
                if response.status_code not in RETRY_STATUSES:
                    raise Invalid(f"{problem} (model {self.model!r})")
                wait_s = retry_after(response.headers.get("retry-after"))
            if time.monotonic() + wait_s > deadline:
                raise Unavailable(f"{what}: {problem} (gave up after {give_up_s:g} s)")
            time.sleep(wait_s)

    def close(self) -> None:
        self._http.close()


@dataclass(frozen=True)
class Refused:
    """The gateway refused one request (not the run): why, and its request id (its audit record)."""

    reason: str
    request_id: str | None


@dataclass(frozen=True)
class Answer:
    text: str
    model: str  # the engine's name for what answered
    tokens: int | None  # as the engine counted them
    refused: str | None = None  # why the gateway refused the request


def answer_of(response: httpx.Response) -> Answer:
    """The answer in a chat completion; Unavailable if it is not one. Text that UTF-8 cannot hold
    (a lone surrogate) is replaced, so it can be stored."""
    try:
        answer = response.json()
        content, model = answer["choices"][0]["message"]["content"] or "", answer.get("model", "")
        tokens = (answer.get("usage") or {}).get("completion_tokens")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise Unavailable(f"the gateway's answer is not a chat completion: {response.text[:200]!r}") from exc
    if not isinstance(content, str) or not isinstance(model, str):
        raise Unavailable(f"the gateway's answer is not a chat completion: {response.text[:200]!r}")
    counted = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0 else None
    return Answer(content.encode("utf-8", "replace").decode("utf-8"), model, counted)


def _invalid_tool_call(response: httpx.Response) -> bool:
    """The gateway refused the model's tool call (it failed the request's schema): this answer
    only, not a gateway that is busy."""
    try:
        return bool(response.status_code == 502 and response.json()["error"]["code"] == "invalid_tool_call")
    except (ValueError, KeyError, TypeError):
        return False


def retry_after(header: str | None) -> float:
    """Seconds a Retry-After header asks for (2 when it is absent or not a number of seconds)."""
    try:
        seconds = float(header or 2)
    except ValueError:
        return 2.0
    return min(max(seconds, 0.1), 60.0) if math.isfinite(seconds) else 2.0


def adapter_version(model: str, adapter: str | None) -> int | None:
    """The adapter version that answered, from the engine's model name (name-vN)."""
    if adapter is None:
        return None
    found = re.fullmatch(rf"{re.escape(adapter)}-v(\d+)", model)
    return int(found.group(1)) if found else None


class Loop:
    def __init__(self, home: Home, settings: Settings, run: Run) -> None:
        self.home, self.settings, self.run = home, settings, run
        self.spec = run.spec
        self.directory = run_dir(home, run.id)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.store = RunStore(self.directory / STORE_FILE)
        artifacts = artifact_store(settings.artifacts, home)
        tasks = load(self.spec.tasks, self.spec.split, artifacts, home, self.spec.tasks_sha256)
        self.tasks = tasks[:self.spec.limit] if self.spec.limit else tasks
        self.writer = TrajectoryWriter(self.store, artifacts, home, run, self.tasks, settings.rl.segment_attempts)
        cap = settings.execution.workers or os.cpu_count() or 1
        self.pool = WorkerPool(self.store, home, cap)
        self.model = self.spec.adapter or self.spec.base
        self.adapter = self.spec.grpo.policy if self.spec.grpo else self.spec.adapter  # whose versions answer
        self.generated = self.store.generations()
        self._housekept = 0.0
        self._done = -1  # generations and attempts at the last progress stamp
        self.resumed_from: str | None = None  # a GRPO run's: the step and version it resumed from

    def first_steps(self) -> list[Step]:
        """Every first answer a sampling run asks for."""
        return [Step(task, sample, 0, first_messages(task))
                for task in self.tasks for sample in range(self.spec.samples)]

    def plan(self, firsts: list[Step]) -> tuple[deque[Step], dict[str, Step]]:
        """What is left of these first answers and their corrections: answers to ask for, and
        answers whose execution is awaited (a resumed run starts from what its store holds)."""
        attempts = {a.key: a for a in self.store.attempts()}
        asks: deque[Step] = deque()
        awaited: dict[str, Step] = {}
        for first in firsts:
            step, task = first, first.task
            while (attempt := attempts.get(step.key)) is not None:
                if not self.corrects(attempt):
                    break
                step = next_step(step, attempt)
            else:
                generation = self.generated.get(step.key)
                if generation is None:
                    asks.append(step)
                elif generation.refused is not None:  # killed before its attempt was saved
                    self.store.save_attempt(self._attempt(step, not_run(generation.refused)))
                else:
                    self.store.enqueue(step.key, generation.code, task)
                    awaited[step.key] = step
        return asks, awaited

    def execute(self) -> str:
        """Run to the end (or to a cancel request: RunCancelled); the outcome in one line."""
        try:
            self.attempt_all(self.first_steps(), self.model)
        except Unavailable:
            raise  # the worker waits and resumes the run: nothing final to write yet
        except Exception:
            self.keep_trajectories()  # a cancelled or failed run does not resume: what it did is kept
            raise
        manifest = self.writer.finish()
        figures = self.report()
        return (f"{figures.attempts_done} attempts over {figures.tasks} tasks: pass rate {figures.pass_rate:.0%} "
                f"(first answers {figures.first_pass_rate:.0%}), mean reward {figures.mean_reward:.3f}; "
                f"trajectories {manifest}")

    def attempt_all(self, firsts: list[Step], model: str) -> None:
        """Generate with `model` (a served name) and execute these first answers and their
        corrections until each has its attempts (or to a cancel request: RunCancelled)."""
        self.store.requeue_orphans(executor_alive)  # held by the sandbox workers of a run that was stopped
        asks, awaited = self.plan(firsts)
        generator = Generator(self.settings, self.home, model)
        pending: dict[Future[Generation], Step] = {}
        concurrency = self.settings.rl.generation_concurrency
        threads = ThreadPoolExecutor(concurrency, thread_name_prefix="generate")
        try:
            while asks or pending or awaited:
                if (self.directory / CANCEL_FILE).exists():
                    self._collect(awaited, asks)  # verdicts already in become attempts
                    raise RunCancelled("run stopped as asked; its attempts so far are kept")
                while asks and len(pending) < concurrency:
                    step = asks.popleft()
                    pending[threads.submit(self._generate, generator, step)] = step
                if pending:
                    done, _ = wait(pending, timeout=TICK_S, return_when=FIRST_COMPLETED)
                else:
                    done = set()
                    time.sleep(TICK_S)  # only executions to wait for
                for future in done:
                    step = pending.pop(future)
                    generation = future.result()
                    self.store.save_generation(step.key, generation)
                    self.generated[step.key] = generation
                    if generation.refused is None:
                        self.store.enqueue(step.key, generation.code, step.task)
                        awaited[step.key] = step
                    else:  # nothing to run: the attempt is the refusal
                        self.store.save_attempt(self._attempt(step, not_run(generation.refused)))
                if time.monotonic() - self._housekept >= 1.0:
                    self._housekeep()
                self.pool.follow(self.store.depth())
                self._collect(awaited, asks)
        finally:
            threads.shutdown(wait=False, cancel_futures=True)  # a stop does not wait for answers in flight
            self.pool.stop()
            generator.close()

    def close(self) -> None:
        self.store.close()

    def _collect(self, awaited: dict[str, Step], asks: deque[Step]) -> None:
        """The verdicts in: each an attempt, and a failing one's correction asked for."""
        for key, verdict in self.store.verdicts(set(awaited)).items():
            step = awaited.pop(key)
            attempt = self._attempt(step, verdict)
            self.store.save_attempt(attempt)
            if self.corrects(attempt):
                asks.append(next_step(step, attempt))

    def corrects(self, attempt: Attempt) -> bool:
        """Whether a correction round follows: the answer ran and failed, and rounds are left (an
        answer that could not run, or was refused, ends its sample)."""
        return attempt.status == "failed" and attempt.round < self.spec.rounds

    def _housekeep(self) -> None:
        """Once a second: executions held by a dead sandbox worker back to the queue, full segments to
        the artifact store (a store that fails now is tried again), the run's figures, and its
        progress stamped when it generated or judged something since (the watchdog's stall clock)."""
        self._housekept = time.monotonic()
        self.store.requeue_orphans(executor_alive)
        try:
            self.writer.flush()
        except ArtifactStoreError as exc:
            log.warning("run %d: trajectory segment not stored yet (tried again): %s", self.run.id, exc.message)
        done = len(self.generated) + self.report().attempts_done
        if done != self._done:
            self._done = done
            progressed(self.home, self.run.id, os.getpid())

    def _generate(self, generator: Generator, step: Step) -> Generation:
        started = time.monotonic()
        answer = generator.generate(step, self.spec.max_tokens, self.spec.temperature,
                                    self.spec.seed * 1_000_003 + step.sample * 101 + step.round)
        code = extract_code(answer.text, step.task) if answer.refused is None else ""
        return Generation(step.messages, answer.text, code, round(time.monotonic() - started, 3), answer.model,
                          answer.refused, answer.tokens)

    def _attempt(self, step: Step, verdict: Verdict) -> Attempt:
        generation = self.generated[step.key]
        earned = reward(verdict, step.task, self.settings.rl, tokens=generation.tokens, max_tokens=self.spec.max_tokens)
        return Attempt(
            run=self.run.id, task=step.task.id, sample=step.sample, round=step.round, messages=step.messages,
            completion=generation.completion, code=generation.code, status=verdict.status,
            exit_reason=verdict.reason, tests_passed=verdict.tests_passed, tests_total=verdict.tests_total,
            stdout=verdict.stdout, stderr=verdict.stderr,
            feedback=feedback(verdict) if verdict.status == "failed" else "",
            reward=earned.total, efficiency=earned.efficiency, length_penalty=earned.length_penalty,
            completion_tokens=generation.tokens,
            generate_s=generation.seconds, execute_s=verdict.wall_s, model=generation.model,
            adapter=self.adapter, adapter_version=adapter_version(generation.model, self.adapter))

    def keep_trajectories(self) -> None:
        try:
            log.info("run %d: trajectories so far in %s", self.run.id, self.writer.finish())
        except ApplianceError as exc:
            log.error("run %d: its trajectories could not be written: %s", self.run.id, exc.one_line())

    def report(self) -> RunProgress:
        """Write the run's figures and return them."""
        attempts = self.store.attempts()
        solved = {a.task for a in attempts if a.status == "passed"}
        first = [a for a in attempts if a.round == 0]
        grpo = self.spec.grpo
        asked = grpo.steps * min(grpo.tasks_per_step, len(self.tasks)) if grpo else len(self.tasks)
        planned = asked * self.spec.samples
        progress = RunProgress(
            tasks=len(self.tasks), attempts_done=len(attempts),
            attempts_planned=planned + sum(a.round > 0 for a in attempts),
            passed=sum(a.status == "passed" for a in attempts),
            pass_rate=len(solved) / len(self.tasks) if self.tasks else 0.0,
            first_pass_rate=sum(a.status == "passed" for a in first) / len(first) if first else 0.0,
            mean_reward=sum(a.reward for a in attempts) / len(attempts) if attempts else 0.0,
            queue_depth=self.store.depth(), workers=self.pool.alive(),
            trajectory_segments=len(self.store.segments()),
            policy=None if grpo is None else PolicyProgress(
                policy=grpo.policy, steps=grpo.steps, finished=self.store.policy_steps_done(),
                done=self.store.policy_steps(RECENT_STEPS), resumed_from=self.resumed_from))
        write_progress(self.home, self.run.id, progress)
        return progress


def next_step(step: Step, attempt: Attempt) -> Step:
    """The correction round after a failing attempt: its answer and its parsed error added."""
    return Step(step.task, step.sample, step.round + 1,
                [*step.messages, {"role": "assistant", "content": attempt.completion},
                 {"role": "user", "content": attempt.feedback}])
