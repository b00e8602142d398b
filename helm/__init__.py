"""HELM model zoo: fully hyperbolic (Lorentz) LLMs for Hugging Face ``transformers``.

Importing ``helm`` registers ``helm_d`` and ``helm_mice`` with ``AutoConfig`` / ``AutoModel`` /
``AutoModelForCausalLM``; ``helm.load_config(name)`` returns a preset's config.
"""

import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"geoopt(\..*)?")

from . import manifold, models  # noqa: E402
from .presets import available_presets, load_config  # noqa: E402
from .convert import convert_official_checkpoint  # noqa: E402

__version__ = "0.1.0"
__all__ = ["manifold", "models", "available_presets", "convert_official_checkpoint", "load_config", "__version__"]
