"""transformers' causal language models run with this package's attention layer and its own cache.

:func:`replace_attention` swaps the ``self_attn`` block of every decoder
layer of a transformers causal LM (``LlamaForCausalLM``,
``Phi3ForCausalLM``, ... : any model whose blocks
:func:`mha_multi.interop.llama.from_llama` knows) for a module around
:class:`mha_multi.torch.MultiHeadAttention`, in PyTorch. ``model(input_ids,
attention_mask=...)`` and ``model.generate(...)`` then compute the model's
attention with the layer, and decode with the layer's key/value cache
(docs: "Generating with a cache"), never with a transformers cache.

How a call is read (docs: "Porting weights"):

* **A sequence.** Each swapped block holds a :class:`~mha_multi.spec.KVCache`
  of ``max_length`` positions per example, allocated once and emptied when
  a sequence begins. A call *continues* the sequence when it is given, as
  ``past_key_values``, the object that the previous call returned (as
  ``generate`` does from its second step); any other call begins a new
  sequence (an empty transformers cache, or none). The object returned
  holds no keys or values: it stands for the sequence in the layer's caches,
  and counts its positions.
* **Padding.** The 2-D ``attention_mask`` (1 for a token, 0 for padding, as
  wide as the sequence so far) tells which new positions are padding;
  padding is never written to the caches nor seen as a key, so a
  left-padded batch decodes as transformers decodes it. Outputs at padded
  positions are zeros (transformers' are meaningless there too).
* **Positions** are transformers' ``position_ids`` (given, or what the
  model would compute: ``arange`` after the positions the sequence holds).
* **Packed sequences.** A call without a cache (``use_cache=False``, no
  ``past_key_values``) and without an ``attention_mask``, given
  ``position_ids`` that restart within a row (``DataCollatorWithFlattening``),
  packs several sequences into that row, as transformers reads it: a sequence
  starts wherever a position is not the one before it plus 1. Each attends
  only within itself (the layer's ``segment_ids``; docs: "Packed sequences").
  gpt-oss' model builds its masks without the positions, and reads one
  sequence per row whatever they are: so does the layer there.

Not supported, with a ``ValueError`` saying so: ``output_attentions``,
reordering or cropping the cache (beam search, assisted generation), a 4-D
``attention_mask``, continuing with another batch size, and a transformers
cache that already holds keys and values. ``max_length`` bounds each
sequence: the layer refuses to write past it.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from transformers import DynamicCache

from mha_multi import spec
from mha_multi.interop.llama import from_llama
from mha_multi.torch import MultiHeadAttention, set_weights

__all__ = ["OurAttention", "replace_attention"]


class _Sequence:
    """What the swapped blocks of a model share: the sequence under way, this call's padding."""

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length
        #: Counts the sequences begun: a block whose cache is of an older one empties it.
        self.number = 0
        self.batch_size = 0
        #: Positions (tokens and padding) the sequence holds before this call.
        self.seen = 0
        self.use_cache = False
        #: ``(B, T)`` bool, which of this call's positions are tokens; ``None``: all.
        self.real: torch.Tensor | None = None
        self.length = 0
        #: The object the latest call returned as ``past_key_values``.
        self.latest: _SequenceCache | None = None
        #: ``(B, T)`` ids of packed sequences of this call; ``None``: one sequence a row.
        self.segments: torch.Tensor | None = None


class _SequenceCache(DynamicCache):
    """The ``past_key_values`` a model with swapped blocks returns: it holds no keys or values.

    It stands for the sequence that the layers' own caches hold; passing it
    back continues that sequence. It counts the sequence's positions, so
    that ``generate`` slices its inputs as for a cache of that length, and
    refuses to be reordered or cropped, which the layers' caches are not.
    """

    def __init__(self, sequence: _Sequence) -> None:
        super().__init__()
        self._sequence = weakref.ref(sequence)
        self._number = sequence.number

    def get_seq_length(self, layer_idx: int = 0) -> int:
        sequence = self._sequence()
        if sequence is None or sequence.number != self._number:
            return 0
        return sequence.seen

    def __bool__(self) -> bool:
        # True while it holds positions, as a cache of keys and values is (a DynamicCache
        # without layers is false): Phi-3's generate recomputes a sequence that crosses
        # its original context length where its past_key_values are true.
        return self.get_seq_length() > 0

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError(
            "the layer's key/value cache cannot be reordered, cropped or regrouped (beam search, "
            "assisted generation): generate with one beam and no assistant"
        )

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _refuse


