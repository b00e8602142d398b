"""HELM model zoo: fully hyperbolic (Lorentz) LLMs for Hugging Face ``transformers``.

Importing ``helm`` registers ``helm_d`` and ``helm_mice`` with ``AutoConfig`` / ``AutoModel`` /
``AutoModelForCausalLM``; ``helm.load_config(name)`` returns a preset's config.
"""

import warnings

# geoopt's torch.jit DeprecationWarnings are emitted once, when it is first imported: silenced there, and the
# process's warning filters are left as they were
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import geoopt  # noqa: F401

from . import manifold, models  # noqa: E402
from .presets import available_presets, load_config  # noqa: E402
from .convert import convert_official_checkpoint  # noqa: E402

__version__ = "0.1.0"
__all__ = ["manifold", "models", "available_presets", "convert_official_checkpoint", "load_config", "__version__"]
