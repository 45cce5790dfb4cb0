"""What the test layers share: model factories, ONNX's node-test runner, fixtures, the repository's root."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