class OurAttention(torch.nn.Module):
    """A decoder layer's ``self_attn`` computed by :class:`mha_multi.torch.MultiHeadAttention`.

    Built by :func:`replace_attention`; its ``layer`` holds the block's
    weights (:func:`~mha_multi.interop.llama.from_llama`) and ``cache`` the
    sequence's keys and values.
    """

    def __init__(self, block: torch.nn.Module, sequence: _Sequence) -> None:
        super().__init__()
        weights, kwargs = from_llama(block)
        reference = next(block.parameters())
        # (Made in the block's dtype, its weights set there: a float64 block's are not
        # rounded through float32.)
        layer = MultiHeadAttention(
            block.config.hidden_size, **kwargs, device=reference.device, dtype=reference.dtype
        )
        self.layer = set_weights(layer, weights)
        self.train(block.training)
        self.layer_idx = block.layer_idx
        self.cache: spec.KVCache | None = None
        self._number = 0
        self._sequence = sequence

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Any = None,
        position_ids: torch.Tensor | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, None]:
        sequence = self._sequence
        batch, length, features = hidden_states.shape
        if position_ids is None:
            position_ids = torch.arange(length, device=hidden_states.device) + sequence.seen
        positions = position_ids.expand(batch, length)
        x, real = hidden_states, sequence.real
        if real is not None:
            # Tokens first, in order: padding becomes the tail the layer neither keeps nor sees.
            order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)
            x = torch.gather(x, 1, order[..., None].expand(-1, -1, features))
            positions = torch.gather(positions, 1, order)
        lengths = None if real is None else real.sum(dim=1, dtype=torch.int32)
        if sequence.segments is not None:
            return self.layer(
                x, x, x, causal=True, positions=positions, segment_ids=sequence.segments
            ), None
        if sequence.use_cache:
            output, self.cache = self.layer(
                x, x, x, lengths, causal=True, positions=positions, cache=self._cache(batch)
            )
        else:
            output = self.layer(x, x, x, lengths, causal=True, positions=positions)
        if real is not None:
            index = order[..., None].expand(-1, -1, output.shape[-1])
            output = torch.zeros_like(output).scatter(1, index, output)
            output = output * real[..., None].to(output.dtype)
        return output, None

    def _cache(self, batch: int) -> spec.KVCache:
        """The cache of the sequence under way; emptied (allocated once) when one begins."""
        sequence = self._sequence
        if self._number != sequence.number:
            self._number = sequence.number
            cache = self.cache
            parameter = next(self.layer.parameters())
            if (
                cache is None
                or cache.keys.shape[0] != batch
                or cache.keys.shape[2] != sequence.max_length
                or cache.keys.dtype != parameter.dtype
                or cache.keys.device != parameter.device
            ):
                self.cache = self.layer.init_cache(batch, sequence.max_length)
            else:
                self.cache = cache._replace(lengths=torch.zeros_like(cache.lengths))
        elif self.cache is None:
            raise ValueError(
                "this call continues a sequence begun with use_cache=False: the layer holds no "
                "cache of it"
            )
        return self.cache


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The module holding the decoder layers: ``model.model`` of a ``...ForCausalLM``."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    if not isinstance(getattr(decoder, "layers", None), torch.nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} has no decoder layers where transformers' causal language "
            "models keep them (model.get_decoder().layers)"
        )
    return decoder


#: Model types whose model builds its masks without the call's ``position_ids``
#: (transformers 5.23's gpt-oss): a row is one causal sequence whatever its positions.
_ONE_SEQUENCE_PER_ROW = frozenset({"gpt_oss"})


