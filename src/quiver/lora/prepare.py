"""`quiver lora prepare`: QNN-style LoRA YAML -> one context, one section per use case, a manifest."""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import yaml

from quiver.errors import AdapterError, FileAccessError
from quiver.formats.encodings import EncodingSet, load_encodings, save_encodings, to_document
from quiver.formats.files import read_text
from quiver.formats.writer import write_atomically, write_text_atomically
from quiver.lora.attach import AttachPoint, find_attach_points
from quiver.lora.create import (
    ALPHA_INPUT,
    LoraGraph,
    create_lora_graph,
    slot_ranks,
    use_case_values,
)
from quiver.lora.peft import PeftAdapter, has_weights, load_peft_adapter
from quiver.passes.compare import compare_models
from quiver.passes.load import load_model
from quiver.passes.qdq import QuantizeOptions
from quiver.runtime.context import Context


@dataclass(frozen=True)
class UseCase:
    name: str
    adapters: list[str]
    alphas: list[float]
    model: Path | None  # QNN needs one export per use case; Quiver only checks it against the base
    quant_overrides: Path | None = None  # the use case's AIMET encodings (from QAT), used when quantizing
    more_models: tuple[Path, ...] = ()  # the base use case's further exports (a list `model_name`): more graphs


@dataclass(frozen=True)
class LoraProject:
    base_model: Path
    adapters: dict[str, Path]
    use_cases: list[UseCase]
    attach_map: dict[str, str] | None
    # Every graph of the context: the base model, then other exports of it (e.g. other fixed shapes) that
    # the same adapters adapt; with `share_adapters_between_graphs` one section per use case covers them all.
    graph_models: tuple[Path, ...] = ()
    share_adapters_between_graphs: bool = False


def _list(raw: dict[str, Any], key: str, source: Path) -> list[Any]:
    value = raw.get(key)
    if value is None:  # absent, or a YAML key with nothing after it
        return []
    if not isinstance(value, list):
        raise AdapterError(f"{source}: {key!r} must be a list")
    return value


# Every key the YAML may hold (QNN's LoRA v3 flow); anything else is a typo that would be ignored silently.
_TOP_KEYS = {"adapter", "use-case", "attach_point_onnx_mapping", "share_adapters_between_graphs"}
_ADAPTER_KEYS = {"name", "lora_config"}
_USE_CASE_KEYS = {"name", "adapter_names", "adapter_alphas", "model_name", "quant_overrides"}


def _check_keys(entry: dict[str, Any], allowed: set[str], where: str, source: Path) -> None:
    unknown = sorted(str(k) for k in set(entry) - allowed)
    if unknown:
        raise AdapterError(f"{source}: {where} has unknown keys {unknown}; the keys are {sorted(allowed)}")


def _alpha(value: Any, use_case: str, source: Path) -> float:
    try:
        alpha = float(value)
    except (TypeError, ValueError):
        alpha = math.nan
    if not math.isfinite(alpha):
        raise AdapterError(f"{source}: use case {use_case!r} has alpha {value!r}; alphas are finite numbers")
    return alpha


def _file_name(value: Any, key: str, where: str, source: Path) -> str:
    if not isinstance(value, str) or not value:
        raise AdapterError(f"{source}: {where}: {key} must be a file name (relative to the YAML), not {value!r}")
    return value


