"""`lcx report`'s page: index.html beside README.md, every prompt's answer browsable.

    python -m lcx.report.page results/report/smollm2-135m-n16     # writes only DIR/index.html
    lcx report --page --out DIR                                    # the same

One self-contained file (no network, no library): the README's tables and pictures (converted
here from README.md, or rendered from the record when a folder has none), the effective context
length (`lcx.report.effective`: a table and bars, also for a record rendered before that section
existed), and every answer of every passkey and RULER prompt, filterable by method, length,
task, depth, right/wrong and kind of miss in plain JavaScript. The answers come from the record
(`report.json.gz`: `results[method][kind][length]`), which holds every prompt's output.

Expected values. A passkey sample stores its key (`eval_tasks/passkey/data.py` draws it from
`random.Random(f"{seed}:{sample}:{depth}")`; the cell records it), so the page shows it. A RULER
sample stores its expected answers (`expected`, lm-eval's doc `outputs`) since 2026-12-07; the
RULER cells measured before kept only the output, score and prompt index, and for those the page
says "not stored" instead of rebuilding the tasks (the model's tokenizer and lm-eval's seeded
generators) or guessing.

Kinds of answer (`passkey_outcome`, `ruler_outcome`; computed here and stored in the page's data,
so the page only filters on them):

- passkey, by the task's own rule (`eval_tasks/passkey/task.py`: right when the first run of
  decimal digits in the output, `first_int`, equals the key): `right`; a miss is `prose` when the
  output holds no decimal digit at all (e.g. " the pass key." -- the model answered in words, a
  failure of format as much as of retrieval), `key_late` when the first number differs from the
  key but the key appears later as a whole run of digits, `wrong_number` when the output holds
  numbers and none of them is the key, `no_output` when the cell recorded no output (cells of
  early versions kept the verdict only: the verdict is shown, the answer is not).
- RULER, by its stored score (every expected answer found = 1, partial credit otherwise): `right`
  (score 1), `partial` (0 < score < 1), `miss` (score 0).

Data. The answers are columns (one list per field) with the outputs in a table of distinct
strings (cells that took vanilla's answers repeat them), inlined as gzip + base64 decoded in the
browser with `DecompressionStream` (Chromium, Firefox, Safari >= 16.4), or as plain JSON when that
is smaller (`encode`). The PNGs are referenced as sibling files, not inlined: they are committed
beside the page already, and inlining them would store each picture twice (a third more again
in base64).
"""

from __future__ import annotations

import base64
import gzip
import html
import json
import re
import sys
from pathlib import Path
from typing import Any

from .config import RULER_TASKS
from .passkey import passkey_outcome  # noqa: F401  (re-exported)

PASSKEY_KINDS = ("right", "prose", "key_late", "wrong_number", "no_output")
RULER_KINDS = ("right", "partial", "miss")
KINDS = ("right", "prose", "key_late", "wrong_number", "no_output", "partial", "miss")
SUITES = ("passkey", "RULER")  # the `g` column: which suite a task belongs to
KIND_HELP = {
    "right": "scored correct",
    "prose": "passkey miss: no decimal digit in the output",
    "key_late": "passkey miss: the first number is not the key, the key comes later",
    "wrong_number": "passkey miss: numbers, none of them the key",
    "no_output": "passkey miss whose output was not recorded (cells of early lcx versions)",
    "partial": "RULER: some of the expected answers found (0 < score < 1)",
    "miss": "RULER: none of the expected answers found (score 0)",
}
RULER_EXPECTED_NOTE = ("RULER cells measured before 2026-12-07 keep each prompt's output, score and index, not "
                       "its expected answers (lm-eval draws them when it builds the task): \"not stored\" there "
                       "rather than rebuilt or guessed")
PAGE = "index.html"


# Classifiers
# ============================================================================================

def ruler_outcome(score: float) -> str:
    """The kind of a RULER answer from its stored score in [0, 1]: "right" (1), "partial", "miss" (0)."""
    if not isinstance(score, (int, float)) or isinstance(score, bool) or not 0.0 <= score <= 1.0:
        raise ValueError(f"ruler_outcome: score must be a number in [0, 1], got {score!r}")
    return "right" if score == 1.0 else "miss" if score == 0.0 else "partial"


