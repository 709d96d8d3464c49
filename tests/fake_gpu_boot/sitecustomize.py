"""Python imports this at start where this folder is on PYTHONPATH: with FAKE_GPU set, the process
runs on tests/fake_gpu.py's faked GPU (the fake_gpu fixture exports both for the processes a test starts)."""

import os
import sys

if os.environ.get("FAKE_GPU"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
    import fake_gpu

    fake_gpu.install_from_env()
