"""What several test files share: references written from their definitions, helpers that launch
and read runs, shared settings, and the worker scripts the tests start as processes (each run as
`python tests/support/<name>_worker.py`, under torchrun or DeepSpeed's launcher, with the
repository root on sys.path). Imported as `tests.support.<module>`; no test file imports another
(tests/test_tests_apart.py)."""
