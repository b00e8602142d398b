"""The task heads ``transformers`` gives Llama (sequence classification, token classification, extractive question
answering), for any HELM base model. Each family's modeling file mixes one of these into its pre-trained class and
names its base model (``base_model_class``); the heads are registered with the Auto classes there.

Every head reads the final hyperbolic hidden state (a point ``[..., 1+n]`` after the last RMSNorm_L) through a
:class:`helm.nn.LorentzLMHead` with ``config.lm_head_mode``: ``linear`` is the paper's LM head (a Euclidean map of
the full vector), ``distance`` scores each class by ``-d²(x, p_c)/τ`` to a learned class point ``p_c`` on the
hyperboloid. Inputs, outputs, pooling and losses are Llama's (``transformers``' ``GenericFor…`` classes): the same
fields, ``num_labels``, ``problem_type``, ``pad_token_id`` semantics and ``self.loss_function``."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_outputs import (
    QuestionAnsweringModelOutput,
    SequenceClassifierOutputWithPast,
    TokenClassifierOutput,
)
from transformers.utils import can_return_tuple, logging

from ..manifold.math import lift
from ..nn.head import LorentzLMHead
from .modeling_common import CACHE_FIELD, resolve_cache
# the target transformers' cross-entropy (fixed_cross_entropy) leaves out of the classification losses
IGNORE_INDEX = -100

logger = logging.get_logger(__name__)


def problem_type(config, labels: torch.Tensor) -> str:
    """The loss a sequence-classification head computes for ``labels``: ``config.problem_type``, or when unset the
    one ``transformers``' ``ForSequenceClassificationLoss`` infers (and then stores in the config): ``regression``
    for ``num_labels=1``, ``single_label_classification`` for int64 / int32 labels, else
    ``multi_label_classification``."""
    if config.problem_type is not None:
        return config.problem_type
    if config.num_labels == 1:
        return "regression"
    return "single_label_classification" if labels.dtype in (torch.long, torch.int) else "multi_label_classification"


def class_head(config, out_features: int, *, bias: bool) -> LorentzLMHead:
    """Scores of ``out_features`` classes from a point ``[..., 1+n]`` (``config.lm_head_mode``)."""
    return LorentzLMHead(config.hidden_size, out_features, k=config.k, mode=config.lm_head_mode, bias=bias,
                         init_std=config.initializer_range)


def labelled_count(targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The number of ``targets`` other than ``ignore_index``, at least 1, on their device (no synchronisation): the
    ``num_items_in_batch`` that makes a cross-entropy the mean over the scored targets, and 0 with zero gradients
    when every target is ignored (the mean is ``0/0 = NaN`` there), as the causal-LM loss
    (:func:`~helm.models.modeling_common.causal_lm_loss`)."""
    return (targets != ignore_index).sum().clamp_min(1)


def answer_loss(start_logits: torch.Tensor, end_logits: torch.Tensor, start: torch.Tensor,
                end: torch.Tensor) -> torch.Tensor:
    """``transformers``' ``ForQuestionAnsweringLoss`` (positions clamped to ``[0, T]``, ``T`` ignored, the mean of
    the start and end cross-entropies), each side normalised by its :func:`labelled_count`: the same loss whenever
    a position of that side is scored, 0 for a side whose every position is ``T``, where ``transformers`` gives
    NaN."""
    ignored = start_logits.shape[1]
    sides = []
    for logits, positions in ((start_logits, start), (end_logits, end)):
        positions = positions.reshape(-1).to(logits.device).clamp(0, ignored)
        total = nn.functional.cross_entropy(logits, positions, ignore_index=ignored, reduction="sum")
        sides.append(total / labelled_count(positions, ignored))
    return (sides[0] + sides[1]) / 2


class HelmTaskHead:
    """Shared by the heads: the base model under ``model`` (``base_model_class``) and the checkpoint keys a
    causal-LM checkpoint brings that a task head does not use (its LM head)."""

    base_model_class: type
    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]

    def base_forward(self, input_ids, attention_mask, position_ids, past_key_values, cache, inputs_embeds, use_cache,
                     kwargs):
        """The base model's outputs."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          past_key_values=resolve_cache(past_key_values, cache), inputs_embeds=inputs_embeds,
                          use_cache=use_cache, **kwargs)

    def with_balance_loss(self, loss: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``loss`` plus the base model's training-time balance loss (HELM-MiCE), as ``…ForCausalLM`` adds it."""
        balance = self.balance_loss()
        return loss if loss is None or balance is None else loss + balance


