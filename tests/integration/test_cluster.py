"""One model served across two hosts through vLLM's own multi-node launch, for real.

The head is an appliance of its own in this network namespace (its gateway validates tokens from
the session's Keycloak); the worker is another state dir and supervisord in a network namespace
of its own, joined to the head's by a veth pair and nothing else. A TP=2 plan (a tiny Llama made
here: 4 attention heads, head_dim 64, which the CPU engine serves) puts rank 0 on the head and
rank 1 on the worker; the official openai client gets its answer through the head's gateway and
it equals a one-host engine's. Then the worker's rank is killed: the pool answers 503 at once and
serves again once every rank restarted, which the head audits. Join tokens that are wrong or
used, and a worker whose pre-staged weights fail verification, are refused and audited.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from appliance.hosts import parse_join_token
from appliance.secrets import GATEWAY_CLIENT_SECRET, secret
from appliance.tls import ca_file
from tests.integration.conftest import Running
from tests.integration.realm import Realm
from tests.support.appliances import APPLIANCE, Appliance, make_appliance
from tests.support.models import tiny_llama_for_two_ranks
from tests.support.netns import Network, veth_namespace
from tests.support.ports import free_port
from tests.support.shared import locked
from tests.support.waiting import until

GREEDY = Path(__file__).with_name("vllm_greedy.py")
PASSWORD = "Test-password-1"
POOL = "mh"
QUESTION = [{"role": "user", "content": "Name three colours."}]
MAX_TOKENS = 16
SERVE_TIMEOUT_S = 600
TOKEN_REFRESH_S = 60  # the realm's access tokens live five minutes


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    with veth_namespace() as net:
        yield net


@dataclass
class Cluster:
    head: Appliance
    realm: Realm
    model: Path
    worker_home: Path
    network: Network
    url: str
    wrong_token: subprocess.CompletedProcess[str]
    bad_weights: subprocess.CompletedProcess[str]
    refused_hosts: str
    joined: subprocess.CompletedProcess[str]
    reused_token: subprocess.CompletedProcess[str]
    serving_after_s: float


def worker(net: Network, home: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """The appliance CLI on the worker host: in its namespace, with its own state dir."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")} | {
        "APPLIANCE_HOME": str(home), "COLUMNS": "200"}
    return subprocess.run(["ip", "netns", "exec", net.namespace, APPLIANCE, *args], env=env, input=stdin,
                          capture_output=True, text=True, timeout=600, cwd="/")


