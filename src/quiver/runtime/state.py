"""What one run of a graph reads: its updateable tensors and LoRA strengths, one immutable snapshot."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from quiver.errors import SectionMismatchError, TensorUpdateError
from quiver.ir.tensors import TensorInfo


def _frozen(array: np.ndarray) -> np.ndarray:
    array = np.array(array, np.float32, copy=True)
    array.flags.writeable = False
    return array


# Strengths are float32 in the graph: beyond this they only overflow what they scale (Genie's are 0 to 1).
MAX_LORA_STRENGTH = 100.0


@dataclass(frozen=True)
class LoraStrengths:
    """The `lora_alpha` feed a section's metadata sets: one strength per adapter (Genie's LoRA strengths)."""

    alpha_input: str
    adapters: tuple[str, ...]
    alphas: np.ndarray  # read-only: a change makes a new LoraStrengths
    active: tuple[str, ...]  # the adapters the section holds weights for (its use case); the others are zero

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], source: str = "the section") -> LoraStrengths | None:
        """The strengths a section's metadata names; None for a section without `lora` metadata."""
        lora = metadata.get("lora")
        if lora is None:
            return None
        try:
            if not isinstance(lora, dict) or not isinstance(lora["adapters"], list):
                raise TypeError("lora must be an object with an adapters list")
            adapters = tuple(str(a) for a in lora["adapters"])
            alphas = np.asarray(lora["alphas"], dtype=np.float32)
            # sections written before "active" existed: the adapters their use case gives a strength
            active = tuple(str(a) for a in lora.get("active", [a for a, v in zip(adapters, alphas.flat) if v != 0]))
            alpha_input = lora["alpha_input"]
            if not isinstance(alpha_input, str):
                raise TypeError("alpha_input must be a string")
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise SectionMismatchError(
                f"{source}: its lora metadata is malformed ({exc}); make the section again"
            ) from None
        if alphas.shape != (len(adapters),) or not np.all(np.isfinite(alphas)) or not set(active) <= set(adapters):
            raise SectionMismatchError(
                f"{source}: its lora metadata needs one finite strength per adapter and active adapters among "
                f"them; make the section again"
            )
        return cls(alpha_input, adapters, _frozen(alphas), active)

    def check_fits(self, graph: str, inputs: tuple[TensorInfo, ...], source: str) -> None:
        """Refuses strengths the graph could not be fed: a wrong input name or length would fail every run."""
        info = next((i for i in inputs if i.name == self.alpha_input), None)
        fits = (
            info is not None
            and info.dtype == "float32"
            and info.shape is not None
            and len(info.shape) == 1
            and (not isinstance(info.shape[0], int) or info.shape[0] == len(self.adapters))
        )
        if not fits:
            raise SectionMismatchError(
                f"{source}: its lora metadata feeds {self.alpha_input!r} with {len(self.adapters)} strengths, "
                f"which graph {graph!r} does not take; apply a section made for this graph"
            )

    def with_strength(self, graph: str, adapter: str, value: float) -> LoraStrengths:
        if adapter not in self.adapters:
            raise TensorUpdateError(
                f"graph {graph!r} has no adapter {adapter!r}; its adapters are {list(self.adapters)}"
            )
        if adapter not in self.active:
            raise TensorUpdateError(
                f"adapter {adapter!r} is not in the section applied to graph {graph!r} (it holds {list(self.active)}); "
                "apply a section of a use case with that adapter first"
            )
        if not np.isfinite(value) or abs(value) > MAX_LORA_STRENGTH:
            raise TensorUpdateError(
                f"strength {value} for adapter {adapter!r} is not a number from -{MAX_LORA_STRENGTH} to "
                f"{MAX_LORA_STRENGTH} (1 is the adapter as trained, 0 turns it off)"
            )
        alphas = self.alphas.copy()
        alphas[self.adapters.index(adapter)] = value
        return replace(self, alphas=_frozen(alphas))


@dataclass(frozen=True)
class GraphState:
    """The values of a graph's updateable tensors and its LoRA strengths, as one run sees them.

    Never mutated: applying a section or setting a strength makes a new state and swaps it in, so a
    run reads one consistent state however the handle changes meanwhile.
    """

    values: Mapping[str, np.ndarray]
    lora: LoraStrengths | None = None

    def updated(self, values: Mapping[str, np.ndarray], lora: LoraStrengths | None = None) -> GraphState:
        """A new state with these tensor values (and strengths, when given) over this one's."""
        return GraphState({**self.values, **values}, lora if lora is not None else self.lora)
