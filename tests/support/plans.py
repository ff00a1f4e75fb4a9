"""Plans for tests: made by the planner in-process, or written by the real `appliance plan --json`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from appliance.records import Plan
from installer.hardware import parse_hardware_spec
from installer.model_config import load_model_config
from installer.planner import Pins, plan
from tests.support.appliances import APPLIANCE
from tests.support.models import MODEL_CONFIGS


def plan_for(model_dir: Path, hardware: str, **pins: Any) -> Plan:
    """The plan for the checkpoint in `model_dir` on `hardware`, a small context, with `pins`."""
    return plan(load_model_config(model_dir), parse_hardware_spec(hardware), context=64, concurrency=1,
                pins=Pins(**pins), model_ref=str(model_dir))


def plan_file(home: Path, model: str, hardware: str, *extra: str) -> Path:
    """A plan record written by the real `appliance plan --json`, for an appliance whose state dir is `home`."""
    result = subprocess.run([APPLIANCE, "plan", str(MODEL_CONFIGS / f"{model}.json"), "--hardware", hardware,
                             "--json", *extra], capture_output=True, text=True,
                            env={**os.environ, "APPLIANCE_HOME": str(home)})
    path = home / f"{model}-{hardware}.json"
    path.write_text(result.stdout)
    return path
