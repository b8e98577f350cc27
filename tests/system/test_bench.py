"""The benchmark scripts in ``bench/`` run end to end with tiny workloads and write their files.

Only that they run and report what they promise is checked: no figure is
compared with an expected speed (numbers on a shared machine are noise).
Results go to a temporary directory through ``RINGSERVE_BENCH_RESULTS``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ringserve.engine.modelfile import default_model_path
from tests.support.models import smollm2_path
from tests.support.server import MODEL_THREADS

ROOT = Path(__file__).resolve().parents[2]


def run_bench(name: str, tmp_path: Path, *args: str, timeout: float = 240, stdout: list[str] | None = None,
              png: bool = True) -> dict:
    """Run ``bench/NAME.py ARGS``; return its JSON after checking the PNG exists too (unless ``png`` is
    false: a script that plots nothing), and append what it printed to ``stdout`` if given."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{name}.py"), *args],
        cwd=ROOT,
        env={**os.environ, "RINGSERVE_BENCH_RESULTS": str(tmp_path)},
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if stdout is not None:
        stdout.append(proc.stdout)
    if png:
        assert (tmp_path / f"{name}.png").stat().st_size > 0
    return json.loads((tmp_path / f"{name}.json").read_text())


def test_resume_bench_replays_each_position(tmp_path: Path) -> None:
    out = run_bench("resume", tmp_path, "--tokens", "200", "--repeats", "2")
    assert out["machine"]["cores"] >= 1
    for variant in out["results"].values():
        positions = variant["positions"]
        # the start replays more than the middle, which replays more than the end
        assert positions["start"]["events"] > positions["middle"]["events"] > positions["end"]["events"] >= 1
        for pos in positions.values():
            assert len(pos["samples"]["total"]) == 2
            assert 0 < pos["first_byte_p50"] <= pos["total_p50"]


def test_cpu_per_token_bench_measures_both_surfaces(tmp_path: Path) -> None:
    out = run_bench("cpu_per_token", tmp_path, "--streams", "2", "--tokens", "300", "--rounds", "1", "--step-ms", "2")
    [tree] = out["results"].values()
    assert set(tree) == {"anthropic", "openai"}
    assert all(len(us) == 1 and us[0] > 0 for us in tree.values())
    [loop] = out["event_loop_us_per_step"].values()
    assert set(loop) == {"anthropic", "openai"}
    assert all(len(us) == 1 and us[0] > 0 for us in loop.values())
    assert out["step_ms"] == 2


def test_gateway_bench_holds_and_fans_out(tmp_path: Path) -> None:
    out = run_bench("gateway", tmp_path, "--streams", "20", "--heartbeat", "1", "--hold-seconds", "2.5",
                    "--fanout-seconds", "1.5", "--messages", "2", "--entry-rate", "10", "--rounds", "1")
    hold = out["runs"]["hold"]["20"][0]
    assert hold["alive"] == 20 and hold["streams_without_ping"] == 0
    assert hold["rss_bytes"] > hold["rss_base_bytes"] > 0
    fan = out["runs"]["fanout"]["20"][0]
    assert fan["alive"] == 20 and fan["entries"] > 0 and fan["offered_entries_per_second"] == 200
    assert fan["spread_p50"] is not None


@pytest.mark.model
def test_engine_bench_compares_both_sides(tmp_path: Path) -> None:
    out = run_bench("engine", tmp_path, "--seqs", "1", "2", "--tokens", "8", "--bursts", "2", "--threads", str(MODEL_THREADS))
    for n in ("1", "2"):
        summary = out["summary"][n]
        assert summary["raw"]["tokens_per_second"] > 0 and summary["ringserve"]["tokens_per_second"] > 0
        bursts = out["bursts_raw"][n]
        assert len(bursts) == 2
        for b in bursts:
            assert b["ratio"] == pytest.approx(b["ringserve_tokens_per_second"] / b["raw_tokens_per_second"])
        assert summary["ringserve"]["ttft_p50"] > 0 and summary["ringserve"]["tbt_p99"] > 0


@pytest.mark.model
def test_omp_teams_bench_times_both_sides_in_their_own_processes(tmp_path: Path) -> None:
    out = run_bench("omp_teams", tmp_path, "--seqs", "2", "--tokens", "4", "--rounds", "2", "--threads", str(MODEL_THREADS))
    assert [sorted(r) for r in out["rounds"]] == [["one", "ratio", "two"]] * 2
    for r in out["rounds"]:
        assert r["one"] > 0 and r["two"] > 0 and r["ratio"] == pytest.approx(r["two"] / r["one"])
    assert out["summary"]["ratio"] == pytest.approx((out["rounds"][0]["ratio"] + out["rounds"][1]["ratio"]) / 2)


