"""The memory planner: one rank's training step simulated under fake tensors (`step`) and the
search for the longest sequence each strategy fits on given GPUs (`plan`, `upipe plan`).

It sits above the training stack (it runs `upipe.train.Trainer`), which sits above the
measurement tools it shares with the planner (`upipe.memory`).
"""
