"""Hyperparameter studies of training runs (``oakemu tune``, ``oakemu_core.tune``) on Optuna.

``search_space`` reads a study's search space (TOML) and holds the default ones (rl-baselines3-zoo's PPO
ranges, ``spaces/``); ``study`` opens a study's storage (SQLite by default, any SQLAlchemy database
shared by several machines), defines a trial's objective (a training run, pruned by its evaluations) and
the loop each worker runs; ``outputs`` writes what a study leaves in its folder. The processes (the
``--jobs`` workers, the command) are :mod:`oakemu_services.tune`'s. ``search_space`` imports no Optuna;
``study`` and ``outputs`` need the ``tune`` extra.
"""
