"""Offline stand-in for pip's get-pip.py, which ansible-test downloads to bootstrap its venvs.

ansible-test fetches get-pip.py from a host that this CI cannot reach; the script's only job
is to put a given pip version into an empty virtualenv. Here ensurepip installs the pip that
ships with Python and that pip installs the requested pins from the package index.
"""

import ensurepip
import os
import subprocess
import sys

GET_PIP_ONLY = {"--no-setuptools", "--no-wheel"}

env = dict(os.environ)  # ensurepip sets PIP_CONFIG_FILE=/dev/null; the index config must apply
ensurepip.bootstrap(upgrade=True)
args = [arg for arg in sys.argv[1:] if arg not in GET_PIP_ONLY]
sys.exit(subprocess.call([sys.executable, "-m", "pip", "install", *args], env=env))
