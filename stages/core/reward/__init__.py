"""Grading and rewards: a grader turns a response and a reference answer into a Grade; a reward
(dapo_math, ...) turns a Grade into the number RL trains on.

May import stages.core.common. (tests/test_layers.py checks the order.)
"""
