"""lcx.report.page: the report as one self-contained page (index.html beside README.md).

The classifier of passkey answers, the page's data (every answer of every committed report, the
verdicts it stores agreeing with the scores), and the page itself in headless Chromium (Debian's
`chromium`): it loads with no console error, a screenshot is taken, filtering to one method lists
only its answers, a link of the summary filters to one kind of miss. The Chromium tests skip,
saying why, where no chromium is installed (.ci/run installs it).
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from lcx.data.io import read_json
from lcx.eval_tasks.common import first_int
from lcx.report.page import (KINDS, answers, encode, kind_counts, markdown_html, page_html, passkey_outcome,
                             ruler_outcome, write_page, write_page_from_folder)

ROOT = Path(__file__).resolve().parents[1]
REPORTS = sorted(p.parent for p in (ROOT / "results" / "report").glob("**/report.json.gz"))
SMALL = ROOT / "results" / "report" / "smollm2-135m-n16"  # passkey only, prose misses, 336 answers

# (output, key, kind): the definitions of the module docstring, edge cases included
OUTCOMES = [
    (" 48213.", "48213", "right"),
    ("48213", "48213", "right"),
    (" 48213 is the pass key. 12", "48213", "right"),
    (" the pass key.", "48213", "prose"),
    ("", "48213", "prose"),
    ("\n", "48213", "prose"),
    (" forty-eight thousand", "48213", "prose"),
    (" 12345. 48213 is it", "48213", "key_late"),
    (" 1 2 48213", "48213", "key_late"),
    (" 482130", "48213", "wrong_number"),  # the key inside a longer run is not the key
    (" 4821", "48213", "wrong_number"),
    (" 48.213", "48213", "wrong_number"),
    (" 00048213", "48213", "wrong_number"),
    (None, "48213", "no_output"),
]


@pytest.mark.parametrize("output,key,kind", OUTCOMES, ids=[repr(o)[:24] for o, _, _ in OUTCOMES])
def test_passkey_outcome(output, key, kind):
    assert passkey_outcome(output, key) == kind
    if output is not None:  # "right" is exactly the task's scoring rule
        assert (kind == "right") == (first_int(output) == key)


@pytest.mark.parametrize("bad", [48213, "", "48a13", None])
def test_passkey_outcome_refuses_a_key_that_is_not_digits(bad):
    with pytest.raises(ValueError, match="key must be a string of digits"):
        passkey_outcome(" 1", bad)


def test_ruler_outcome():
    assert [ruler_outcome(s) for s in (1.0, 1, 0.5, 0.25, 0.0, 0)] == ["right", "right", "partial", "partial",
                                                                      "miss", "miss"]
    for bad in (-0.1, 1.01, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="score must be a number in"):
            ruler_outcome(bad)


@pytest.mark.parametrize("folder", REPORTS, ids=[str(p.relative_to(ROOT / "results")) for p in REPORTS])
def test_every_committed_answer_is_in_the_data_with_the_verdict_the_tables_count(folder):
    """answers() of each committed record: one row per passkey and RULER answer, and per method
    and length the rows counted right are the k of the README's intervals (passkey, RULER tasks)."""
    from lcx.report.render import passkey_intervals
    from lcx.report.ruler import ruler_intervals

    record = read_json(folder / "report.json.gz")
    data = answers(record)
    c = data["cols"]
    n = len(c["m"])
    assert all(len(col) == n for col in c.values()) and set(data["kinds"]) == set(KINDS)
    right: dict[tuple[str, str, str], int] = {}
    for m, L, t, k, x, o in zip(c["m"], c["L"], c["t"], c["k"], c["x"], c["o"]):
        key = (data["methods"][m], str(L), data["tasks"][t])
        right[key] = right.get(key, 0) + (data["kinds"][k] == "right")
        if data["tasks"][t] in ("passkey", "passkey_primed"):  # the key is stored; the kind follows from it and the output
            assert x is not None and (o is None or passkey_outcome(data["outputs"][o], x) == data["kinds"][k])
        elif x is not None:  # RULER cells since 2026-12-07: a right answer holds one of the expected (all, for NIAH)
            assert isinstance(x, list) and all(isinstance(v, str) for v in x)
            if data["kinds"][k] == "right":
                assert any(v.lower() in data["outputs"][o].lower() for v in x)
    for m, by_len in passkey_intervals(record).items():
        for L, iv in by_len.items():
            assert right[(m, L, "passkey")] == iv["k"]
    for m, by_len in ruler_intervals(record).items():
        for L, entry in by_len.items():
            for t, iv in entry["tasks"].items():
                assert right[(m, L, t)] == iv["k"]
    for name, r in record["results"].items():  # primed passkey cells (#76): the page counts what the cell holds
        for L, cell in r.get("passkey_primed", {}).items():
            assert right[(name, str(L), "passkey_primed")] == sum(bool(x["correct"]) for x in cell["passkey_samples"])
    expected = sum(len(cell.get("passkey_samples") or []) for r in record["results"].values()
                   for kind in ("lmeval", "passkey_primed") for cell in r.get(kind, {}).values())
    expected += sum(len(tc.get("samples", [])) for r in record["results"].values()
                    for cell in r.get("ruler", {}).values() for tc in cell["tasks"].values())
    assert n == expected


