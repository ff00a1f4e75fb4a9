"""LoRA/QLoRA post-training (issue 7)."""
