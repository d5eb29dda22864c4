"""`kernelpilot train`: task synthesis, rollouts, RFT, critic and RL on existing engines (TRL; verl on clusters).

The trainer is a caller of the harness like any other: rewards come from `Judge`, trajectories from the agent's
session transcripts. Training engines are imported lazily, so the rest of kernelpilot works without them.
"""
