"""A GGUF file's parsed metadata (`hal.models.gguf_file`): what the cache gives back is what
``gguf.GGUFReader`` reads, fields and tensor data alike, and a changed file is parsed again."""

import os

import gguf
import numpy as np
import pytest

from hal.models import gguf_file


def write(path, tokens, scale=1.0):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.5)
    w.add_token_list(tokens)
    x = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32) * scale
    w.add_tensor("a.weight", x)
    q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q4_1)
    w.add_tensor("b.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def same_as_the_reader(f, path):
    r = gguf.GGUFReader(str(path))
    assert f.fields == {k: v.contents() for k, v in r.fields.items() if not k.startswith("GGUF.")}
    assert [t.name for t in f.tensors] == [t.name for t in r.tensors]
    for mine, theirs in zip(f.tensors, r.tensors):
        assert mine.kind == theirs.tensor_type.name and mine.shape == [int(d) for d in reversed(theirs.shape)]
        got = f.data(mine)
        assert got.dtype == theirs.data.dtype and np.array_equal(got, theirs.data)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HAL_CACHE", str(tmp_path / "cache"))
    gguf_file._open.cache_clear()
    yield tmp_path / "cache" / "gguf"
    gguf_file._open.cache_clear()


def test_the_cached_table_is_what_the_reader_reads(tmp_path, cache):
    path = tmp_path / "m.gguf"
    write(path, ["a", "b", "<|im_end|>"])
    same_as_the_reader(gguf_file.open_gguf(path), path)          # parsed
    assert len(list(cache.glob("*.json"))) == 1
    gguf_file._open.cache_clear()
    same_as_the_reader(gguf_file.open_gguf(path), path)          # read back from $HAL_CACHE


def test_a_changed_file_is_parsed_again(tmp_path, cache):
    path = tmp_path / "m.gguf"
    write(path, ["a", "b"])
    first = gguf_file.open_gguf(path)
    write(path, ["a", "b", "c", "d"], scale=2.0)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # a coarse clock still sees a new version
    again = gguf_file.open_gguf(path)
    assert again.field("tokenizer.ggml.tokens") == ["a", "b", "c", "d"] != first.field("tokenizer.ggml.tokens")
    same_as_the_reader(again, path)


def test_a_damaged_cache_file_is_parsed_again(tmp_path, cache):
    path = tmp_path / "m.gguf"
    write(path, ["a"])
    gguf_file.open_gguf(path)
    for f in cache.glob("*.json"):
        f.write_text("{not json")
    gguf_file._open.cache_clear()
    same_as_the_reader(gguf_file.open_gguf(path), path)
