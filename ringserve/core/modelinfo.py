"""What a GGUF model file says of itself, as plain values: its shape, its tensors' bytes, its chat
template and its recommended sampling settings.

Sans-I/O: :func:`ringserve.engine.gguf.read_gguf` reads a file's metadata into a :class:`GGUFInfo`
(without llama.cpp); :mod:`ringserve.core.sizing` and the catalog work on the value. The keys are
the ones llama.cpp reads (``src/llama-arch.cpp``, ``LLM_KV_NAMES``; gguf-py spells them in
``gguf.Keys``), and each field says which.

Which layers use a sliding window (SWA) follows llama.cpp's ``load_hparams`` of each architecture
(``src/models/<arch>.cpp``: ``load_swa_pattern(ml, period)``, ``llama_hparams::set_swa_pattern``),
in :data:`SWA_PATTERNS`. A model whose context memory is not a plain KV cache per attention layer
(recurrent and hybrid architectures, multi-head latent attention, layers that share KV, a sliding
window of an architecture this module does not list) has :attr:`GGUFInfo.kv_unknown` set: the
estimate says it does not know rather than guess.
"""

from __future__ import annotations

from pathlib import Path

import attrs

#: Architectures whose memory is recurrent state only (``llm_arch_is_recurrent``, ``src/llama-arch.cpp``).
RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})

#: Architectures with recurrent and attention layers (``llm_arch_is_hybrid``, ``src/llama-arch.cpp``).
HYBRID_ARCHS = frozenset({
    "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe",
    "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next", "qwen35", "qwen35moe", "qwen4exp",
    "deepseek4", "minimax-01",
})


@attrs.frozen
class SwaPattern:
    """How an architecture spreads sliding-window layers when the GGUF gives only a period.

    Attributes:
        period: every ``period`` layers, all but one use the window (``set_swa_pattern``:
            layer ``il`` is SWA when ``il % period < period - 1``; with ``dense_first`` when
            ``il % period != 0``).
        dense_first: the full-attention layer starts each period instead of ending it.
        default_window: the window when the GGUF has no ``<arch>.attention.sliding_window``;
            None: no key, no window (the model then has none).
    """

    period: int
    dense_first: bool = False
    default_window: int | None = None


#: The architectures whose sliding-window layout this module knows, as llama.cpp's
#: ``src/models/<arch>.cpp`` loads them (gemma2: 2, default window 4096; gemma3: 6; cohere2: 4;
#: llama4: 4, chunked, default 8192, none when the key is 0; gpt-oss: 2; olmo2 and mellum: 4 when
#: the key is there). ``phi3`` has the key but llama.cpp ignores it (its SWA is disabled).
SWA_PATTERNS: dict[str, SwaPattern] = {
    "gemma2": SwaPattern(2, default_window=4096),
    "gemma3": SwaPattern(6),
    "cohere2": SwaPattern(4),
    "llama4": SwaPattern(4, default_window=8192),
    "gpt-oss": SwaPattern(2),
    "olmo2": SwaPattern(4),
    "mellum": SwaPattern(4),
}

#: Architectures whose ``sliding_window`` key llama.cpp reads and then ignores.
SWA_IGNORED = frozenset({"phi3"})


def swa_layers(period: int, n_layer: int, dense_first: bool = False) -> tuple[bool, ...]:
    """Which of ``n_layer`` layers use the window for a period (``llama_hparams::set_swa_pattern``;
    a period of 0 makes every layer SWA)."""
    if dense_first:
        return tuple(period == 0 or il % period != 0 for il in range(n_layer))
    return tuple(period == 0 or il % period < period - 1 for il in range(n_layer))


@attrs.frozen
class SamplingDefaults:
    """The model's recommended sampling settings, ``general.sampling.*`` (``src/llama-arch.cpp``
    ``LLM_KV_GENERAL_SAMPLING_*``); None for a key the file does not have.

    Attributes:
        sequence: the samplers' order, llama.cpp's letters (``"edkypmxt"``).
        top_k, top_p, min_p, temp: as llama.cpp's samplers take them.
        xtc_probability, xtc_threshold: XTC.
        penalty_last_n, penalty_repeat: the repetition penalty's window (tokens) and factor.
        mirostat: 0 off, 1 or 2 the version; mirostat_tau, mirostat_eta its target and rate.
    """

    sequence: str | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    temp: float | None = None
    penalty_last_n: int | None = None
    penalty_repeat: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None


@attrs.frozen
class SSMShape:
    """A recurrent model's state shape, where the GGUF gives one (``<arch>.ssm.*``, ``<arch>.wkv.*``);
    None for a key it does not have. Kept to describe the model: :mod:`ringserve.core.sizing` does
    not estimate recurrent state."""

    conv_kernel: int | None = None
    inner_size: int | None = None
    state_size: int | None = None
    time_step_rank: int | None = None
    group_count: int | None = None
    wkv_head_size: int | None = None


