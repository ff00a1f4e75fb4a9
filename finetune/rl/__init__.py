"""Post-training from execution feedback (issue 20): the execution sandbox so far."""
