"""Small valid GGUF files for tests that read names and metadata, not weights (gguf-py's
``GGUFWriter``, the writer llama.cpp ships): the keys llama.cpp requires of a model, a chat
template and sampling defaults if asked, and one tiny tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np


def write_gguf(path: Path, *, arch: str = "llama", context: int = 2048, template: str | None = None,
               file_type: gguf.LlamaFileType = gguf.LlamaFileType.MOSTLY_Q4_K_M, name: str | None = None,
               sampling: dict[str, Any] | None = None, split: tuple[int, int] | None = None,
               pad: int = 0) -> Path:
    """Write a GGUF model file of ``arch`` with ``context`` tokens of trained context.

    Args:
        template: ``tokenizer.chat_template`` (None: no key).
        sampling: ``general.sampling.*`` values by gguf-py's names (``temp``, ``top_k``, ...).
        split: ``(index, count)`` for one part of a split model (index from 1): ``split.*`` keys.
        pad: bytes of tensor data (the file's size grows by as much).

    Returns:
        ``path``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(context)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(1)
    writer.add_file_type(file_type)
    if name is not None:
        writer.add_name(name)
    if template is not None:
        writer.add_chat_template(template)
    for key, value in (sampling or {}).items():
        getattr(writer, f"add_sampling_{key}")(value)
    if split is not None:
        writer.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_NO, split[0] - 1)
        writer.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, split[1])
    writer.add_tensor("token_embd.weight", np.zeros(max(1, pad // 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