class SequenceClassificationHead(HelmTaskHead):
    """``…ForSequenceClassification``: class scores of the last token that is not ``config.pad_token_id`` (the
    rightmost one, so left and right padding both work; the last token when ``pad_token_id`` is None, which allows
    batches of one only, or with ``inputs_embeds``), as ``LlamaForSequenceClassification``. The head is ``score``
    (no bias, as Llama's); ``logits [B, num_labels]``; the loss follows ``config.problem_type`` (regression,
    single- or multi-label), inferred from ``num_labels`` and the labels' dtype when unset; a single-label loss
    whose every label is -100 is 0 with zero gradients (Llama: NaN), as the causal-LM head's
    (:func:`labelled_count`)."""

    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = self.base_model_class(config)
        self.score = class_head(config, config.num_labels, bias=False)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_values: Optional[Cache] = None,
                cache: Optional[Cache] = None, inputs_embeds: Optional[torch.Tensor] = None,
                labels: Optional[torch.LongTensor] = None, use_cache: Optional[bool] = None,
                **kwargs) -> SequenceClassifierOutputWithPast:
        outputs = self.base_forward(input_ids, attention_mask, position_ids, past_key_values, cache, inputs_embeds,
                                    use_cache, kwargs)
        hidden_states = outputs.last_hidden_state
        batch = hidden_states.shape[0]
        pad = self.config.pad_token_id
        if pad is None and batch != 1:
            raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined.")
        if pad is None:
            last = torch.full((batch,), hidden_states.shape[1] - 1, device=hidden_states.device)
        elif input_ids is not None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
            last = (positions * (input_ids != pad)).argmax(-1).to(hidden_states.device)
        else:
            last = torch.full((batch,), hidden_states.shape[1] - 1, device=hidden_states.device)
            logger.warning_once(f"{type(self).__name__} will not detect padding tokens in `inputs_embeds`. Results "
                                "may be unexpected if using padding tokens in conjunction with `inputs_embeds.`")
        # the head is per token, so scoring only the pooled points gives Llama's pooled logits
        logits = self.score(hidden_states[torch.arange(batch, device=hidden_states.device), last])
        loss = None
        if labels is not None:
            # single-label: the mean over the labels other than -100, 0 when all are (see labelled_count)
            count = ({"num_items_in_batch": labelled_count(labels, IGNORE_INDEX)}
                     if problem_type(self.config, labels) == "single_label_classification" else {})
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=logits, config=self.config, **count)
        return SequenceClassifierOutputWithPast(loss=self.with_balance_loss(loss), logits=logits,
                                                **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)},
                                                hidden_states=outputs.hidden_states,
                                                attentions=outputs.attentions)


class TokenClassificationHead(HelmTaskHead):
    """``…ForTokenClassification``: class scores of every token, ``logits [B, T, num_labels]``, cross-entropy over
    labels other than -100, as ``LlamaForTokenClassification``, and 0 with zero gradients when every label is -100
    (Llama: NaN), as the causal-LM head (:func:`labelled_count`). Dropout (``config.classifier_dropout``, else
    ``hidden_dropout``, else 0.1, as Llama) acts on the space part and the time coordinate is recomputed, so the
    head still reads a point. The head is ``score`` (with a bias, as Llama's)."""

    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = self.base_model_class(config)
        dropout = getattr(config, "classifier_dropout", None)
        if dropout is None:
            dropout = getattr(config, "hidden_dropout", None)
        self.dropout = nn.Dropout(0.1 if dropout is None else dropout)
        self.score = class_head(config, config.num_labels, bias=True)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_values: Optional[Cache] = None,
                cache: Optional[Cache] = None, inputs_embeds: Optional[torch.Tensor] = None,
                labels: Optional[torch.LongTensor] = None, use_cache: Optional[bool] = None,
                **kwargs) -> TokenClassifierOutput:
        outputs = self.base_forward(input_ids, attention_mask, position_ids, past_key_values, cache, inputs_embeds,
                                    use_cache, kwargs)
        points = outputs.last_hidden_state
        points = lift(self.dropout(points[..., 1:]), k=self.config.k)
        logits = self.score(points)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config,
                                      num_items_in_batch=labelled_count(labels, IGNORE_INDEX))
        return TokenClassifierOutput(loss=self.with_balance_loss(loss), logits=logits,
                                     hidden_states=outputs.hidden_states, attentions=outputs.attentions)


class QuestionAnsweringHead(HelmTaskHead):
    """``…ForQuestionAnswering`` (extractive): start and end scores of every token, ``start_logits``,
    ``end_logits [B, T]``, and with ``start_positions`` / ``end_positions`` the mean of the two cross-entropies
    (a position equal to ``T``, an answer outside the window, ignored), as ``LlamaForQuestionAnswering``; a side
    whose every position is ``T`` contributes 0 (Llama: NaN), as the causal-LM head (:func:`answer_loss`). The head
    is ``qa_outputs`` (two classes, with a bias, as Llama's). Only one of the two positions is a ``ValueError`` naming
    both."""

    def __init__(self, config):
        super().__init__(config)
        self.model = self.base_model_class(config)
        self.qa_outputs = class_head(config, 2, bias=True)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_values: Optional[Cache] = None,
                cache: Optional[Cache] = None, inputs_embeds: Optional[torch.Tensor] = None,
                start_positions: Optional[torch.LongTensor] = None, end_positions: Optional[torch.LongTensor] = None,
                use_cache: Optional[bool] = None, **kwargs) -> QuestionAnsweringModelOutput:
        # the output has no cache field (as Llama's): nothing is cached
        outputs = self.base_forward(input_ids, attention_mask, position_ids, past_key_values, cache, inputs_embeds,
                                    False, kwargs)
        start_logits, end_logits = self.qa_outputs(outputs.last_hidden_state).unbind(-1)
        start_logits, end_logits = start_logits.contiguous(), end_logits.contiguous()
        loss = None
        if (start_positions is None) != (end_positions is None):
            given, missing = (("start_positions", "end_positions") if end_positions is None
                              else ("end_positions", "start_positions"))
            raise ValueError(f"{given} without {missing}: the loss needs both (pass both for a loss, neither for "
                             "logits only)")
        if start_positions is not None:
            loss = answer_loss(start_logits, end_logits, start_positions, end_positions)
        return QuestionAnsweringModelOutput(loss=self.with_balance_loss(loss), start_logits=start_logits,
                                            end_logits=end_logits, hidden_states=outputs.hidden_states,
                                            attentions=outputs.attentions)


__all__ = ["QuestionAnsweringHead", "SequenceClassificationHead", "TokenClassificationHead", "class_head"]
