"""HELM-D configuration: Llama field names; HELM-specific fields after them (see :class:`HelmConfigBase`)."""

from __future__ import annotations

from ..configuration_common import HelmConfigBase


class HelmDConfig(HelmConfigBase):
    r"""Configuration of a dense HELM model (hyperbolic self-attention + hyperbolic SwiGLU, paper §4).

    Fields are those of :class:`helm.models.configuration_common.HelmConfigBase` (Llama's names, then the
    HELM-specific ones documented there); ``head_dim`` defaults to ``1 + (hidden_size - 1) / num_heads``, derived
    again from the current fields when None is assigned after construction.

    ```python
    >>> import helm
    >>> config = helm.load_config("helm-d-115m")          # or HelmDConfig(hidden_size=..., ...)
    >>> config.k, config.residual_space_scale            # derived: -1/curvature, 4·sqrt(389)
    ```
    """

    model_type = "helm_d"


__all__ = ["HelmDConfig"]
