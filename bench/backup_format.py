"""Backups as age files against the appliance's earlier envelope, same run, taking turns, on one
state (settings, a secret, a 90 KB queue file and a 64 MiB adapter; Keycloak external): sealing
the same archive (age with a passphrase, age with an X25519 identity, the earlier envelope), then
`verify` (read whole, checked) and `restore` of each. Times, ratios of medians against the earlier
envelope, and sizes go to bench/results/backup_format.json. Each passphrase seal or open includes
its scrypt derivation (age's: rage picks the work factor for about a second on the sealing host;
the earlier envelope: fixed 2^17).

    .venv/bin/python -m bench.backup_format [--rounds N] [--adapter-mib M]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pyrage

from appliance.home import Home
from appliance.settings import load_settings
from installer import backup, backup_age
from tests.support.legacy_backup import legacy_sealed

PASSPHRASE = b"a passphrase for the bench"
RESULTS = Path(__file__).parent / "results" / "backup_format.json"


def state(root: Path, adapter_mib: int) -> Home:
    home = Home(root / "h").ensure()
    home.settings_file.write_text('[keycloak]\nmode = "external"\nurl = "https://idp:8443"\n'
                                  'gateway_client_secret = "s3cret"\n')
    (home.secrets / "gateway-client-secret").write_text("generated\n")
    (home.root / "adapters" / "bench" / "v1").mkdir(parents=True)
    (home.root / "adapters" / "bench" / "v1" / "adapter_model.safetensors").write_bytes(os.urandom(adapter_mib << 20))
    (home.root / "queue.jsonl").write_bytes(b"{\"n\": 1}\n" * 10000)
    return home


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--adapter-mib", type=int, default=64)
    arguments = parser.parse_args()
    identity = str(pyrage.x25519.Identity.generate()).encode()
    work = Path(tempfile.mkdtemp(prefix="bk-format-", dir="/tmp"))
    try:
        home = state(work, arguments.adapter_mib)
        made = work / "made.backup"
        backup.create_file(load_settings(home.settings_file), home, made, identity)
        plain = pyrage.decrypt(made.read_bytes(), [pyrage.x25519.Identity.from_str(identity.decode())])
        kinds: dict[str, tuple[bytes, Callable[[], bytes]]] = {
            "earlier": (PASSPHRASE, lambda: legacy_sealed(plain, PASSPHRASE)),
            "age_passphrase": (PASSPHRASE, lambda: _age(plain, PASSPHRASE)),
            "age_identity": (identity, lambda: _age(plain, identity)),
        }
        times: dict[str, dict[str, list[float]]] = {kind: {"seal": [], "verify": [], "restore": []} for kind in kinds}
        sizes: dict[str, int] = {}
        for i in range(arguments.rounds):
            for kind, (key, seal) in kinds.items():  # taking turns, each round
                sizes[kind] = _round(seal, key, work / f"{kind}.backup", work / f"restored-{kind}-{i}", times[kind])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = {kind: {step: statistics.median(values) for step, values in steps.items()}
               for kind, steps in times.items()}
    result = {
        "what": "one state's archive (a 64 MiB adapter, settings, secrets, a queue file) sealed, verified and "
                "restored as an age file (passphrase; X25519 identity) and in the earlier envelope, same run, "
                "taking turns",
        "rounds": arguments.rounds, "adapter_mib": arguments.adapter_mib, "host_cpus": os.cpu_count(),
        "archive_bytes": len(plain), "sizes": sizes, "times_s": times, "median_s": medians,
        "ratio_to_earlier": {kind: {step: medians[kind][step] / medians["earlier"][step] for step in medians[kind]}
                             for kind in medians},
    }
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "times_s"}, indent=1))


def _round(seal: Callable[[], bytes], key: bytes, path: Path, target: Path, times: dict[str, list[float]]) -> int:
    """One seal, verify and restore of one kind; returns the sealed size."""
    started = time.perf_counter()
    sealed = seal()
    times["seal"].append(time.perf_counter() - started)
    path.write_bytes(sealed)
    with path.open("rb") as source:
        started = time.perf_counter()
        backup.read_backup(source, key, path.name, None)
        times["verify"].append(time.perf_counter() - started)
    with path.open("rb") as source:
        started = time.perf_counter()
        backup.restore(source, key, path.name, target)
        times["restore"].append(time.perf_counter() - started)
    shutil.rmtree(target)
    return len(sealed)


def _age(plain: bytes, key: bytes) -> bytes:
    out = io.BytesIO()
    writer = backup_age.AgeWriter(out, key)
    writer.write(plain)
    writer.close()
    return out.getvalue()


if __name__ == "__main__":
    main()
