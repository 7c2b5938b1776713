"""The library's ground floor: artifact I/O and its errors, progress bars, method and answer names,
pass@k.

Imports nothing else from stages. (tests/test_layers.py checks the order.)
"""
