"""Read a GGUF model's metadata without llama.cpp: :func:`read_gguf` gives a
:class:`~ringserve.core.modelinfo.GGUFInfo`.

The container (ggml ``docs/gguf.md``): the magic ``GGUF``, a version (2 or 3), the tensor and
key-value counts, the key-value pairs (typed scalars, strings, arrays), the tensor infos (name,
dimensions, ``ggml_type``, offset), then the tensor data, aligned to ``general.alignment`` (32).
The keys, value types, tensor types' block sizes and file-type names are gguf-py's (``gguf.Keys``,
``GGUFValueType``, ``GGML_QUANT_SIZES``, ``LlamaFileType``), the package llama.cpp ships.

The header is parsed here rather than by gguf-py's ``GGUFReader``, which builds a numpy array per
element of every array: the tokenizer's 262,144 tokens, scores and types of gemma-3-270m took it
11.3 s (SmolLM2's 49,152 tokens 1.9 s) on the shared 2-core machine of issue 40, where
:func:`read_gguf` reads only the lengths of the arrays it does not need.

A split model (``split.count`` in its first file, parts named ``PREFIX-00001-of-0000N.gguf`` as
``llama_split_path`` names them) is read from every part: metadata from the first, tensors from
all, sizes summed.
"""

from __future__ import annotations

import mmap
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ringserve.core.modelinfo import (
    HYBRID_ARCHS,
    RECURRENT_ARCHS,
    SWA_IGNORED,
    SWA_PATTERNS,
    GGUFInfo,
    SamplingDefaults,
    SSMShape,
    swa_layers,
)
from ringserve.engine.modelfile import GGUF_MAGIC, ModelFileError, check_model_file, parse_name

__all__ = ["read_gguf"]

#: Arrays longer than this are not kept, only their length (the tokenizer's).
_KEEP_ARRAY = 4096

