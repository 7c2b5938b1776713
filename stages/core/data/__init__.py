"""The problems: one record type for every dataset, and the adapters that read each benchmark's own
format into it.

May import stages.core.common. (tests/test_layers.py checks the order.)
"""