def test_the_prose_misses_of_issue_76_are_counted():
    """#76: '145 of SmolLM2's 148 passkey misses beyond 8k are prose' (smollm2-135m-n16)."""
    counts = kind_counts(answers(read_json(SMALL / "report.json.gz")))["passkey"]
    beyond = {k: sum(c.get(k, 0) for by_len in counts.values() for L, c in by_len.items() if int(L) > 8192)
              for k in KINDS}
    assert beyond["prose"] == 145 and beyond["prose"] + beyond["wrong_number"] + beyond["key_late"] == 148


def _ruler_record(expected: bool) -> dict:
    smp = [{"index": 0, "score": 1.0, "correct": True, "prompt_tokens": 1000, "output": " 7 and 8"},
           {"index": 1, "score": 0.5, "correct": False, "prompt_tokens": 1000, "output": " 7"},
           {"index": 2, "score": 0.0, "correct": False, "prompt_tokens": 1000, "output": None}]
    if expected:
        for s, x in zip(smp, (["7", "8"], ["7", "9"], ["5", "6"])):
            s["expected"] = x
    cell = {"tasks": {"niah_multivalue": {"samples": smp}, "cwe": {"skipped": "no room"}}}
    taken = {**cell, "equivalent_to": {"method": "vanilla", "identity_up_to": 2048, "longest_sequence": 1100,
                                       "checked_prompts": 2}}
    return {"config": {"model": "tiny-ret-5m", "context": 256, "lengths": [1024], "ruler_lengths": [1024],
                       "ruler_tasks": ["niah_multivalue", "cwe"]},
            "results": {"vanilla": {"lmeval": {}, "ruler": {"1024": cell}},
                        "wide": {"lmeval": {}, "ruler": {"1024": taken}}}}


@pytest.mark.parametrize("expected", [True, False], ids=["expected-stored", "cells-before-2026-12-07"])
def test_ruler_answers_carry_their_expected_values_where_the_cell_stored_them(expected):
    data = answers(_ruler_record(expected))
    c = data["cols"]
    assert data["tasks"] == ["niah_multivalue"] and data["suites"] == ["passkey", "RULER"] and set(c["g"]) == {1}
    assert [data["kinds"][k] for k in c["k"]] == ["right", "partial", "miss"] * 2
    assert c["x"] == ([["7", "8"], ["7", "9"], ["5", "6"]] * 2 if expected else [None] * 6)
    assert c["o"] == [0, 1, None, 0, 1, None] and data["outputs"] == [" 7 and 8", " 7"]  # stored once
    assert c["s"] == [1.0, 0.5, 0.0] * 2 and c["d"] == [None] * 6 and c["i"] == [0, 1, 2] * 2
    assert list(data["notes"]) == ["1|0|1024"] and "taken from vanilla's cell" in data["notes"]["1|0|1024"]


