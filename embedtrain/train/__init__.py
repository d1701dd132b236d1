"""Training: the task-agnostic Trainer loop, tasks, optimizers, checkpoints, process groups."""
