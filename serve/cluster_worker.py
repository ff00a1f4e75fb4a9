"""A worker host of a cluster: `appliance join HEAD_URL` (the token on standard input), and the
programs its own supervisord runs afterwards (its ranks, and `cluster-agent` reporting them).

Joining: fetch the head's CA and check it against the fingerprint in the token (so this host
talks to no one else), redeem the token for a credential and the ranks' launch, get the
weights (pulled from the head, each file's SHA-256 checked; or a pre-staged directory checked
the same way), report the result (a failed check is refused by the head and audited there),
then start. A join refused before the token was spent may be tried again with it; after that, the
head invites the host again (`hosts remove`, `hosts add`). Either way files already here and
correct are not fetched again.
"""

from __future__ import annotations

import hashlib
import shutil
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from appliance.cluster_client import CREDENTIAL_SECRET, head_ca_file, head_client
from appliance.digest import sha256_file
from appliance.durable import replace_file
from appliance.engine_build import installed_engine
from appliance.engine_launch import RANK_MODULE, engine_program, python
from appliance.errors import ApplianceError, Invalid, Unavailable
from appliance.home import HOME_ENV, Home
from appliance.hosts import (
    JoinAnswer,
    JoinRequest,
    Membership,
    RankLaunch,
    WeightFile,
    WeightsReport,
    membership,
    membership_file,
    parse_join_token,
    worker_model_dir,
)
from appliance.programs import CONTROL, ENV_KEY, Program
from appliance.settings import Settings
from appliance.tls import certificate_sha256, tls_dir
from serve.engine import interface_of

# vLLM options that would run code the weights bring along, or open the rank to others.
REFUSED_OPTIONS = {"--trust-remote-code", "--worker-extension-cls", "--worker-cls", "--logits-processors",
                   "--tool-parser-plugin", "--allowed-local-media-path"}
# What a rank's environment may set (the head builds it; a worker runs nothing else on its word).
RANK_ENV_PREFIXES = ("VLLM_", "HF_", "TRANSFORMERS_", "DO_NOT_TRACK", "CUDA_VISIBLE_DEVICES", "GLOO_", "NCCL_")


def _pin_ca(home: Home, head_url: str, ca_sha256: str) -> None:
    """Fetch the head's CA (unverified, then checked against the token's fingerprint) and keep it."""
    try:
        pem = httpx.get(f"{head_url}/cluster/ca", verify=False, timeout=30).text  # checked below
        if pem.count("-----BEGIN") != 1:
            raise ValueError("not exactly one PEM certificate")
        certificate = x509.load_pem_x509_certificate(pem.encode())
    except (httpx.HTTPError, ValueError) as exc:
        raise Unavailable(f"{head_url}: cannot fetch the head's CA: {exc}") from exc
    got = certificate_sha256(certificate)
    if got != ca_sha256:
        raise Invalid(f"{head_url} presents a CA whose SHA-256 is {got}, not the {ca_sha256} in the token: not the "
                      "head that invited this host")
    tls_dir(home).mkdir(mode=0o700, parents=True, exist_ok=True)
    # Only the certificate that was checked is kept: it is all this host will ever trust.
    replace_file(head_ca_file(home), certificate.public_bytes(serialization.Encoding.PEM), mode=0o644)


def _local_address(head_url: str) -> str:
    """This host's address on the route to the head (no packet is sent)."""
    parts = urlsplit(head_url)
    family = socket.AF_INET6 if ":" in (parts.hostname or "") else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((parts.hostname or "", parts.port or 443))
        return str(probe.getsockname()[0])


def _answer(response: httpx.Response, what: str) -> httpx.Response:
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail")
        except ValueError:
            detail = response.text[:200]
        raise Invalid(f"{what}: the head refused ({response.status_code}): {detail}")
    return response


def join(home: Home, head_url: str, token: str, weights: Path | None, say: Callable[[str], None]) -> Membership:
    """Join the cluster; the membership written (and the credential, 0600) once the weights verified."""
    parsed = parse_join_token(token)
    head_url = head_url.rstrip("/")
    if not head_url.startswith("https://"):
        raise Invalid(f"{head_url}: the head's cluster URL must be https://")
    if membership_file(home).exists():
        raise Invalid(f"this host joined a cluster already ({membership_file(home)})",
                      hint="`appliance down`, remove that file, then join again")
    engine = installed_engine()
    if engine is None:
        raise Unavailable("no vLLM engine is installed on this host", hint="run ./bootstrap.sh or install.sh first")
    _pin_ca(home, head_url, parsed.ca_sha256)
    address = _local_address(head_url)
    request = JoinRequest(name=parsed.name, secret=parsed.secret, home=str(home.root), python=python(),
                          engine=engine, address=address, interface=interface_of(address))
    with head_client(home, head_url, timeout=600) as client:  # the head may hash the weights first
        answer = JoinAnswer.model_validate(_answer(client.post("/cluster/join", json=request.model_dump(mode="json")),
                                                   "join").json())
    for rank in answer.ranks:
        _check_launch(home, rank)
    home.secrets.mkdir(mode=0o700, parents=True, exist_ok=True)
    replace_file(home.secrets / CREDENTIAL_SECRET, answer.credential.encode())
    say(f"joined as {parsed.name}: " + ", ".join(f"node {r.node} of pool {r.pool}" for r in answer.ranks))
    with head_client(home, head_url, parsed.name, answer.credential, timeout=600) as client:
        for rank in answer.ranks:
            problem = _weights(client, home, rank, weights, say)
            _answer(client.post("/cluster/weights-report", json=WeightsReport(pool=rank.pool, problem=problem)
                                .model_dump()), "weights report")
            if problem:
                raise Invalid(f"pool {rank.pool}: {problem}; the head refused this host",
                              hint="stage the weights again (or drop --weights to pull them from the head)")
    record = Membership(head_url=head_url, name=parsed.name, heartbeat_s=answer.heartbeat_s, ranks=answer.ranks)
    replace_file(membership_file(home), record.model_dump_json(indent=1).encode())
    return record