# The answers
# ============================================================================================

def answers(record: dict[str, Any]) -> dict[str, Any]:
    """Every passkey and RULER answer of a report record as columns: `m` method, `L` length, `t`
    task (indices into `methods`, `tasks`), `d` needle depth (passkey; None for RULER), `i` the
    prompt's index (RULER's; a passkey prompt's position in its cell), `o` index into `outputs`
    (None: not recorded), `x` expected value (passkey: the key; RULER: the list of expected
    answers; None: not stored), `c` 1 right / 0 wrong as scored, `s` score, `k` index into
    `kinds`, `g` suite (index into `suites`: passkey or RULER); `notes`: "method index|task
    index|length" -> a note on the cell (answers taken from vanilla's). A passkey answer whose
    stored verdict disagrees with `passkey_outcome` raises ValueError (the task's scoring rule and
    this page would disagree)."""
    methods = list(record["results"])
    cfg = record["config"]
    ruler_tasks = list(cfg.get("ruler_tasks") or RULER_TASKS) if cfg.get("ruler_lengths") else []
    tasks: list[str] = []
    cols: dict[str, list[Any]] = {c: [] for c in "mLtdioxcsk"}
    outputs: list[str] = []
    where: dict[str, int] = {}
    notes: dict[str, str] = {}

    def add(m: str, L: int, task: str, depth: float | None, i: int, out: str | None, expected: str | list[str] | None,
            correct: bool, score: float, kind: str) -> None:
        if task not in tasks:
            tasks.append(task)
        if out is not None and out not in where:
            where[out] = len(outputs)
            outputs.append(out)
        for c, v in zip("mLtdioxcsk", (methods.index(m), L, tasks.index(task), depth, i,
                                       None if out is None else where[out], expected, int(correct), score,
                                       KINDS.index(kind))):
            cols[c].append(v)

    # passkey's cells, then passkey_primed's (the published prompts with a primed answer, `lcx.report.primed`)
    for cell_kind, task in (("lmeval", "passkey"), ("passkey_primed", "passkey_primed")):
        for m in methods:
            for L, cell in sorted(record["results"][m].get(cell_kind, {}).items(), key=lambda kv: int(kv[0])):
                for i, smp in enumerate(cell.get("passkey_samples") or []):
                    key, out = str(smp["key"]), smp.get("output")
                    # an output not recorded (cells of early versions): the stored verdict alone
                    kind = ("right" if smp["correct"] else "no_output") if out is None else passkey_outcome(out, key)
                    if (kind == "right") != bool(smp["correct"]):
                        raise ValueError(f"{task} answer {i} of {m} at {L}: stored correct={smp['correct']} but the "
                                         f"first number of {out!r} {'is' if kind == 'right' else 'is not'} the key {key}")
                    add(m, int(L), task, round(float(smp["depth"]), 4), i, out, key, bool(smp["correct"]),
                        float(smp["correct"]), kind)
    equivalent = []
    for m in methods:
        for L, cell in sorted(record["results"][m].get("ruler", {}).items(), key=lambda kv: int(kv[0])):
            if cell.get("equivalent_to"):
                equivalent.append((m, L, cell))
            for t in sorted(cell["tasks"], key=lambda t: ruler_tasks.index(t) if t in ruler_tasks else len(ruler_tasks)):
                for smp in cell["tasks"][t].get("samples", []):
                    expected = smp.get("expected")  # (cells measured before 2026-12-07 lack it)
                    add(m, int(L), t, None, int(smp["index"]), smp.get("output"),
                        None if expected is None else [str(x) for x in expected], bool(smp["correct"]),
                        float(smp["score"]), ruler_outcome(float(smp["score"])))
    for m, L, cell in equivalent:
        eq = cell["equivalent_to"]
        for t in cell["tasks"]:
            if t in tasks:
                notes[f"{methods.index(m)}|{tasks.index(t)}|{L}"] = (
                    f"answers taken from {eq['method']}'s cell: this method computes what {eq['method']} "
                    f"computes on every prompt of it ({eq['checked_prompts']} prompts checked)")
    # (a third suite only where a report has primed cells: the pages of earlier reports stay as they were)
    suites = list(SUITES) + (["passkey_primed"] if "passkey_primed" in tasks else [])
    cols["g"] = [suites.index(tasks[t] if tasks[t] in suites else "RULER") for t in cols["t"]]
    return {"methods": methods, "tasks": tasks, "suites": suites, "kinds": list(KINDS), "kind_help": KIND_HELP,
            "lengths": sorted(set(cols["L"])), "outputs": outputs, "cols": cols, "notes": notes,
            "ruler_expected": RULER_EXPECTED_NOTE}