def test_a_stored_verdict_the_rule_contradicts_is_refused():
    record = read_json(SMALL / "report.json.gz")
    smp = record["results"]["vanilla"]["lmeval"]["16384"]["passkey_samples"][0]
    smp["correct"] = 1.0 - smp["correct"]
    with pytest.raises(ValueError, match="passkey answer 0 of vanilla at 16384: stored correct"):
        answers(record)


def _decode(page: str) -> dict:
    start = page.index('id="lcx-data" data-encoding="') + len('id="lcx-data" data-encoding="')
    encoding = page[start:page.index('"', start)]
    blob = page[page.index(">", start) + 1:page.index("</script>", start)]
    if encoding == "json":
        return json.loads(blob)
    assert encoding == "gzip+base64"
    return json.loads(gzip.decompress(base64.b64decode(blob)))


def test_encode_picks_the_shorter_and_round_trips():
    small = {"a": [1, "</script>"]}
    enc, text = encode(small)
    assert enc == "json" and "</" not in text and json.loads(text) == small
    big = {"rows": [" The grass is green. The sky is blue."] * 500}
    enc, text = encode(big)
    assert enc == "gzip+base64" and len(text) < len(json.dumps(big)) / 10
    assert json.loads(gzip.decompress(base64.b64decode(text))) == big
    assert encode(big) == (enc, text)  # deterministic (gzip without a time stamp): the committed page is stable


def test_markdown_subset():
    md = ("# Title `x<y`\n\nSome **bold** text\nover two lines.\n\n| method | 256 |\n|---|---:|\n| a<b | 0.5 |\n\n"
          "![pic](there.png)\n\n![gone](missing.png)\n\n- **m**: `{}`\n\n```json\n{\"a\": \"<b>\"}\n```\n")
    out = markdown_html(md)
    assert '<h1 id="r-title-x-y">Title <code>x&lt;y</code></h1>' in out
    assert "<p>Some <strong>bold</strong> text over two lines.</p>" in out
    assert "<th>method</th><th class=num>256</th>" in out and "<td>a&lt;b</td><td class=num>0.5</td>" in out
    assert '<img src="there.png"' in out and "<li><strong>m</strong>: <code>{}</code></li>" in out
    assert "<pre>{&quot;a&quot;: &quot;&lt;b&gt;&quot;}</pre>" in out


def test_markdown_notes_a_picture_the_folder_lacks(tmp_path):
    (tmp_path / "there.png").write_bytes(b"\x89PNG")
    out = markdown_html("![pic](there.png)\n\n![gone](missing.png)\n", tmp_path)
    assert '<img src="there.png"' in out and "(missing.png is not in this folder)" in out and "missing.png\"" not in out


