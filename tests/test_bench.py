"""bench.measure_roofline: the two ceilings the book's prefill/decode chapter plots."""

from __future__ import annotations

import math

from fucina_course.bench import measure_roofline


def test_measure_roofline_reports_both_ceilings():
    shapes = ((64, 96, 128), (32, 32, 32))
    r = measure_roofline(2, read_bytes=2**22, shapes=shapes, read_repeats=2,
                         matmul_repeats=1)
    assert r["threads"] == 2
    assert math.isfinite(r["bandwidth_gb_s"]) and r["bandwidth_gb_s"] > 0
    assert [(s["m"], s["n"], s["k"]) for s in r["sgemm"]] == list(shapes)
    assert all(math.isfinite(s["gflop_s"]) and s["gflop_s"] > 0 for s in r["sgemm"])
    assert r["peak_gflop_s"] == max(s["gflop_s"] for s in r["sgemm"])
