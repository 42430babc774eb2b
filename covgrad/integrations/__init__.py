"""Integrations with training stacks (optional extras): ``covgrad.integrations.trl``."""