def read_adapters_and_use_cases(path: str | Path) -> tuple[dict[str, Any], dict[str, Path], list[UseCase]]:
    """The YAML's top level, its adapters (name -> PEFT folder) and use cases, checked; no base model needed
    (`quiver t2t export` builds the base from a transformers folder)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(read_text(path, limit=16 << 20, what="LoRA config"))
    except (FileAccessError, yaml.YAMLError, RecursionError) as exc:
        raise AdapterError(f"cannot read LoRA config {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{path}: must be a YAML mapping with 'adapter' and 'use-case' lists")
    folder = path.parent
    _check_keys(raw, _TOP_KEYS, "the top level", path)
    adapters = {}
    for entry in _list(raw, "adapter", path):
        if not isinstance(entry, dict) or "name" not in entry or "lora_config" not in entry:
            raise AdapterError(f"{path}: each adapter needs 'name' and 'lora_config'")
        _check_keys(entry, _ADAPTER_KEYS, f"adapter {entry['name']!r}", path)
        adapters[str(entry["name"])] = folder / str(entry["lora_config"])
    use_cases = []
    for entry in _list(raw, "use-case", path):
        if not isinstance(entry, dict) or "name" not in entry:
            raise AdapterError(f"{path}: each use case needs a 'name'")
        _check_keys(entry, _USE_CASE_KEYS, f"use case {entry['name']!r}", path)
        names = [str(n) for n in _list(entry, "adapter_names", path)]
        unknown = sorted(set(names) - set(adapters))
        if unknown:
            raise AdapterError(f"{path}: use case {entry['name']!r} names unknown adapters {unknown}")
        given_alphas = _list(entry, "adapter_alphas", path) or [1.0] * len(names)
        alphas = [_alpha(a, str(entry["name"]), path) for a in given_alphas]
        if len(alphas) != len(names):
            raise AdapterError(f"{path}: use case {entry['name']!r} has {len(names)} adapters but {len(alphas)} alphas")
        where = f"use case {entry['name']!r}"
        given = entry.get("model_name")
        given = [] if given is None else given if isinstance(given, list) else [given]
        models = [folder / _file_name(m, "model_name", where, path) for m in given]
        if len(models) > 1 and names:
            raise AdapterError(f"{path}: {where}: only the base use case names several models")
        quant = entry.get("quant_overrides")
        overrides = folder / _file_name(quant, "quant_overrides", where, path) if quant is not None else None
        model = models[0] if models else None
        use_cases.append(UseCase(str(entry["name"]), names, alphas, model, overrides, tuple(models[1:])))
    return raw, adapters, use_cases


def load_lora_config(path: str | Path) -> LoraProject:
    """Reads the YAML of DESIGN.md; relative paths are relative to the YAML's folder."""
    path = Path(path)
    folder = path.parent
    raw, adapters, use_cases = read_adapters_and_use_cases(path)
    bases = [u for u in use_cases if not u.adapters and u.model is not None]
    if not bases:
        raise AdapterError(f"{path}: no base use case (adapter_names: [] with a model_name) gives the base model")
    mapping = None
    if raw.get("attach_point_onnx_mapping"):
        map_path = folder / str(raw["attach_point_onnx_mapping"])
        try:
            mapping = {str(k): str(v) for k, v in json.loads(read_text(map_path, what="attach-point map")).items()}
        except (FileAccessError, ValueError, AttributeError, RecursionError) as exc:
            raise AdapterError(f"cannot read the attach-point map {map_path}: {exc}") from None
    base = bases[0].model
    graphs = (base, *bases[0].more_models) if base is not None else ()
    for model in graphs:
        if not model.is_file():
            raise AdapterError(f"{path}: the base model {model} does not exist; fix 'model_name' of the base use case")
    stems = [model.stem for model in graphs]
    if len(set(stems)) != len(stems):
        raise AdapterError(f"{path}: the base models {stems} name their graphs; give files of different names")
    share = raw.get("share_adapters_between_graphs", False)
    if not isinstance(share, bool):
        raise AdapterError(f"{path}: share_adapters_between_graphs is Yes or No, not {share!r}")
    assert base is not None
    return LoraProject(base, adapters, use_cases, mapping, tuple(graphs), share)


def _check_use_case_models(project: LoraProject) -> None:
    """A use case exported with its own model must share the base part with the base model."""
    for use_case in project.use_cases:
        if use_case.model is None or use_case.model == project.base_model:
            continue
        comparison = compare_models(project.base_model, use_case.model)
        if comparison.only_a or comparison.different:
            changed = [a.name for a, _ in comparison.different][:3] + [t.name for t in comparison.only_a][:3]
            raise AdapterError(
                f"use case {use_case.name!r}: {use_case.model} does not contain the base model's weights unchanged "
                f"(e.g. {changed}); its base part must equal {project.base_model}"
            )


