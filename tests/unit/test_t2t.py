"""Text generation (quiver.t2t) on tiny seeded models, against an independent numpy forward pass."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import quiver
from quiver.t2t.config import dialog_config_document, read_dialog_config
from quiver.t2t.dialog import Dialog
from quiver.t2t.export import ExportOptions, export
from quiver.t2t.graph import past_names, present_names
from quiver.t2t.sampling import Sampler, Sampling
from quiver.t2t.tokenizer import TextTokenizer
from tests.support import ROOT
from tests.support.tiny_llm import HEAD_DIM, KV_HEADS, LAYERS, TEXT, forward, tiny_adapter, tiny_decoder

PROMPT = "the quick brown fox"
CONTEXT = 64


@dataclasses.dataclass
class Tiny:
    folder: Path
    out: Path
    weights: dict[str, np.ndarray]
    deltas: dict[str, dict[str, np.ndarray]]

    @property
    def config(self) -> Path:
        return self.out / "genie_config.json"


def _make(root: Path, architecture: str, adapters: bool) -> Tiny:
    folder = root / "model"
    weights = tiny_decoder(folder, architecture)
    deltas = {}
    if adapters:
        deltas["all"] = tiny_adapter(
            root / "all",
            weights,
            4,
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            seed=1,
        )
        deltas["qv"] = tiny_adapter(root / "qv", weights, 2, ["q_proj", "v_proj"], seed=2)
    export(folder, root / "out", {n: root / n for n in deltas}, options=ExportOptions(context_size=CONTEXT))
    return Tiny(folder, root / "out", weights, deltas)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    return _make(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM", adapters=True)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    return _make(tmp_path_factory.mktemp("qwen"), "Qwen2ForCausalLM", adapters=False)


def _numpy_greedy(weights: dict[str, np.ndarray], ids: list[int], count: int, delta: dict | None = None) -> list[int]:
    history, new = list(ids), []
    for _ in range(count):
        token = int(np.argmax(forward(weights, history, delta)))
        new.append(token)
        history.append(token)
    return new


def _kv_cache() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """An empty KV cache, and the same arrays as the presents' output buffers (appended in place)."""
    cache = {n: np.zeros((1, KV_HEADS, CONTEXT, HEAD_DIM), np.float32) for i in range(LAYERS) for n in past_names(i)}
    return cache, {present_names(i)[j]: cache[past_names(i)[j]] for i in range(LAYERS) for j in (0, 1)}


def _scaled(delta: dict[str, np.ndarray], strength: float) -> dict[str, np.ndarray]:
    return {name: value * strength for name, value in delta.items()}


@pytest.mark.parametrize("model", ["llama", "qwen"])
def test_greedy_generation_follows_the_numpy_forward_pass(model: str, request: pytest.FixtureRequest) -> None:
    tiny: Tiny = request.getfixturevalue(model)
    with Dialog.from_config(tiny.config) as dialog:
        result = dialog.query(PROMPT, max_new_tokens=12, min_new_tokens=12, greedy=True)
    assert result.prompt_ids == dialog.tokenizer.encode(PROMPT)
    assert result.new_ids == _numpy_greedy(tiny.weights, result.prompt_ids, 12)


def test_prefill_and_decode_logits_match_the_numpy_forward_pass(llama: Tiny) -> None:
    with quiver.Context.from_binary(llama.out / "model.qctx") as context:
        cache, out = _kv_cache()
        ids = [5, 17, 42, 8]
        for graph, chunk, total in (("prefill", ids[:3], 3), ("decode", ids[3:], 4)):
            feeds = {
                "input_ids": np.array([chunk], np.int64),
                "seqlens_k": np.array([total - 1], np.int32),
                "total_sequence_length": np.array(total, np.int32),
                **cache,
            }
            result = context.graph(graph).execute(feeds, out=out)
            np.testing.assert_allclose(result["logits"][0, 0], forward(llama.weights, ids[:total]), atol=2e-4)
            assert all(result[name] is array for name, array in out.items())  # written in place, not copied
        assert np.count_nonzero(cache["past_key_values.0.key"][0, :, :4]) > 0
        assert not cache["past_key_values.0.key"][0, :, 4:].any()  # nothing beyond the four positions fed


def test_a_long_prompt_is_prefilled_in_chunks_with_the_same_result(llama: Tiny) -> None:
    config = read_dialog_config(llama.config)
    prompt = " ".join(TEXT[:2])
    results = []
    for window in (128, 3):
        with Dialog(dataclasses.replace(config, prefill_window=window)) as dialog:
            results.append(dialog.query(prompt, max_new_tokens=6, min_new_tokens=6, greedy=True).new_ids)
    assert results[0] == results[1]
    assert results[0] == _numpy_greedy(llama.weights, TextTokenizer(config.tokenizer).encode(prompt), 6)


