"""Serving: the engine launcher (vLLM arguments from settings); the gateway comes next."""

from serve.engine import EngineLaunch, build_launch, engine_programs, model_dir

__all__ = ["EngineLaunch", "build_launch", "engine_programs", "model_dir"]
