"""engine/gguf.py: a GGUF's metadata read without llama.cpp, on files gguf-py writes and on the real
models (checked against gguf-py's own ``GGUFReader``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from ringserve.core.modelinfo import SamplingDefaults
from ringserve.engine.gguf import read_gguf
from ringserve.engine.modelfile import ModelFileError
from tests.support.models import gemma_path, smollm2_path


def write_model(
    path: Path,
    arch: str = "llama",
    *,
    n_layer: int = 4,
    keys: Callable[[gguf.GGUFWriter], Any] | None = None,
    tied: bool = False,
    split_max_tensors: int = 0,
    context: bool = True,
) -> Path:
    """A tiny model of ``n_layer`` layers (8-wide, 2 heads) with float32 tensors: token_embd (16 x 8),
    per layer attn_q (8 x 8) and attn_norm (8), output_norm (8) and, unless ``tied``, output (16 x 8)."""
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    if context:
        w.add_context_length(2048)
    w.add_block_count(n_layer)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_name("Tiny Test")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_token_list([f"t{i}" for i in range(16)])
    if keys is not None:
        keys(w)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    for il in range(n_layer):
        w.add_tensor(f"blk.{il}.attn_q.weight", np.zeros((8, 8), np.float32))
        w.add_tensor(f"blk.{il}.attn_norm.weight", np.zeros(8, np.float32))
    w.add_tensor("output_norm.weight", np.zeros(8, np.float32))
    if not tied:
        w.add_tensor("output.weight", np.zeros((16, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_shape_and_tensor_bytes(tmp_path: Path) -> None:
    info = read_gguf(write_model(tmp_path / "tiny.gguf"))
    assert (
        info.paths == (tmp_path / "tiny.gguf",) and info.file_bytes == (tmp_path / "tiny.gguf").stat().st_size
    )
    assert (info.architecture, info.name, info.file_type) == ("llama", "Tiny Test", "Q4_K_M")
    assert (info.n_ctx_train, info.n_layer, info.n_embd, info.n_vocab) == (2048, 4, 8, 16)
    assert info.n_head == info.n_head_kv == (2, 2, 2, 2)  # head_count_kv defaults to head_count
    assert (info.key_length, info.value_length) == (4, 4)  # n_embd / n_head
    # each tensor padded to the 32-byte alignment: 256 + 32 (attn_norm: 32 bytes) per layer
    assert info.layer_bytes == (288,) * 4
    assert (info.input_bytes, info.output_bytes, info.tied_output) == (512, 32 + 512, False)
    assert info.token_embd_bytes == 512
    assert (info.n_swa, info.swa_layers, info.kv_unknown) == (0, (False,) * 4, None)
    assert info.chat_template is None and info.sampling == SamplingDefaults()


def test_sampling_keys_and_chat_template(tmp_path: Path) -> None:
    def keys(w: gguf.GGUFWriter) -> None:
        g = gguf.Keys.General
        w.add_float32(g.SAMPLING_TEMP, 0.7)
        w.add_int32(g.SAMPLING_TOP_K, 20)
        w.add_float32(g.SAMPLING_TOP_P, 0.8)
        w.add_string(g.SAMPLING_SEQUENCE, "edkypmxt")
        w.add_uint32(g.SAMPLING_PENALTY_LAST_N, 64)
        w.add_chat_template("{{ messages }}")

    info = read_gguf(write_model(tmp_path / "s.gguf", keys=keys))
    assert info.sampling == SamplingDefaults(
        sequence="edkypmxt", top_k=20, top_p=0.8, temp=0.7, penalty_last_n=64
    )
    assert info.chat_template == "{{ messages }}"


def test_per_layer_kv_heads_and_head_widths(tmp_path: Path) -> None:
    def keys(w: gguf.GGUFWriter) -> None:
        w.add_head_count_kv([2, 1, 0, 1])
        w.add_key_length(16)
        w.add_value_length(8)

    info = read_gguf(write_model(tmp_path / "h.gguf", keys=keys))
    assert info.n_head_kv == (2, 1, 0, 1)
    assert [info.kv_width(il) for il in range(4)] == [(32, 16), (16, 8), (0, 0), (16, 8)]


@pytest.mark.parametrize(("n_layer", "expected"), [(12, (True,) * 5 + (False,) + (True,) * 5 + (False,))])
def test_gemma3_sliding_window_every_sixth_layer_full(
    tmp_path: Path, n_layer: int, expected: tuple[bool, ...]
) -> None:
    info = read_gguf(
        write_model(tmp_path / "g.gguf", "gemma3", n_layer=n_layer, keys=lambda w: w.add_sliding_window(512))
    )
    assert (info.n_swa, info.swa_layers, info.kv_unknown) == (512, expected, None)


def test_gemma3_without_a_window_has_none(tmp_path: Path) -> None:
    info = read_gguf(write_model(tmp_path / "g.gguf", "gemma3"))
    assert (info.n_swa, info.swa_layers) == (0, (False,) * 4)


def test_gemma2_window_defaults_and_alternates(tmp_path: Path) -> None:
    info = read_gguf(write_model(tmp_path / "g2.gguf", "gemma2"))
    assert (info.n_swa, info.swa_layers) == (4096, (True, False, True, False))


def test_a_pattern_array_in_the_file_wins(tmp_path: Path) -> None:
    def keys(w: gguf.GGUFWriter) -> None:
        w.add_sliding_window(128)
        w.add_array(
            gguf.Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch="gpt-oss"), [False, True, True, False]
        )

    info = read_gguf(write_model(tmp_path / "o.gguf", "gpt-oss", keys=keys))
    assert (info.n_swa, info.swa_layers) == (128, (False, True, True, False))


def test_a_window_this_reader_does_not_know_is_unknown(tmp_path: Path) -> None:
    info = read_gguf(write_model(tmp_path / "x.gguf", "newarch", keys=lambda w: w.add_sliding_window(256)))
    assert info.kv_unknown == "newarch has a sliding window whose layers this estimate does not know"
    ignored = read_gguf(write_model(tmp_path / "p.gguf", "phi3", keys=lambda w: w.add_sliding_window(2047)))
    assert (ignored.n_swa, ignored.kv_unknown) == (0, None)


def test_recurrent_models_keep_their_state_shape_and_are_not_estimated(tmp_path: Path) -> None:
    def keys(w: gguf.GGUFWriter) -> None:
        w.add_ssm_conv_kernel(4)
        w.add_ssm_inner_size(16)
        w.add_ssm_state_size(8)

    info = read_gguf(write_model(tmp_path / "m.gguf", "mamba", keys=keys))
    assert info.kv_unknown == "mamba is a recurrent architecture"
    assert info.ssm is not None and (info.ssm.conv_kernel, info.ssm.inner_size, info.ssm.state_size) == (
        4,
        16,
        8,
    )


def test_latent_attention_is_not_estimated(tmp_path: Path) -> None:
    info = read_gguf(write_model(tmp_path / "d.gguf", "deepseek2", keys=lambda w: w.add_kv_lora_rank(512)))
    assert info.kv_unknown == "deepseek2 uses latent attention"


def test_tied_output(tmp_path: Path) -> None:
    info = read_gguf(write_model(tmp_path / "t.gguf", tied=True))
    assert info.tied_output and info.output_bytes == 32


def test_split_model_reads_every_part(tmp_path: Path) -> None:
    whole = read_gguf(write_model(tmp_path / "whole.gguf"))
    write_model(tmp_path / "split.gguf", split_max_tensors=4)
    parts = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(parts) == 3  # 11 tensors, 4 per part
    info = read_gguf(parts[0])
    assert info.paths == tuple(parts) and info.file_bytes == sum(p.stat().st_size for p in parts)
    assert (info.layer_bytes, info.input_bytes, info.output_bytes) == (
        whole.layer_bytes,
        whole.input_bytes,
        whole.output_bytes,
    )
    parts[2].unlink()
    with pytest.raises(ModelFileError, match="model file not found") as exc:
        read_gguf(parts[0])
    assert str(parts[2]) in str(exc.value)


def test_a_truncated_file_is_one_line_naming_it(tmp_path: Path) -> None:
    path = write_model(tmp_path / "cut.gguf")
    data = path.read_bytes()
    for cut in (20, 200, len(data) - 100):
        path.write_bytes(data[:cut])
        with pytest.raises(
            ModelFileError, match=r"cannot read the GGUF metadata \(.*\): .*cut\.gguf$"
        ) as exc:
            read_gguf(path)
        assert "\n" not in str(exc.value) and exc.value.path == path
        assert "unpack_from" not in str(exc.value)  # (struct's words for a read past the end)


def test_a_missing_required_key_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match=r"\(no llama\.context_length\)"):
        read_gguf(write_model(tmp_path / "nc.gguf", context=False))


def test_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        read_gguf(tmp_path / "x.gguf")


def test_the_bundled_model_as_gguf_py_reads_it() -> None:
    path = smollm2_path()
    info = read_gguf(path)
    reader = gguf.GGUFReader(path)
    assert info.n_vocab == len(reader.fields["tokenizer.ggml.tokens"].data)
    assert info.chat_template == reader.fields["tokenizer.chat_template"].contents()
    assert (
        info.weights_bytes == reader.tensors[-1].data_offset + reader.tensors[-1].n_bytes - reader.data_offset
    )
    assert (info.architecture, info.n_ctx_train, info.n_layer, info.n_embd) == ("llama", 8192, 30, 576)
    assert (info.n_head[0], info.n_head_kv[0], info.key_length, info.file_type) == (9, 3, 64, "Q4_1")


def test_gemma3_270m() -> None:
    info = read_gguf(gemma_path())
    assert (info.architecture, info.name, info.file_type, info.n_ctx_train) == (
        "gemma3",
        "Gemma 3 270m",
        "Q4_K_M",
        32768,
    )
    assert (info.n_layer, info.n_vocab, info.n_swa, info.key_length, info.n_head_kv[0]) == (
        18,
        262144,
        512,
        256,
        1,
    )
    assert [il for il in range(18) if not info.swa_layers[il]] == [5, 11, 17]
    assert info.tied_output and info.chat_template is None and info.kv_unknown is None
