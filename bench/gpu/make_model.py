"""A Llama-shaped GGUF with random weights and a real tokenizer: the speed of a real model, no download.

The GPU run (``bench/gpu/run.sh``) has no network, and the bundled SmolLM2-135M is too small to
load a GPU. This writes a model of llama.cpp's ``llama`` architecture whose body has the shape of
a known model (``--shape 1b``: Llama 3.2 1B's, 16 layers of width 2048, 32 query and 8 key/value
heads, feed-forward 8192) with SmolLM2's tokenizer and chat template (49,152 tokens, ChatML) copied
from a GGUF (``--vocab``: the bundled model, or the tokenizer-only ``vocab.gguf`` that
``bench/gpu/pack.py`` writes with :func:`write_vocab`). Its tokens are noise; the work per token
(matrix shapes, KV cache, attention) is that of the real shape, so throughput is real.

Weights are F16 (matrices) and F32 (norms), as llama.cpp's converter writes an F16 model; the
matrices are normal with standard deviation 0.02 (the Hugging Face initialisation of Llama), RMS
norm weights 1, the output projection tied to the token embedding (llama.cpp uses
``token_embd.weight`` when ``output.weight`` is absent). The embedding rows of the tokenizer's
control tokens (``<|endoftext|>``, ``<|im_end|>``...) are zero, so their logit is exactly 0 while
the largest of the other 49,135 is positive: greedy decoding never ends a stream early, and
every request runs to ``max_tokens`` on both servers.

Run (``gguf`` is llama.cpp's gguf-py: the project's venv has it; the GPU run takes it from the
cargo)::

    python bench/gpu/make_model.py --vocab VOCAB.gguf --shape 1b --out model.gguf

Prints one line: the file, its parameters and bytes. ``--shape tiny`` (2 layers of width 64) is
for rehearsals and tests.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np

INIT_STD = 0.02
"""Standard deviation of every weight matrix (``initializer_range`` of Hugging Face's LlamaConfig)."""


@attrs.frozen
class Shape:
    """A Llama body: width, layers, heads, feed-forward width (the vocabulary comes from ``--vocab``)."""

    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int = 8192
    rope_freq_base: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def tensors(self, n_vocab: int) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Name and numpy shape (rows = output features) of every tensor, in file order."""
        kv = self.n_head_kv * self.head_dim
        yield "token_embd.weight", (n_vocab, self.n_embd)
        for i in range(self.n_layer):
            yield f"blk.{i}.attn_norm.weight", (self.n_embd,)
            yield f"blk.{i}.attn_q.weight", (self.n_embd, self.n_embd)
            yield f"blk.{i}.attn_k.weight", (kv, self.n_embd)
            yield f"blk.{i}.attn_v.weight", (kv, self.n_embd)
            yield f"blk.{i}.attn_output.weight", (self.n_embd, self.n_embd)
            yield f"blk.{i}.ffn_norm.weight", (self.n_embd,)
            yield f"blk.{i}.ffn_gate.weight", (self.n_ff, self.n_embd)
            yield f"blk.{i}.ffn_up.weight", (self.n_ff, self.n_embd)
            yield f"blk.{i}.ffn_down.weight", (self.n_embd, self.n_ff)
        yield "output_norm.weight", (self.n_embd,)


SHAPES = {
    "1b": Shape(n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192),  # Llama 3.2 1B (config.json)
    "tiny": Shape(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=128),
}
"""The shapes ``--shape`` names. With SmolLM2's 49,152 tokens, ``1b`` has 1.07 billion parameters
(2.1 GB in F16)."""


def tokenizer_fields(path: Path) -> list[tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """The ``tokenizer.*`` key-value pairs of the GGUF at ``path`` (tokens, merges, types, special ids,
    chat template): ``(key, value, type, array element type)`` each, as ``GGUFWriter.add_key_value``
    takes them.

    Raises:
        ValueError: the file has no ``tokenizer.ggml.tokens``.
    """
    reader = gguf.GGUFReader(path)
    fields = []
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            fields.append((field.name, field.contents(), vtype, sub))
    if not any(name == gguf.Keys.Tokenizer.LIST for name, *_ in fields):
        raise ValueError(f"{path} has no {gguf.Keys.Tokenizer.LIST}")
    return fields


def write_vocab(source: Path, dest: Path) -> int:
    """Write ``source``'s tokenizer (:func:`tokenizer_fields`) to ``dest``, a GGUF with no tensors.

    Returns:
        The size of ``dest`` in bytes.
    """
    writer = gguf.GGUFWriter(dest, "llama")
    for key, value, vtype, sub in tokenizer_fields(source):
        writer.add_key_value(key, value, vtype, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return dest.stat().st_size


def write_model(vocab: Path, dest: Path, shape: Shape, seed: int = 0) -> int:
    """Write the random-weight model (module docstring) to ``dest``, one tensor at a time.

    Args:
        vocab: a GGUF with the tokenizer to copy (:func:`tokenizer_fields`).
        dest: the model file to write.
        shape: the body's shape.
        seed: the random generator's seed (the same seed writes the same file).

    Returns:
        The number of parameters.
    """
    fields = tokenizer_fields(vocab)
    values = {key: value for key, value, _, _ in fields}
    n_vocab = len(values[gguf.Keys.Tokenizer.LIST])
    control = np.flatnonzero(np.asarray(values[gguf.Keys.Tokenizer.TOKEN_TYPE]) == gguf.TokenType.CONTROL)
    writer = gguf.GGUFWriter(dest, "llama")
    writer.add_name(f"random {shape.n_layer}x{shape.n_embd}")
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_freq_base)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value, vtype, sub in fields:
        writer.add_key_value(key, value, vtype, sub_type=sub)
    tensors = list(shape.tensors(n_vocab))
    for name, dims in tensors:
        dtype = np.dtype(np.float32 if len(dims) == 1 else np.float16)
        writer.add_tensor_info(name, dims, dtype, int(np.prod(dims)) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    params = 0
    for name, dims in tensors:
        if len(dims) == 1:
            data = np.ones(dims, np.float32)
        else:
            weights = rng.standard_normal(dims, dtype=np.float32)
            weights *= INIT_STD
            if name == "token_embd.weight":
                weights[control] = 0.0
            data = weights.astype(np.float16)
        params += int(np.prod(dims))
        writer.write_tensor_data(data)
    writer.close()
    return params


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=Path, required=True,
                    help="a GGUF whose tokenizer and chat template are copied")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    params = write_model(args.vocab, args.out, SHAPES[args.shape], args.seed)
    print(f"wrote {args.out}: {args.shape} ({params / 1e9:.3f} B parameters, F16),"
          f" {args.out.stat().st_size / 2**20:.0f} MiB in {time.monotonic() - t0:.1f} s")


if __name__ == "__main__":
    main()
