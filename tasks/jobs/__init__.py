"""Runners: what opens stores, loads models and then runs a covgrad engine (the scores job, the regime fold, the
rank runners, the rollout import, the trajectory's step source). Stage modules call them; nothing here imports prefect.
"""
