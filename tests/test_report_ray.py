"""`lcx report --ray` (`lcx.report.ray_executor`): journals carried between the driver and a task
byte for byte, what a cell asks of the cluster, the flags; and (slow) a real two-node Ray cluster
on 127.0.0.1 measuring a small sweep with the cells of a serial run, through a worker killed
mid-cell and a node removed mid-sweep, with a failing cell reported while the others go on."""

from __future__ import annotations

from lcx.report.cells import journal_dir, read_cells, read_run, running_path  # noqa: E402,F401 (#74: the cache, not the report folder)

import os

# Before Ray is imported (it reads this once): a node given 127.0.0.1 stays there instead of taking
# the machine's interface address (`ray._private.services.resolve_ip_for_localhost`).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import json  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from lcx.report.ray_executor import (  # noqa: E402
    append_rows,
    cell_memory,
    cell_resources,
    cluster_capacity,
    is_loopback,
    journal_rows,
    unfit,
)

# The sweep of the cluster tests: 3 methods x 2 lengths; passkey + perplexity, 2 RULER tasks (every
# RULER length is >= 1024), decode at the first length; a few prompts each (15 cells).
SWEEP = dict(model="tiny-ret-5m", methods=("vanilla", "yarn", "lm_infinite"), lengths=(1024, 2048),
             decode_lengths=(1024,), depths=(0.25, 0.75), samples_per_depth=1, ppl_docs=1, decode_tokens=3,
             tasks=("passkey", "ppl", "ruler"), ruler_tasks=("niah_single_1", "ruler_vt"), ruler_samples=2)
TIMINGS = {"wall_s", "prefill_s", "decode_s", "decode_cpu_s", "tokens_per_s", "threads", "resumed_requests"}
# the tiny Llama's config (tests/conftest.py `tiny_model`): 2 layers, hidden 64, 4/2 heads of 16, vocab 259
TINY_CONFIG = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 256, "vocab_size": 259,
               "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}


# The journal between driver and task
# ============================================================================================

def test_journal_rows_carry_lm_evals_answers_byte_for_byte(tmp_path):
    """What lm-eval's request cache (sqlitedict, as `CachingLM` opens it) wrote is read in write
    order from a row on, appended to another journal unchanged, and read back there by sqlitedict
    as the same answers; a journal not yet written holds none."""
    from sqlitedict import SqliteDict

    src, dst = tmp_path / "task_rank0.db", tmp_path / "driver" / "cell_rank0.db"
    assert journal_rows(src) == ([], 0) and journal_rows(src, 7) == ([], 7)
    answers = {"loglikelihood-a": (-3.25, True), "generate_until-b": "the pass key is 71432", "c": (-0.5, False)}
    with SqliteDict(str(src), autocommit=True) as db:
        for k, v in answers.items():
            db[k] = v
    rows, last = journal_rows(src)
    assert [k for k, _ in rows] == list(answers) and last == 3
    append_rows(dst, rows[:2])
    append_rows(dst, journal_rows(src, 2)[0])  # the rows after the second: the third alone
    with SqliteDict(str(dst), flag="r") as db:
        assert dict(db.items()) == answers
    assert journal_rows(dst)[0] == rows  # the same bytes


# What a cell asks for
# ============================================================================================

def test_a_cells_memory_estimate_is_its_weights_kv_activations_and_the_process():
    """`cell_memory` for the tiny Llama at 101 tokens, by hand: params 259*64 (tied) + 2*(q,o 2*64*64
    + k,v 2*64*32 + MLP 3*64*256) = 139,456 -> 557,824 B in float32; KV 2*2*2*16*101*4 = 51,712;
    activations 4*101*256*4 + 2*101*259*4 = 622,968; plus 1.5 GiB, times 1.25."""
    assert cell_memory(TINY_CONFIG, "float32", 101) == int(1.25 * (1.5 * 2**30 + 557_824 + 51_712 + 622_968))
    assert cell_memory(TINY_CONFIG, "bfloat16", 101) < cell_memory(TINY_CONFIG, "float32", 101)
    assert cell_memory(TINY_CONFIG, "float32", 4097) > cell_memory(TINY_CONFIG, "float32", 101)
    untied = cell_memory({**TINY_CONFIG, "tie_word_embeddings": False}, "float32", 101)
    assert abs(untied - cell_memory(TINY_CONFIG, "float32", 101) - 1.25 * 259 * 64 * 4) <= 1  # the lm head
    with pytest.raises(ValueError, match="vocab_size"):
        cell_memory({**TINY_CONFIG, "vocab_size": 0}, "float32", 101)
    with pytest.raises(ValueError, match="length"):
        cell_memory(TINY_CONFIG, "float32", 0)


