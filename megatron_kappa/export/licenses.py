"""The Hugging Face Hub's licence identifiers: the values a model card's `license:` may take.

Copied from the Hub's documented list (huggingface/hub-docs, docs/hub/repositories-licenses.md, the
"region licenses" table, as of 2026-08-22): the Hub files a card with any other value under no
licence it knows. `other` is the Hub's own way to say "a licence of its own" (with `license_name`
and a LICENSE file), and stays the export's default: nothing was chosen.
"""
from __future__ import annotations

import difflib

from megatron_kappa.config import ConfigError

HUB_LICENSES = (
    "apache-2.0", "mit", "openrail", "bigscience-openrail-m", "creativeml-openrail-m", "bigscience-bloom-rail-1.0",
    "bigcode-openrail-m", "afl-3.0", "artistic-2.0", "bsl-1.0", "bsd", "bsd-2-clause", "bsd-3-clause",
    "bsd-3-clause-clear", "c-uda", "cc", "cc0-1.0", "cc-by-2.0", "cc-by-2.5", "cc-by-3.0", "cc-by-4.0", "cc-by-sa-3.0",
    "cc-by-sa-4.0", "cc-by-nc-2.0", "cc-by-nc-3.0", "cc-by-nc-4.0", "cc-by-nd-4.0", "cc-by-nc-nd-3.0",
    "cc-by-nc-nd-4.0", "cc-by-nc-sa-2.0", "cc-by-nc-sa-3.0", "cc-by-nc-sa-4.0", "cdla-sharing-1.0",
    "cdla-permissive-1.0", "cdla-permissive-2.0", "wtfpl", "ecl-2.0", "epl-1.0", "epl-2.0", "etalab-2.0", "eupl-1.1",
    "eupl-1.2", "agpl-3.0", "gfdl", "gpl", "gpl-2.0", "gpl-3.0", "lgpl", "lgpl-2.1", "lgpl-3.0", "isc", "h-research",
    "intel-research", "lppl-1.3c", "ms-pl", "apple-ascl", "apple-amlr", "mpl-2.0", "odc-by", "odbl", "openmdw-1.0",
    "openmdw-1.1", "openrail++", "osl-3.0", "postgresql", "ofl-1.1", "ncsa", "unlicense", "zlib", "pddl", "lgpl-lr",
    "deepfloyd-if-license", "fair-noncommercial-research-license", "llama2", "llama3", "llama3.1", "llama3.2",
    "llama3.3", "llama4", "grok2-community", "gemma", "unknown", "other",
)
HUB_LIST = "https://huggingface.co/docs/hub/repositories-licenses"


def check_license(license: str) -> str:
    """`license` if the Hub knows it; else a one-line ConfigError with the nearest identifiers."""
    if license in HUB_LICENSES:
        return license
    near = difflib.get_close_matches(license.lower().replace(" ", "-"), HUB_LICENSES, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(n) for n in near)}? " if near else ""
    raise ConfigError(f"--license: {license!r} is not a Hugging Face Hub licence identifier ({hint}the list: "
                      f"{HUB_LIST}; other for a licence of its own)")
