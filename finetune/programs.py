"""The supervised programs finetune contributes: the training worker and the RL worker.

Only their specs, so that `appliance up` starts supervisord without importing the trainers.
"""

from __future__ import annotations

from appliance.home import Home
from appliance.programs import Program, python_module_program
from appliance.settings import Settings


def worker_programs(settings: Settings, home: Home) -> list[Program]:
    """The `appliance.programs` entry point: one training worker and one RL worker, after the
    engines and the gateway; neither serves a request, so both yield the cores while `up` runs."""
    nice = settings.engine.yield_nice
    return [python_module_program("finetune-worker", "finetune.worker", home, priority=95, start_nice=nice),
            python_module_program("rl-worker", "finetune.rl.worker", home, priority=96, start_nice=nice)]
