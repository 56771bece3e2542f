"""GRPO reference app: a real RL job on Ray that forge_ckpt resumes bit for bit (see README)."""
