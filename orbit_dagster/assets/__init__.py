"""Software-defined assets: training runs, checkpoints, evaluations, best checkpoint, cost."""
