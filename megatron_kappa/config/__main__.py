"""`python -m megatron_kappa.config --markdown` prints docs/config.md."""
import sys

from megatron_kappa.config.reference import markdown_reference

if sys.argv[1:] == ["--markdown"]:
    print(markdown_reference())
else:
    print("usage: python -m megatron_kappa.config --markdown", file=sys.stderr)
    sys.exit(2)
