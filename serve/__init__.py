"""Serving: the engine launcher (vLLM arguments from settings); the gateway comes next."""

from serve.engine import EngineLaunch, build_launch, engine_programs, model_dir
from serve.gateway import create_app

__all__ = ["EngineLaunch", "build_launch", "create_app", "engine_programs", "model_dir"]
