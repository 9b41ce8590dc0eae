"""Training: the configuration (`config`), chat data and loss masks (`data`), the training sequences
(`examples`), self-distillation (`distill`), the hidden-state cache (`hidden`), losses, steps, the
optimizer (`optim`), the trainer and its checkpoints."""
from medusa_jax.train.config import TrainConfig, TrainConfigError
from medusa_jax.train.trainer import ResumeConflictError, TrainResult, train

__all__ = ["ResumeConflictError", "TrainConfig", "TrainConfigError", "TrainResult", "train"]
