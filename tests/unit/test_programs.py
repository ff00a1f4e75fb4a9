"""What `appliance up` hands supervisord: every package's program specs, found quickly."""

import json
import os
import subprocess
import sys
from pathlib import Path

from appliance.home import HOME_ENV, Home
from appliance.programs import discover_programs
from appliance.settings import load_settings

EXTERNAL_KEYCLOAK = {"APPLIANCE_KEYCLOAK__MODE": "external", "APPLIANCE_KEYCLOAK__URL": "https://idp.corp:8443/",
                     "APPLIANCE_KEYCLOAK__REALM": "llm", "APPLIANCE_KEYCLOAK__GATEWAY_CLIENT_SECRET": "s"}
# Modules a program runs, not what declares it: importing them before supervisord starts would
# delay every program, the engines included (about a second of CPU on two cores).
PROGRAM_BODIES = ("serve.gateway", "serve.batch_worker", "serve.cluster", "finetune.worker", "finetune.rl.worker",
                  "finetune.runner", "installer.backup", "installer.backup_schedule", "torch", "fastapi")


def test_what_serves_starts_at_normal_priority_and_the_rest_yields_the_cores(home: Home) -> None:
    settings = load_settings(home.settings_file, environ={**EXTERNAL_KEYCLOAK, "APPLIANCE_BACKUP__EVERY_HOURS": "24",
                                                           "APPLIANCE_BACKUP__KEY_FILE": str(home.root / "k")})
    nice = {p.name: p.start_nice for p in discover_programs(settings, home)}
    assert nice["vllm-main"] == nice["gateway"] == 0
    background = {"prometheus", "alertmanager", "finetune-worker", "rl-worker", "batch-worker", "backup-scheduler",
                  "watchdog"}
    assert {name for name, n in nice.items() if n} == background
    assert {nice[name] for name in background} == {settings.engine.yield_nice}


def test_the_program_specs_import_none_of_the_programs(home: Home) -> None:
    code = ("import json, sys; from appliance.home import Home; from appliance.settings import load_settings; "
            "from appliance.programs import discover_programs; home = Home.from_env(); "
            "names = [p.name for p in discover_programs(load_settings(home.settings_file), home)]; "
            "print(json.dumps([names, sorted(sys.modules)]))")
    env = {**os.environ, HOME_ENV: str(home.root), **EXTERNAL_KEYCLOAK}
    names, modules = json.loads(subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True,
                                               text=True, check=True, cwd=Path(home.root)).stdout)
    assert {"vllm-main", "gateway", "batch-worker", "finetune-worker", "rl-worker"} <= set(names)
    assert not set(PROGRAM_BODIES) & set(modules)
