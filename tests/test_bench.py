"""`edgekv bench` runs end to end on a tiny bundle and reports every number it promises."""
import json

from tests.conftest import run_edgekv


def test_bench_reports_all_measurements(tiny_bundle_int8, tmp_path):
    out = tmp_path / "bench.json"
    r = run_edgekv("bench", tiny_bundle_int8, "--prompt-lengths", "8", "--capacities", "32,64", "--fill", "8",
                   "--decode-tokens", "4", "--rss-tokens", "40", "--repeat", "1", "--threads", "1", "--json", out)
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert {run["capacity"] for run in d["runs"]} == {32, 64}
    assert all(run["decode_tps"] > 0 and run["ttft_ms"] > 0 for run in d["runs"])
    assert d["decode_ratio_big_vs_small_capacity"] > 0 and 0 < d["fraction_of_bandwidth_bound"]
    assert d["rss"]["tokens"] == 40 and d["peak_rss_mib"] > 0
    assert "of the bound" in r.stdout and "RSS over 40 decoded tokens" in r.stdout
