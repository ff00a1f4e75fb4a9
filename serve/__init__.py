"""Serving: the engine launcher (vLLM arguments from settings), the authenticated gateway, the
cluster and the batch worker.

Its public names are imported when first used (appliance.lazy): an engine rank, the cluster agent
and the batch worker each load only what they run, never the gateway."""

from appliance.lazy import lazy_exports

_HOMES = {"EngineLaunch": "serve.engine", "build_launch": "serve.engine", "engine_programs": "serve.engine",
          "create_app": "serve.gateway", "serve_programs": "serve.programs"}
__all__ = sorted(_HOMES)
__getattr__ = lazy_exports(__name__, _HOMES)