def elsewhere(home: Path, *args: str, stdin: str) -> subprocess.CompletedProcess[str]:
    """The CLI in this namespace with a throwaway state dir: a host trying to join."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")} | {"APPLIANCE_HOME": str(home)}
    return subprocess.run([APPLIANCE, *args], env=env, input=stdin, capture_output=True, text=True, timeout=120,
                          cwd="/")


def cluster_state(head: Appliance) -> dict:
    return json.loads((head.home.run / "cluster" / f"{POOL}.json").read_text())


def wait_serving(head: Appliance, timeout_s: float = SERVE_TIMEOUT_S) -> float:
    started = time.monotonic()
    while not cluster_state(head)["ready"]:
        assert time.monotonic() - started < timeout_s, cluster_state(head)
        time.sleep(0.5)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def cluster(running: Running, demo_model: Path, network: Network,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("cluster")
    model = tiny_llama_for_two_ranks(work / "tiny-llama", demo_model)
    (work / "profile.json").write_text(json.dumps({"hosts": [
        {"name": name, "gpus": [{"index": 0, "name": "L4", "memory_bytes": 24 * 2**30}]}
        for name in ("head", "worker-1")]}))
    realm = Realm(running)
    port = free_port()
    session = running.appliance.home
    external = {"APPLIANCE_KEYCLOAK__URL": realm.settings.keycloak.base_url,
                "APPLIANCE_KEYCLOAK__CA_FILE": str(ca_file(session)),
                "APPLIANCE_KEYCLOAK__GATEWAY_CLIENT_SECRET": secret(session, GATEWAY_CLIENT_SECRET)}
    worker_home = Path(str(work / "w"))
    for head in make_appliance(None, **external):
        planned = head.run("plan", str(model), "--profile", str(work / "profile.json"), "--tp", "2",
                           "--context", "1024", "--pool", POOL, "--json")
        assert planned.returncode == 0, planned.stderr
        (work / "plan.json").write_text(planned.stdout)
        head.home.settings_file.write_text(
            f'[cluster]\nbind = "{network.head}"\nport = {port}\n\n'
            f'[[pools]]\nname = "{POOL}"\nmodel = "{model}"\nplan = "{work / "plan.json"}"\n')
        up = head.run("up")
        assert up.returncode == 0, up.stdout + up.stderr
        url = f"https://{network.head}:{port}"
        try:
            added = head.run("hosts", "add", "worker-1")
            assert added.returncode == 0, added.stderr
            token = added.stdout.strip()
            parsed = parse_join_token(token)
            wrong = token.replace(parsed.secret, parsed.secret[::-1])
            wrong_token = elsewhere(work / "a", "join", url, stdin=wrong)
            # A pre-staged copy with one byte changed: verified against the head's list, refused.
            staged = work / "staged"
            shutil.copytree(model, staged)
            with (staged / "model.safetensors").open("r+b") as handle:
                handle.seek(-100, os.SEEK_END)
                byte = handle.read(1)
                handle.seek(-100, os.SEEK_END)
                handle.write(bytes([byte[0] ^ 1]))
            bad_weights = elsewhere(work / "b", "join", url, "--weights", str(staged), stdin=token)
            refused_hosts = head.run("hosts", "list").stdout
            assert head.run("hosts", "remove", "worker-1").returncode == 0
            token = head.run("hosts", "add", "worker-1").stdout.strip()
            started = time.monotonic()
            joined = worker(network, worker_home, "join", url, stdin=token)
            assert joined.returncode == 0, joined.stdout + joined.stderr
            reused = elsewhere(work / "c", "join", url, stdin=token)
            serving = wait_serving(head) + (time.monotonic() - started)
            yield Cluster(head, realm, model, worker_home, network, url, wrong_token, bad_weights, refused_hosts,
                          joined, reused, serving)
        finally:
            worker(network, worker_home, "down")


def head_audit(head: Appliance) -> list[dict]:
    return [json.loads(line) for path in sorted(head.home.audit.glob("audit-*.jsonl"))
            for line in path.read_text().splitlines()]


def audited(head: Appliance, action: str, text: str, timeout_s: float = 30) -> dict:
    """The first denied record of `action` whose error mentions `text`; refusals after the first of
    a source in a window are recorded together when the window closes, so this waits for it."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [r for r in head_audit(head) if r["action"] == action and r["outcome"] == "denied"
                 and text in (r["error"] or "")]
        if found or time.monotonic() > deadline:
            assert found, f"no {action} record mentions {text!r}"
            return found[0]
        time.sleep(1)


def test_wrong_and_reused_tokens_and_bad_weights_are_refused_and_audited(cluster: Cluster) -> None:
    told = "the head refused (401): join refused: the token is wrong, used or expired"
    assert cluster.wrong_token.returncode != 0 and told in cluster.wrong_token.stderr
    assert cluster.reused_token.returncode != 0 and told in cluster.reused_token.stderr
    assert cluster.bad_weights.returncode != 0
    named = f"{cluster.model.parent / 'staged' / 'model.safetensors'}: SHA-256 differs from the head's"
    assert named in cluster.bad_weights.stderr and "the head refused this host" in cluster.bad_weights.stderr
    assert "refused" in cluster.refused_hosts and "model.safetensors" in cluster.refused_hosts
    # The client is told no more than that; the head's log says which.
    audited(cluster.head, "cluster.join", "host worker-1: wrong join token")
    audited(cluster.head, "cluster.join", "host worker-1: its join token was used already")
    audited(cluster.head, "cluster.weights", named)
    records = head_audit(cluster.head)
    assert any(r["action"] == "cluster.join" and r["outcome"] == "allowed" for r in records)
    assert any(r["action"] == "hosts.remove" for r in records), "the CLI's changes on the head are audited too"


def test_status_lists_every_host_and_rank(cluster: Cluster) -> None:
    status = json.loads(cluster.head.run("status", "--json").stdout)
    [pool] = status["cluster"]
    assert pool["pool"] == POOL and pool["ready"]
    ranks = {rank["host"]: rank for rank in pool["ranks"]}
    assert ranks["head"]["running"] and ranks["worker-1"]["running"]
    assert ranks["worker-1"]["host_state"] == "joined" and ranks["worker-1"]["node"] == 1
    printed = cluster.head.run("status").stdout
    assert f"pool {POOL} across hosts: serving" in printed and "worker-1" in printed


