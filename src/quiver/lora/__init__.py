"""LoRA adapters: PEFT adapter folders, attach points in ONNX graphs (issue 3, in progress)."""