@pytest.mark.model
def test_abort_bench_frees_every_cancel(tmp_path: Path) -> None:
    out = run_bench("abort", tmp_path, "--cancels", "3", "--slots", "2", "--threads", str(MODEL_THREADS))
    for setting in ("idle", "loaded"):
        s = out["summary"][setting]
        assert s["cancels"] == 3 and s["statuses"] == ["cancelled"]
        assert 0 < s["cancel_to_free_p50"] <= s["close_to_free_p50"]
        assert s["tokens_after_cancel_max"] <= 1  # only a decode already in flight


@pytest.mark.model
def test_http_bench_runs_end_to_end(tmp_path: Path) -> None:
    """The smallest run: ringserve only, one stream, one request, one round (of two, cut by --deadline),
    one llama.cpp thread (two stall each other on a loaded machine: 3 minutes for this run at load
    average 11, against 35 s with one). The comparison with llama_cpp.server, which starts a second
    model server, is opt-in: RINGSERVE_BENCH_BOTH=1."""
    printed: list[str] = []
    out = run_bench("http_streams", tmp_path, "--servers", "ringserve", "--streams", "1", "--tokens", "8",
                    "--requests", "1", "--rounds", "2", "--deadline", "1", "--slots", "1",
                    "--threads", str(MODEL_THREADS), "--logs", str(tmp_path / "logs"), stdout=printed)
    # a second round would end after --deadline (1 s from the start, before the first round ends)
    assert out["rounds_run"] == 1 and "stopping after 1 of 2 rounds" in printed[0]
    [level] = out["rounds"]["ringserve"]["1"]
    assert level["errors"] == [] and level["requests"] == 1
    assert level["tokens"] > 0 and level["ttft_p50"] > 0
    # the engine-idle share: time between decode calls while busy, over that plus the decode calls
    idle, decode, share = (level[k] for k in ("server_engine_idle_seconds", "server_decode_seconds", "engine_idle_share"))
    assert decode > 0 and idle >= 0 and share == pytest.approx(idle / (idle + decode)) and 0 <= share < 1
    assert out["summary"]["1"]["ringserve"]["engine_idle_share"] == share  # one round: its median
    assert "ready:" in (tmp_path / "logs" / "ringserve.log").read_text()  # --logs keeps the server's log
    ratio = out["summary"]["1"]["ratio_raw_loop"]
    assert ratio > 0
    # the ratio table is printed: one row for 1 stream with the raw-loop ratio and its one round, no other server
    head, row = printed[0].split("ringserve / the others", 1)[1].splitlines()[1:3]
    assert "vs raw loop" in head and "llama" not in head and row.split() == ["1", f"{ratio:.2f}", f"{ratio:.2f}"]
    assert out["rounds"]["llama_cpp.server"]["1"] == [] and out["summary"]["1"]["ratio_tokens_per_second"] == {}


@pytest.mark.model
def test_raw_loop_prefills_more_prompts_than_one_batch_holds() -> None:
    """32 prompts of 21 tokens are more than the raw loop's 512-token batch: it prefills them in two
    batches, each sequence sampled after the batch that holds its last prompt token (the GPU run
    takes the raw loop to 64 streams)."""
    from bench.raw_decode import N_BATCH, RawDecoder

    with RawDecoder(default_model_path(), 32, 2, n_threads=MODEL_THREADS) as decoder:
        assert len(decoder.prompt) * 32 > N_BATCH
        run = decoder.run()
    assert run.tokens_per_second > 0 and run.prefill_seconds > 0 and len(run.step_seconds) == 2


@pytest.mark.model
@pytest.mark.skipif(os.environ.get("RINGSERVE_BENCH_BOTH") != "1", reason="opt-in: RINGSERVE_BENCH_BOTH=1 (about 2 minutes)")
@pytest.mark.skipif(importlib.util.find_spec("uvicorn") is None or importlib.util.find_spec("fastapi") is None,
                    reason="needs llama-cpp-python's server extra: pip install -e '.[bench]'")
