"""Official HELM checkpoints (Graph-and-Geometric-Learning/helm, ``torch.save`` of the model's ``state_dict``)
converted to this zoo's models, computing the same function.

The official code differs from the paper in a few places (FIDELITY.md); the converted config selects the
official behaviour through the switches that exist for it: ``head_merge="flatten"``, ``final_proj=True``, a
residual space scale of ``4·sqrt(width)`` (dense) / ``sqrt(width)`` (MiCE) with ``width`` the ambient width,
and for MiCE ``scoring_func="softmax"``, ``norm_topk_prob=False``, ``expert_combine="lresnet_official"``.
Parameter maps (official → ours):

* attention ``scale`` / ``softmax_scale`` (scores ``-d²/scale``) → ``log_tau = log(scale)``;
* residual ``w_y`` (used raw) → ``raw_weight = softplus⁻¹(w_y)``;
* MiCE expert ``expert_manifold.k`` → ``log_k``; ``wkv_a`` rows → ``kv_a_proj`` (latent) + ``k_rope_proj``;
* every linear, norm gain, embedding table and head is copied as is.

Dropped: the curvature aliases (``*.c``, ``*.manifold*.k``, which must all equal the model curvature or the
expert's), ``attn_mask`` / ``freqs_complex`` (recomputed), the Lorentz token tables' ``token_embed.add_pos`` /
``embed.add_pos`` (built but never called) and the attention score ``bias`` (one constant per row: it cancels in
the softmax). A checkpoint with any other key, or a value the zoo cannot represent (``scale <= 0``, ``w_y <= 0``),
is refused with the key named; official settings the zoo cannot represent are refused naming the official flag
(:func:`convert_official_checkpoint`).
"""

from __future__ import annotations

import math
import os
import re
from typing import Mapping, Optional, Union

import torch

MODELS = ("helm_d", "helm_mice")
_ALIAS = re.compile(r"(^|\.)(c|manifold(_in|_hidden|_out)?\.(k|c)|expert_manifold\.c)$")


def _read(path_or_state_dict) -> tuple[dict, Optional[dict]]:
    """``(state_dict, args)``: the tensors in fp64 (integers as they are) and the official argparse fields stored
    beside them under ``"args"`` (None when the file holds none)."""
    source, shape = "the state dict given", "a dict of parameter names to tensors, bare or under 'state_dict' / 'model'"

    def kind(value) -> str:
        name = type(value).__name__
        return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"

    if isinstance(path_or_state_dict, Mapping):
        state = dict(path_or_state_dict)
    else:
        path = os.path.expanduser(os.fspath(path_or_state_dict))
        if os.path.isdir(path):
            raise IsADirectoryError(_folder_message(path))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"official checkpoint {path!r} does not exist")
        try:  # never unpickle arbitrary objects
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:
            raise ValueError(f"cannot read the official checkpoint {path!r} as tensors ({type(error).__name__}: "
                             f"{error})") from None
        source = f"the official checkpoint {path!r}"
        if not isinstance(state, Mapping):  # torch.save of a list, a tensor, a number: no parameter names
            raise ValueError(f"{source} holds {kind(state)}, not a state dict ({shape})")
    args = dict(state["args"]) if isinstance(state.get("args"), Mapping) else None
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(state.get(key), Mapping):
            state = dict(state[key])
    if other := next(((k, v) for k, v in state.items() if not isinstance(v, torch.Tensor)), None):
        raise ValueError(f"{source} is not a state dict of tensors: its entry {other[0]!r} is {kind(other[1])} "
                         f"({shape})")
    # DistributedDataParallel and torch.compile prefixes
    return {re.sub(r"^(module\.|_orig_mod\.)+", "", k): v.detach().to(torch.float64) if v.is_floating_point() else v
            for k, v in state.items()}, args