@pytest.mark.parametrize("model", ["llama", "qwen"])  # q/k/v apart (adapters on them), and packed
def test_the_reference_backend_generates_the_same_tokens(model: str, request: pytest.FixtureRequest) -> None:
    config = read_dialog_config(request.getfixturevalue(model).config)
    outputs = []
    for backend in ("cpu", "reference"):
        with Dialog(dataclasses.replace(config, backend=backend, prefill_window=4)) as dialog:
            outputs.append(dialog.query(PROMPT, max_new_tokens=5, min_new_tokens=5, greedy=True).new_ids)
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("adapter", ["all", "qv"])
def test_adapters_and_strengths_follow_the_numpy_forward_pass(llama: Tiny, adapter: str) -> None:
    with Dialog.from_config(llama.config) as dialog:
        ids = dialog.tokenizer.encode(PROMPT)
        dialog.apply_lora(adapter)
        applied = dialog.token_query(ids, max_new_tokens=8, min_new_tokens=8, greedy=True).new_ids
        dialog.set_lora_strength(adapter, 0.5)
        half = dialog.token_query(ids, max_new_tokens=8, min_new_tokens=8, greedy=True).new_ids
        dialog.set_lora_strength(adapter, 0.0)
        off = dialog.token_query(ids, max_new_tokens=8, min_new_tokens=8, greedy=True).new_ids
    delta = llama.deltas[adapter]
    assert applied == _numpy_greedy(llama.weights, ids, 8, delta)
    assert half == _numpy_greedy(llama.weights, ids, 8, _scaled(delta, 0.5))
    assert off == _numpy_greedy(llama.weights, ids, 8)
    assert applied != off


def test_prefill_and_decode_share_every_weight(llama: Tiny) -> None:
    with quiver.Context.from_binary(llama.out / "model.qctx") as context:
        graphs = context.file.graphs
        assert sorted(graphs) == ["batch", "decode", "prefill"]
        prefill, decode, batch = graphs["prefill"].weights, graphs["decode"].weights, graphs["batch"].weights
        assert prefill == decode  # every tensor name maps to the same stored weight
        # the batched graph too: its adapter tables are inputs, not weights; only a few shape constants are its own
        assert all(prefill[name] == index for name, index in batch.items() if name in prefill)
        own = {index for name, index in batch.items() if name not in prefill} - set(prefill.values())
        assert len(set(prefill.values()) | own) == len(context.file.weights)
        assert sum(context.file.weights[i].length for i in own) < 1024


def test_sampling_is_seeded_and_top_k_1_is_greedy(llama: Tiny) -> None:
    def fresh(dialog: Dialog, **options: object) -> list[int]:
        dialog.reset()  # each query starts a new conversation
        return dialog.query(PROMPT, max_new_tokens=10, **options).new_ids  # type: ignore[arg-type]

    with Dialog.from_config(llama.config) as dialog:
        runs = [fresh(dialog, greedy=False, temperature=1.5, seed=s) for s in (1, 1, 2)]
        greedy = fresh(dialog, greedy=True)
        top1 = fresh(dialog, greedy=False, temperature=2.0, top_k=1, seed=9)
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert top1 == greedy


def test_sampler_applies_penalty_then_temperature_top_k_and_top_p() -> None:
    logits = np.array([2.0, 1.0, 0.0, -1.0], np.float32)
    assert Sampler(Sampling(greedy=True)).next_token(logits, []) == 0
    # penalty 4 divides token 0's positive logit: 0.5 < 1.0
    assert Sampler(Sampling(greedy=True, repetition_penalty=4.0)).next_token(logits, [0]) == 1
    # top-k 2: only tokens 0 and 1, whatever the temperature
    picks = {
        Sampler(Sampling(greedy=False, temperature=50.0, top_k=2, seed=s)).next_token(logits, []) for s in range(60)
    }
    assert picks == {0, 1}
    # top-p 0.5 keeps the most likely token alone (its probability is 0.64)
    picks = {Sampler(Sampling(greedy=False, top_p=0.5, seed=s)).next_token(logits, []) for s in range(30)}
    assert picks == {0}


