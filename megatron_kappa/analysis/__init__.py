"""Analyses of finished runs: figures (plots.py, drawn on the axes of figure_axes.py) and a study's table (study_table.py)."""