def test_http_bench_runs_both_servers(tmp_path: Path) -> None:
    out = run_bench("http_streams", tmp_path, "--streams", "1", "--tokens", "8", "--requests", "1",
                    "--rounds", "1", "--slots", "1", "--threads", str(MODEL_THREADS))
    for server in ("ringserve", "llama_cpp.server"):
        level = out["rounds"][server]["1"][0]
        assert level["errors"] == [] and level["requests"] == 1
        assert level["tokens"] > 0 and level["ttft_p50"] > 0
    assert out["summary"]["1"]["ratio_tokens_per_second"]["llama_cpp.server"] > 0


def test_multi_turn_bench_reports_cached_and_prefilled_tokens_per_turn(tmp_path: Path) -> None:
    out = run_bench("multi_turn", tmp_path, "--fake", "--turns", "2", "--rounds", "1", "--tokens", "4",
                    "--conversations", "2", timeout=120)
    assert out["fake_engine"] and set(out["summary"]) == {"ringserve", "ringserve (no cache)"}
    for scenario in ("single", "shared"):
        on = out["summary"]["ringserve"][scenario]
        off = out["summary"]["ringserve (no cache)"][scenario]
        assert on["errors"] == off["errors"] == []
        turn1, turn2 = on["per_turn"]["1"], on["per_turn"]["2"]
        # turn 2 finds turn 1's prompt in the cache (one token per byte on the fake engine)
        assert turn2["cached_tokens"] >= turn1["prompt_tokens"]
        assert turn2["prefilled_tokens"] == turn2["prompt_tokens"] - turn2["cached_tokens"]
        assert all(t["cached_tokens"] == 0 for t in off["per_turn"].values())
        assert on["later_turns_ttft_p50"] > 0 and off["first_turn_ttft_p50"] > 0
    # the second conversation copied the shared system prompt (~4,600 bytes) from the first one's slot;
    # the first one reused only what its tag shares with the previous scenario's prompt
    first, second = (t["cached_tokens"] for t in out["raw"]["ringserve"]["shared"][0] if t["turn"] == 1)
    assert first < 100 and second > 4000


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed (apt-get install redis-server)")
def test_count_tokens_bench_times_a_burst_idle_and_beside_decoding_streams(tmp_path: Path) -> None:
    out = run_bench("count_tokens", tmp_path, "--fake", "--calls", "8", "--streams", "2", "--rounds", "1")
    [one] = out["rounds"]
    assert len(one["idle"]) == len(one["decoding"]) == 8 and all(s > 0 for s in one["idle"] + one["decoding"])
    assert set(out["summary"]) == {"idle", "decoding"} and len(out["body_tokens"]) >= 20


def test_redis_append_bench_runs_both_modes(tmp_path: Path) -> None:
    pytest.importorskip("coredis", reason="the redis extra is not installed")
    out = run_bench("redis_append", tmp_path, "--streams", "4", "--entries", "10", "--repeats", "1")
    assert set(out["summary"]) == {"pipelined", "per_entry"}
    assert out["summary"]["per_entry"]["round_trips"] == 40
    assert out["summary"]["pipelined"]["round_trips"] < 40  # several streams' entries per round trip


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed (apt-get install redis-server)")
def test_redis_resume_bench_resumes_on_the_other_replica_the_owner_and_a_memory_replica(tmp_path: Path) -> None:
    pytest.importorskip("coredis", reason="the redis extra is not installed")
    out = run_bench("redis_resume", tmp_path, "--tokens", "200", "--repeats", "2")
    assert len(out["results"]) == 3
    for positions in out["results"].values():
        assert positions["start"]["events_replayed"] > positions["end"]["events_replayed"] > 0
        assert all(len(p["samples"]["first"]) == 2 and p["first_byte_p50"] > 0 for p in positions.values())


def test_responses_memory_bench_stays_bounded(tmp_path: Path) -> None:
    """Issue 15: what grows with the number of stored responses is bounded: the ring bytes by the
    memory cap at every checkpoint (no generation running: every log is a completed one), the
    logs by the TTL, the store by its retention. RSS is reported, not judged."""
    cap_mib = 0.5
    out = run_bench("responses_memory", tmp_path, "--responses", "240", "--checkpoints", "60,120", "--ttl", "1",
                    "--retention", "--memory-cap-mib", str(cap_mib), "--workers", "4")
    points = {p["label"]: p for p in out["points"]}
    assert [p["responses"] for p in out["points"]] == [0, 60, 120, 240, 240, 240]
    for p in out["points"]:
        assert p["ringserve_ring_bytes"] <= cap_mib * 2**20 == p["ringserve_ring_memory_cap_bytes"], p
        assert p["rss_bytes"] > 0
    assert points["after ttl"]["ringserve_ring_logs"] == 0 == points["after ttl"]["ringserve_ring_bytes"]
    assert points["after retention (restart)"]["ringserve_store_swept_messages"] == 240
    costs = out["store_per_response"]
    assert costs["rows"] == 240 and 0 < costs["trace"] < costs["text"]


