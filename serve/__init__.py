"""Serving: the engine launcher (vLLM arguments from settings) and the authenticated gateway."""

from serve.engine import EngineLaunch, build_launch, engine_programs
from serve.gateway import create_app
from serve.programs import serve_programs

__all__ = ["EngineLaunch", "build_launch", "create_app", "engine_programs", "serve_programs"]
