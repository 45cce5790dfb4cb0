"""The package names its public API in `__all__`; everything that looks public is exported."""

from __future__ import annotations

import inspect

import quiver
import quiver.errors


def test_everything_in_all_exists() -> None:
    for name in quiver.__all__:
        assert hasattr(quiver, name), name


def test_every_public_error_is_exported_and_is_a_quiver_error() -> None:
    for name, value in vars(quiver.errors).items():
        if inspect.isclass(value) and issubclass(value, Exception) and value.__module__ == "quiver.errors":
            assert name in quiver.__all__, f"{name} is public in quiver.errors but not exported"
            assert issubclass(value, quiver.QuiverError)


def test_nothing_public_at_top_level_is_missing_from_all() -> None:
    public = {n for n, v in vars(quiver).items() if not n.startswith("_") and not inspect.ismodule(v)}
    assert public <= set(quiver.__all__), public - set(quiver.__all__)


def test_every_module_has_a_docstring() -> None:
    import pkgutil

    for module in pkgutil.walk_packages(quiver.__path__, "quiver."):
        if module.name.endswith("__main__"):
            continue
        imported = __import__(module.name, fromlist=["_"])
        assert imported.__doc__ and imported.__doc__.strip(), module.name
