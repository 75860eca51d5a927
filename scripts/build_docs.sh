#!/usr/bin/env bash
# Build the documentation site into site/ with every MkDocs warning an error.
# Needs the docs extra: pip install -e ".[docs]". Then `mkdocs serve` serves it locally, and
# `python scripts/check_site.py` checks the built pages in headless Chromium.
set -euo pipefail
cd "$(dirname "$0")/.."
python scripts/gen_api_docs.py --check
NO_MKDOCS_2_WARNING=1 mkdocs build --strict "$@"
