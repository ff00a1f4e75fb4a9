"""Backup and restore of the demo state, against what a hurried operator would do instead, same
run, taking turns: `appliance backup create` (pg_dump, SQLite's backup API, sealed) against `pg_dump`
plus a plain `tar` of the same files (neither consistent nor encrypted); `appliance backup restore`
(checked whole, a new PostgreSQL cluster, pg_restore) against unpacking that tar. Times, the ratio
of medians, and sizes go to bench/results/backup.json.

    .venv/bin/python -m bench.backup [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from appliance.adapters import AdapterState
from appliance.artifacts import artifact_store
from appliance.home import Home
from appliance.jobs import Hyperparameters
from appliance.records import config_sha256
from appliance.settings import load_settings
from bench.own_appliance import APPLIANCE, cli, own_appliance
from finetune.adapters import register
from installer import postgres
from installer.backup import LEFT_OUT
from tests.support.models import random_adapter
from tests.support.records import metrics

PASSPHRASE = "a passphrase for the bench"
RESULTS = Path(__file__).parent / "results" / "backup.json"
PORTS = {"APPLIANCE_GATEWAY__PORT": "18780", "APPLIANCE_KEYCLOAK__PORT": "18790",
         "APPLIANCE_KEYCLOAK__MANAGEMENT_PORT": "18791", "APPLIANCE_KEYCLOAK__POSTGRES_PORT": "18792"}


def timed(command: list[str], env: dict[str, str], stdin: str | None = None) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, input=stdin, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    with own_appliance("bk-", PORTS) as (home, env):
        cli(env, "up")
        demo = Home.from_env().demo_model
        adapter = random_adapter(demo, home.root.parent / "adapter")
        register(home, artifact_store(load_settings(home.settings_file).artifacts, home), adapter, name="bench",
                 base_model="demo", base_config_sha256=config_sha256(json.loads((demo / "config.json").read_text())),
                 dataset="none", dataset_sha256="-", hyperparameters=Hyperparameters(), metrics=metrics(),
                 state=AdapterState.REGISTERED)
        work = Path(tempfile.mkdtemp(prefix="bk-work-", dir="/tmp"))
        work.chmod(0o711)
        excludes = [f"--exclude=./{'/'.join(parts)}" for parts in LEFT_OUT] + ["--exclude=./keycloak/keycloak-*"]
        sealed, plain, restored, unpacked, sizes = [], [], [], [], {}
        try:
            for i in range(rounds):
                out = work / f"{i}.backup"
                sealed.append(timed([APPLIANCE, "backup", "create", "--out", str(out)],
                                    {**env, "APPLIANCE_BACKUP_PASSPHRASE": PASSPHRASE}))
                tar = work / f"{i}.tar"
                dump = work / f"{i}.dump"
                started = time.perf_counter()
                with postgres.reachable(home, load_settings(home.settings_file, env).keycloak) as pg_env:
                    timed([str(postgres.binaries() / "pg_dump"), "--format=custom", f"--file={dump}"], pg_env)
                timed(["tar", "-cf", str(tar), *excludes, "-C", str(home.root), "."], env)
                plain.append(time.perf_counter() - started)
                target = work / f"restored-{i}" / "h"
                restored.append(timed([APPLIANCE, "backup", "restore", str(out)],
                                      {**env, "APPLIANCE_HOME": str(target)}, stdin=PASSPHRASE + "\n"))
                (work / f"untarred-{i}").mkdir()
                unpacked.append(timed(["tar", "-xf", str(tar), "-C", str(work / f"untarred-{i}")], env))
                sizes = {"backup_bytes": out.stat().st_size, "plain_tar_and_dump_bytes":
                         tar.stat().st_size + dump.stat().st_size}
                shutil.rmtree(work / f"restored-{i}")
                shutil.rmtree(work / f"untarred-{i}")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    result = {
        "what": "appliance backup create/restore of the demo state (Keycloak on PostgreSQL, one adapter) against "
                "pg_dump + tar / untar of the same files, same run, taking turns",
        "rounds": rounds, "host_cpus": os.cpu_count(),
        "create_s": sealed, "plain_backup_s": plain, "restore_s": restored, "plain_unpack_s": unpacked,
        "create_median_s": statistics.median(sealed), "restore_median_s": statistics.median(restored),
        "create_ratio": statistics.median(sealed) / statistics.median(plain),
        "restore_ratio": statistics.median(restored) / statistics.median(unpacked), **sizes,
    }
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=1))


if __name__ == "__main__":
    main()
