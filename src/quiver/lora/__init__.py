"""LoRA adapters: PEFT adapter folders, attach points, the max-rank LoRA graph and the prepare flow."""