def test_soak_bench_runs_every_operation_and_reports_rss_over_time(tmp_path: Path) -> None:
    """Issue 43 item 8: RSS sampled over the run and its slope per half reported, not judged; every
    operation of the mix answered as expected."""
    out = run_bench("soak", tmp_path, "--minutes", "0.4", "--sample-seconds", "2", "--workers", "4")
    summary = out["summary"]
    assert summary["unexpected"] == {} and summary["requests"] > 100
    assert len(out["points"]) >= 6 and all(p["rss_bytes"] > 0 for p in out["points"])
    assert summary["slope_second_half_mb_per_min"] is not None


def test_reply_waves_bench_reports_peak_and_idle_rss(tmp_path: Path) -> None:
    """Issue 43 item 8: each wave's peak and RSS after, and once the logs' TTL passed (no log
    left); figures reported, not judged."""
    out = run_bench("reply_waves", tmp_path, "--waves", "2", "--messages", "4", "--reply-mb", "0.2",
                    "--slots", "4", "--ttl", "1")
    rows = out["rows"]
    assert [r["when"] for r in rows[:3]] == ["start", "wave 1", "wave 2"] and rows[-1]["ring_mb"] == 0
    assert all(r["read_mb"] >= 4 * 0.2 * 0.9 for r in rows[1:3])


def test_gpu_proxy_bench_checks_every_stream_on_every_surface(tmp_path: Path) -> None:
    printed: list[str] = []
    out = run_bench("gpu_proxy", tmp_path, "--levels", "4:5:20", "--rounds", "1", stdout=printed)
    assert out["surfaces"] == ["anthropic", "openai", "responses"]
    [name] = out["names"]
    for surface in out["surfaces"]:
        [m] = out["runs"][name]["4x5ms"][surface]
        assert m["streams_short"] == 0 and m["errors"] == []
        assert 0 < m["ratio"] <= 1.5 and m["server_cpu_us_per_token"] > 0 and m["decode_steps"] >= 20
        assert m["tokens_per_second"] == pytest.approx(m["ratio"] * m["ideal_tokens_per_second"])
        assert 0 <= m["engine_idle_share"] < 1
    assert "delivered / engine-bound rate" in printed[0]


@pytest.mark.model
def test_kv_types_bench_reports_memory_and_speed_per_cache_type(tmp_path: Path) -> None:
    printed: list[str] = []
    out = run_bench("kv_types", tmp_path, "--models", "smollm2", "--ctx", "512", "--fills", "16", "64",
                    "--tokens", "4", "--rounds", "2", "--threads", str(MODEL_THREADS), stdout=printed)
    rows = out["results"]["smollm2"]["rows"]
    assert list(rows) == ["f16/f16 fa=off", "f16/f16 fa=on", "bf16/bf16 fa=off", "bf16/bf16 fa=on",
                          "q8_0/f16 fa=off", "q8_0/q8_0 fa=on", "q4_0/q4_0 fa=on"]
    for row in rows.values():
        assert set(row["tokens_per_second"]) == {"16", "64"}
        assert all(len(speeds) == 2 and min(speeds) > 0 for speeds in row["tokens_per_second"].values())
        assert row["kv_per_token_llama"] == pytest.approx(row["kv_per_token_estimated"], rel=0.01)
    assert rows["f16/f16 fa=off"]["speed_ratio"] == {"16": 1, "64": 1}
    assert rows["f16/f16 fa=off"]["memory_ratio"] == 1
    assert rows["q8_0/q8_0 fa=on"]["memory_ratio"] == pytest.approx(34 / 64, rel=0.01)
    assert rows["q4_0/q4_0 fa=on"]["memory_ratio"] == pytest.approx(18 / 64, rel=0.01)
    assert "KV/token llama" in printed[0] and "tok/s @64" in printed[0]