def map_attach_points(
    project: LoraProject, adapters: dict[str, PeftAdapter], base: onnx.ModelProto | None = None
) -> tuple[dict[str, AttachPoint], list[str]]:
    """`quiver lora map`: the attach point of every adapted module, and the modules that found none.

    `base` is the base model if it is already loaded (its structure is all that is read).
    """
    if base is None:
        base, _ = load_model(project.base_model)
    modules = sorted({m for a in adapters.values() for m in a.modules})
    return find_attach_points(base, modules, project.attach_map)


def load_adapters(project: LoraProject) -> dict[str, PeftAdapter]:
    """Each adapter from its PEFT folder; one given by its config alone (QNN's flow) from the exported
    graph of a use case it is in (the one with fewest adapters: its own, where exported)."""
    from quiver.lora.exported import adapter_from_export

    adapters = {}
    for name, path in project.adapters.items():
        if has_weights(path):
            adapters[name] = load_peft_adapter(path, name)
            continue
        exports = sorted(
            (u for u in project.use_cases if name in u.adapters and u.model is not None), key=lambda u: len(u.adapters)
        )
        if not exports:
            raise AdapterError(
                f"adapter {name!r}: {path} has no weights beside it (adapter_model.safetensors) and no use case "
                "with it names an exported model (model_name) to read them from"
            )
        assert exports[0].model is not None
        adapters[name] = adapter_from_export(path, name, exports[0].model)
    return adapters


def create_graphs(project: LoraProject, adapters: dict[str, PeftAdapter]) -> list[LoraGraph]:
    """The LoRA graph of each of the project's base graphs. Several are exports of one model (each holds
    every adapted module) or the parts of a split one (`..._1_of_3`: each holds the modules it has, and
    every module must be in one); a module found in one graph but not in another holding the same layer
    weight is an export whose mapping failed, an error rather than a graph silently left unadapted."""
    if len(project.graph_models) <= 1:
        return [create_graph(project, adapters)]
    _check_use_case_models(project)
    bases = {model: onnx.load(str(model)) for model in project.graph_models}
    modules = sorted({m for adapter in adapters.values() for m in adapter.modules})
    found = {
        model: find_attach_points(base, modules, project.attach_map, part=True)[0] for model, base in bases.items()
    }
    nowhere = [m for m in modules if not any(m in points for points in found.values())]
    if nowhere:
        raise AdapterError(
            f"no attach point for {len(nowhere)} adapted module(s) in any of {[m.name for m in bases]}, e.g. "
            f"{nowhere[:3]}; export with torch.onnx (dynamo) or give attach_point_onnx_mapping (module -> node name)"
        )
    contents = {model: {_digest(t) for t in base.graph.initializer} for model, base in bases.items()}
    for model, points in found.items():
        weights = {t.name: t for t in bases[model].graph.initializer}
        for module, point in points.items():
            other = next(
                (o for o in bases if module not in found[o] and _digest(weights[point.weight]) in contents[o]), None
            )
            if other is not None:
                raise AdapterError(
                    f"module {module!r} attaches in {model.name} but not in {other.name}, which holds the same layer "
                    "weight; give attach_point_onnx_mapping (module -> node name) for that graph's export"
                )
    remedy = "export with torch.onnx (dynamo) or give attach_point_onnx_mapping (module -> node name)"
    return [
        lora_graph(base, adapters, project.use_cases, model.stem, project.attach_map, remedy, modules=found[model])
        for model, base in bases.items()
    ]


def _digest(tensor: onnx.TensorProto) -> bytes:
    """A weight's content (type, shape and bytes), whatever its name."""
    from onnx import numpy_helper

    array = numpy_helper.to_array(tensor)
    return hashlib.sha256(f"{array.dtype}{array.shape}".encode() + array.tobytes()).digest()