def kind_counts(data: dict[str, Any]) -> dict[str, dict[str, dict[str, dict[str, int]]]]:
    """suite ("passkey" / "RULER" / "passkey_primed") -> method -> length -> kind -> answers, from `answers`."""
    c = data["cols"]
    out: dict[str, dict[str, dict[str, dict[str, int]]]] = {}
    for m, L, g, k in zip(c["m"], c["L"], c["g"], c["k"]):
        group = data["suites"][g]
        cell = out.setdefault(group, {}).setdefault(data["methods"][m], {}).setdefault(str(L), {})
        kind = data["kinds"][k]
        cell[kind] = cell.get(kind, 0) + 1
    return out


# HTML
# ============================================================================================

def _inline(text: str) -> str:
    """Markdown's inline code, bold and links in one line of README text, HTML-escaped."""
    parts = re.split(r"(`[^`]*`)", text)
    out = []
    for p in parts:
        if len(p) >= 2 and p.startswith("`") and p.endswith("`"):
            out.append(f"<code>{html.escape(p[1:-1])}</code>")
            continue
        p = html.escape(p, quote=False)
        p = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", p)
        p = re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", lambda mt: f'<a href="{html.escape(mt.group(2))}">{mt.group(1)}</a>', p)
        out.append(p)
    return "".join(out)