def test_cell_resources_and_what_a_cluster_holds():
    assert cell_resources(threads=3, gpu=True, memory=5) == {"num_cpus": 3, "num_gpus": 1, "memory": 5}
    assert cell_resources(threads=1, gpu=False, memory=5)["num_gpus"] == 0
    with pytest.raises(ValueError, match="threads"):
        cell_resources(threads=0, gpu=False, memory=5)
    nodes = [{"Resources": {"CPU": 3.0}}, {"Resources": {"CPU": 1.0}}, {"Resources": {"CPU": 8.0, "GPU": 2.0}}]
    assert cluster_capacity(nodes, threads=1, gpu=False) == 12
    assert cluster_capacity(nodes, threads=2, gpu=False) == 1 + 0 + 4
    assert cluster_capacity(nodes, threads=1, gpu=True) == 2  # a cell per GPU; CPU-only nodes hold none


def test_a_cell_no_node_fits_is_named_not_queued_for_ever():
    """`unfit`: None when some node has the CPUs, GPU and memory a cell asks for; else a reason
    naming the request and every node (the driver fails such a cell instead of waiting on Ray)."""
    nodes = [{"Resources": {"CPU": 2.0, "memory": 3 * 2**30}}, {"Resources": {"CPU": 8.0, "GPU": 1.0, "memory": 2**30}}]
    assert unfit(nodes, cell_resources(threads=2, gpu=False, memory=2 * 2**30)) is None
    assert unfit(nodes, cell_resources(threads=3, gpu=False, memory=2**30)) is None  # the second node
    why = unfit(nodes, cell_resources(threads=3, gpu=False, memory=2 * 2**30))
    assert why is not None and "3 CPU, 0 GPU and 2.0 GiB" in why and "8 CPU, 1 GPU, 1.0 GiB" in why
    assert "1 GPU" in unfit(nodes[:1], cell_resources(threads=1, gpu=True, memory=1))
    assert "no node alive" in unfit([], cell_resources(threads=1, gpu=False, memory=1))


@pytest.mark.parametrize("address, loopback", [
    ("127.0.0.1:6379", True), ("localhost:6379", True), ("ray://127.0.0.1:10001", True), ("[::1]:6379", True),
    ("127.0.1.1:6379", True), ("10.0.0.2:6379", False), ("ray://head.example:10001", False), ("auto", False)])
def test_which_addresses_are_loopback(address, loopback):
    assert is_loopback(address) is loopback


