#!/usr/bin/env bash
# Set up (if needed) and run the built-in demo; extra arguments go to `klppo demo`.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec klppo demo "$@"
