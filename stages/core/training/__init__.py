"""The trainer's pieces: rollouts and their advantages, token selectors, policy losses, the actor
step, SFT, resume states and live metrics.

May import every subpackage below it: common, data, reward, models, statistics.
(tests/test_layers.py checks the order.)
"""
