#!/usr/bin/env python3
"""Placement quality and speed benchmark; same as `fastshare bench placement` (see --help)."""

import sys

from fastshare.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "placement", *sys.argv[1:]]))