def test_kv_pool_bench_runs_a_long_request_with_chats_and_queues_a_second_long_one(tmp_path: Path) -> None:
    """On the fake engine (a pool of 3,000 tokens): the long request and the chats complete; the
    second long request, sent while the first runs, is queued (its status said so) and completes."""
    printed: list[str] = []
    out = run_bench("kv_pool", tmp_path, "--fake", "--long-tokens", "2000", "--fake-ctx", "3000", "--poll", "0.05",
                    stdout=printed)
    assert out["all_complete"] and out["fourth_sent_while_first_ran"]
    first, *chats, fourth = out["rows"]
    assert len(chats) == 3 and all(r["input_tokens"] < 100 and r["output_tokens"] == 8 for r in chats)
    assert first["input_tokens"] == fourth["input_tokens"] == out["prompt_tokens_counted"]["long 1"] > 1900
    assert fourth["queued_polls"] >= 1 and 0 < fourth["queued_s"] < fourth["total_s"]
    assert "waited" in printed[0] and "all complete: yes" in printed[0]


@pytest.mark.model
def test_load_beside_bench_times_a_stream_while_a_model_loads_here_and_elsewhere(tmp_path: Path) -> None:
    """One round on the bundled model (the load in the server, in another process, and none): every
    window holds gaps, and the ratios are of the p99s."""
    printed: list[str] = []
    out = run_bench("load_beside", tmp_path, "--model", str(smollm2_path()), "--rounds", "1", "--tokens", "1000",
                    stdout=printed)
    [one] = out["rounds"]
    assert sorted(one["order"]) == ["elsewhere", "idle", "load"]
    for condition in ("load", "elsewhere", "idle"):
        run = one[condition]
        assert run["window_s"] > 0 and len(run["gaps"]) > 10 and 0 < run["p50"] <= run["p99"] <= run["max"]
    for condition in ("load", "elsewhere"):
        assert one[f"ratio_{condition}"] == pytest.approx(one[condition]["p99"] / one["idle"]["p99"])
        assert out["summary"][f"ratio_{condition}_median"] == pytest.approx(one[f"ratio_{condition}"])
    assert out["summary"]["goal"] == 1.25 and "load / idle" in printed[0]


@pytest.mark.skipif(not (ROOT / ".ci" / "agents" / "node_modules" / ".bin" / "codex").exists(),
                    reason="the agents are not installed: npm ci --prefix .ci/agents")
def test_agents_model_bench_launches_both_agents_and_reads_their_requests(tmp_path: Path) -> None:
    """On the fake engine (``--fake``: the server started by the bench, found by the launcher): both
    agents exit 0 with the fake's reply, and their requests, statuses and tokens are reported."""
    scratch = Path("/var/tmp") / f"ringserve-bench-agents-{tmp_path.name}"  # Codex refuses helpers under /tmp
    try:
        printed: list[str] = []
        out = run_bench("agents_model", tmp_path, "--fake", "--scratch", str(scratch), stdout=printed)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    claude, codex = out["runs"]
    assert claude["agent"] == "claude" and codex["agent"] == "codex"
    for run in (claude, codex):
        assert run["returncode"] == 0, run["stderr_tail"]
        assert run["requests"] and all(q["status"] == 200 for q in run["requests"])
        assert run["prompt_tokens"] > 1000 and run["generated_tokens"] > 0
    assert claude["outcome"] == "Hi." and codex["outcome"] == "turn.completed"
    assert "requests (status, s)" in printed[0]
def test_step_timeline_bench_splits_the_steps_of_ringserve_and_the_raw_loop(tmp_path: Path) -> None:
    out = run_bench("step_timeline", tmp_path, "--streams", "2", "--tokens", "8", "--rounds", "1",
                    "--threads", str(MODEL_THREADS))
    assert out["sides"] == ["ringserve", "raw loop"]
    for side in out["sides"]:
        [burst] = out["runs"][side]["2"]
        assert burst["tokens_per_second"] > 0
        assert burst["timeline"]["llama_decode"] > 0 and burst["timeline"]["decode_threads_run_queue_wait"] >= 0


def test_decode_beside_bench_times_every_mode_against_the_loop_alone(tmp_path: Path) -> None:
    out = run_bench("decode_beside", tmp_path, "--seqs", "2", "--tokens", "4", "--rounds", "1",
                    "--threads", str(MODEL_THREADS), png=False)
    assert set(out["runs"]) == {"alone", "during", "between", "wakeups", "busy"}
    assert all(run["step_p50"] > 0 for runs in out["runs"].values() for run in runs)