def create_graph(project: LoraProject, adapters: dict[str, PeftAdapter], model: Path | None = None) -> LoraGraph:
    """`quiver lora create`: map, then one max-rank LoRA graph for every use case, over the base model or
    `model` (another of the project's graphs)."""
    _check_use_case_models(project)
    model = model or project.base_model
    base = onnx.load(str(model))  # with its weights: the created graph carries them
    return lora_graph(
        base,
        {name: adapters[name] for name in project.adapters},
        project.use_cases,
        model.stem,
        project.attach_map,
        remedy="export with torch.onnx (dynamo) or give attach_point_onnx_mapping (module -> node name)",
    )


def lora_graph(
    base: onnx.ModelProto,
    adapters: Mapping[str, PeftAdapter],
    use_cases: Sequence[UseCase],
    name: str,
    attach_map: Mapping[str, str] | None = None,
    remedy: str = "",
    per_row: bool = False,
    share_down_projections: bool = True,
    modules: Collection[str] | None = None,
) -> LoraGraph:
    """One max-rank LoRA graph for every use case over `base` (adapters in the order given); `remedy`
    ends the error when an adapted module has no attach point. `per_row` and `share_down_projections`:
    `quiver.lora.create.create_lora_graph`'s. `modules`: the adapted modules this graph holds (a part of a
    split model), default all."""
    adapted = {m for adapter in adapters.values() for m in adapter.modules}
    modules = sorted(adapted if modules is None else adapted & set(modules))
    points, missing = find_attach_points(base, modules, attach_map)
    if missing:
        raise AdapterError(f"no attach point for {len(missing)} adapted module(s), e.g. {missing[:3]}; {remedy}")
    cases = {u.name: u.adapters for u in use_cases}
    model, slots = create_lora_graph(
        base, points, slot_ranks(adapters, cases), len(adapters), per_row, share_down_projections
    )
    return LoraGraph(model, slots, list(adapters), name)


def full_alphas(use_case: UseCase, adapter_order: Sequence[str]) -> list[float]:
    """The use case's strength for every adapter of the graph, in its order (0 for those it leaves out)."""
    return [use_case.alphas[use_case.adapters.index(a)] if a in use_case.adapters else 0.0 for a in adapter_order]


def section_metadata(use_case: UseCase, adapter_order: Sequence[str]) -> dict[str, Any]:
    """The `lora` metadata of a use case's section: applying it sets these strengths (Genie's defaults)."""
    return {
        "lora": {
            "use_case": use_case.name,
            "alpha_input": ALPHA_INPUT,
            "adapters": list(adapter_order),
            "alphas": full_alphas(use_case, adapter_order),
            "active": use_case.adapters,
        }
    }


def use_case_encodings(project: LoraProject, common: EncodingSet | None = None) -> dict[str, EncodingSet]:
    """Per use case, the encodings it is quantized with: `common` (`--quantization-overrides`, e.g. the base
    model's) with the use case's own `quant_overrides` over them, tensor by tensor; none for a use case
    that has neither."""
    result = {}
    for use_case in project.use_cases:
        if use_case.quant_overrides is None:
            if common is not None:
                result[use_case.name] = common
            continue
        own = load_encodings(use_case.quant_overrides)
        result[use_case.name] = own if common is None else replace(own, tensors={**common.tensors, **own.tensors})
    return result


