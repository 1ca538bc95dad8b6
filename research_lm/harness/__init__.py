"""The experiment harness: the CLI's tasks and checks, workloads, loggers, reports, reproduction and training."""
