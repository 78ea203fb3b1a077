"""The latency targets' scorecard (benchmarks/targets.py) reads each benchmark's JSON the way
it is written and judges every target against its bar: a figure just past the bar misses,
one on it is met, a benchmark not run is "not measured" rather than met, and the serving
comparison takes pdserve at the tight pair against vLLM at the loose one."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.append(str(BENCHMARKS))  # after everything else: no module here shadows another

import slo  # noqa: E402
import targets  # noqa: E402

TIGHT, LOOSE = (1.0, 0.05), (2.0, 0.1)


def by_name(rows: list[dict]) -> dict[str, dict]:
    return {r["target"]: r for r in rows}


def serve_report(goodput: dict[str, dict[str, float]], tpot_p99: dict[str, dict]) -> dict:
    """serve.py's shape: summary.<system>.goodput_sum_rps[label], systems.<system>.rates[]."""
    return {
        "summary": {n: {"goodput_sum_rps": g} for n, g in goodput.items()},
        "systems": {
            n: {"rates": [{"rate_rps": r, "tpot_s": {"p99": p}} for r, p in rates.items()]}
            for n, rates in tpot_p99.items()
        },
    }


def test_decode_steps_are_judged_per_batch_and_a_missing_batch_is_not_measured():
    report = {
        "floors": {
            "invariant": {
                "1": {"step_over_floor": 1.2},
                "4": {"step_over_floor": 1.5},
                "16": {"step_over_floor": 1.51},
            },
            "fast": {"64": {"step_over_floor": 1.0}},  # the other path is not scored
        }
    }
    rows = by_name(targets.score_decode(report))
    assert [rows[f"decode_step_over_floor@batch{b}"]["met"] for b in targets.BATCHES] == [
        True,
        True,
        False,
        None,
    ]
    assert rows["decode_step_over_floor@batch16"]["want"] == "<= 1.5"


def test_decode_steps_are_judged_by_the_floors_probed_beside_them_where_measured():
    report = {
        "floors": {"invariant": {"1": {"step_over_floor": 1.6}, "16": {"step_over_floor": 1.4}}},
        "floors_beside_each_step": {
            "1": {"step_over_floor": 1.3},
            "16": {"step_over_floor": 1.7, "step_over_dense_floor": 1.8},
        },
    }
    rows = by_name(targets.score_decode(report))
    one, sixteen = rows["decode_step_over_floor@batch1"], rows["decode_step_over_floor@batch16"]
    assert (one["figure"], one["met"], one["whole_run_figure"]) == (1.3, True, 1.6)
    assert (sixteen["figure"], sixteen["met"], sixteen["whole_run_figure"]) == (1.7, False, 1.4)
    assert (one["dense_floor_figure"], sixteen["dense_floor_figure"]) == (None, 1.8)


def test_the_compute_floor_counts_the_attention_flops_beside_the_dense_ones(tmp_path):
    import decode_step  # torch and the kernels: only this test needs them

    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = decode_step.model_shape(str(tmp_path))
    # Per context token, over 2 layers: QK and PV, one multiply-add (2 FLOPs) each per query
    # element (4 heads x 16), so 4 FLOPs per element; K and V, 2 heads x 16 elements each.
    assert shape["attention_flops_per_context_token"] == 2 * 4 * (4 * 16)
    assert shape["kv_elements_per_token"] == 2 * 2 * (2 * 16)
    dense = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128) + 100 * 64
    assert shape["dense_weights"] == dense

    # At 0.6 GB/s and 1 GFLOP/s: batch 4 at 50 tokens of context, 4-byte elements.
    f = decode_step.step_floors(4, shape, 50, 4, 0.6, 1.0)
    attention = 4 * 50 * 512
    assert f["dense_compute_floor_ms"] == pytest.approx(2 * 4 * dense / 1e6)
    assert f["compute_floor_ms"] == pytest.approx((2 * 4 * dense + attention) / 1e6)
    assert f["memory_floor_ms"] == pytest.approx((dense * 4 + 4 * 50 * 128 * 4) / 0.6 / 1e6)
    # The step is judged against the larger floor: here the memory floor lies between the
    # dense FLOPs' and all the FLOPs', so the two ratios use different floors.
    assert f["dense_compute_floor_ms"] < f["memory_floor_ms"] < f["compute_floor_ms"]
    ratio, dense_ratio = decode_step.over_floors(1.0, f)
    assert ratio == pytest.approx(1.0 / f["compute_floor_ms"])
    assert dense_ratio == pytest.approx(1.0 / f["memory_floor_ms"])


