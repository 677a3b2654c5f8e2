"""The benchmarks (docs/benchmarks.md), run from the checkout as `python bench/<name>.py` or
`python -m bench.<name>`; what they share is megatron_kappa/bench/. A package, not an installed
one, so that `python -m bench.<name>` run here finds this folder before any other `bench`."""
