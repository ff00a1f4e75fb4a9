"""LoRA/QLoRA post-training and the RL loop rewarded by sandboxed code execution (finetune.rl)."""
