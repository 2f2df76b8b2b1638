"""Graph: DeepSeek-V4.1-Flash in PyTorch, the single source of truth."""