_T = gguf.GGUFValueType
_SCALARS: dict[int, struct.Struct] = {
    _T.UINT8: struct.Struct("<B"), _T.INT8: struct.Struct("<b"),
    _T.UINT16: struct.Struct("<H"), _T.INT16: struct.Struct("<h"),
    _T.UINT32: struct.Struct("<I"), _T.INT32: struct.Struct("<i"),
    _T.UINT64: struct.Struct("<Q"), _T.INT64: struct.Struct("<q"),
    _T.FLOAT32: struct.Struct("<f"), _T.FLOAT64: struct.Struct("<d"),
    _T.BOOL: struct.Struct("<?"),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")



class _Long:
    """An array that was too long to keep: its length only."""

    def __init__(self, length: int) -> None:
        self.length = length


class _Header:
    """One file's key-value pairs and tensor infos (name -> (bytes, data offset))."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fields: dict[str, Any] = {}
        self.tensors: dict[str, tuple[int, int]] = {}
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            self._parse(buf)

    def _parse(self, buf: mmap.mmap) -> None:
        self._buf, self._pos = buf, 0
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise ValueError("not a GGUF file")
        self._pos = 4
        version = self._read(_U32)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (this reader knows 2 and 3, little-endian)")
        n_tensors, n_kv = self._read(_U64), self._read(_U64)
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._read(_U32))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._read(_U64) for _ in range(self._read(_U32))]
            kind = gguf.GGMLQuantizationType(self._read(_U32))
            offset = self._read(_U64)
            elements = 1
            for d in dims:
                elements *= d
            block, size = gguf.GGML_QUANT_SIZES[kind]
            infos.append((name, elements // block * size, offset))
        align = int(self.fields.get(gguf.Keys.General.ALIGNMENT, gguf.GGUF_DEFAULT_ALIGNMENT))
        data = -(-self._pos // align) * align
        if infos and data + max(off + n for _, n, off in infos) > len(buf):
            raise ValueError("the tensor data runs past the end of the file (truncated?)")
        for name, n, offset in infos:
            self.tensors[name] = (-(-n // align) * align, data + offset)
        del self._buf

    def _read(self, s: struct.Struct) -> Any:
        (value,) = s.unpack_from(self._buf, self._pos)
        self._pos += s.size
        return value

    def _string(self) -> str:
        n = self._read(_U64)
        end = self._pos + n
        if end > len(self._buf):
            raise ValueError("a string runs past the end of the file (truncated?)")
        text = bytes(self._buf[self._pos:end]).decode("utf-8", errors="replace")
        self._pos = end
        return text

    def _value(self, kind: int) -> Any:
        scalar = _SCALARS.get(kind)
        if scalar is not None:
            value = self._read(scalar)
            # a float32 as its shortest decimal: 0.7, not 0.699999988
            return float(str(np.float32(value))) if kind == _T.FLOAT32 else value
        if kind == _T.STRING:
            return self._string()
        if kind != _T.ARRAY:
            raise ValueError(f"unknown value type {kind}")
        item, n = self._read(_U32), self._read(_U64)
        if n <= _KEEP_ARRAY:
            return [self._value(item) for _ in range(n)]
        scalar = _SCALARS.get(item)
        if scalar is not None:
            self._pos += n * scalar.size
        elif item == _T.STRING:
            buf, pos, u64 = self._buf, self._pos, _U64.unpack_from
            for _ in range(n):
                pos += 8 + u64(buf, pos)[0]
            self._pos = pos
        else:
            for _ in range(n):
                self._value(item)
        return _Long(n)


def _parts(path: Path, first: _Header) -> Iterator[Path]:
    """The paths of a split model's other parts, after the first."""
    count = int(first.fields.get(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, 1))
    if count <= 1:
        return
    name = parse_name(path.name)
    if name is None or name.count != count or name.index != 1:
        raise ValueError(f"a split model of {count} parts, named other than PREFIX-00001-of-{count:05d}.gguf")
    for no in range(2, count + 1):
        yield path.with_name(f"{name.prefix}-{no:05d}-of-{count:05d}.gguf")


def read_gguf(path: str | Path) -> GGUFInfo:
    """The metadata of the GGUF model at ``path`` (a split model: its first part).

    Reads the headers only (memory-mapped), never the tensor data.

    Raises:
        ModelFileError: the file (or a part of a split model) is missing, not GGUF, truncated
            or malformed, or lacks a key llama.cpp requires (``general.architecture``,
            ``<arch>.context_length``, ``block_count``, ``embedding_length``); one line naming the
            path.
    """
    first_path = check_model_file(path)
    current = first_path
    try:
        first = _Header(first_path)
        headers = [first]
        for part in _parts(first_path, first):
            current = check_model_file(part)
            headers.append(_Header(current))
        return _info(headers)
    except (ValueError, KeyError, struct.error, OSError, IndexError) as exc:
        reason = (exc.strerror if isinstance(exc, OSError) and exc.strerror
                  # (a read past the end: "unpack_from requires a buffer of at least ... bytes")
                  else "the header runs past the end of the file (truncated?)"
                  if isinstance(exc, struct.error) else str(exc) or type(exc).__name__)
        raise ModelFileError(f"cannot read the GGUF metadata ({reason}): {current}", current) from None


def _info(headers: list[_Header]) -> GGUFInfo:
    fields = headers[0].fields
    general = gguf.Keys.General
    arch = _required(fields, general.ARCHITECTURE, str)

    def key(template: str) -> str:
        return template.format(arch=arch)

    llm, attn = gguf.Keys.LLM, gguf.Keys.Attention
    n_layer = _required(fields, key(llm.BLOCK_COUNT), int)
    n_embd = _required(fields, key(llm.EMBEDDING_LENGTH), int)
    n_head = _per_layer(fields.get(key(attn.HEAD_COUNT), 0), n_layer)
    n_head_kv = _per_layer(fields.get(key(attn.HEAD_COUNT_KV), list(n_head)), n_layer)
    head = n_embd // max(n_head) if max(n_head, default=0) else 0
    key_length = int(fields.get(key(attn.KEY_LENGTH), head))
    value_length = int(fields.get(key(attn.VALUE_LENGTH), head))
    n_swa, swa, swa_unknown = _sliding_window(fields, arch, n_layer)

    tensors: dict[str, tuple[int, int]] = {}
    for h in headers:
        tensors.update(h.tensors)
    layer_bytes = [0] * n_layer
    input_bytes = output_bytes = 0
    for name, (size, _) in tensors.items():
        block = re.match(r"blk\.(\d+)\.", name)
        if block is not None and int(block[1]) < n_layer:
            layer_bytes[int(block[1])] += size
        elif name.startswith(("token_embd", "position_embd", "token_types")):
            input_bytes += size
        else:
            output_bytes += size

    ssm = _ssm(fields, key)
    kv_unknown = (
        f"{arch} is a recurrent architecture" if arch in RECURRENT_ARCHS
        else f"{arch} is a hybrid architecture" if arch in HYBRID_ARCHS
        else f"{arch} uses latent attention" if key(attn.KV_LORA_RANK) in fields
        else f"{arch} shares KV between layers" if key(attn.SHARED_KV_LAYERS) in fields
        else f"{arch} has recurrent state" if ssm is not None
        else swa_unknown
    )
    file_type = fields.get(general.FILE_TYPE)
    tokens = fields.get(gguf.Keys.Tokenizer.LIST, [])
    return GGUFInfo(
        paths=tuple(h.path for h in headers),
        file_bytes=sum(h.path.stat().st_size for h in headers),
        architecture=arch,
        name=_optional(fields, general.NAME),
        basename=_optional(fields, general.BASENAME),
        size_label=_optional(fields, general.SIZE_LABEL),
        file_type=None if file_type is None else _file_type_name(int(file_type)),
        n_ctx_train=_required(fields, key(llm.CONTEXT_LENGTH), int),
        n_layer=n_layer,
        n_embd=n_embd,
        n_vocab=(tokens.length if isinstance(tokens, _Long) else len(tokens))
        or int(fields.get(key(llm.VOCAB_SIZE), 0)),
        n_head=n_head,
        n_head_kv=n_head_kv,
        key_length=key_length,
        value_length=value_length,
        key_length_swa=int(fields.get(key(attn.KEY_LENGTH_SWA), key_length)),
        value_length_swa=int(fields.get(key(attn.VALUE_LENGTH_SWA), value_length)),
        n_swa=n_swa,
        swa_layers=swa,
        n_layer_nextn=int(fields.get(key(llm.NEXTN_PREDICT_LAYERS), 0)),
        n_expert=int(fields.get(key(llm.EXPERT_COUNT), 0)),
        kv_unknown=kv_unknown,
        ssm=ssm,
        layer_bytes=tuple(layer_bytes),
        input_bytes=input_bytes,
        output_bytes=output_bytes,
        tied_output="output.weight" not in tensors,
        token_embd_bytes=tensors.get("token_embd.weight", (0, 0))[0],
        chat_template=_optional(fields, gguf.Keys.Tokenizer.CHAT_TEMPLATE),
        sampling=_sampling(fields),
    )


def _required(fields: dict[str, Any], key: str, kind: type) -> Any:
    value = fields.get(key)
    if value is None:
        raise ValueError(f"no {key}")
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise ValueError(f"{key} is not a {kind.__name__}")
    return value


def _optional(fields: dict[str, Any], key: str) -> str | None:
    value = fields.get(key)
    return value if isinstance(value, str) else None


def _per_layer(value: Any, n_layer: int) -> tuple[int, ...]:
    """A per-layer count given as one number or an array (``get_key_or_arr``)."""
    if isinstance(value, list):
        if len(value) != n_layer:
            raise ValueError(f"a per-layer array of {len(value)} values for {n_layer} layers")
        return tuple(int(x) for x in value)
    return (int(value),) * n_layer


def _sliding_window(
    fields: dict[str, Any], arch: str, n_layer: int
) -> tuple[int, tuple[bool, ...], str | None]:
    """(window, SWA flag per layer, why unknown) as llama.cpp's ``load_hparams`` of ``arch`` sets them."""
    none = (False,) * n_layer
    window_key = gguf.Keys.Attention.SLIDING_WINDOW.format(arch=arch)
    pattern_value = fields.get(gguf.Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=arch))
    window = fields.get(window_key)
    pattern = SWA_PATTERNS.get(arch)
    if pattern is None:
        if window and arch not in SWA_IGNORED:
            return 0, none, f"{arch} has a sliding window whose layers this estimate does not know"
        return 0, none, None
    n_swa = pattern.default_window if window is None else int(window)
    if not n_swa:
        return 0, none, None
    if isinstance(pattern_value, list):
        if len(pattern_value) != n_layer:
            raise ValueError(f"a sliding_window_pattern of {len(pattern_value)} values for {n_layer} layers")
        return n_swa, tuple(bool(x) for x in pattern_value), None
    period = pattern.period if pattern_value is None else int(pattern_value)
    return n_swa, swa_layers(period, n_layer, pattern.dense_first), None