def _before_call(sequence: _Sequence, decoder: torch.nn.Module):
    """The decoder's forward pre-hook: reads the call's sequence, padding and positions."""
    signature = inspect.signature(decoder.forward)

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        given = signature.bind(*args, **kwargs).arguments
        extra = given.get("kwargs", {})
        if extra.get("output_attentions") or getattr(module.config, "output_attentions", False):
            raise ValueError(
                "output_attentions is not supported with the layer's attention: it returns no "
                "attention weights to transformers"
            )
        inputs = given.get("input_ids")
        if inputs is None:
            inputs = given.get("inputs_embeds")
        batch, length = int(inputs.shape[0]), int(inputs.shape[1])
        past = given.get("past_key_values")
        use_cache = given.get("use_cache")
        if use_cache is None:
            use_cache = bool(getattr(module.config, "use_cache", True))
        continuing = past is not None and past is sequence.latest
        sequence.latest = None  # a call that fails leaves no sequence to continue
        if continuing:
            if not use_cache:
                raise ValueError("continuing a sequence needs use_cache=True")
            if batch != sequence.batch_size:
                raise ValueError(
                    f"the sequence under way has {sequence.batch_size} examples; "
                    f"this call has {batch}"
                )
        elif past is not None and not isinstance(past, DynamicCache):
            raise ValueError(
                f"past_key_values is a {type(past).__name__} (generate's cache_implementation "
                "other than the default): the layer keeps the sequence's keys and values in "
                "its own cache; generate with the default dynamic cache"
            )
        elif past is not None and (isinstance(past, _SequenceCache) or past.get_seq_length() > 0):
            raise ValueError(
                "past_key_values holds keys and values computed by transformers' attention, or "
                "stands for an earlier sequence: the layer continues only the sequence of the "
                "latest call, with the past_key_values that call returned"
            )
        else:
            sequence.number += 1
            sequence.seen, sequence.batch_size = 0, batch
        sequence.use_cache, sequence.length = bool(use_cache), length
        sequence.real = _real_positions(given.get("attention_mask"), sequence, length)
        sequence.segments = None
        if (
            given.get("attention_mask") is None
            and not use_cache
            and past is None
            and module.config.model_type not in _ONE_SEQUENCE_PER_ROW
        ):
            sequence.segments = _packed_sequences(given.get("position_ids"), batch)
        if given.get("position_ids") is None:
            start = sequence.seen
            kwargs["position_ids"] = torch.arange(start, start + length, device=inputs.device)[None]
        # The layer reads the padding from the 2-D mask above, not from transformers' 4-D one.
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = None
        return args, kwargs

    return hook


def _real_positions(
    mask: torch.Tensor | None, sequence: _Sequence, length: int
) -> torch.Tensor | None:
    """Which of the call's positions are tokens, from transformers' 2-D ``attention_mask``."""
    if mask is None:
        return None
    expected = (
        f"transformers' 2-D mask of the whole sequence so far, (batch, {sequence.seen + length})"
    )
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"attention_mask must be {expected}; got a {type(mask).__name__}")
    if mask.ndim != 2 or mask.shape[1] != sequence.seen + length:
        raise ValueError(f"attention_mask must be {expected}; got shape {tuple(mask.shape)}")
    real = mask[:, -length:] != 0
    return None if bool(real.all()) else real


def _packed_sequences(position_ids: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """The ``(B, T)`` ids of the sequences packed into the rows of ``position_ids``.

    transformers' rule (``find_packed_sequence_indices``): a sequence starts
    wherever a position is not the one before it plus 1. ``None`` where every
    row holds one sequence.
    """
    if position_ids is None:
        return None
    positions = position_ids.expand(batch, -1)
    steps = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
    ids = (steps != 1).cumsum(-1)
    return ids if bool((ids[:, -1] > 0).any()) else None


def _after_call(sequence: _Sequence):
    """The decoder's forward hook: the sequence's positions, and what stands for it."""

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        sequence.seen += sequence.length
        sequence.real = sequence.segments = None
        if sequence.use_cache and hasattr(output, "past_key_values"):
            sequence.latest = _SequenceCache(sequence)
            output.past_key_values = sequence.latest
        return output

    return hook


def replace_attention(model: torch.nn.Module, *, max_length: int) -> torch.nn.Module:
    """Computes the attention of every decoder layer of a transformers causal LM with our layer.

    Every ``self_attn`` block is converted by
    :func:`~mha_multi.interop.llama.from_llama` first: a block it does not
    know is refused before anything is swapped. Then each is replaced by an
    :class:`OurAttention` on the block's device and dtype, and hooks on the
    decoder read each call's sequence, padding and positions (see the
    module notes).

    Args:
        model: a transformers causal LM (``LlamaForCausalLM``,
            ``Phi3ForCausalLM``...), changed in place.
        max_length: the positions each example's cache holds: a sequence's
            prompt, padding included, and its generated tokens.

    Returns:
        ``model``.

    Raises:
        ValueError: a block :func:`~mha_multi.interop.llama.from_llama`
            refuses, no decoder layers, or a ``max_length`` below 1.

    Example:
        >>> model = replace_attention(LlamaForCausalLM(config).eval(), max_length=64)
        >>> tokens = model.generate(input_ids, attention_mask=mask, max_new_tokens=16)
    """
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be a positive int; got {max_length!r}")
    decoder = _decoder(model)
    sequence = _Sequence(max_length)
    ours = [OurAttention(layer.self_attn, sequence) for layer in decoder.layers]
    for layer, attention in zip(decoder.layers, ours, strict=True):
        layer.self_attn = attention
    decoder.register_forward_pre_hook(_before_call(sequence, decoder), with_kwargs=True)
    decoder.register_forward_hook(_after_call(sequence), with_kwargs=True)
    return model