def write_use_cases(config: str | Path, output: Path, common: EncodingSet | None = None) -> dict[str, dict[str, Any]]:
    """`quiver lora import`: each use case's updateable tensors as `<use case>.safetensors` (zero-padded)
    and, where it has encodings (`use_case_encodings`), those of the LoRA graph's tensors as
    `<use case>.encodings` (AIMET, the file's version); `use_cases.json` names them, the adapter order and
    alphas, in `output`; returns that summary."""
    from safetensors.numpy import save

    from quiver.lora.quantized_sections import encodings_in_graph

    project = load_lora_config(config)
    adapters = load_adapters(project)
    graph = create_graph(project, adapters)
    encodings = use_case_encodings(project, common)
    output.mkdir(parents=True, exist_ok=True)
    summary: dict[str, dict[str, Any]] = {}
    for name, (values, alphas) in import_use_cases(project, adapters, graph).items():
        write_atomically(output / f"{name}.safetensors", save(values))
        summary[name] = {
            "tensors": f"{name}.safetensors",
            "adapters": graph.adapter_order,
            "alphas": alphas,
            "active": next(u.adapters for u in project.use_cases if u.name == name),
        }
        if name in encodings:
            found = encodings_in_graph(graph.model, encodings[name], f"use case {name!r}")
            save_encodings(found, output / f"{name}.encodings", found.version)
            summary[name]["encodings"] = f"{name}.encodings"
    write_text_atomically(output / "use_cases.json", json.dumps(summary, indent=2))
    return summary


def import_use_cases(
    project: LoraProject, adapters: dict[str, PeftAdapter], graph: LoraGraph
) -> dict[str, tuple[dict[str, np.ndarray], list[float]]]:
    """`quiver lora import`: per use case, the updateable tensors (zero-padded) and the full alpha vector."""
    result = {}
    for use_case in project.use_cases:
        values = use_case_values(graph.slots, adapters, use_case.adapters, graph.adapter_order)
        result[use_case.name] = (values, full_alphas(use_case, graph.adapter_order))
    return result


@dataclass(frozen=True)
class LoraQuantization:
    """Quantize every use case (LoRA-aware): calibration feeds of the base inputs, and the options."""

    samples: Sequence[Mapping[str, np.ndarray]]  # none: --float-fallback, every quantized tensor has an encoding
    options: QuantizeOptions  # its `encodings` (--quantization-overrides) serve every use case
    lora_weight_bits: int | None = None  # e.g. 16 while the base is 8-bit


