"""Post-training from execution feedback: task sets, the execution sandbox, the RL loop, its exports."""