def _ssm(fields: dict[str, Any], key: Callable[[str], str]) -> SSMShape | None:
    ssm = gguf.Keys.SSM
    names = (ssm.CONV_KERNEL, ssm.INNER_SIZE, ssm.STATE_SIZE, ssm.TIME_STEP_RANK, ssm.GROUP_COUNT,
             gguf.Keys.WKV.HEAD_SIZE)
    values = [fields.get(key(name)) for name in names]
    if all(x is None for x in values):
        return None
    return SSMShape(*(None if x is None else int(x) for x in values))


def _file_type_name(value: int) -> str | None:
    """llama.cpp's name of a ``general.file_type`` (``LLAMA_FTYPE_MOSTLY_Q4_K_M`` -> ``Q4_K_M``);
    the ``LLAMA_FTYPE_GUESSED`` bit ignored."""
    try:
        name = gguf.LlamaFileType(value & ~gguf.LlamaFileType.GUESSED).name
    except ValueError:
        return None
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def _sampling(fields: dict[str, Any]) -> SamplingDefaults:
    g = gguf.Keys.General

    def number(key: str, kind: type[int] | type[float]) -> Any:
        value = fields.get(key)
        return None if value is None or isinstance(value, (str, list, _Long)) else kind(value)

    return SamplingDefaults(
        sequence=_optional(fields, g.SAMPLING_SEQUENCE),
        top_k=number(g.SAMPLING_TOP_K, int),
        top_p=number(g.SAMPLING_TOP_P, float),
        min_p=number(g.SAMPLING_MIN_P, float),
        xtc_probability=number(g.SAMPLING_XTC_PROBABILITY, float),
        xtc_threshold=number(g.SAMPLING_XTC_THRESHOLD, float),
        temp=number(g.SAMPLING_TEMP, float),
        penalty_last_n=number(g.SAMPLING_PENALTY_LAST_N, int),
        penalty_repeat=number(g.SAMPLING_PENALTY_REPEAT, float),
        mirostat=number(g.SAMPLING_MIROSTAT, int),
        mirostat_tau=number(g.SAMPLING_MIROSTAT_TAU, float),
        mirostat_eta=number(g.SAMPLING_MIROSTAT_ETA, float),
    )