def _folder_message(path: str) -> str:
    """Why a folder is not an official checkpoint, naming the file to pass when the folder holds exactly one
    ``torch.save`` file (``.pt`` / ``.pth``), and ``from_pretrained`` when it is already a converted model."""
    saved = sorted(name for name in os.listdir(path)
                   if name.endswith((".pt", ".pth")) and os.path.isfile(os.path.join(path, name)))
    message = (f"official checkpoint {path!r} is a folder; convert_official_checkpoint takes the official "
               f".pt/.pth file (torch.save) or a state dict")
    if len(saved) == 1:
        return f"{message}: pass {os.path.join(path, saved[0])!r}"
    if saved:
        return f"{message}: the folder holds {len(saved)} such files ({', '.join(saved[:4])}" + (
            ", ...)" if len(saved) > 4 else ")")
    if os.path.isfile(os.path.join(path, "config.json")):
        return f"{message}; it holds a config.json, so it may already be a model folder: load it with from_pretrained"
    return message


def _positive_log(value: torch.Tensor, key: str, what: str) -> torch.Tensor:
    if not bool((value > 0).all()):
        raise ValueError(f"{key} = {value.flatten().tolist()} must be positive: the zoo stores {what}")
    return value.log().reshape(1)  # the zoo's scalars are [1]-shaped (FSDP2 shards dim 0)


def _inverse_softplus(value: torch.Tensor, key: str) -> torch.Tensor:
    if not bool((value > 0).all()):
        raise ValueError(f"{key} = {value.item():g}: the official residual weight must be positive to convert "
                         "(the zoo keeps residual weights positive, w = softplus(raw_weight))")
    return torch.log(torch.expm1(value)).reshape(1)


def _curvature(state: dict) -> float:
    """The model curvature parameter ``k`` (geoopt's; the official code's ``c``), checked on every alias."""
    k = state.get("manifold_hidden.k")
    if k is None:
        raise ValueError("the checkpoint has no manifold_hidden.k: not an official HELM state_dict")
    for key in ("manifold_in.k", "manifold_out.k"):
        if key in state and not torch.allclose(state[key], k):
            raise ValueError(f"{key} = {state[key].item():g} differs from manifold_hidden.k = {k.item():g}: models "
                             "with several curvatures are not supported")
    return float(k)


def _linear(out: dict, ours: str, state: dict, theirs: str, used: set, rows: Optional[slice] = None) -> None:
    for part in ("weight", "bias"):
        if f"{theirs}.{part}" in state:
            value = state[f"{theirs}.{part}"]
            out[f"{ours}.{part}"] = value if rows is None else value[rows]
            used.add(f"{theirs}.{part}")


def _layer_scalars(out: dict, state: dict, used: set, o: str, p: str, scale: str, residuals: tuple) -> None:
    """A layer's temperature (official ``scale``, scores ``-d²/scale``; the score bias is dropped) and its two
    residual weights (``(official, ours)`` names), from official prefix ``o`` to our prefix ``p``."""
    out[p + "self_attn.log_tau"] = _positive_log(state[o + scale], o + scale, "the temperature as log_tau")
    used |= {o + scale, o + "attn.bias"}
    for theirs, ours in zip(residuals, ("attn_residual", "mlp_residual")):
        out[p + ours + ".raw_weight"] = _inverse_softplus(state[o + theirs + ".w_y"], o + theirs + ".w_y")
        used.add(o + theirs + ".w_y")