def test_offline_fraction_is_at_least_its_bar():
    assert targets.score_offline({"pdserve_fraction_of_ceiling": 0.6})[0]["met"] is True
    assert targets.score_offline({"pdserve_fraction_of_ceiling": 0.59})[0]["met"] is False
    assert targets.score_offline(None)[0]["met"] is None


def test_serving_compares_pdserve_tight_with_vllm_loose_and_reads_the_scored_rate():
    report = serve_report(
        {
            "colocated": {"1:0.05": 0.9, "2:0.1": 1.4},
            "disaggregated": {"1:0.05": 0.7, "2:0.1": 1.6},
            "vllm-2core": {"1:0.05": 0.0, "2:0.1": 0.5},
            "vllm": {"1:0.05": 0.1, "2:0.1": 0.6},
        },
        {
            "colocated": {0.5: 0.030, 1.0: 0.049, 1.5: 0.2},
            "disaggregated": {0.5: 0.02, 1.0: 0.051},
        },
    )
    rows = by_name(targets.score_serve(report, TIGHT, LOOSE, tpot_rate=1.0))
    goodput = rows["tight_goodput_over_vllm_loose"]
    assert goodput["pdserve_best"] == "colocated" and goodput["pdserve_tight_goodput_sum"] == 0.9
    assert goodput["vllm_best"] == "vllm" and goodput["vllm_loose_goodput_sum"] == 0.6
    assert goodput["figure"] == 1.5 and goodput["met"] is True
    assert rows["tpot_p99_s@1rps:colocated"] == {
        "target": "tpot_p99_s@1rps:colocated",
        "figure": 0.049,
        "want": "<= 0.05",
        "met": True,
    }
    assert rows["tpot_p99_s@1rps:disaggregated"]["met"] is False
    # A rate that was not run is not measured, whatever the others say.
    rows = by_name(targets.score_serve(report, TIGHT, LOOSE, tpot_rate=2.0))
    assert rows["tpot_p99_s@2rps:colocated"]["met"] is None


def test_vllm_serving_no_one_is_beaten_by_any_goodput_but_not_by_none():
    ours = {"colocated": {"1:0.05": 0.4}, "vllm-2core-fp32": {"2:0.1": 0.0}}
    row = targets.score_serve(serve_report(ours, {}), TIGHT, LOOSE, 1.0)[0]
    assert row["figure"] is None and row["met"] is True
    ours["colocated"]["1:0.05"] = 0.0
    row = targets.score_serve(serve_report(ours, {}), TIGHT, LOOSE, 1.0)[0]
    assert row["met"] is False
    without_vllm = serve_report({"colocated": {"1:0.05": 0.4}}, {})
    row = targets.score_serve(without_vllm, TIGHT, LOOSE, 1.0)[0]
    assert row["met"] is None and row["vllm_best"] is None


def test_nothing_run_is_nothing_met():
    rows = targets.score({}, TIGHT, LOOSE, 1.0)
    assert len(rows) == len(targets.BATCHES) + 1 + 3
    assert all(r["met"] is None for r in rows)


def test_the_serve_command_gives_the_workers_the_tight_pair_as_their_targets(tmp_path):
    args = argparse.Namespace(
        tight=(2.0, 0.15), loose=(4.0, 0.3), prompt_len="32-128", output_len="32-256",
        rates="0.4,1", duration=60.0, out_dir=tmp_path,
    )  # fmt: skip
    serve = targets.commands(args, "float32", vllm=True)["serve"]
    assert serve[serve.index("--systems") + 1] == "colocated,disaggregated,vllm-2core-fp32"
    assert serve[serve.index("--slo-ttft") + 1 :][:4] == ["2", "--slo-tpot", "0.15", "--extra-slo"]
    assert serve[serve.index("--extra-slo") + 1] == "4:0.3"
    for flag in ("--ttft-target-ms=2000", "--tpot-target-ms=150", "--handoff-wait-ms=2000"):
        assert f"--serve-arg={flag}" in serve
    bf16 = targets.commands(args, "bfloat16", vllm=True)["serve"]
    assert bf16[bf16.index("--systems") + 1].endswith(",vllm-2core")
    alone = targets.commands(args, "float32", vllm=False)["serve"]
    assert alone[alone.index("--systems") + 1] == "colocated,disaggregated"


@pytest.mark.parametrize("text", ["1", "a:b", "0:0.05", "1:-1", "1:2:3"])
def test_a_bad_slo_pair_is_refused_by_name(text):
    with pytest.raises(argparse.ArgumentTypeError, match=r"TTFT|> 0|one"):
        slo.slo_pair(text)