def test_ray_flag_picks_the_cluster_threads_and_cpus(monkeypatch, tmp_path, capsys):
    """`--ray` alone: a local cluster (or $RAY_ADDRESS), 1 thread per cell under `auto`, every core;
    `--ray ADDRESS --jobs 2 --threads 3`: that cluster, 6 CPUs if started here; a device index is
    refused (Ray picks each cell's GPU); a record with failed cells exits 1."""
    import argparse

    from lcx.report import cli

    seen, record = {}, {"results": {}}
    monkeypatch.setattr(cli, "run_report", lambda cfg, out, **kw: seen.update(kw) or record)
    monkeypatch.setattr(cli, "markdown", lambda rec: "")
    monkeypatch.setattr("lcx.threads.resolve_threads", lambda t, **k: 1)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    out = ["--out", str(tmp_path)]
    assert cli.run(p.parse_args(["--ray", *out])) == 0
    assert (seen["ray"], seen["ray_address"], seen["ray_cpus"], seen["jobs"], seen["job_threads"]) == (
        True, None, None, None, 1)
    assert cli.run(p.parse_args(["--ray", "127.0.0.1:6379", "--jobs", "2", "--threads", "3", *out])) == 0
    assert (seen["ray_address"], seen["ray_cpus"], seen["jobs"], seen["job_threads"]) == ("127.0.0.1:6379", 6, 2, 3)
    monkeypatch.setenv("RAY_ADDRESS", "10.1.2.3:6379")
    assert cli.run(p.parse_args(["--ray", *out])) == 0 and seen["ray_address"] == "10.1.2.3:6379"
    seen.clear()
    assert cli.run(p.parse_args(["--ray", "--device", "cuda:1", *out])) == 2 and not seen
    assert "--device must be cpu or cuda" in capsys.readouterr().err
    monkeypatch.setattr("lcx.report.jobs.auto_jobs", lambda cfg: 1)  # (without --ray: --jobs auto's count)
    assert cli.run(p.parse_args(out)) == 0 and "ray" not in seen and seen["jobs"] == 1
    record["cells_failed"] = {"lm_infinite/lmeval/383": "NotImplementedError: ..."}
    assert cli.run(p.parse_args(["--ray", *out])) == 1
    assert "1 cell(s) failed" in capsys.readouterr().err


def test_run_report_refuses_a_device_index_under_ray(tmp_path):
    from lcx.report import ReportConfig, run_report

    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        run_report(ReportConfig(model="tiny-ret-5m", device="cuda:1"), tmp_path, ray=True, progress=False)


# A real cluster on 127.0.0.1 (slow tier)
# ============================================================================================