def markdown_html(text: str, folder: Path | None = None) -> str:
    """The subset of Markdown lcx's report READMEs use (headings, paragraphs, pipe tables, images,
    bullet lists, fenced code) as HTML. An image missing from `folder` becomes a note."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif line.startswith("```"):
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            out.append("<pre>" + html.escape("\n".join(lines[i + 1:j])) + "</pre>")
            i = j + 1
        elif (h := re.match(r"(#{1,4}) (.*)", line)):
            n = len(h.group(1))
            slug = re.sub(r"[^a-z0-9]+", "-", h.group(2).lower()).strip("-")[:40]
            out.append(f'<h{n} id="r-{slug}">{_inline(h.group(2))}</h{n}>')
            i += 1
        elif (img := re.fullmatch(r"!\[([^\]]*)\]\(([^)\s]+)\)", line.strip())):
            alt, src = img.groups()
            if folder is not None and not (folder / src).is_file():
                out.append(f'<p class="note">({html.escape(src)} is not in this folder)</p>')
            else:
                out.append(f'<figure><img src="{html.escape(src)}" alt="{html.escape(alt)}">'
                           f"</figure>")
            i += 1
        elif line.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            align = []
            if len(rows) > 1 and all(re.fullmatch(r":?-+:?", c) for c in rows[1]):
                align = ["right" if c.endswith(":") else "left" for c in rows[1]]
                rows.pop(1)
            cell = lambda tag, j, c: (f'<{tag}{" class=num" if j < len(align) and align[j] == "right" else ""}>'  # noqa: E731
                                      f"{_inline(c)}</{tag}>")
            body = "".join("<tr>" + "".join(cell("td", j, c) for j, c in enumerate(r)) + "</tr>" for r in rows[1:])
            out.append('<div class="scroll"><table><thead><tr>' + "".join(cell("th", j, c) for j, c in enumerate(rows[0]))
                       + f"</tr></thead><tbody>{body}</tbody></table></div>")
        elif line.startswith("- "):
            items = []
            while i < len(lines) and lines[i].startswith("- "):
                items.append(f"<li>{_inline(lines[i][2:])}</li>")
                i += 1
            out.append("<ul>" + "".join(items) + "</ul>")
        else:
            para = []
            while i < len(lines) and lines[i].strip() and not re.match(r"(#|\||```|- |!\[)", lines[i]):
                para.append(lines[i])
                i += 1
            out.append(f"<p>{_inline(' '.join(para))}</p>")
    return "\n".join(out)


def effective_html(record: dict[str, Any], folder: Path, *, with_section: bool) -> str:
    """The effective context length: bars per method (length on a log2 scale) for every (task,
    threshold), after the README's section (`lcx.report.effective`) if `with_section` (a README
    written before that section existed)."""
    from .effective import describe, markdown_section, report_effective_lengths

    eff = record.get("effective_length") or report_effective_lengths(record)
    series = [(task, kind) for task in ("passkey", "ruler") if task in eff
              for kind in ("absolute", "relative") if eff[task]["thresholds"][kind] is not None]
    if not series:
        return ""
    lengths = sorted({L for task in eff.values() for e in task["methods"].values() for v in e.values()
                      for L in v["measured"]})
    import math

    lo, hi = math.log2(lengths[0]) - 1, math.log2(lengths[-1])
    rows = []
    for name in dict.fromkeys(m for task in eff.values() for m in task["methods"]):
        bars = []
        for task, kind in series:
            entry = eff[task]["methods"].get(name, {}).get(kind)
            thr = eff[task]["thresholds"][kind]
            label = f"{'RULER' if task == 'ruler' else 'passkey'} ≥ {thr:.3g}"
            if entry is None:
                continue
            width = 0.0 if entry["length"] is None else 100 * (math.log2(entry["length"]) - lo) / (hi - lo)
            bars.append(f'<div class="bar {task} {kind}"><span style="width:{width:.1f}%"></span>'
                        f"<em>{html.escape(label)}: {html.escape(describe(entry))}</em></div>")
        rows.append(f"<tr><th>{html.escape(name)}</th><td>{''.join(bars)}</td></tr>")
    chart = ('<div class="scroll"><table class="effbars"><thead><tr><th>method</th><th>effective length (bar: '
             f'log2 scale from {lengths[0] // 2} to {lengths[-1]} tokens; ≥: every measured length passes, &lt;: '
             "the shortest already fails)</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table></div>")
    text = ""
    if with_section:
        lines = markdown_section(record)  # (its picture only where the folder has it: the bars draw the same)
        text = markdown_html("\n".join(x for x in lines if "(effective_length.png)" not in x
                                       or (folder / "effective_length.png").is_file()), folder)
    return text + chart


def summary_html(data: dict[str, Any]) -> str:
    """Tables of answers by kind per method and length, each count a link that filters to them."""
    from urllib.parse import quote

    counts = kind_counts(data)
    parts = []
    for group, kinds in (("passkey", PASSKEY_KINDS), ("passkey_primed", PASSKEY_KINDS), ("RULER", RULER_KINDS)):
        by_method = counts.get(group)
        if not by_method:
            continue
        lengths = sorted({int(L) for m in by_method.values() for L in m})
        shown = [k for k in kinds if any(c.get(k) for m in by_method.values() for c in m.values())]
        head = "".join(f"<th>{L}</th>" for L in lengths)
        rows = []
        for m, by_len in by_method.items():
            tds = []
            for L in lengths:
                c = by_len.get(str(L), {})
                href = html.escape(f"#m={quote(m, safe='')}&L={L}&g={group}")
                links = " · ".join(f'<a href="{href}&amp;k={k}" class="k-{k}">'
                                   f"{c[k]} {k.replace('_', ' ')}</a>" for k in shown if c.get(k))
                tds.append(f"<td>{links or '—'}</td>")
            rows.append(f"<tr><th>{html.escape(m)}</th>{''.join(tds)}</tr>")
        what = {"passkey": "passkey answers: right, and misses by kind",
                "passkey_primed": "passkey_primed answers (the same prompts, a primed answer): right, and misses by kind",
                "RULER": "RULER answers (all tasks): right, partial, miss"}[group]
        parts.append(f"<h3>{what}</h3><div class=\"scroll\"><table><thead><tr><th>method</th>{head}</tr></thead>"
                     f"<tbody>{''.join(rows)}</tbody></table></div>")
    legend = "; ".join(f"<b>{k.replace('_', ' ')}</b>: {html.escape(v)}" for k, v in KIND_HELP.items())
    return "".join(parts) + f'<p class="note">{legend}. Click a count to list those answers.</p>'


def encode(payload: dict[str, Any]) -> tuple[str, str]:
    """(encoding, text) of the page's data: "gzip+base64" (deterministic gzip, level 9) or "json"
    (compact, `</` escaped), whichever is shorter."""
    text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).replace("</", "<\\/")
    packed = base64.b64encode(gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0)).decode("ascii")
    return ("gzip+base64", packed) if len(packed) < len(text.encode("utf-8")) else ("json", text)


def page_html(record: dict[str, Any], folder: Path) -> str:
    """The page of a report folder holding `record` (its README.md and PNGs, if any, beside it)."""
    folder = Path(folder)
    data = answers(record)
    readme = folder / "README.md"
    if readme.is_file():
        md = readme.read_text(encoding="utf-8")
    else:
        from .render import markdown

        md = markdown(record)
    if md.startswith("# "):  # the page's own title says it
        md = md.split("\n", 1)[1] if "\n" in md else ""
    tables = markdown_html(md, folder)
    eff = effective_html(record, folder, with_section="\n## Effective context length" not in md)
    if eff:  # at the end of the README's own section, or (with its heading) before the method list
        at = tables.find('<h2 id="r-effective-context-length"')
        if at >= 0:
            nxt = tables.find("<h2", at + 4)
            at = len(tables) if nxt < 0 else nxt
        else:
            at = tables.find('<h2 id="r-methods-resolved"')
            at = len(tables) if at < 0 else at
        tables = tables[:at] + eff + tables[at:]
    payload = {"answers": data, "tables": tables, "summary": summary_html(data)}
    encoding, blob = encode(payload)
    c = record["config"]
    title = f"lcx report · {c['model']}"
    n = len(data["cols"]["m"])
    return (_TEMPLATE.replace("{{TITLE}}", html.escape(title))
            .replace("{{SUB}}", html.escape(f"{n} answers; trained context {c['context']}; {len(data['methods'])} methods"))
            .replace("{{ENCODING}}", encoding).replace("{{CSS}}", _CSS).replace("{{JS}}", _JS)
            .replace("{{DATA}}", blob))


def write_page(record: dict[str, Any], folder: Path) -> Path:
    """Write `folder`/index.html (atomically) from `record` and what the folder holds."""
    from ..data.io import atomic_write_text

    return atomic_write_text(Path(folder) / PAGE, page_html(record, folder))


def write_page_from_folder(folder: Path) -> Path:
    """index.html of a report folder from its report.json.gz (and README.md, PNGs): nothing else is written."""
    from ..data.io import json_path, read_json

    folder = Path(folder)
    path = json_path(folder / "report.json")
    if not path.is_file():
        raise ValueError(f"{folder}: no report.json.gz (or report.json) to build the page from")
    return write_page(read_json(path), folder)


_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0 auto;max-width:1200px;padding:0 16px 40px;color:#222}
h1{font-size:22px;margin:16px 0 2px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}h3{font-size:15px}
nav a{margin-right:14px}.note,.sub{color:#666;font-size:12px}
table{border-collapse:collapse;font-size:12px;margin:6px 0}td,th{border:1px solid #ddd;padding:2px 6px;vertical-align:top}
th{background:#f4f4f4;text-align:left}td.num,th.num{text-align:right}.scroll{overflow-x:auto}
img{max-width:100%;border:1px solid #eee}figure{margin:8px 0}pre{background:#f6f6f6;padding:6px;overflow-x:auto;font-size:12px}
.effbars td{width:100%}.bar{position:relative;height:16px;margin:1px 0;background:#f2f2f2}
.bar span{position:absolute;left:0;top:0;bottom:0}.bar em{position:relative;font-style:normal;font-size:11px;padding-left:4px}
.passkey.absolute span{background:#6baed6}.passkey.relative span{background:#c6dbef}
.ruler.absolute span{background:#fb6a4a}.ruler.relative span{background:#fcbba1}
#filters{position:sticky;top:0;background:#fff;padding:6px 0;border-bottom:1px solid #ddd;z-index:1}
#filters label{margin-right:10px;white-space:nowrap}#filters select,#filters input{font-size:12px}
#answers td.out{font-family:ui-monospace,monospace;white-space:pre-wrap;word-break:break-word;max-width:560px}
tr.right td.v{color:#1a7f37}tr.wrong td.v{color:#c62828}.tag{font-size:11px;color:#666}
.k-prose{color:#8e24aa}.k-wrong_number,.k-miss{color:#c62828}.k-key_late,.k-partial{color:#ef6c00}.k-right{color:#1a7f37}
"""

