"""The engine tests' subfolders mirror the package (kernels/, fp8/, speculative/, serving/); their modules
import the shared helpers of this folder (``engine_test_utils``) by name, so this folder is put on the path."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
