"""The cost model against measured decode step times (tests/core/data/h100_decode.json).

Every row is a public vLLM measurement with its source and conditions; the model must
reproduce each within ±15%, so a change to `CostParams` or to the step formula cannot
drift away from the measurements unnoticed. The fit itself is within ±9%.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from treadle.core.cost_model import GPUS, MODELS, TP_DEGREES, CostModel

DATA = Path(__file__).parent / "data" / "h100_decode.json"
TOLERANCE = 0.15  # relative; the bound, with room over the fit's 9%
SCHEMA = "treadle.decode-calibration/1"
# Each row's fields and their types: the format scripts/calibrate-gpu.py writes too.
ROW_FIELDS: dict[str, type | tuple[type, ...]] = {
    "model": str, "gpu": str, "tp": int, "batch": int, "context_per_seq": (int, float),
    "step_ms": (int, float), "source": str, "conditions": str,
}


def load_table(path: Path = DATA) -> dict[str, Any]:
    """The calibration document at `path`."""
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def check_schema(doc: dict[str, Any]) -> None:
    """Raise AssertionError unless `doc` is a calibration document: the schema tag,
    a description and rows with exactly `ROW_FIELDS`, each of its type, naming a
    model and GPU the cost model knows."""
    assert doc["schema"] == SCHEMA
    assert isinstance(doc["description"], str) and doc["description"]
    assert doc["rows"]
    for row in doc["rows"]:
        assert set(row) == set(ROW_FIELDS), row
        for field, kind in ROW_FIELDS.items():
            value = row[field]
            assert isinstance(value, kind) and not isinstance(value, bool), (field, row)
        assert row["model"] in MODELS and row["gpu"] in GPUS, row
        assert row["tp"] in TP_DEGREES and row["batch"] >= 1, row
        assert row["context_per_seq"] >= 0 and row["step_ms"] > 0, row
        assert row["source"] and row["conditions"], row


def predicted_ms(row: dict[str, Any]) -> float:
    """The cost model's step time for a row's conditions (K = batch × context)."""
    cost = CostModel.named(row["model"], row["gpu"])
    return 1e3 * cost.step_time(row["tp"], row["batch"], row["batch"] * row["context_per_seq"])


ROWS = load_table()["rows"]


def test_table_follows_the_schema() -> None:
    check_schema(load_table())


def test_table_covers_every_tp_degree_and_small_and_large_batches() -> None:
    assert {r["tp"] for r in ROWS} == set(TP_DEGREES)
    assert min(r["batch"] for r in ROWS) == 1
    assert max(r["batch"] for r in ROWS) >= 240
    # TP-8 at 80+ sequences is what the model had wrong before the fit.
    assert sum(1 for r in ROWS if r["tp"] == 8 and r["batch"] >= 79) >= 3


@pytest.mark.parametrize("row", ROWS,
                         ids=[f"{r['model']}-tp{r['tp']}-b{r['batch']}" for r in ROWS])
def test_model_reproduces_the_measurement(row: dict[str, Any]) -> None:
    ratio = predicted_ms(row) / row["step_ms"]
    assert 1 - TOLERANCE <= ratio <= 1 + TOLERANCE, (
        f"model {predicted_ms(row):.2f} ms against measured {row['step_ms']} ms "
        f"({ratio:.3f}x) for {row['source']}")


def test_tp8_is_not_cheaper_per_sequence_than_measured_at_large_batch() -> None:
    """The fitted per-token term at TP > 1: the TP-8 step time's slope from batch 79
    to 256 (Llama-3-8B) is within 25% of the measured one (about 21 us a sequence)."""
    by_batch = {r["batch"]: r for r in ROWS if r["model"] == "llama-3-8b" and r["tp"] == 8}
    lo, hi = by_batch[79], by_batch[256]
    measured = (hi["step_ms"] - lo["step_ms"]) / (hi["batch"] - lo["batch"])
    modelled = (predicted_ms(hi) - predicted_ms(lo)) / (hi["batch"] - lo["batch"])
    assert modelled == pytest.approx(measured, rel=0.25)


def test_decode_allreduces_are_slower_than_prefill_ones() -> None:
    """Decode's small all-reduces run at a fraction of the link; prefill's do not."""
    cost = CostModel.named("qwen3-14b", "h100")
    assert cost.allreduce_s(8, 256.0) > cost.allreduce_s(8, 256.0, decode=False)
    assert cost.allreduce_s(8, 0.0) == cost.allreduce_s(8, 0.0, decode=False)
    assert cost.allreduce_s(1, 256.0) == 0.0


# -- scripts/calibrate-gpu.py ----------------------------------------------------------


def _script() -> Any:
    """scripts/calibrate-gpu.py as a module (its name has a hyphen)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / "calibrate-gpu.py"
    spec = importlib.util.spec_from_file_location("calibrate_gpu", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve their module through sys.modules while the class is built.
    sys.modules.setdefault("calibrate_gpu", module)
    spec.loader.exec_module(module)
    return module


def test_calibration_script_dry_run_prints_a_document_of_the_table_format(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = _script()
    out = tmp_path / "plan.json"
    assert script.main(["--dry-run", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc == json.loads(out.read_text())
    check_schema(doc)
    assert doc["schema"] == load_table()["schema"]
    # The default plan: two shapes, batch 1 / 80 / 256, TP 1 (the one GPU).
    assert [(r["model"], r["batch"]) for r in doc["rows"]] == [
        (m, b) for m in ("llama-3-8b", "qwen3-14b") for b in (1, 80, 256)]
    assert {r["tp"] for r in doc["rows"]} == {1}
    assert "would measure" in captured.err
    # The predictions in a dry run are the model's own, so they pass its own check.
    for row in doc["rows"]:
        assert predicted_ms(row) == pytest.approx(row["step_ms"], abs=1e-3)


def test_calibration_script_knows_every_shape_it_plans() -> None:
    script = _script()
    for name, cfg in script.HF_CONFIGS.items():
        m = MODELS[name]
        assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"],
                cfg["head_dim"]) == (m.layers, m.hidden, m.kv_heads, m.head_dim)
    assert script.gpu_key("NVIDIA H200") == "h200"
    assert script.gpu_key("NVIDIA H100 80GB HBM3") == "h100"


# -- the engine-free H200 measurements (benchmarks/h200-*.json) -------------------------

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_h200_engine_free_rows_follow_the_schema_and_say_what_they_measured() -> None:
    doc = load_table(BENCHMARKS / "h200-decode.json")
    check_schema(doc)
    assert {r["gpu"] for r in doc["rows"]} == {"h200"}
    for row in doc["rows"]:
        # Not a vLLM step: each row says it is the GPU part alone.
        assert "no engine" in row["conditions"] and "--engine torch" in row["source"]


def test_compare_sets_the_measurements_beside_the_model() -> None:
    script = _script()
    decode = load_table(BENCHMARKS / "h200-decode.json")
    lines = script.compare(decode)
    assert len(lines) == len(decode["rows"])
    first = decode["rows"][0]
    cost = CostModel.named(first["model"], "h200")
    whole = 1e3 * cost.step_time(1, first["batch"], first["batch"] * first["context_per_seq"])
    assert f"whole step {whole:7.3f} ({first['step_ms'] / whole:.2f}x)" in lines[0]
    prefill = json.loads((BENCHMARKS / "h200-prefill.json").read_text())
    assert prefill["schema"] == script.PREFILL_SCHEMA and prefill["host_to_device_gbs"] > 0
    row = prefill["rows"][0]
    cost = CostModel.named(row["model"], "h200")
    predicted = 1e3 * (cost.prefill_time(1, row["new_tokens"], row["cached_tokens"])
                       - cost.params.step_overhead_s)
    # The stored model figure is the model's prefill less its step overhead.
    assert row["model_ms"] == pytest.approx(predicted, abs=1e-3)
    assert f"({row['ms'] / row['model_ms']:.2f}x)" in script.compare(prefill)[0]
