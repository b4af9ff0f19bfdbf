"""Part III: agents and reinforcement learning."""
