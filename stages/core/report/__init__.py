"""The report: reported numbers from the papers, Markdown/LaTeX/HTML rendering, plots and figures.

May import stages.core.common, data, reward, models, statistics and training. (tests/test_layers.py
checks the order.)
"""
