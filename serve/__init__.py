"""Serving: the engine launcher (vLLM arguments from settings), the authenticated gateway
(serve.gateway.create_app), the cluster and the batch worker. Nothing is imported here: an engine
rank, the cluster agent and the batch worker each load only what they run, not the gateway."""
