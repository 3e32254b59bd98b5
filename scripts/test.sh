#!/usr/bin/env bash
# Set up (if needed) and run the test suite; extra arguments go to pytest.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec python -m pytest -q "$@"
