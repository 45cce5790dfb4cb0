"""ONNX's own backend node tests are the operator conformance suite (see docs/CONFORMANCE.md)."""

from __future__ import annotations

import pytest

from tests.support.node_suite import run_suite


@pytest.fixture(scope="module")
def report() -> dict:
    return run_suite(("cpu", "reference"))


def test_suite_covers_most_node_tests(report: dict) -> None:
    assert report["cases"] > 1200
    assert report["in_scope"] > 750


def test_cpu_backend_passes_every_case_plain_onnxruntime_passes(report: dict) -> None:
    ort_passed = set(report["passed_cases"]["onnxruntime"])
    cpu_passed = set(report["passed_cases"]["cpu"])
    assert ort_passed - cpu_passed == set(), {k: report["failures"]["cpu"][k] for k in ort_passed - cpu_passed}
    assert len(cpu_passed) >= len(ort_passed)


def test_reference_backend_passes_at_least_95_percent(report: dict) -> None:
    rate = report["passed"]["reference"] / report["in_scope"]
    assert rate >= 0.95, report["failures"]["reference"]
