"""Single-process training: trainer, optimizer and schedule, evaluation, run directories."""
