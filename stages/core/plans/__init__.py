"""The plans: memory per GPU and the cost of a run on a cluster, from the config alone (no torch).

May import any subpackage below it. (tests/test_layers.py checks the order.)
"""
