"""A node without the model folder copies it from a folder or a URL (a real HTTP server on 127.0.0.1) and
checks every context and section against its checksums first: a damaged copy is refused and removed."""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from quiver.t2t.batch import BatchDecoder
from quiver.t2t.export import ExportOptions, export
from quiver.t2t.model_source import ModelSourceError, ensure_model_folder
from tests.support.tiny_llm import tiny_adapter, tiny_decoder

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("source")
    weights = tiny_decoder(root / "model", "LlamaForCausalLM")
    tiny_adapter(root / "qv", weights, 2, ["q_proj", "v_proj"], seed=2)
    return export(root / "model", root / "out", {"qv": root / "qv"}, options=ExportOptions(context_size=64)).path


@pytest.fixture()
def served_folder(exported: Path, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A copy of the exported folder behind a real HTTP server on 127.0.0.1 (its URL, its folder)."""
    folder = tmp_path / "published"
    shutil.copytree(exported.parent, folder)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", folder
    finally:
        server.shutdown()
        thread.join(10)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_an_existing_config_is_used_as_it_is(exported: Path) -> None:
    assert ensure_model_folder(exported, "http://127.0.0.1:9/unused") == exported


def test_a_missing_folder_is_copied_from_a_folder_and_from_a_url(exported: Path, served_folder: tuple[str, Path],
                                                                 tmp_path: Path) -> None:  # fmt: skip
    url, _ = served_folder
    for source, where in ((str(exported.parent), "from_folder"), (url, "from_url")):
        config = tmp_path / where / "smollm" / "genie_config.json"
        assert ensure_model_folder(config, source) == config
        assert _files(config.parent) == _files(exported.parent)  # every file, the chat template's included
        decoder = BatchDecoder.from_config(config, max_batch=1)  # a model that runs, adapters and all
        assert decoder.adapters.names == ["qv"]
        decoder.close()
    assert not [p for p in tmp_path.rglob(".smollm.*")]  # no staging folder left


def test_a_damaged_copy_is_refused_and_removed(served_folder: tuple[str, Path], tmp_path: Path) -> None:
    url, folder = served_folder
    context = next(folder.glob("*.qctx"))
    data = bytearray(context.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside the weights
    context.write_bytes(bytes(data))
    config = tmp_path / "node" / "model" / "genie_config.json"
    with pytest.raises(ModelSourceError, match="damaged"):
        ensure_model_folder(config, url)
    assert not config.parent.exists() and not list((tmp_path / "node").iterdir())


def test_sources_that_cannot_be_used_are_clear_errors(served_folder: tuple[str, Path], tmp_path: Path) -> None:
    url, folder = served_folder
    config = tmp_path / "node" / "model" / "genie_config.json"
    with pytest.raises(ModelSourceError, match="no source"):
        ensure_model_folder(config, None)
    with pytest.raises(ModelSourceError, match="cannot copy genie_config.json"):
        ensure_model_folder(config, f"{url}/nothing-here")
    with pytest.raises(ModelSourceError, match="give a folder or a file://"):
        ensure_model_folder(config, "ftp://127.0.0.1/model")
    dialog = json.loads((folder / "genie_config.json").read_text())
    dialog["dialog"]["tokenizer"]["path"] = "../../outside.json"  # a config reaching out of its folder
    (folder / "genie_config.json").write_text(json.dumps(dialog))
    with pytest.raises(ModelSourceError, match="outside its folder: refused"):
        ensure_model_folder(config, url)
    (folder / "genie_config.json").write_text('{"dialog": {}}')
    with pytest.raises(ModelSourceError, match="not one Quiver can serve"):
        ensure_model_folder(config, url)
    assert not (tmp_path / "node" / "model").exists()


def test_two_processes_copying_at_once_leave_one_folder(served_folder: tuple[str, Path], tmp_path: Path) -> None:
    """Replicas starting together on one node: both get the config, the first rename wins, no staging left."""
    url, _ = served_folder
    config = tmp_path / "node" / "model" / "genie_config.json"
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: ensure_model_folder(config, url), range(3)))
    assert results == [config] * 3
    assert [p.name for p in (tmp_path / "node").iterdir()] == ["model"]