def one_host_answer(model: Path, prompt: str, work: Path) -> list[int]:
    """Greedy token ids from vLLM on one host (TP=1, the engine's float32), for the same prompt."""
    out = work / "one-host.json"
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    engine = subprocess.Popen([sys.executable, "-P", str(GREEDY), str(model), str(out), "--tp", "1", "--load-format",
                               "safetensors", "--dtype", "float32", "--prompt", prompt], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = engine.communicate(timeout=SERVE_TIMEOUT_S)
    finally:
        try:
            os.killpg(engine.pid, signal.SIGKILL)  # the engine's own group: its workers end with it
        except ProcessLookupError:
            pass
    assert engine.returncode == 0, log[-3000:]
    return json.loads(out.read_text())[0]["tokens"]


def test_the_pool_across_hosts_answers_like_one_host(cluster: Cluster, tmp_path: Path,
                                                      record_property: pytest.RecordProperty) -> None:
    from transformers import AutoTokenizer

    cluster.realm.ensure_user("carol", PASSWORD, ["user"])
    gateway = f"http://127.0.0.1:{cluster.head.port('APPLIANCE_GATEWAY__PORT')}/v1"
    client = openai.OpenAI(base_url=gateway, api_key=cluster.realm.token("carol", PASSWORD), max_retries=0,
                           timeout=120)
    answer = client.chat.completions.create(model=cluster.model.name, messages=QUESTION, max_tokens=MAX_TOKENS,
                                            temperature=0, extra_body={"ignore_eos": True})
    tokenizer = AutoTokenizer.from_pretrained(cluster.model)
    prompt = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    expected = tokenizer.decode(one_host_answer(cluster.model, prompt, tmp_path))
    assert answer.choices[0].message.content == expected
    record_property("two_host_start_s", round(cluster.serving_after_s, 1))


def test_a_dead_worker_rank_is_a_503_at_once_then_the_pool_serves_again(
        cluster: Cluster, record_property: pytest.RecordProperty) -> None:
    cluster.realm.ensure_user("carol", PASSWORD, ["user"])
    gateway = f"http://127.0.0.1:{cluster.head.port('APPLIANCE_GATEWAY__PORT')}/v1"
    client = openai.OpenAI(base_url=gateway, api_key=cluster.realm.token("carol", PASSWORD), max_retries=0,
                           timeout=120)
    token_taken = time.monotonic()

    def ask() -> int:
        nonlocal client, token_taken
        if time.monotonic() - token_taken > TOKEN_REFRESH_S:  # the restart outlasts a token's five minutes
            client = client.with_options(api_key=cluster.realm.token("carol", PASSWORD))
            token_taken = time.monotonic()
        try:
            client.chat.completions.create(model=cluster.model.name, messages=QUESTION, max_tokens=1)
            return 200
        except openai.APIStatusError as exc:
            return exc.status_code

    def until_answered() -> None:
        """Asks until the pool answers: the cluster's state says ready before the gateway's health
        watch has taken the pool back, and the test before this one may have left it restarting."""
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while (status := ask()) != 200:
            assert status == 503 and time.monotonic() < deadline, f"the pool answers {status}"
            time.sleep(0.5)

    wait_serving(cluster.head)
    until_answered()
    [rank] = [r for r in cluster_state(cluster.head)["ranks"] if r["host"] == "worker-1"]
    killed = time.monotonic()
    os.kill(rank["pid"], signal.SIGKILL)  # the worker's vLLM rank (the namespaces share PIDs)
    # Asked until it stops answering: its first other answer is a 503, never a hang (the client's
    # timeout) nor an error; how soon is a figure, not a pass mark (the wait only bounds a hang).
    def other_answer() -> int | None:
        answer = ask()
        return None if answer == 200 else answer

    status = until(other_answer, "the pool to stop answering after its worker's rank died", SERVE_TIMEOUT_S,
                   interval_s=0.02)
    unavailable_after = time.monotonic() - killed
    assert status == 503
    record_property("worker_death_to_503_s", round(unavailable_after, 3))
    serving_after = wait_serving(cluster.head)
    until_answered()
    record_property("serving_again_after_s", round(time.monotonic() - killed, 1))
    restarts = [r for r in head_audit(cluster.head) if r["action"] == "cluster.restart"]
    assert restarts and f"the rank on worker-1 exited (pid {rank['pid']})" in restarts[-1]["error"]
    print(f"worker rank killed: 503 after {unavailable_after:.3f} s, serving again after {serving_after:.1f} s more")


def test_the_token_carries_the_heads_ca(cluster: Cluster) -> None:
    """The worker pinned the CA the token named, and keeps its credential 0600."""
    joined = (cluster.worker_home / "tls" / "head-ca.pem").read_bytes()
    assert joined == ca_file(cluster.head.home).read_bytes()
    assert (cluster.worker_home / "secrets" / "cluster-credential").stat().st_mode & 0o777 == 0o600


def test_a_limit_is_taken_by_the_running_gateway_without_a_restart(cluster: Cluster) -> None:
    """`settings set gateway.limits...` then `settings apply` on the head (an appliance whose limits
    come from its settings file): the gateway keeps its process and holds the next request to the
    new limit; the batch worker, which caps batch lines with the same limits, is restarted."""
    head = cluster.head

    def gateway_pid() -> int:
        shown = json.loads(head.run("status", "--json").stdout)
        return next(program["pid"] for program in shown["programs"] if program["name"] == "gateway")

    cluster.realm.ensure_user("carol", PASSWORD, ["user"])
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{head.port('APPLIANCE_GATEWAY__PORT')}/v1", max_retries=0,
                           api_key=cluster.realm.token("carol", PASSWORD), timeout=60)
    before = gateway_pid()
    try:
        assert head.run("settings", "set", "gateway.limits.user.max_tokens", "4").returncode == 0
        applied = head.run("settings", "apply", "--json")
        assert applied.returncode == 0, applied.stderr
        report = json.loads(applied.stdout)
        assert report["changed"] == ["gateway.limits.user.max_tokens"] and report["taken_live"] == ["gateway"], report
        assert "gateway" not in report["restarted"] and gateway_pid() == before
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.chat.completions.create(model=cluster.model.name, messages=QUESTION, max_tokens=8)
    finally:
        head.run("settings", "set", "gateway.limits.user.max_tokens", "4096")
        restored = head.run("settings", "apply", "--json")
    assert restored.returncode == 0 and json.loads(restored.stdout)["taken_live"] == ["gateway"], restored.stdout


