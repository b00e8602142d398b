"""HELM model zoo: fully hyperbolic (Lorentz) LLMs for Hugging Face ``transformers``."""

import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"geoopt(\..*)?")

from . import manifold, models  # noqa: E402
from .presets import available_presets, load_config  # noqa: E402

__version__ = "0.1.0"
