#!/usr/bin/env bash
# `make demo`: the main job on simulated GPUs, no cluster needed. Grows with the project.
set -euo pipefail
fastshare --version
fastshare --help