@pytest.mark.parametrize(
    "values", [{"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2}, {"repetition_penalty": 0.0}]
)
def test_sampling_values_out_of_range_are_generation_errors(values: dict) -> None:
    with pytest.raises(quiver.GenerationError, match="sampling"):
        Sampling(**values)


def test_streamed_text_never_splits_a_character(llama: Tiny) -> None:
    tokenizer = TextTokenizer(read_dialog_config(llama.config).tokenizer)
    text = TEXT[2]
    ids = tokenizer.encode(text)
    stream = tokenizer.stream()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert len(ids) > len(text.split())  # the emoji and CJK really are split over several tokens


def test_save_and_restore_return_to_the_same_conversation(llama: Tiny) -> None:
    with Dialog.from_config(llama.config) as dialog:
        dialog.query(PROMPT, max_new_tokens=4, greedy=True)
        saved = dialog.save()
        first = dialog.query(" jumps over", max_new_tokens=6, greedy=True)
        dialog.query(" something else entirely", max_new_tokens=3, greedy=True)
        dialog.restore(saved)
        again = dialog.query(" jumps over", max_new_tokens=6, greedy=True)
    assert first.new_ids == again.new_ids


def test_a_second_query_continues_the_dialog(llama: Tiny) -> None:
    with Dialog.from_config(llama.config) as dialog:
        first = dialog.query(PROMPT, max_new_tokens=4, greedy=True)
        second = dialog.query(" over the", max_new_tokens=4, min_new_tokens=4, greedy=True)
    history = first.prompt_ids + first.new_ids + second.prompt_ids
    assert second.new_ids == _numpy_greedy(llama.weights, history, 4)


def test_abort_stops_a_query_from_another_thread(llama: Tiny) -> None:
    with Dialog.from_config(llama.config) as dialog:
        started = threading.Event()

        def on_token(_: str) -> None:
            started.set()
            dialog.abort()

        result = dialog.query(PROMPT, max_new_tokens=40, min_new_tokens=40, greedy=True, on_token=on_token)
    assert started.is_set() and result.stop_reason == "aborted" and len(result.new_ids) < 40


def test_stop_sequences_end_the_text(llama: Tiny) -> None:
    with Dialog.from_config(llama.config) as dialog:
        full = dialog.query(PROMPT, max_new_tokens=12, min_new_tokens=12, greedy=True)
        dialog.reset()
        stop = full.text[len(full.text) // 2 :][:2]
        cut = dialog.query(PROMPT, max_new_tokens=12, min_new_tokens=12, greedy=True, stop=[stop])
    assert cut.stop_reason == "stop-sequence" and cut.text == full.text[: full.text.find(stop)]


def test_streamed_text_never_shows_a_stop_string_or_its_beginning(llama: Tiny) -> None:
    """Text that may begin a stop string is held back until it does not: the pieces streamed are the
    final text exactly (a stop string split over tokens never leaks its first characters)."""
    with Dialog.from_config(llama.config) as dialog:
        full = dialog.query(PROMPT, max_new_tokens=12, min_new_tokens=12, greedy=True)
        for start in range(1, len(full.text) - 2):
            stop = full.text[start : start + 3]
            dialog.reset()
            pieces: list[str] = []
            cut = dialog.query(PROMPT, max_new_tokens=12, min_new_tokens=12, greedy=True, stop=[stop],
                               on_token=pieces.append)  # fmt: skip
            assert "".join(pieces) == cut.text == full.text[: full.text.find(stop)]
        dialog.reset()
        pieces = []
        never = dialog.query(PROMPT, max_new_tokens=12, min_new_tokens=12, greedy=True, stop=[full.text[-2:] + "#"],
                             on_token=pieces.append)  # fmt: skip
    assert "".join(pieces) == never.text == full.text  # held back, then released at the end


def test_bad_queries_and_adapters_are_generation_errors(llama: Tiny) -> None:
    with Dialog.from_config(llama.config) as dialog:
        with pytest.raises(quiver.GenerationError, match="does not fit the context"):
            dialog.token_query([5] * CONTEXT)
        with pytest.raises(quiver.GenerationError, match="no LoRA adapter 'nope'.*'all', 'qv'"):
            dialog.apply_lora("nope")
        with pytest.raises(quiver.GenerationError, match="apply_lora"):
            dialog.set_lora_strength("all", 0.5)
        dialog.apply_lora("all")
        with pytest.raises(quiver.GenerationError, match="no strength 'nope'"):
            dialog.set_lora_strength("nope", 0.5)
        with pytest.raises(quiver.GenerationError, match="token ids"):
            dialog.token_query([10**6])


def test_output_buffers_are_checked(llama: Tiny) -> None:
    with quiver.Context.from_binary(llama.out / "model.qctx") as context:
        graph = context.graph("decode")
        with pytest.raises(quiver.FeedDTypeError, match="buffer"):
            graph.execute({}, out={"logits": np.zeros((1, 1, 3), np.float64)})
        with pytest.raises(quiver.FeedNameError, match="no output"):
            graph.execute({}, out={"nope": np.zeros(1, np.float32)})


@dataclasses.dataclass
class _Decoding:
    """The decode graph bound after a three-token prefill: write the next token into `token`, `seqlens`
    and `total`, run `step`, read `logits`."""

    step: Any
    token: np.ndarray
    seqlens: np.ndarray
    total: np.ndarray
    logits: np.ndarray
    feeds: dict[str, np.ndarray]
    presents: dict[str, np.ndarray]


IDS_BOUND = [5, 17, 42, 8, 23]


def _bound_decoding(context: quiver.Context, llama: Tiny) -> _Decoding:
    cache, presents = _kv_cache()
    logits = np.zeros((1, 1, llama.weights["model.embed_tokens.weight"].shape[0]), np.float32)
    out = {"logits": logits, **presents}
    context.graph("prefill").execute(
        {"input_ids": np.array([IDS_BOUND[:3]], np.int64), "seqlens_k": np.array([2], np.int32),
         "total_sequence_length": np.array(3, np.int32), **cache},
        out=out,
    )  # fmt: skip
    token, seqlens, total = np.zeros((1, 1), np.int64), np.zeros(1, np.int32), np.zeros((), np.int32)
    feeds = {"input_ids": token, "seqlens_k": seqlens, "total_sequence_length": total, **cache}
    return _Decoding(context.graph("decode").bind(feeds, out), token, seqlens, total, logits, feeds, presents)


def test_a_bound_run_reads_its_arrays_in_place_each_run(llama: Tiny) -> None:
    with quiver.Context.from_binary(llama.out / "model.qctx") as context:
        bound = _bound_decoding(context, llama)
        step, token, seqlens, total, logits = bound.step, bound.token, bound.seqlens, bound.total, bound.logits
        feeds, presents, ids = bound.feeds, bound.presents, IDS_BOUND
        for length in (4, 5):  # new values written into the bound arrays, not new arrays
            token[0, 0], seqlens[0], total[()] = ids[length - 1], length - 1, length
            assert step.run() == {}  # every output landed in its buffer
            np.testing.assert_allclose(logits[0, 0], forward(llama.weights, ids[:length]), atol=2e-4)
        # an output bound without a buffer comes back from each run: a sixth token, 23 again
        unbuffered = context.graph("decode").bind(feeds, presents)
        token[0, 0], seqlens[0], total[()] = 23, 5, 6
        returned = unbuffered.run()
        assert list(returned) == ["logits"]
        np.testing.assert_allclose(returned["logits"][0, 0], forward(llama.weights, [*ids, 23]), atol=2e-4)


def test_a_repeating_run_is_the_bound_run_and_sees_a_section_applied_between_two_steps(llama: Tiny) -> None:
    """`BoundRun.repeating()` (a dialog's decode loop): each call runs on the arrays' values as they are
    then; a section applied between two calls is in the next one, as it would be for `run()`."""
    with quiver.Context.from_binary(llama.out / "model.qctx") as context:
        bound = _bound_decoding(context, llama)
        step, token, seqlens, total, logits = bound.step, bound.token, bound.seqlens, bound.total, bound.logits
        feeds, presents, ids = bound.feeds, bound.presents, IDS_BOUND
        with step.repeating() as decode:
            for length in (4, 5):
                token[0, 0], seqlens[0], total[()] = ids[length - 1], length - 1, length
                decode()
                np.testing.assert_allclose(logits[0, 0], forward(llama.weights, ids[:length]), atol=2e-4)
            base = logits.copy()
            context.apply_binary_section(None, llama.out / "all.qsec")
            decode()  # the fifth token again, now through the adapter
            adapted = logits.copy()
        assert np.abs(adapted - base).max() > 1e-2
        assert step.run() == {}  # the same step by `run()`: what the loop's last call computed
        np.testing.assert_allclose(logits, adapted, rtol=0, atol=1e-6)
        with pytest.raises(quiver.FeedDTypeError, match=r"writes every output into a buffer; bind \['logits'\]"):
            with context.graph("decode").bind(feeds, presents).repeating():
                pass


def test_binding_refuses_what_a_run_could_not_read_in_place(llama: Tiny) -> None:
    with quiver.Context.from_binary(llama.out / "model.qctx") as context:
        graph = context.graph("decode")
        cache, presents = _kv_cache()
        feeds = {"input_ids": np.zeros((1, 1), np.int64), "seqlens_k": np.zeros(1, np.int32),
                 "total_sequence_length": np.zeros((), np.int32), **cache}  # fmt: skip
        out = {"logits": np.zeros(next(o.shape for o in graph.outputs if o.name == "logits"), np.float32), **presents}
        with pytest.raises(quiver.FeedDTypeError, match="bound feed 'seqlens_k' must be a numpy array"):
            graph.bind({**feeds, "seqlens_k": [0]}, out)
        with pytest.raises(quiver.FeedShapeError, match="output 'logits' has shape"):
            graph.bind(feeds, {**out, "logits": np.zeros((1, 2, 3), np.float32)})
        with pytest.raises(quiver.FeedNameError, match="unknown \\['nope'\\]"):
            graph.bind({**feeds, "nope": np.zeros(1, np.float32)}, out)
        with pytest.raises(quiver.FeedDTypeError, match="input 'input_ids' expects int64"):
            graph.bind({**feeds, "input_ids": np.zeros((1, 1), np.int32)}, out)


def test_a_folder_that_is_not_a_causal_lm_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "hidden_size": 8}))
    with pytest.raises(quiver.ModelFolderError, match="BertModel.*not a causal LM"):
        export(tmp_path, tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(quiver.ModelFolderError, match="has no config.json"):
        export(tmp_path / "empty", tmp_path / "out2")
    with pytest.raises(quiver.ModelFolderError, match="is not a folder"):
        export(tmp_path / "missing", tmp_path / "out2")


def test_an_adapter_for_another_model_is_refused(llama: Tiny, tmp_path: Path) -> None:
    foreign = {"model.decoder.layers.0.self_attn.out_proj.weight": np.zeros((8, 8), np.float32)}  # an OPT module
    tiny_adapter(tmp_path / "foreign", foreign, 2, ["out_proj"], seed=0)
    with pytest.raises(quiver.AdapterError, match="not projections of this model"):
        export(llama.folder, tmp_path / "out", {"foreign": tmp_path / "foreign"})


def test_configs_naming_missing_files_or_bad_values_are_config_errors(llama: Tiny, tmp_path: Path) -> None:
    document = json.loads(llama.config.read_text())
    document["dialog"]["engine"]["model"]["binary"]["ctx-bins"] = ["missing.qctx"]
    (llama.out / "c.json").write_text(json.dumps(document))
    with pytest.raises(quiver.DialogConfigError, match="missing.qctx"):
        read_dialog_config(llama.out / "c.json")
    (tmp_path / "moved.json").write_text(llama.config.read_text())  # its relative paths now lead nowhere
    with pytest.raises(quiver.DialogConfigError, match="tokenizer.path names 'tokenizer.json'"):
        read_dialog_config(tmp_path / "moved.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(quiver.DialogConfigError, match="not a readable JSON"):
        read_dialog_config(tmp_path / "bad.json")
    document = json.loads(llama.config.read_text())
    document["dialog"]["context"]["size"] = 10**6
    (llama.out / "huge.json").write_text(json.dumps(document))
    with pytest.raises(quiver.GenerationError, match="exceeds"):
        Dialog.from_config(llama.out / "huge.json")


def test_genie_configs_are_read_and_written_and_qnn_backends_run_on_cpu(llama: Tiny) -> None:
    config = read_dialog_config(llama.config)
    assert config.context_size == CONTEXT and config.eos_tokens == (1,)
    assert set(config.adapters) == {"all", "qv", "base"}  # each adapter's use case, and the base
    document = dialog_config_document(config, llama.out)
    assert document == json.loads(llama.config.read_text())
    document["dialog"]["engine"]["backend"] = {"version": 1, "type": "QnnHtp"}
    (llama.out / "htp.json").write_text(json.dumps(document))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert read_dialog_config(llama.out / "htp.json").backend == "cpu"
    assert any("QnnHtp" in str(w.message) for w in caught)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "quiver", *args], capture_output=True, text=True, timeout=300)