# The browser's part: decode the data, show the tables, filter and list the answers. No library.
_JS = r"""
"use strict";
const $ = (id) => document.getElementById(id);
const FIELDS = [["m", "method"], ["L", "length"], ["g", "suite"], ["t", "task"], ["d", "depth"], ["c", "verdict"],
                ["k", "kind"]];
const PAGE = 200;
let D = null, A = null, shown = PAGE;

async function load() {
  const el = $("lcx-data"), enc = el.dataset.encoding, text = el.textContent.trim();
  if (enc === "json") return JSON.parse(text);
  const bytes = Uint8Array.from(atob(text), (ch) => ch.charCodeAt(0));
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  return JSON.parse(await new Response(stream).text());
}

function label(f, v) {
  if (v === null) return "—";
  if (f === "m") return A.methods[v];
  if (f === "t") return A.tasks[v];
  if (f === "g") return A.suites[v];
  if (f === "k") return A.kinds[v].replace("_", " ");
  if (f === "c") return v ? "right" : "wrong";
  if (f === "d") return (v * 100).toFixed(0) + "%";
  return String(v);
}

function buildFilters() {
  const box = $("filters"), c = A.cols;
  for (const [f, name] of FIELDS) {
    const values = [...new Set(c[f])].filter((v) => f !== "d" || v !== null).sort((a, b) => a - b);
    const sel = document.createElement("select");
    sel.id = "f-" + f; sel.dataset.field = f;
    sel.add(new Option("all", ""));
    for (const v of values) sel.add(new Option(label(f, v), String(v)));
    sel.addEventListener("change", () => { shown = PAGE; writeHash(); render(); });
    const lab = document.createElement("label");
    lab.append(name + " ", sel);
    box.append(lab);
  }
  const q = document.createElement("input");
  q.id = "f-q"; q.placeholder = "text in the answer"; q.size = 18;
  q.addEventListener("input", () => { shown = PAGE; writeHash(); render(); });
  const lab = document.createElement("label");
  lab.append("search ", q);
  box.append(lab);
}

// the hash names values (#m=vanilla&L=8192&g=passkey&k=prose), not indices, so links stay readable
const NAMES = { m: () => A.methods, t: () => A.tasks, g: () => A.suites, k: () => A.kinds, c: () => ["wrong", "right"] };

function readHash() {
  const p = new URLSearchParams(location.hash.slice(1));
  for (const [f] of FIELDS) {
    const sel = $("f-" + f), raw = p.get(f);
    if (raw === null) { sel.value = ""; continue; }
    const v = NAMES[f] ? NAMES[f]().indexOf(raw) : Number(raw);
    sel.value = [...sel.options].some((o) => o.value === String(v)) ? String(v) : "";
  }
  $("f-q").value = p.get("q") || "";
}

function writeHash() {
  const p = new URLSearchParams();
  for (const [f] of FIELDS) {
    const v = $("f-" + f).value;
    if (v !== "") p.set(f, NAMES[f] ? NAMES[f]()[Number(v)] : v);
  }
  if ($("f-q").value) p.set("q", $("f-q").value);
  history.replaceState(null, "", "#" + p.toString());
}

function matches() {
  const c = A.cols, want = {}, q = $("f-q").value.toLowerCase(), out = [];
  for (const [f] of FIELDS) { const v = $("f-" + f).value; if (v !== "") want[f] = Number(v); }
  for (let i = 0; i < c.m.length; i++) {
    let ok = true;
    for (const f in want) if (c[f][i] !== want[f]) { ok = false; break; }
    if (ok && q) ok = c.o[i] !== null && A.outputs[c.o[i]].toLowerCase().includes(q);
    if (ok) out.push(i);
  }
  return out;
}

function td(tr, text, cls) {
  const cell = tr.insertCell();
  cell.textContent = text;
  if (cls) cell.className = cls;
  return cell;
}

function render() {
  const c = A.cols, rows = matches(), body = $("answers").tBodies[0];
  body.replaceChildren();
  for (const i of rows.slice(0, shown)) {
    const tr = body.insertRow();
    tr.className = c.c[i] ? "right" : "wrong";
    tr.dataset.method = A.methods[c.m[i]];
    td(tr, A.methods[c.m[i]]); td(tr, String(c.L[i]), "num"); td(tr, A.tasks[c.t[i]]);
    td(tr, c.d[i] === null ? "#" + c.i[i] : label("d", c.d[i]) + " #" + c.i[i]);
    td(tr, c.x[i] === null ? "not stored" : Array.isArray(c.x[i]) ? c.x[i].join(" | ") : c.x[i]);
    const out = td(tr, c.o[i] === null ? "(no output recorded)" : JSON.stringify(A.outputs[c.o[i]]).slice(1, -1), "out");
    const note = A.notes[c.m[i] + "|" + c.t[i] + "|" + c.L[i]];
    if (note) { const s = document.createElement("div"); s.className = "tag"; s.textContent = note; out.append(s); }
    td(tr, (c.c[i] ? "right" : "wrong") + (A.tasks[c.t[i]] === "passkey" ? "" : " (" + c.s[i].toFixed(2) + ")"), "v");
    td(tr, label("k", c.k[i]), "k-" + A.kinds[c.k[i]]).title = A.kind_help[A.kinds[c.k[i]]];
  }
  $("count").textContent = rows.length + " of " + c.m.length + " answers match" +
    (rows.length > shown ? "; showing the first " + shown : "");
  $("more").hidden = rows.length <= shown;
}

async function main() {
  D = await load();
  A = D.answers;
  $("tables").innerHTML = D.tables;
  $("summary").innerHTML = D.summary;
  const unstored = A.cols.x.some((x, i) => x === null && A.tasks[A.cols.t[i]] !== "passkey");
  $("ruler-note").textContent = unstored ? "Expected answers: " + A.ruler_expected + "." : "";
  buildFilters();
  readHash();
  render();
  $("more").addEventListener("click", () => { shown += PAGE * 5; render(); });
  window.addEventListener("hashchange", () => { shown = PAGE; readHash(); render(); $("browse").scrollIntoView(); });
  document.body.dataset.ready = "1";
}
main().catch((e) => { $("count").textContent = "could not read the page's data: " + e; throw e; });
"""

_TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<title>{{TITLE}}</title><style>{{CSS}}</style></head>
<body>
<h1>{{TITLE}}</h1><p class="sub">{{SUB}} · written by <code>lcx report</code> (<code>python -m lcx.report.page DIR</code>)
from report.json.gz · <a href="README.md">README.md</a> · <a href="report.json.gz">report.json.gz</a></p>
<nav><a href="#tables">tables and pictures</a><a href="#browse">every answer</a></nav>
<noscript><p>The tables and answers are stored compressed in this page and need JavaScript; README.md has the tables.</p></noscript>
<section id="tables"></section>
<section id="browse"><h2>Every answer</h2><div id="summary"></div>
<p class="note" id="ruler-note"></p>
<div id="filters"></div><p id="count"></p>
<div class="scroll"><table id="answers"><thead><tr><th>method</th><th>length</th><th>task</th><th>depth / prompt</th>
<th>expected</th><th>answer (output as generated, escapes as in JSON)</th><th>verdict</th><th>kind</th></tr></thead><tbody></tbody></table></div>
<button id="more" hidden>show more</button></section>
<script type="application/octet-stream" id="lcx-data" data-encoding="{{ENCODING}}">{{DATA}}</script>
<script>{{JS}}</script>
</body></html>
"""


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m lcx.report.page",
                                description="Write index.html of lcx report folders from what each holds "
                                            "(report.json.gz, README.md, PNGs); nothing else is written.")
    p.add_argument("folders", nargs="+", type=Path, help="report folders (each with report.json.gz)")
    args = p.parse_args(argv)
    for folder in args.folders:
        try:
            path = write_page_from_folder(folder)
        except ValueError as e:
            print(f"lcx.report.page: {e}", file=sys.stderr)
            return 2
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
