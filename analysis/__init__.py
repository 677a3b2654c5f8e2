"""Analyses of finished runs: figures (plots.py) and a study's table (study_table.py)."""
