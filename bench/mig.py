#!/usr/bin/env python3
"""MIG fragmentation benchmark; same as `fastshare bench mig` (see --help)."""

import sys

from fastshare.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "mig", *sys.argv[1:]]))
