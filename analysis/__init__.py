"""`python -m analysis.kappa_range` and the scripts here, run from the checkout: the analyses are
megatron_kappa/analysis/. A package, not an installed one, so that `python -m analysis.<name>` run
here finds this folder before any other `analysis` on the path."""