def prepare(
    config: str | Path,
    out_dir: str | Path,
    genie_config: str | Path | None = None,
    on_step: Callable[[str], object] = lambda _: None,
    quantization: LoraQuantization | None = None,
    share_adapters_between_graphs: bool | None = None,
) -> dict[str, Any]:
    """The whole LoRA v3 flow: map, create, import, then the context, sections and manifest in `out_dir`.

    With `quantization`, the context holds one QDQ graph and each section also carries its use case's
    adapter integers and encodings (`quiver.lora.quantized_sections`). With several base graphs (the base use
    case's `model_name` a list: exports of one model, or the parts of a split one, each adapted where it
    holds the modules), the context has a graph for each, and each use case one section per adapted
    graph, or one for them all (a super adapter, each distinct tensor stored once) when sharing
    (`share_adapters_between_graphs`, else the YAML's key of that name).
    """
    config = Path(config)
    project = load_lora_config(config)
    share = (
        project.share_adapters_between_graphs
        if share_adapters_between_graphs is None
        else share_adapters_between_graphs
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    on_step("reading adapters")
    adapters = load_adapters(project)
    on_step("mapping and creating the LoRA graph")
    graphs = create_graphs(project, adapters)
    if quantization is not None and len(graphs) > 1:
        raise AdapterError(
            f"{config}: quantizing names one base model; prepare each of {[g.name for g in graphs]} on its own"
        )
    graph = graphs[0]
    imported_by_graph = {g.name: import_use_cases(project, adapters, g) for g in graphs}
    imported = imported_by_graph[graph.name]
    unused = [u.name for u in project.use_cases if u.quant_overrides is not None]
    if quantization is None and unused:
        warnings.warn(
            f"{config}: the quant_overrides of use case(s) {unused} are used when quantizing: give --input-list "
            "(calibration) or --float-fallback (what they leave out stays float); the sections are float",
            stacklevel=2,
        )
    models = {g.name: (g.model, g.updateable) for g in graphs}
    values = {  # graph -> use case -> its tensors
        g: {name: dict(tensors) for name, (tensors, _) in cases.items()} for g, cases in imported_by_graph.items()
    }
    encodings: dict[str, Any] = {}
    if quantization is not None:
        from quiver.lora.quantized_sections import quantize_use_cases

        on_step("calibrating and quantizing every use case")
        quantized = quantize_use_cases(
            graph,
            imported,
            quantization.samples,
            quantization.options,
            quantization.lora_weight_bits,
            use_case_encodings(project, quantization.options.encodings),
        )
        models[graph.name] = (quantized.model, quantized.updateable)
        values[graph.name] = quantized.values
        encodings = {name: to_document(found) for name, found in quantized.encodings.items()}
    context = Context.create("reference", workdir=out)
    for name, (model, updateable) in models.items():
        context.add_graph(name, model, updateable=updateable)
    context.save(out / f"{config.stem}.qctx")
    manifest: dict[str, Any] = {
        "context": f"{config.stem}.qctx",
        "graph": graph.name,
        "graphs": list(models),
        "shared_between_graphs": share and len(models) > 1,
        "alpha_input": ALPHA_INPUT,
        "adapters": graph.adapter_order,
        "use_cases": {},
    }
    cases = {u.name: u for u in project.use_cases}
    if quantization is not None:
        manifest["quantized"] = {"updateable_tensors": len(models[graph.name][1])}
    adapted = [g for g, (_, updateable) in models.items() if updateable]  # a split model's parts may hold none
    for name in imported:
        on_step(f"writing the section of use case {name}")
        for graph_name in adapted:
            context.graph(graph_name).update_tensors(values[graph_name][name])
        context.finalize()
        metadata = section_metadata(cases[name], graph.adapter_order)
        if name in encodings:
            metadata["encodings"] = encodings[name]  # its adapter weights' and the changed activations
        if len(adapted) == 1 or share:
            files = {f"{name}.qsec": None if len(adapted) > 1 else adapted[0]}
        else:
            files = {f"{name}.{graph_name}.qsec": graph_name for graph_name in adapted}
        for file, covers in files.items():
            # replaced, never rewritten: a process that applied the old file keeps what it checked
            write_atomically(out / file, context.get_binary_section(covers, metadata))
        manifest["use_cases"][name] = {"adapters": cases[name].adapters, "alphas": cases[name].alphas}
        manifest["use_cases"][name] |= (
            {"section": next(iter(files))} if len(files) == 1 else {"sections": {g: f for f, g in files.items()}}
        )
    context.close()
    write_text_atomically(out / "manifest.json", json.dumps(manifest, indent=2))
    if genie_config is not None:
        genie = genie_lora_block(manifest, out, Path(genie_config).parent)
        write_text_atomically(Path(genie_config), json.dumps(genie, indent=2))
    return manifest


def section_files(case: Mapping[str, Any]) -> list[str]:
    """A manifest use case's section files: one (for its graph, or all of them), or one per graph."""
    return [case["section"]] if "section" in case else list(case["sections"].values())


def genie_lora_block(manifest: dict[str, Any], out_dir: Path, relative_to: Path) -> dict[str, Any]:
    """The `"lora"` block of a Genie dialog config for a prepared folder (DESIGN.md)."""

    def where(section: str) -> str:
        target = (out_dir / section).resolve()
        try:  # relative to the config wherever it lies (Genie reads them so): the pair moves together
            return Path(os.path.relpath(target, relative_to.resolve())).as_posix()
        except ValueError:  # another drive (Windows): no relative path exists
            return str(target)

    return {
        "lora": {
            "version": 1,
            "alpha-tensor-name": manifest["alpha_input"],
            "adapters": [
                {
                    "version": 1,
                    "name": name,
                    "alphas": case["adapters"],
                    "bin-sections": [where(f) for f in section_files(case)],
                }
                for name, case in manifest["use_cases"].items()
            ],
        }
    }