def test_cli_streams_text_and_prints_json(llama: Tiny) -> None:
    greedy = ["t2t", "run", "-c", str(llama.config), "-p", PROMPT, "--greedy", "--max-new-tokens", "6"]
    streamed = _cli(*greedy, "--min-new-tokens", "6")
    assert streamed.returncode == 0, streamed.stderr
    result = _cli(*greedy, "--min-new-tokens", "6", "--json", "-l", "all,all,0.0")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert set(document) >= {"prompt_ids", "new_ids", "text", "prefill_tok_s", "decode_tok_s"}
    assert streamed.stdout.rstrip("\n") == document["text"]  # strength 0: the base model's text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-l", "nope"], "no LoRA adapter"),
        (["--top-p", "3"], "top-p"),
    ],
)
def test_cli_errors_are_one_line(llama: Tiny, args: list[str], message: str) -> None:
    result = _cli("t2t", "run", "-c", str(llama.config), "-p", PROMPT, *args)
    assert result.returncode == 1 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def _set(path: str, value: object) -> Callable[[dict[str, Any]], None]:
    """An edit of the dialog config: `path` is dotted keys under "dialog"."""

    def edit(dialog: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = dialog
        for key in parents:
            node = node[key]
        node[last] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (_set("engine.n-threads", 1_000_000), "engine.n-threads"),
        (_set("context.n-vocab", -1), "context.n-vocab"),
        (_set("context.eos-token", 1_000_000), "context.eos-token"),
        (_set("context.bos-token", 1_000_000), "context.bos-token"),
        (_set("sampler.greedy", "no"), "sampler.greedy"),
        (_set("sampler.seed", -1), "sampler.seed"),
        (_set("sampler.temp", 1e308), "sampler.temp"),
        (_set("engine.backend.type", ["cpu"]), "backend.type"),
        (_set("engine.model.binary.lora.adapters", 3), "lora adapters"),
        (_set("engine.model.binary.lora.groups", 3), "lora groups"),
        (_set("engine.model.binary.lora.groups", [{"name": "g", "members": 3}]), "lora members"),
    ],
)
def test_a_hostile_dialog_config_is_a_one_line_error_naming_the_field(
    llama: Tiny, edit: Callable[[dict[str, Any]], None], field: str
) -> None:
    document = json.loads(llama.config.read_text())
    edit(document["dialog"])
    path = llama.out / f"hostile-{field.replace(' ', '-')}.json"  # beside the real one: its paths resolve
    path.write_text(json.dumps(document))
    result = _cli("t2t", "run", "-c", str(path), "-p", PROMPT)
    assert result.returncode == 1 and field in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_a_deeply_nested_dialog_config_is_a_one_line_error(tmp_path: Path) -> None:
    path = tmp_path / "nested.json"
    path.write_text('{"dialog": ' + "[" * 100_000 + "]" * 100_000 + "}")
    result = _cli("t2t", "run", "-c", str(path), "-p", PROMPT)
    assert result.returncode == 1 and "not a readable JSON" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-l", "all,all,1e308"], "strength 1e+308"),
        (["-l", "all,all,nan"], "strength nan"),
        (["--seed", "-1"], "seed -1"),
        (["--temp", "inf"], "temperature inf"),
    ],
)
def test_hostile_run_flags_are_one_line_errors(llama: Tiny, args: list[str], message: str) -> None:
    result = _cli("t2t", "run", "-c", str(llama.config), "-p", PROMPT, *args)
    assert result.returncode == 1 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_prompt_of_undecodable_bytes_is_a_one_line_error(llama: Tiny) -> None:
    command = [sys.executable, "-m", "quiver", "t2t", "run", "-c", str(llama.config), "-p", b"caf\xe9 \xff"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "not UTF-8" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_tiny_temperature_samples_the_most_likely_token_without_nan(llama: Tiny) -> None:
    args = ["t2t", "run", "-c", str(llama.config), "-p", PROMPT, "--max-new-tokens", "5", "--min-new-tokens", "5"]
    greedy = _cli(*args, "--greedy", "--json")
    tiny = _cli(*args, "--temp", "1e-40", "--seed", "3", "--json")
    assert greedy.returncode == 0 and tiny.returncode == 0, tiny.stderr
    assert json.loads(tiny.stdout)["new_ids"] == json.loads(greedy.stdout)["new_ids"]


def test_cli_export_refuses_a_folder_without_a_model(tmp_path: Path) -> None:
    result = _cli("t2t", "export", "--model", str(tmp_path), "-o", str(tmp_path / "out"))
    assert result.returncode == 1 and "no config.json" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_the_t2t_guides_example_runs_on_a_tiny_llama(llama: Tiny) -> None:
    guide = (ROOT / "docs" / "t2t.md").read_text()
    block = guide[guide.index("```python\n") + 10 :]
    block = block[: block.index("```")]
    code = block.replace("smollm2/genie_config.json", str(llama.config)).replace('"chat"', '"all"')
    exec(compile(code, "docs/t2t.md", "exec"), {})


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("bits", [4, 8])
def test_weight_quantized_exports_stay_close_to_float(llama: Tiny, tmp_path: Path, bits: int, backend: str) -> None:
    config = export(llama.folder, tmp_path, options=ExportOptions(context_size=CONTEXT, weight_bits=bits)).path
    ids = [5, 17, 42, 8, 99]
    with Dialog(dataclasses.replace(read_dialog_config(config), backend=backend)) as dialog:
        ops = {n.op_type for n in dialog._context._require_store().info("decode").skeleton.graph.node}
        # ORT's MatMulNBitsQuantizer writes negative scales, which no encoding holds: left out, not an error
        dialog._context.graph("decode").encodings()
        dialog.token_query(ids, max_new_tokens=1)
        logits = dialog._logits.reshape(-1).astype(np.float64)
    # 4-bit blocks of 32 on Quiver's kernel (MatMul4Bits), 8-bit ones on ORT's MatMulNBits; no float MatMul left
    assert ("MatMul4Bits" if bits == 4 else "MatMulNBits") in ops and "MatMul" not in ops
    want = forward(llama.weights, ids)
    cosine = logits @ want / np.linalg.norm(logits) / np.linalg.norm(want)
    assert cosine > (0.99 if bits == 8 else 0.9), cosine


def test_a_lora_yaml_gives_use_cases_of_several_adapters(llama: Tiny, tmp_path: Path) -> None:
    root = llama.folder.parent
    (tmp_path / "lora.yaml").write_text(
        f"adapter:\n  - name: all\n    lora_config: {root / 'all'}\n  - name: qv\n    lora_config: {root / 'qv'}\n"
        "use-case:\n  - name: base\n    adapter_names: []\n  - name: both\n    adapter_names: [all, qv]\n"
        "    adapter_alphas: [0.5, 1.0]\n"
    )
    result = _cli("t2t", "export", "--model", str(llama.folder), "-o", str(tmp_path / "out"), "--lora-config",
                  str(tmp_path / "lora.yaml"), "--context-size", str(CONTEXT), "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    config = read_dialog_config(tmp_path / "out" / "genie_config.json")
    assert list(config.adapters) == ["both", "base"] and config.adapters["both"].alphas == ("all", "qv")
    assert config.adapters["base"].alphas == ()  # the base use case: a section with every adapter off
    combined = {k: 0.5 * llama.deltas["all"].get(k, 0) + llama.deltas["qv"].get(k, 0) for k in llama.deltas["all"]}
    with Dialog(config) as dialog:
        ids = dialog.tokenizer.encode(PROMPT)
        dialog.apply_lora("both")
        assert dialog.token_query(ids, max_new_tokens=6, min_new_tokens=6, greedy=True).new_ids == _numpy_greedy(
            llama.weights, ids, 6, combined
        )
        dialog.apply_lora("base")
        base = dialog.token_query(ids, max_new_tokens=6, min_new_tokens=6, greedy=True).new_ids
        assert base == _numpy_greedy(llama.weights, ids, 6, {})


def test_strengths_are_set_by_the_alpha_names_a_genie_config_gives(llama: Tiny, tmp_path: Path) -> None:
    document = json.loads(llama.config.read_text())
    for adapter in document["dialog"]["engine"]["model"]["binary"]["lora"]["adapters"]:
        adapter["alphas"] = [f"alpha-{name}" for name in adapter["alphas"]]  # names of the user's choosing
    (llama.out / "alphas.json").write_text(json.dumps(document))
    half = {k: 0.5 * v for k, v in llama.deltas["all"].items()}
    with Dialog.from_config(llama.out / "alphas.json") as dialog:
        ids = dialog.tokenizer.encode(PROMPT)
        dialog.apply_lora("all")
        for strength, deltas in ((1.0, llama.deltas["all"]), (0.5, half), (0.0, {})):
            dialog.set_lora_strength("alpha-all", strength)
            got = dialog.token_query(ids, max_new_tokens=6, min_new_tokens=6, greedy=True).new_ids
            assert got == _numpy_greedy(llama.weights, ids, 6, deltas), strength
        with pytest.raises(quiver.GenerationError, match=r"no strength 'alpha-qv'; its alphas are \['alpha-all'\]"):
            dialog.set_lora_strength("alpha-qv", 1.0)
    greedy = ["t2t", "run", "-c", str(llama.out / "alphas.json"), "-p", PROMPT, "--greedy", "--max-new-tokens", "6",
              "--min-new-tokens", "6", "--json"]  # fmt: skip
    runs = {spec: _cli(*greedy, "-l", spec) for spec in ("all,alpha-all,0.5", "base")}
    assert all(r.returncode == 0 for r in runs.values()), [r.stderr for r in runs.values()]
    ids = json.loads(runs["base"].stdout)["prompt_ids"]
    assert json.loads(runs["all,alpha-all,0.5"].stdout)["new_ids"] == _numpy_greedy(llama.weights, ids, 6, half)
    assert json.loads(runs["base"].stdout)["new_ids"] == _numpy_greedy(llama.weights, ids, 6, {})


def test_generation_stops_at_any_eos_token(llama: Tiny) -> None:
    config = read_dialog_config(llama.config)
    with Dialog(config) as dialog:
        free = dialog.query(PROMPT, max_new_tokens=4, min_new_tokens=4, greedy=True)
    with Dialog(dataclasses.replace(config, eos_tokens=(1, free.new_ids[2]))) as dialog:
        stopped = dialog.query(PROMPT, max_new_tokens=4, greedy=True)
        dialog.reset()
        held = dialog.query(PROMPT, max_new_tokens=4, min_new_tokens=4, greedy=True)
    assert stopped.stop_reason == "eos" and stopped.new_ids == free.new_ids[:3]
    assert held.new_ids != free.new_ids  # min_new_tokens kept the eos token out: another token came instead
    assert stopped.text == dialog.tokenizer.decode(free.new_ids[:2])  # the eos token is not text


def test_queries_from_several_threads_take_turns(llama: Tiny) -> None:
    results: list[int] = []
    with Dialog.from_config(llama.config) as dialog:

        def ask() -> None:
            results.append(len(dialog.query("a", max_new_tokens=3, min_new_tokens=3, greedy=True).new_ids))

        threads = [threading.Thread(target=ask) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert results == [3, 3, 3, 3]
        assert len(dialog.save().history) == 4 * (len(dialog.tokenizer.encode("a")) + 3) - 1  # one conversation


def test_the_models_generation_config_gives_the_sampler_defaults(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    tiny_decoder(folder)
    (folder / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "eos_token_id": [1, 7]})
    )
    config = export(folder, tmp_path / "out", options=ExportOptions(context_size=CONTEXT))
    assert config.sampler.greedy is False and config.sampler.temperature == 0.6 and config.sampler.top_k == 20
    assert config.sampler.top_p == 0.9 and config.eos_tokens == (1, 7)
    (folder / "generation_config.json").write_text("{oops")
    with pytest.raises(quiver.ModelFolderError, match="generation_config.json"):
        export(folder, tmp_path / "out")


def test_a_temperature_samples_even_when_the_config_is_greedy(llama: Tiny) -> None:
    with Dialog.from_config(llama.config) as dialog:
        assert dialog.config.sampler.greedy  # the tiny model ships no generation_config.json
        greedy = dialog.query(PROMPT, max_new_tokens=12)
        sampled = [
            (dialog.reset(), dialog.query(PROMPT, max_new_tokens=12, temperature=3.0, seed=s))[1] for s in range(3)
        ]
    assert any(r.new_ids != greedy.new_ids for r in sampled)


def test_output_buffers_on_sessions_of_the_python_api(llama: Tiny) -> None:
    from quiver.backends.cpu import CpuBackend

    # prepack=False: every session comes from ORT's Python API (IOBinding); logits are not bound here
    with quiver.Context.from_binary(llama.out / "model.qctx", backend=CpuBackend(prepack=False)) as context:
        cache, out = _kv_cache()
        ids = [5, 17, 42]
        feeds = {"input_ids": np.array([ids], np.int64), "seqlens_k": np.array([2], np.int32),
                 "total_sequence_length": np.array(3, np.int32), **cache}  # fmt: skip
        result = context.graph("prefill").execute(feeds, out=out)
    np.testing.assert_allclose(result["logits"][0, 0], forward(llama.weights, ids), atol=2e-4)
    assert all(result[name] is array for name, array in out.items())
    assert (
        np.count_nonzero(cache["past_key_values.1.value"][0, :, :3])
        and not cache["past_key_values.1.value"][0, :, 3:].any()
    )


_FORKED_DIALOG = """
import os, sys
from quiver.t2t.dialog import Dialog
dialog = Dialog.from_config(sys.argv[1])
first = dialog.query("the quick brown fox", max_new_tokens=6, min_new_tokens=6, greedy=True).new_ids
dialog.reset()
pid = os.fork()
again = dialog.query("the quick brown fox", max_new_tokens=6, min_new_tokens=6, greedy=True).new_ids
if pid == 0:
    os._exit(0 if again == first else 1)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status), "parent", int(again == first))
"""


def test_a_dialog_keeps_generating_in_a_forked_child(llama: Tiny) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _FORKED_DIALOG, str(llama.config)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["child", "0", "parent", "1"]


def test_a_dialog_threads_idle_between_its_runs(llama: Tiny) -> None:
    """Its prefill and decode graphs run on sessions of their own: threads spinning on after one's run
    would take the cores from the other's (ORT's otherwise burn ~45 ms of CPU in the 0.1 s after a run)."""
    config = dataclasses.replace(read_dialog_config(llama.config), n_threads=2)
    with Dialog(config) as dialog:
        dialog.query(PROMPT, max_new_tokens=8, min_new_tokens=8, greedy=True)
        dialog.context.wait_until_ready()  # a float model's packed session, made in the background
        dialog.query(PROMPT, max_new_tokens=8, min_new_tokens=8, greedy=True)
        start = time.process_time()
        time.sleep(0.1)
        busy = time.process_time() - start
    assert busy < 0.02


def test_a_dialog_s_prefill_and_decode_graphs_run_on_one_executable(llama: Tiny) -> None:
    """The decode graph is the prefill graph's body with one token: the cpu backend prepares it once (ORT
    packs every session's weights again, shared container or not), and lets it go when both graphs have."""
    from tests.support.helpers import executables

    with Dialog.from_config(llama.config) as dialog:
        prepared = executables(dialog.context)
        assert set(prepared) >= {"prefill", "decode"} and prepared["prefill"] is prepared["decode"]
        shared = prepared["prefill"]
        dialog.context.release_graph("prefill")
        assert shared._session is not None  # the decode graph still runs on it
        dialog.reset()
        assert len(dialog.query(PROMPT, max_new_tokens=4, min_new_tokens=4, greedy=True).new_ids) == 4
    assert shared._session is None  # both let go


def test_a_graph_of_fixed_sizes_another_cannot_take_is_not_shared(llama: Tiny) -> None:
    """Prepared first, the decode graph's session takes one token only: the prefill graph gets its own."""
    from tests.support.helpers import executables

    context = quiver.Context.from_binary(llama.out / "model.qctx", backend=quiver.CpuBackend(lazy_prepack=False))
    try:
        config = read_dialog_config(llama.config)
        feeds = {
            "input_ids": np.array([[1]], np.int64), "seqlens_k": np.array([0], np.int32),
            "total_sequence_length": np.array(1, np.int32),
        }  # fmt: skip
        decode = context.graph("decode")
        caches = {i.name: np.zeros(i.shape, np.float32) for i in decode.inputs if i.name.startswith("past")}
        decode.execute(feeds | caches)
        two = {"input_ids": np.array([[1, 2]], np.int64), "seqlens_k": np.array([1], np.int32),
               "total_sequence_length": np.array(2, np.int32)}  # fmt: skip
        context.graph("prefill").execute(two | caches)
        prepared = executables(context)
        assert prepared["prefill"] is not prepared["decode"] and config.decode_graph == "decode"
    finally:
        context.close()


def test_a_float_dialog_is_packed_in_the_background_and_answers_the_same(llama: Tiny) -> None:
    """Float weights need no packing to compute the same bits: a dialog's first tokens come from the mapped
    weights while ORT packs in the background (lazily, as the backend packs by default)."""
    from quiver.backends.cpu import CpuBackend
    from tests.support.helpers import executables

    with Dialog.from_config(llama.config) as dialog:
        first = dialog.query(PROMPT, max_new_tokens=8, min_new_tokens=8, greedy=True).new_ids
        dialog.context.wait_until_ready()
        assert executables(dialog.context)["prefill"].is_packed
        dialog.reset()
        assert dialog.query(PROMPT, max_new_tokens=8, min_new_tokens=8, greedy=True).new_ids == first
    assert CpuBackend().lazy_prepack


_LEAVING = r"""
import sys, threading, time
from quiver.backends.cpu import executable
from quiver.cli import entry
if sys.argv[1] == "packing":  # a packed session still being made (a thread nothing will join soon)
    threading.Thread(target=time.sleep, args=(60,), name=executable.PACKING_THREAD).start()
print("answered")  # left in the buffer: leaving must write it
entry.leave_without_waiting_for_packing(3)
print("returned")
"""


@pytest.mark.parametrize("packing", [True, False])
def test_the_cli_leaves_without_waiting_for_background_packing(packing: bool) -> None:
    """`quiver t2t run` on a float model answers before ORT has packed it: when the command is done, the
    process ends with the command's status and its output, not waiting for the packing thread."""
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", _LEAVING, "packing" if packing else "idle"], capture_output=True, text=True, timeout=60
    )
    assert time.monotonic() - start < 30
    expected = (3, ["answered"]) if packing else (0, ["answered", "returned"])
    assert (result.returncode, result.stdout.split()) == expected


def test_a_memory_hint_counts_a_shared_executable_once(llama: Tiny) -> None:
    """The prefill and decode graphs on one executable hold its packed weights once: a hint between one
    and two copies of them keeps both graphs live."""
    from quiver.backends.cpu import CpuBackend
    from tests.support.helpers import executables

    graphs = ("prefill", "decode")
    with quiver.Context.from_binary(llama.out / "model.qctx", backend=CpuBackend(lazy_prepack=False)) as context:
        feeds = {"input_ids": np.array([[1]], np.int64), "seqlens_k": np.array([0], np.int32),
                 "total_sequence_length": np.array(1, np.int32)}  # fmt: skip
        caches = {i.name: np.zeros(i.shape, np.float32) for i in context.graph("decode").inputs if "past" in i.name}
        context.graph("prefill").execute(feeds | caches)
        packed = executables(context)["prefill"].private_bytes
    assert packed > 0
    hint = 1.5 * packed / (1 << 20)
    context = quiver.Context.from_binary(
        llama.out / "model.qctx", backend=CpuBackend(lazy_prepack=False), memory_limit_hint_mb=hint
    )
    with context:
        for name in graphs:
            context.graph(name).execute(feeds | caches)
        assert sorted(context.live_graphs) == sorted(graphs)


def test_a_background_packing_waits_for_the_graph_to_be_quiet(llama: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packing beside a generation would take a core and the memory bus from it: the packed session is made
    once the graph has not run for a moment (or at the latest a while after its first output)."""
    from quiver.backends.cpu import executable
    from tests.support.helpers import executables

    monkeypatch.setattr(executable, "QUIET_BEFORE_PACKING_S", 0.5)
    monkeypatch.setattr(executable, "LONGEST_WAIT_FOR_QUIET_S", 60.0)
    with Dialog.from_config(llama.config) as dialog:
        dialog.query(PROMPT, max_new_tokens=4, min_new_tokens=4, greedy=True)
        assert not executables(dialog.context)["prefill"].is_packed  # it ran a moment ago
        dialog.context.wait_until_ready()
        assert executables(dialog.context)["prefill"].is_packed


_EXITING = r"""
import sys
from quiver.backends.cpu import executable
executable.QUIET_BEFORE_PACKING_S = executable.LONGEST_WAIT_FOR_QUIET_S = 60.0  # never quiet before exit
from quiver.t2t.dialog import Dialog
dialog = Dialog.from_config(sys.argv[1])
print(len(dialog.query("the quick brown fox", max_new_tokens=4, min_new_tokens=4, greedy=True).new_ids))
"""


def test_a_program_that_is_done_does_not_wait_for_a_packing_not_yet_begun(llama: Tiny) -> None:
    """A script that asks a float dialog once and ends: the packing waiting for a quiet moment gives up
    when the main thread has ended, rather than holding the interpreter's exit until it is done."""
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", _EXITING, str(llama.config)], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0 and result.stdout.split() == ["4"], result.stderr
    assert time.monotonic() - start < 30  # not the 60 s it was told to wait for quiet