def _descendants(root: int) -> set[int]:
    """`root` and every process under it (from /proc)."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    out, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in out]
        out.update(kids)
        frontier += kids
    return out


def _listening(pids: set[int]) -> list[tuple[str, str]]:
    """(local address, process) of every TCP socket listening in `pids`: `ss -Hltnp`, or where
    iproute2 is missing the same from /proc (LISTEN rows of /proc/net/tcp{,6} by socket inode)."""
    import re

    if shutil.which("ss"):
        lines = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout.splitlines()
        return [(line.split()[3], name) for line in lines for name, pid in re.findall(r'\("([^"]+)",pid=(\d+)', line)
                if int(pid) in pids]
    import ipaddress

    listen: dict[str, str] = {}
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            f = row.split()
            if f[3] == "0A":  # TCP_LISTEN
                hexip, port = f[1].split(":")
                raw = bytes.fromhex(hexip)
                ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
                listen[f[9]] = f"{ip}:{int(port, 16)}"
    out = []
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        out += [(listen[ln[8:-1]], _comm(pid)) for ln in links if ln.startswith("socket:[") and ln[8:-1] in listen]
    return out


def _on_loopback(addr: str) -> bool:
    host = addr.rsplit(":", 1)[0].strip("[]")
    return host.startswith("127.") or host.startswith("::ffff:127.") or host == "::1"


def _numbers(cells: dict) -> dict:
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in TIMINGS}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x
    return strip(json.loads(json.dumps(cells)))


def _cluster(n_workers: int):
    from ray.cluster_utils import Cluster

    # the head runs cells too (1 CPU); the driver (this process) takes none. A node that stops
    # answering is declared dead after 3 missed 1 s health checks (Ray's default: 5 of 3 s)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "node_ip_address": "127.0.0.1",
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}})
    nodes = [cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1") for _ in range(n_workers)]
    cluster.wait_for_nodes()
    return cluster, nodes


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    pytest.importorskip("ray")
    from lcx.report import ReportConfig, run_report

    out = tmp_path_factory.mktemp("serial")
    return run_report(ReportConfig(**SWEEP), out, progress=False, log=lambda s: None)


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray")
    cluster, _ = _cluster(1)
    yield cluster
    cluster.shutdown()


@pytest.mark.slow
def test_a_two_node_cluster_measures_a_serial_runs_cells(serial, cluster, tmp_path):
    """The sweep's 15 cells on two nodes (1 CPU each): every number of the serial run, the cells in
    the serial order, the run finished; every socket a Ray process of the cluster listens on is on
    loopback."""
    from lcx.report import ReportConfig, run_report

    rec = run_report(ReportConfig(**SWEEP), tmp_path, progress=False, ray=True, ray_address=cluster.address,
                     job_threads=1, jobs=None, log=lambda s: None)
    assert rec["cells_total"] == 15 and "cells_failed" not in rec
    assert _numbers(rec["results"]) == _numbers(serial["results"])
    assert len(rec["ray_cells"]) == 15 and len({c["node"] for c in rec["ray_cells"].values()}) == 2  # both nodes
    assert all(c["attempts"] == 1 and c["task_s"] >= c["overhead_s"] >= 0 for c in rec["ray_cells"].values())
    order = [(n, k, list(c)) for n, r in rec["results"].items() for k, c in r.items()]
    assert order == [(n, k, list(c)) for n, r in serial["results"].items() for k, c in r.items()]
    assert read_run(tmp_path)["finished"] is True
    assert len(read_cells(tmp_path)) == 15
    assert not list(journal_dir(tmp_path).glob("*_rank0.db"))  # every journal dropped with its cell
    sockets = _listening(_descendants(os.getpid()))
    assert {name for _, name in sockets} >= {"gcs_server", "raylet"}
    assert [s for s in sockets if not _on_loopback(s[0])] == []


@pytest.mark.slow
def test_a_failing_cell_is_reported_and_the_others_are_measured(cluster, tmp_path):
    """LM-Infinite's cell on the `cuda` attention backend fails on a CPU node (its own error, not
    retried); vanilla's (no attention method) is measured; the run stays unfinished, so the same
    command measures the failed cell again."""
    from lcx.report import ReportConfig, run_report

    cfg = ReportConfig(model="tiny-ret-5m", methods=("vanilla", "lm_infinite"), lengths=(383,), decode_lengths=(),
                       depths=(0.5,), samples_per_depth=1, ppl_docs=1, tasks=("passkey", "ppl"), attn_backend="cuda")
    rec = run_report(cfg, tmp_path, progress=False, ray=True, ray_address=cluster.address, job_threads=1,
                     log=lambda s: None)
    assert list(rec["cells_failed"]) == ["lm_infinite/lmeval/383"]
    assert "NotImplementedError" in rec["cells_failed"]["lm_infinite/lmeval/383"]
    assert rec["results"]["vanilla"]["lmeval"]["383"]["passkey_docs"] == 1
    assert rec["results"]["lm_infinite"]["lmeval"] == {}
    manifest = read_run(tmp_path)
    assert manifest["finished"] is False and list(manifest["cells_failed"]) == ["lm_infinite/lmeval/383"]


@pytest.mark.slow
def test_a_killed_worker_and_a_removed_node_lose_nothing(serial, tmp_path):
    """Mid-sweep on two nodes: every process running a cell is SIGKILLed once a RULER cell has
    streamed answers to the driver's journal, and two cells later the second node is removed. The
    sweep completes on the head alone: no cell failed, every number is the serial run's, and the
    killed RULER cell resumed from the answers its journal had."""
    from lcx.report import ReportConfig, run_report

    cluster, (node,) = _cluster(1)
    out = tmp_path / "r"
    events: list[str] = []
    stop = threading.Event()

    def sabotage() -> None:
        journal = journal_dir(out)
        while not stop.is_set():
            if any(journal_rows(db)[0] for db in journal.glob("*.ruler.*_rank0.db")):
                break
            time.sleep(0.05)
        else:
            return
        cells = [p for p in _descendants(os.getpid()) if _comm(p) == "ray::cell_task"]
        for pid in cells:
            os.kill(pid, signal.SIGKILL)
        events.append(f"killed {len(cells)}")
        n = len(read_cells(out))
        while not stop.is_set() and len(read_cells(out)) < n + 2:
            time.sleep(0.1)
        if not stop.is_set():
            cluster.remove_node(node, allow_graceful=False)
            events.append("removed")

    saboteur = threading.Thread(target=sabotage, daemon=True)
    saboteur.start()
    try:
        rec = run_report(ReportConfig(**SWEEP), out, progress=False, ray=True, ray_address=cluster.address,
                         job_threads=1, jobs=None, log=lambda s: None)
    finally:
        stop.set()
        saboteur.join(timeout=30)
        cluster.shutdown()
    assert events[0] != "killed 0" and events == [events[0], "removed"]
    assert "cells_failed" not in rec and rec["cells_total"] == 15
    assert _numbers(rec["results"]) == _numbers(serial["results"])
    resumed = [c.get("resumed_requests", 0) for r in rec["results"].values() for c in r["ruler"].values()]
    assert max(resumed) >= 1
    assert max(c["attempts"] for c in rec["ray_cells"].values()) >= 2  # measured again after a loss
    assert read_run(out)["finished"] is True


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""



@pytest.mark.slow
def test_a_driver_killed_mid_sweep_resumes_with_the_same_command(serial, cluster, tmp_path):
    """A driver process SIGKILLed once cells are written and a RULER cell's journal holds answers:
    the same call in a new driver keeps the written cells, resumes the journaled one from its
    answers, and ends with every number of the serial run."""
    import sys

    from lcx.report import ReportConfig, run_report

    out = tmp_path / "r"
    script = ("import sys; from pathlib import Path; from lcx.report import ReportConfig, run_report; "
              f"run_report(ReportConfig(**{SWEEP!r}), Path({str(out)!r}), progress=False, ray=True, "
              f"ray_address={cluster.address!r}, job_threads=1, jobs=None, log=lambda s: None)")
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and driver.poll() is None:
            if (len(read_cells(out)) >= 2
                    and any(journal_rows(db)[0] for db in journal_dir(out).glob("*.ruler.*_rank0.db"))):
                break
            time.sleep(0.05)
        assert driver.poll() is None, "the driver finished before it could be killed"
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
    written = len(read_cells(out))
    rec = run_report(ReportConfig(**SWEEP), out, progress=False, ray=True, ray_address=cluster.address,
                     job_threads=1, jobs=None, log=lambda s: None)
    assert rec["cells_reused"] == written >= 2 and "cells_failed" not in rec
    assert _numbers(rec["results"]) == _numbers(serial["results"])
    assert max(c.get("resumed_requests", 0) for r in rec["results"].values() for c in r["ruler"].values()) >= 1


@pytest.mark.slow
def test_a_cluster_started_for_the_run_listens_on_loopback_only(tmp_path):
    """`--ray` without an address: a local cluster started for the run (2 CPUs) measures a serial
    run's cells; while it runs, every socket its Ray processes listen on is on 127.0.0.1."""
    pytest.importorskip("ray")
    from lcx.report import ReportConfig, run_report

    cfg = ReportConfig(model="tiny-ret-5m", methods=("vanilla", "lm_infinite"), lengths=(383,), decode_lengths=(383,),
                       depths=(0.5,), samples_per_depth=1, ppl_docs=1, decode_tokens=3, tasks=("passkey", "ppl"))
    want = run_report(cfg, tmp_path / "serial", progress=False, log=lambda s: None)
    seen: list[tuple[str, str]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.extend(_listening(_descendants(os.getpid())))
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        got = run_report(cfg, tmp_path / "ray", progress=False, ray=True, ray_cpus=2, job_threads=1, jobs=None,
                         log=lambda s: None)
    finally:
        stop.set()
        watcher.join(timeout=10)
    assert _numbers(got["results"]) == _numbers(want["results"]) and "cells_failed" not in got
    assert {name for _, name in seen} >= {"gcs_server", "raylet"}
    assert sorted({s for s in seen if not _on_loopback(s[0])}) == []
