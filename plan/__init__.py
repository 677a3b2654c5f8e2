"""`python -m plan` and `python -m plan.tables` from the checkout: the memory planner is
megatron_kappa/plan/ (docs/plan.md). A package, not an installed one, so that `python -m plan`
run here finds this folder before any other `plan` on the path."""