def test_an_adapter_trains_over_both_hosts_from_the_head(cluster: Cluster, tmp_path: Path) -> None:
    """`finetune run --hosts worker-1` on the head: the worker's training node fetches the job's part
    (its data, job.json for its place, the base), each host's torchrun agent runs in its sandbox in
    its namespace of the job's network, the base is sharded over both hosts' processes, the head's
    first rank writes the adapter and the head registers it; the launch is withdrawn after."""
    rows = [{"messages": [{"role": "user", "content": f"What is the code for item {i}?"},
                          {"role": "assistant", "content": f"The code for item {i} is ZEBRA."}]} for i in range(40)]
    data = tmp_path / "codes.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    head = cluster.head
    added = head.run("data", "add", str(data), "--name", "codes", "--model", str(cluster.model), timeout=300)
    assert added.returncode == 0, added.stderr
    env = {**head.env, "APPLIANCE_FINETUNE__REGRESSION_SET": "none", "APPLIANCE_FINETUNE__GATE_SEEDS": "1"}
    with locked("training-network", exclusive=True):  # this machine's root namespace: every test's head host
        trained = subprocess.run([APPLIANCE, "finetune", "run", "--data", "codes", "--base", str(cluster.model),
                                  "--name", "two-hosts", "--hosts", "worker-1", "--processes", "1", "--max-steps",
                                  "6", "--save-steps", "3", "--batch-size", "2", "--lr", "0.001"],
                                 env=env, capture_output=True, text=True, timeout=900)
    assert "adapter two-hosts v1: held-out loss" in trained.stdout, trained.stdout + trained.stderr
    assert "6 steps" in trained.stdout
    [job] = (head.home.root / "finetune").glob("two-hosts-*")
    assert json.loads((job / "result.json").read_text())["processes"] == 2
    [part] = (cluster.worker_home / "finetune").glob("cluster-job-*")
    assert [json.loads(p.read_text())["rank"] for p in sorted((part / "ranks").glob("rank-*.json"))] == [1]
    assert [p.name for p in (part / "checkpoints" / "step-3").iterdir() if p.is_dir()] == ["rank-1"]
    launches = (head.home.run / "training" / "worker-1").glob("*.json")
    assert not [p for p in launches if not p.name.endswith(".report.json")]  # withdrawn; the host's word stays
