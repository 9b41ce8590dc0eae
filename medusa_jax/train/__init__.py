"""Training: chat data and loss masks (data), self-distillation (distill), losses, trainer."""
