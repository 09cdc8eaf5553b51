"""Model-side code: the pi0.5 network and its input/output processing."""