@attrs.frozen
class GGUFInfo:
    """A GGUF model's metadata (:func:`ringserve.engine.gguf.read_gguf`).

    Attributes:
        paths: the file, or every part of a split model (``split.count``), in order.
        file_bytes: the size of all the parts (bytes).
        architecture: ``general.architecture`` (``llama``, ``gemma3``).
        name: ``general.name``; basename, size_label: ``general.basename``, ``general.size_label``
            (None where absent).
        file_type: ``general.file_type`` by llama.cpp's ``LLAMA_FTYPE_MOSTLY_*`` name without the
            prefix (``Q4_K_M``, ``F16``; gguf-py's ``LlamaFileType``); None when absent or unknown.
        n_ctx_train: ``<arch>.context_length`` (tokens).
        n_layer: ``<arch>.block_count``, the repeating layers.
        n_embd: ``<arch>.embedding_length``.
        n_vocab: the tokens in ``tokenizer.ggml.tokens`` (else ``<arch>.vocab_size``, else 0).
        n_head, n_head_kv: per layer, ``<arch>.attention.head_count`` and ``head_count_kv`` (a
            number or an array; ``n_head_kv`` defaults to ``n_head``).
        key_length, value_length: a head's K and V width, ``<arch>.attention.key_length`` /
            ``value_length``, default ``n_embd / n_head``.
        key_length_swa, value_length_swa: the same on sliding-window layers
            (``..._swa``, default the above).
        n_swa: the sliding window (tokens, ``<arch>.attention.sliding_window``); 0: none.
        swa_layers: per layer, whether it uses the window (all False without one).
        n_layer_nextn: ``<arch>.nextn_predict_layers``: the last layers are a draft head that has
            no KV cache in the main context.
        n_expert: ``<arch>.expert_count`` (0: dense).
        kv_unknown: why the KV cache cannot be estimated from these values (a recurrent or hybrid
            architecture, latent attention, shared KV layers, a sliding window of an architecture
            :data:`SWA_PATTERNS` does not list); None when it can.
        ssm: the recurrent state's shape, where the file has one.
        layer_bytes: per repeating layer, the bytes of its tensors (``blk.N.*``, each padded to the
            file's alignment as it lies in the file).
        input_bytes: tensors that stay in host memory (``token_embd.*``, position and token-type
            embeddings: llama.cpp never offloads the input layer).
        output_bytes: the other tensors outside the layers (``output.*``, ``output_norm.*``):
            they go with the output layer, the last offloaded one.
        tied_output: no ``output.weight``: the output reuses ``token_embd.weight``, which
            llama.cpp copies to the GPU when it offloads the output layer.
        token_embd_bytes: the bytes of ``token_embd.weight`` (the copy a tied output takes).
        chat_template: ``tokenizer.chat_template``, None when absent.
        sampling: ``general.sampling.*``.
    """

    paths: tuple[Path, ...]
    file_bytes: int
    architecture: str
    name: str | None
    basename: str | None
    size_label: str | None
    file_type: str | None
    n_ctx_train: int
    n_layer: int
    n_embd: int
    n_vocab: int
    n_head: tuple[int, ...]
    n_head_kv: tuple[int, ...]
    key_length: int
    value_length: int
    key_length_swa: int
    value_length_swa: int
    n_swa: int
    swa_layers: tuple[bool, ...]
    n_layer_nextn: int
    n_expert: int
    kv_unknown: str | None
    ssm: SSMShape | None
    layer_bytes: tuple[int, ...]
    input_bytes: int
    output_bytes: int
    tied_output: bool
    token_embd_bytes: int
    chat_template: str | None
    sampling: SamplingDefaults

    @property
    def path(self) -> Path:
        """The file llama.cpp is given: the first part of a split model."""
        return self.paths[0]

    @property
    def weights_bytes(self) -> int:
        """All the tensors' bytes: input, layers and output."""
        return self.input_bytes + sum(self.layer_bytes) + self.output_bytes

    def kv_width(self, il: int) -> tuple[int, int]:
        """Layer ``il``'s K and V elements per token (``n_embd_k_gqa(il)``, ``n_embd_v_gqa(il)`` in
        ``src/llama-hparams.cpp``): its KV heads times the head widths (the SWA ones on a SWA layer)."""
        swa = self.swa_layers[il]
        k = self.key_length_swa if swa else self.key_length
        v = self.value_length_swa if swa else self.value_length
        return self.n_head_kv[il] * k, self.n_head_kv[il] * v

    @property
    def kv_layers(self) -> range:
        """The layers with a KV cache in the main context (a draft head's ``nextn`` layers have none)."""
        return range(self.n_layer - self.n_layer_nextn)