def test_page_holds_the_tables_the_effective_length_and_every_answer(tmp_path):
    for f in SMALL.iterdir():
        if f.is_file() and f.name != "index.html":
            shutil.copy(f, tmp_path / f.name)
    path = write_page_from_folder(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [p.name for p in SMALL.iterdir() if p.is_file() and p.name != "index.html"] + ["index.html"])
    page = path.read_text(encoding="utf-8")
    assert "http://" not in page and "https://" not in page and "<link" not in page  # nothing from the network
    data = _decode(page)
    assert data["answers"] == json.loads(json.dumps(answers(read_json(tmp_path / "report.json.gz"))))
    assert "Passkey accuracy by context length" in data["tables"] and '<img src="passkey_heatmap.png"' in data["tables"]
    assert 'id="r-effective-context-length"' in data["tables"] and 'class="bar passkey absolute"' in data["tables"]
    t = data["tables"]
    assert t.count("Effective context length</h2>") == 1 and t.count('<h2 id="r-methods-resolved"') == 1
    assert t.index("Effective context length</h2>") < t.index('class="bar passkey') < t.index('id="r-methods-resolved"')
    assert 'href="#m=vanilla&amp;L=16384&amp;g=passkey&amp;k=prose"' in data["summary"]
    # the same folder without its README: the tables are rendered from the record, whose README
    # has the effective-length section: the bars follow it, and it is there once
    (tmp_path / "README.md").unlink()
    t = _decode(page_html(read_json(tmp_path / "report.json.gz"), tmp_path))["tables"]
    assert "Passkey accuracy by context length" in t
    assert t.count("Effective context length</h2>") == 1 and t.count('<h2 id="r-methods-resolved"') == 1
    assert t.index("Effective context length</h2>") < t.index('class="bar passkey') < t.index('id="r-methods-resolved"')
    assert t.index('class="bar passkey') < t.index("<h2", t.index("Effective context length</h2>"))


def test_a_folder_without_a_record_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no report.json.gz"):
        write_page_from_folder(tmp_path)


@pytest.mark.parametrize("folder", REPORTS, ids=[str(p.relative_to(ROOT / "results")) for p in REPORTS])
def test_every_committed_report_folder_has_its_current_page(folder):
    page = folder / "index.html"
    assert page.is_file(), f"{page} missing: python -m lcx.report.page {folder.relative_to(ROOT)}"
    assert page.read_text(encoding="utf-8") == page_html(read_json(folder / "report.json.gz"), folder), (
        f"{page} is not the page of what the folder holds now: python -m lcx.report.page {folder.relative_to(ROOT)}")


def test_lcx_report_page_flag_writes_only_the_page(tmp_path, capsys):
    """`lcx report --page --out DIR` (in process: the CLI's own entry point) writes DIR/index.html
    and nothing else; a folder without a record is exit 2 with the reason."""
    from lcx.cli import main

    for f in ("report.json.gz", "README.md"):
        shutil.copy(SMALL / f, tmp_path / f)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert main(["report", "--page", "--out", str(tmp_path)]) == 0
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != "index.html"} == before
    assert (tmp_path / "index.html").stat().st_size > 1000 and "index.html" in capsys.readouterr().out
    assert main(["report", "--page", "--out", str(tmp_path / "none")]) == 2
    assert "no report.json.gz" in capsys.readouterr().err


# Headless Chromium over the DevTools protocol
# ============================================================================================

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1280,1600", "--remote-debugging-port=0"]


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if (path := shutil.which(name)):
            return path
    why = "no chromium on PATH (Debian: apt-get install -y chromium; .ci/run installs it)"
    if os.environ.get("LCX_REQUIRE_CHROMIUM") == "1":
        pytest.fail(why + " and LCX_REQUIRE_CHROMIUM=1")
    pytest.skip(why)