def _check_launch(home: Home, rank: RankLaunch) -> None:
    """Run only vLLM's rank module with this host's interpreter, on the weights kept here, with
    known variables and options: even the head this host trusts cannot make it run other code."""
    problem = None
    argv = rank.argv
    model = worker_model_dir(str(home.root), rank.pool)
    if argv[:4] != [python(), "-P", "-m", RANK_MODULE]:
        problem = f"a launch that is not {RANK_MODULE} on {python()}"
    elif "--model" not in argv or argv[argv.index("--model") + 1:argv.index("--model") + 2] != [model]:
        problem = f"a launch whose --model is not {model}"
    elif any(CONTROL.search(value) for value in [*argv, *rank.env.values()]):
        problem = "control characters in the launch"
    elif bad := sorted(key for key in rank.env if not ENV_KEY.fullmatch(key) or not key.startswith(RANK_ENV_PREFIXES)):
        problem = f"environment variables a rank does not take: {bad}"
    elif refused := sorted(a.split("=")[0] for a in argv if a.split("=")[0] in REFUSED_OPTIONS):
        problem = f"options this host does not run: {refused}"
    if problem:
        raise Invalid(f"pool {rank.pool}: the head sent {problem}")


def _verify(directory: Path, files: list[WeightFile]) -> str | None:
    """The first problem with `directory` against the head's list, naming the file; None if none."""
    for entry in files:
        path = directory / entry.path
        if not path.is_file():
            return f"{path}: missing"
        if path.stat().st_size != entry.bytes:
            return f"{path}: {path.stat().st_size} bytes, expected {entry.bytes}"
        if sha256_file(path) != entry.sha256:
            return f"{path}: SHA-256 differs from the head's"
    return None


def _weights(client: httpx.Client, home: Home, rank: RankLaunch, staged: Path | None,
             say: Callable[[str], None]) -> str | None:
    """The rank's weights in place (pre-staged and checked, or pulled and checked); a problem or None."""
    target = Path(worker_model_dir(str(home.root), rank.pool))
    if staged is not None:
        problem = _verify(staged, rank.files)
        if problem is None:
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_symlink() or target.is_file():
                target.unlink()
            elif target.is_dir():
                shutil.rmtree(target)  # weights pulled by an earlier join: the pre-staged copy replaces them
            target.symlink_to(staged.resolve(), target_is_directory=True)
            say(f"pool {rank.pool}: {len(rank.files)} pre-staged files in {staged} verified")
        return problem
    total = sum(f.bytes for f in rank.files)
    for number, entry in enumerate(rank.files, start=1):
        path = target / entry.path
        if path.is_file() and path.stat().st_size == entry.bytes and sha256_file(path) == entry.sha256:
            continue  # a resumed join: already here
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        digest = hashlib.sha256()
        with client.stream("GET", f"/cluster/weights/{rank.pool}/{entry.path}") as response, partial.open("wb") as out:
            _answer(response, f"weights {entry.path}")
            for chunk in response.iter_bytes(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != entry.sha256:
            partial.unlink()
            return f"{path}: SHA-256 of what the head sent differs from its list"
        partial.rename(path)
        say(f"pool {rank.pool}: {number}/{len(rank.files)} {entry.path} ({entry.bytes:,} of {total:,} bytes)")
    return None


def worker_programs(settings: Settings, home: Home) -> list[Program]:
    """The `appliance.worker_programs` entry point: this host's ranks (started by the agent, for
    the head's current epoch) and the agent."""
    joined = membership(home)
    if joined is None:
        return []
    ranks = [Program(name=engine_program(rank.pool), command=rank.argv, environment=rank.env, autostart=False,
                     pool=rank.pool, priority=50, startsecs=1, stopwaitsecs=30)
             for rank in joined.ranks]
    agent = Program(name="cluster-agent", command=[python(), "-P", "-m", "serve.cluster_agent"],
                    environment={HOME_ENV: str(home.root)}, priority=90, startsecs=1, stopwaitsecs=5)
    return [*ranks, agent]


def read_token() -> str:
    token = sys.stdin.readline().strip()
    if not token:
        raise ApplianceError("no join token on standard input", hint="appliance join HEAD_URL < TOKEN_FILE")
    return token

