"""Per-key centres of the values for the Lorentz normalisation: the functions of ``helm.ops.attention``, which
the eager and sdpa paths use.

The normaliser of ``S = Σ_j ν_j v_j`` is evaluated in the pairwise form ``N = k + (E - <D, D>_L)`` with
``D = Σ_j ν_j (v_j - c_j)`` and ``E = Σ_j ν_j <v_j - c_j, v_j - c_j>_L`` (see ``kernels/README.md``). Its value does
not depend on the centres ``c_j`` as long as every key a row attends to has the same centre; only its rounding
does. Keys are therefore grouped by document (segment id) and padding, so packed documents stay bit-for-bit
independent, and each group gets ``c = β m``: ``m`` its mean value, ``σ²`` the mean squared Euclidean distance to
``m`` and ``β = max(0, 1 - 100 σ²/|m|²)``. Values spread around the origin (``σ ≥ |m|/10``) get ``c = 0``:
their ``e_j = <v_j, v_j>_L ≈ -k`` are small and exact, where any other centre makes ``e_j`` (and the backward's
``δ = dD·D + dE E``) far larger than ``N``. Values clustered far from it get ``c ≈ m`` (the centred values are small, and so is the fp32
error of their weighted sum). Sorting and segmented scans only: deterministic, no host synchronisation.
"""

from __future__ import annotations

# One implementation for every attention path: the kernels centre the values exactly as eager and sdpa do, so
# their outputs can be compared bit for bit on the centring and a change to the rule cannot leave one path behind.
from helm.ops.attention import _key_groups as key_groups, _value_centres as value_centres

__all__ = ["key_groups", "value_centres"]