class Browser:
    """One headless Chromium page driven over the DevTools protocol (aiohttp's websocket client):
    `run(expression)` evaluates JavaScript, `errors` collects console errors, uncaught exceptions
    and failed loads from the moment the page opens."""

    def __init__(self, profile: Path):
        self.profile = profile
        self.proc = subprocess.Popen([_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.errors: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self._connect())

    async def _connect(self) -> None:
        import aiohttp

        port_file = self.profile / "DevToolsActivePort"
        for _ in range(300):
            if port_file.is_file() and len(port_file.read_text().split()) >= 2:
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}")
            await asyncio.sleep(0.1)
        port, path = port_file.read_text().split()[:2]
        self.http = aiohttp.ClientSession()
        self.ws = await self.http.ws_connect(f"ws://127.0.0.1:{port}{path}", max_msg_size=0)
        self.next_id, self.session = 0, None
        target = (await self.send("Target.createTarget", url="about:blank"))["targetId"]
        self.session = (await self.send("Target.attachToTarget", targetId=target, flatten=True, _session=False))["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            await self.send(f"{domain}.enable")

    async def send(self, method: str, _session: bool = True, **params):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params}
        if _session and self.session:
            msg["sessionId"] = self.session
        await self.ws.send_json(msg)
        while True:
            reply = await self.ws.receive_json(timeout=60)
            self._event(reply)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def _event(self, msg: dict) -> None:
        p = msg.get("params", {})
        if msg.get("method") == "Runtime.exceptionThrown":
            self.errors.append(f"exception: {p['exceptionDetails'].get('exception', {}).get('description') or p['exceptionDetails']['text']}")
        elif msg.get("method") == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
            self.errors.append("console.error: " + " ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
        elif msg.get("method") == "Log.entryAdded" and p["entry"]["level"] == "error":
            self.errors.append(f"log: {p['entry']['text']} {p['entry'].get('url', '')}")

    def call(self, method: str, **params):
        return self.loop.run_until_complete(self.send(method, **params))

    def run(self, expression: str):
        r = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression[:60]}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + 60
        while self.run("document.readyState + '|' + (document.body && document.body.dataset.ready)") != "complete|1":
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not finish: {self.errors}")
            time.sleep(0.05)
        self.run("new Promise(r => setTimeout(r, 100))")  # late images and errors

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self) -> None:
        async def _close():
            await self.ws.close()
            await self.http.close()

        try:
            self.loop.run_until_complete(_close())
        finally:
            self.loop.close()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    pytest.importorskip("aiohttp", reason="the DevTools client uses aiohttp's websocket")
    b = Browser(tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()


def _rows(browser: Browser) -> list[dict]:
    return browser.run("""[...document.querySelectorAll('#answers tbody tr')].map(tr => ({
        method: tr.dataset.method, cells: [...tr.cells].map(td => td.textContent)}))""")


def test_page_in_chromium_loads_filters_and_links(browser, tmp_path):
    """A page built here from smollm2-135m-n16's record: no console error, a screenshot, the
    method filter lists only that method's answers (as many as the data holds), and a link of the
    summary lists exactly the prose misses of one method and length."""
    for f in SMALL.iterdir():
        if f.is_file() and f.name != "index.html":
            shutil.copy(f, tmp_path / f.name)
    record = read_json(tmp_path / "report.json.gz")
    write_page(record, tmp_path)
    data = answers(record)
    browser.errors.clear()
    browser.open((tmp_path / "index.html").as_uri())
    shot = browser.screenshot(tmp_path / "page.png")
    assert browser.errors == []
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    n = len(data["cols"]["m"])
    assert browser.run("document.getElementById('count').textContent") == f"{n} of {n} answers match; showing the first 200"
    pictures = (tmp_path / "README.md").read_text().count("![")
    assert pictures >= 3 and browser.run("document.querySelectorAll('#tables img').length") == pictures
    assert browser.run("[...document.querySelectorAll('#tables img')].every(i => i.complete && i.naturalWidth > 0)")
    assert "Effective context length" in browser.run("document.getElementById('tables').textContent")

    method = "self_extend"
    want = sum(1 for m in data["cols"]["m"] if data["methods"][m] == method)
    browser.run(f"""(() => {{ const s = document.getElementById('f-m');
        s.value = String({data['methods'].index(method)}); s.dispatchEvent(new Event('change')); }})()""")
    rows = _rows(browser)
    assert len(rows) == want == 48 and {r["method"] for r in rows} == {method}
    assert browser.run("location.hash") == f"#m={method}"

    counts = kind_counts(data)["passkey"]["vanilla"]["16384"]
    browser.run("document.querySelector('a[href=\"#m=vanilla&L=16384&g=passkey&k=prose\"]').click()")
    browser.run("new Promise(r => setTimeout(r, 50))")
    rows = _rows(browser)
    assert len(rows) == counts["prose"] > 0
    assert all(r["method"] == "vanilla" and r["cells"][1] == "16384" and r["cells"][-1] == "prose"
               and r["cells"][-2] == "wrong" and not any(ch.isdigit() for ch in r["cells"][5]) for r in rows)
    assert browser.errors == []


@pytest.mark.parametrize("folder", REPORTS, ids=[str(p.relative_to(ROOT / "results")) for p in REPORTS])
def test_committed_page_loads_in_chromium(browser, folder):
    """Each committed index.html opens with no console error and lists every answer of its record."""
    if not (folder / "index.html").is_file():
        pytest.fail(f"no {folder / 'index.html'}")
    n = len(answers(read_json(folder / "report.json.gz"))["cols"]["m"])
    browser.errors.clear()
    browser.open((folder / "index.html").as_uri())
    assert browser.errors == []
    assert browser.run("document.getElementById('count').textContent").startswith(f"{n} of {n} answers match")
    assert browser.run("[...document.querySelectorAll('#tables img')].every(i => i.complete && i.naturalWidth > 0)")


@pytest.mark.slow
def test_a_ruler_cell_stores_its_expected_answers_and_the_page_shows_them(tmp_path):
    """A RULER cell measured now (the bundled model, 1024 tokens, 2 prompts of one task) keeps each
    prompt's expected answers (lm-eval's doc `outputs`), and the page's data carries them."""
    from lcx.presets import resolve
    from lcx.report.config import ReportConfig
    from lcx.report.ruler import run_ruler_cell

    cfg = ReportConfig(model="tiny-ret-5m", methods=("vanilla",), lengths=(1024,), tasks=("ruler",),
                       ruler_tasks=("niah_single_1",), ruler_samples=2)
    run = resolve("vanilla", "tiny-ret-5m", L0=256, factor=4.0)
    cell = run_ruler_cell("tiny-ret-5m", run, cfg, 1024)
    samples = cell["tasks"]["niah_single_1"]["samples"]
    assert len(samples) == 2
    for s in samples:
        assert s["expected"] and all(isinstance(x, str) and x.isdigit() for x in s["expected"])
        assert s["correct"] == all(x in (s["output"] or "") for x in s["expected"])
    record = {"config": {"context": 256, "lengths": [1024], "ruler_lengths": [1024], "ruler_tasks": ["niah_single_1"]},
              "results": {"vanilla": {"lmeval": {}, "ruler": {"1024": cell}}}}
    assert answers(record)["cols"]["x"] == [s["expected"] for s in samples]


def test_page_in_chromium_reads_plain_json_data_and_shows_rulers_expected_answers(browser, tmp_path):
    """The page's other encoding (compact JSON, `encode` picks it when shorter), on RULER answers
    that store their expected values: each row shows them; a cell taken from vanilla says so."""
    (tmp_path / "README.md").write_text("# lcx report · a RULER cell\n\nNo tables here.\n")
    page = page_html(_ruler_record(expected=True), tmp_path)
    data = _decode(page)
    start = page.index('id="lcx-data" data-encoding="')
    end = page.index("</script>", start)
    text = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    (tmp_path / "index.html").write_text(page[:start] + 'id="lcx-data" data-encoding="json">' + text + page[end:],
                                         encoding="utf-8")
    browser.errors.clear()
    browser.open((tmp_path / "index.html").as_uri())
    assert browser.errors == []
    rows = _rows(browser)
    assert [r["cells"][4] for r in rows] == ["7 | 8", "7 | 9", "5 | 6"] * 2
    assert [r["cells"][-1] for r in rows] == ["right", "partial", "miss"] * 2
    assert [r["cells"][-2] for r in rows] == ["right (1.00)", "wrong (0.50)", "wrong (0.00)"] * 2
    assert all("taken from vanilla's cell" in r["cells"][5] for r in rows[3:])
    assert "(no output recorded)" in rows[2]["cells"][5]
    assert browser.run("document.getElementById('ruler-note').textContent") == ""  # every expected value stored