def _helm_d(state: dict, used: set) -> tuple[dict, dict]:
    width = state["token_embed.embedding"].shape[1]
    layers = 1 + max(int(m.group(1)) for key in state if (m := re.match(r"resblocks\.(\d+)\.", key)))
    heads = width - state["resblocks.0.attn.Wq.weight"].shape[0]  # Wq: [H·(W/H - 1), W]
    config = dict(vocab_size=state["mapping.weight"].shape[0], hidden_size=width, num_hidden_layers=layers,
                  num_attention_heads=heads, head_dim=width // heads,
                  intermediate_size=state["resblocks.0.mlp.w1.linear.weight"].shape[0] + 1,
                  embedding_mode="lorentz", residual_space_scale_factor=4 * math.sqrt(width / (width - 1)))
    if "attn_mask" in state:
        config["max_position_embeddings"] = state["attn_mask"].shape[-1]
    out = {"model.embed_tokens.weight": state["token_embed.embedding"], "model.norm.weight": state["ln_final.weight"],
           "lm_head.weight": state["mapping.weight"]}
    used |= {"token_embed.embedding", "ln_final.weight", "mapping.weight", "attn_mask", "freqs_complex"}
    used |= {key for key in state if key.startswith("token_embed.add_pos.")}
    _linear(out, "model.final_proj.linear", state, "final_proj.linear", used)
    for i in range(layers):
        o, p = f"resblocks.{i}.", f"model.layers.{i}."
        for theirs, ours in (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")):
            out[p + ours + ".weight"] = state[o + theirs + ".weight"]
            used.add(o + theirs + ".weight")
        for theirs, ours in (("Wq", "q_proj"), ("Wk", "k_proj"), ("Wv", "v_proj"), ("final_linear", "o_proj")):
            _linear(out, p + f"self_attn.{ours}", state, o + f"attn.{theirs}", used)
        _layer_scalars(out, state, used, o, p, "attn.scale", ("res1", "res2"))
        for theirs, ours in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            _linear(out, p + f"mlp.{ours}", state, o + f"mlp.{theirs}.linear", used)
    return config, out


def _helm_mice(state: dict, used: set) -> tuple[dict, dict]:
    from .nn.mice import LOG_K_RANGE  # where log_k is stored as is (bounded_log_k is the identity there)

    # the token table: official project_emb=True (space parts, embed.weight) or the default False (points)
    lorentz = "embed.embedding" in state
    table = state["embed.embedding" if lorentz else "embed.weight"]
    width = table.shape[1] + (0 if lorentz else 1)
    layers = 1 + max(int(m.group(1)) for key in state if (m := re.match(r"layers\.(\d+)\.", key)))
    dense = [i for i in range(layers) if f"layers.{i}.ffn.w1.linear.weight" in state]
    if dense != list(range(len(dense))):
        raise ValueError(f"dense layers {dense} must come first (first_k_dense_replace)")
    _refuse_unrepresentable_mice(state, layers, dense)
    latent = state["layers.0.attn.kv_norm.weight"].shape[0]  # space dims of c_KV
    rope = state["layers.0.attn.wkv_a.linear.weight"].shape[0] - latent + 1
    config = dict(vocab_size=state["head.weight"].shape[0], hidden_size=width, num_hidden_layers=layers,
                  first_k_dense_replace=len(dense), kv_lora_rank=latent + 1, qk_rope_head_dim=rope,
                  embedding_mode="lorentz" if lorentz else "space",
                  residual_space_scale_factor=math.sqrt(width / (width - 1)),
                  scoring_func="softmax", norm_topk_prob=False, expert_combine="lresnet_official")
    if dense:
        config["intermediate_size"] = state[f"layers.{dense[0]}.ffn.w1.linear.weight"].shape[0] + 1
    if "attn_mask" in state:
        config["max_position_embeddings"] = state["attn_mask"].shape[-1]
    out = {"model.embed_tokens.weight": table, "model.norm.weight": state["norm.weight"],
           "lm_head.weight": state["head.weight"]}
    used |= {"embed.weight", "embed.embedding", "norm.weight", "head.weight", "attn_mask"}
    used |= {key for key in state if key.startswith("embed.add_pos.")}  # built, never called (as in HELM-D)
    _linear(out, "model.final_proj.linear", state, "final_proj.linear", used)
    for i in range(layers):
        o, p = f"layers.{i}.", f"model.layers.{i}."
        for theirs, ours in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                             ("attn.kv_norm", "self_attn.kv_a_layernorm")):
            out[p + ours + ".weight"] = state[o + theirs + ".weight"]
            used.add(o + theirs + ".weight")
        _linear(out, p + "self_attn.q_proj", state, o + "attn.wq.linear", used)
        _linear(out, p + "self_attn.kv_a_proj", state, o + "attn.wkv_a.linear", used, slice(0, latent))
        _linear(out, p + "self_attn.k_rope_proj", state, o + "attn.wkv_a.linear", used, slice(latent, None))
        _linear(out, p + "self_attn.kv_b_proj", state, o + "attn.wkv_b.linear", used)
        _linear(out, p + "self_attn.o_proj", state, o + "attn.wo.linear", used)
        _layer_scalars(out, state, used, o, p, "attn.softmax_scale", ("attn_res", "ffn_res"))
        swiglu = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
        if i in dense:
            for theirs, ours in swiglu:
                _linear(out, p + f"mlp.{ours}", state, o + f"ffn.{theirs}.linear", used)
            continue
        out[p + "mlp.gate.weight"] = state[o + "ffn.gate.weight"]
        out[p + "mlp.e_score_correction_bias"] = state.get(o + "ffn.gate.bias",
                                                           torch.zeros(state[o + "ffn.gate.weight"].shape[0]))
        used |= {o + "ffn.gate.weight", o + "ffn.gate.bias"}
        experts = sorted({int(m.group(1)) for key in state if (m := re.match(rf"{o}ffn\.experts\.(\d+)\.", key))})
        curvatures = []
        for j in experts:
            e = f"{o}ffn.experts.{j}."
            k_j = state[e + "expert_manifold.k"]
            log_k = _positive_log(k_j, e + "expert_manifold.k", "expert curvatures as log_k")
            if not LOG_K_RANGE[0] <= float(log_k) <= LOG_K_RANGE[1]:
                raise ValueError(f"{e}expert_manifold.k = {float(k_j):g} lies outside the zoo's expert curvature "
                                 f"range k in [{math.exp(LOG_K_RANGE[0]):g}, {math.exp(LOG_K_RANGE[1]):g}]")
            out[p + f"mlp.experts.{j}.log_k"] = log_k
            curvatures.append(-1.0 / float(k_j))
            used.add(e + "expert_manifold.k")
            for theirs, ours in swiglu:
                _linear(out, p + f"mlp.experts.{j}.mlp.{ours}", state, e + f"{theirs}.linear", used)
        for theirs, ours in swiglu:
            _linear(out, p + f"mlp.shared_experts.0.{ours}", state, o + f"ffn.shared_experts.{theirs}.linear",
                    used)
        out[p + "mlp.add_experts_weight"] = state[o + "ffn.add_experts.w_y"].reshape(1)
        out[p + "mlp.add_experts_log_scale"] = state[o + "ffn.add_experts.scale"].reshape(1)
        used |= {o + "ffn.add_experts.w_y", o + "ffn.add_experts.scale"}
        config.setdefault("routed_curvatures", curvatures)
        config.setdefault("n_routed_experts", len(experts))
        config.setdefault("moe_intermediate_size", state[f"{o}ffn.experts.{experts[0]}.w1.linear.weight"].shape[0] + 1)
    wq = state["layers.0.attn.wq.linear.weight"].shape[0]        # H · (d_n + d_r) space rows
    wkv_b = state["layers.0.attn.wkv_b.linear.weight"].shape[0]  # H · (d_n + d_v)
    wo_in = state["layers.0.attn.wo.linear.weight"].shape[1]     # H · (1 + d_v)
    # H (d_n + d_r) = wq, H (d_n + d_v) = wkv_b, H (1 + d_v) = wo_in  =>  H (1 + d_r) = wq - wkv_b + wo_in
    heads = (wq - wkv_b + wo_in) // rope
    value = wo_in // heads
    config.update(num_attention_heads=heads, v_head_dim=value, qk_nope_head_dim=wq // heads - (rope - 1) + 1)
    return config, out


def _refuse_unrepresentable_mice(state: dict, layers: int, dense: list) -> None:
    """Official HELM-MiCE settings that leave weights but no model the zoo (or the official forward) computes, each
    refused naming the official flag; read off the keys, so a bare state_dict is checked too."""
    if any(key.startswith("layers.0.attn.wq_a.") for key in state):
        raise ValueError("official q_lora_rank > 0 (attn.wq_a / wq_b / q_norm) cannot be converted: the official "
                         "query compression feeds its q_lora_rank-1 space dims to a q_lora_rank-wide RMSNorm, so its "
                         "forward fails and there is no function to reproduce; train with q_lora_rank 0")
    if "layers.0.attn.softmax_scale" not in state and "layers.0.attn.wq.linear.weight" in state:
        raise ValueError("official max_seq_len > original_seq_len (rope_factor / YaRN frequencies and mscale): the "
                         "attention scale is then a constant the checkpoint does not hold (attn.softmax_scale is "
                         "missing) and the zoo has no DeepSeek-YaRN HoPE; convert a run with max_seq_len <= "
                         "original_seq_len")
    for i in range(len(dense), layers):
        o = f"layers.{i}.ffn."
        if o + "add_experts.w_y" not in state:
            raise ValueError(f"{o}add_experts is missing: official n_activated_experts != 2, whose MoE forward "
                             "has no expert combination (add_experts exists only for n_activated_experts=2), "
                             "cannot be converted")
        shared = state.get(o + "shared_experts.w1.linear.weight")
        routed = state.get(o + "experts.0.w1.linear.weight")
        if shared is None or routed is None or shared.shape != routed.shape or \
                not any(key.startswith(o + "weighted_sum.") for key in state):
            raise ValueError(f"{o}shared_experts: official n_shared_experts != 1 cannot be converted (its forward "
                             "combines the experts through an attribute the official LorentzMoE lacks); the zoo's "
                             "expert_combine='lresnet_official' is the n_shared_experts=1 model")


def _official_flags(args: Optional[Mapping], model: str, state: dict) -> dict:
    """Config fields from the official argparse flags that are not in the weights, and refusals naming the flags
    the zoo cannot represent. ``args`` None: the official defaults (documented in
    :func:`convert_official_checkpoint`)."""
    if not args:
        return {}
    lorentz = "token_embed.embedding" in state or "embed.embedding" in state
    if model == "helm_mice" and "project_emb" in args and bool(args["project_emb"]) == lorentz:
        raise ValueError(f"official project_emb={args['project_emb']!r} disagrees with the checkpoint's token table "
                         f"({'embed.embedding: Lorentz points' if lorentz else 'embed.weight: space parts'})")
    if model != "helm_mice":
        return {}
    fields = {}
    if float(args.get("route_scale", 1.0)) != 1.0:
        raise ValueError(f"official route_scale={args['route_scale']!r} cannot be converted: the zoo's HELM-MiCE "
                         "has no routed-weight scale (route_scale 1)")
    if int(args.get("n_expert_groups", 1)) != 1:
        raise ValueError(f"official n_expert_groups={args['n_expert_groups']!r} cannot be converted: the zoo's "
                         "routing has no expert groups (n_expert_groups 1)")
    if int(args.get("n_activated_experts", 2)) != 2:
        raise ValueError(f"official n_activated_experts={args['n_activated_experts']!r} cannot be converted: the "
                         "official MoE combines experts only for n_activated_experts=2")
    if int(args.get("n_shared_experts", 1)) != 1:
        raise ValueError(f"official n_shared_experts={args['n_shared_experts']!r} cannot be converted: the "
                         "official MoE combines experts only for n_shared_experts=1")
    if "score_func" in args:
        if args["score_func"] not in ("softmax", "sigmoid"):
            raise ValueError(f"official score_func={args['score_func']!r} is neither 'softmax' nor 'sigmoid'")
        # the official gate renormalises the selected weights for sigmoid scores only
        fields.update(scoring_func=args["score_func"], norm_topk_prob=args["score_func"] == "sigmoid")
    if "train_curv" in args:
        fields["trainable_curvatures"] = bool(args["train_curv"])
    return fields


def convert_official_checkpoint(path_or_state_dict: Union[str, os.PathLike, Mapping], model: Optional[str] = None,
                                *, official_args: Optional[Mapping] = None, **overrides):
    """An official HELM checkpoint as a ``HelmDForCausalLM`` / ``HelmMiCEForCausalLM`` computing the same logits.

    ``path_or_state_dict``: a ``torch.save`` file (read with ``weights_only=True``) or a state dict, bare or under
    ``"state_dict"`` / ``"model"``; a folder is refused (``IsADirectoryError``) naming the one ``.pt`` / ``.pth`` file
    in it, if there is one. ``model``: ``"helm_d"`` (official ``LTransformerDecoder``) or ``"helm_mice"``
    (``LorentzDeepSeekV3``); None detects it from the keys. The shapes are read from the weights, and so is the
    token table (HELM-D: Lorentz points; HELM-MiCE: points under ``embed.embedding``, the official default
    ``project_emb=False``, or space parts under ``embed.weight`` with ``project_emb=True``), the dense and MoE layer
    counts and the expert curvatures.

    ``official_args``: the official argparse fields (a dict); by default the ``"args"`` stored beside the state dict
    when the file holds them. They supply what the weights do not say: ``score_func`` (``softmax``: weights not
    renormalised; ``sigmoid``: renormalised), ``train_curv`` (``trainable_curvatures``), and are checked against the
    weights (``project_emb``). Without them the official defaults hold (``softmax``, trained curvatures).
    Official settings that cannot be represented are refused naming the flag: ``route_scale != 1``,
    ``n_expert_groups > 1``, ``n_activated_experts != 2`` and ``n_shared_experts != 1`` (the official MoE forward
    combines experts only for 2 and 1), ``q_lora_rank > 0`` (the official query compression does not run), and
    ``max_seq_len > original_seq_len`` (DeepSeek-YaRN frequencies and an unsaved attention scale).

    ``overrides`` are config fields set on top (e.g. ``max_position_embeddings``, ``eos_token_id``), or
    ``attn_implementation``.
    Returns the model in fp32, in eval mode; ``save_pretrained`` it to get a normal checkpoint folder.
    """
    from .presets import load_config  # the presets register the model types (helm.models)

    state, stored_args = _read(path_or_state_dict)
    args = stored_args if official_args is None else dict(official_args)
    detected = ("helm_d" if "token_embed.embedding" in state
                else "helm_mice" if "embed.weight" in state or "embed.embedding" in state else None)
    model = model or detected
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}" + (
            "" if detected else " (the keys look like neither official model: no token_embed.embedding / "
                                "embed.embedding / embed.weight)"))
    if detected is None:
        sample = ", ".join(sorted(state)[:3]) + (", ..." if len(state) > 3 else "") if state else "no weights at all"
        raise ValueError(f"the checkpoint is not an official HELM checkpoint: it has no token_embed.embedding (HELM-D) "
                         f"and no embed.embedding / embed.weight (HELM-MiCE); its keys: {sample}")
    if detected != model:
        raise ValueError(f"model={model!r}, but the checkpoint's keys are those of the official {detected!r}")
    k = _curvature(state)
    used = {"manifold_in.k", "manifold_hidden.k", "manifold_out.k"}
    flags = _official_flags(args, model, state)
    config_fields, weights = (_helm_d if model == "helm_d" else _helm_mice)(state, used)
    unknown = sorted(key for key in state if key not in used and not _ALIAS.search(key))
    if unknown:
        raise ValueError(f"{len(unknown)} official keys have no counterpart in the zoo: {unknown[:8]}"
                         + (" ..." if len(unknown) > 8 else ""))
    config = load_config(f"helm-{'d-115m' if model == 'helm_d' else 'mice-120m'}", **{
        "curvature": -1.0 / k, "positional": "hope", "lm_head_mode": "linear", "tie_word_embeddings": False,
        "attention_bias": True, "mlp_bias": True, "rms_norm_eps": 1e-8, "head_merge": "flatten",
        "final_proj": "model.final_proj.linear.weight" in weights, **config_fields, **flags, **overrides})
    from transformers import AutoModelForCausalLM

    converted = AutoModelForCausalLM.from_config(config).to(torch.float64)
    own = converted.state_dict()
    missing = sorted(set(own) - set(weights))
    if missing:
        raise ValueError(f"the official checkpoint lacks {len(missing)} weights the converted model needs: "
                         f"{missing[:8]}")
    for key, value in weights.items():
        if tuple(own[key].shape) != tuple(value.shape):
            raise ValueError(f"{key}: official shape {tuple(value.shape)} does not fit the converted model's "
                             f"{tuple(own[key].shape)}")
    converted.load_state_dict(weights, strict=True)
    return converted.restore_geometry().float().eval()


__all__ = ["convert_official_checkpoint"]
