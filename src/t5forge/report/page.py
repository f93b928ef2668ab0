"""The report page: one self-contained HTML file (plotly's JavaScript inlined, no request at view time) for
one run or several overlaid, or for committed benchmark results. Charts are plotly figures; the numbers a
reader checks (last loss, medians, the audit's bytes) are also in tables, as text."""

from __future__ import annotations

import html
import json
import math
from datetime import datetime, timezone
from pathlib import Path

from t5forge.errors import ConfigError
from t5forge.parallel.comm_audit import format_size
from t5forge.report.runs import Run, config_differences, median_of, tokens_seen

# One colour per run in every chart (plotly's default qualitative palette).
COLOURS = ("#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3", "#ff6692", "#b6e880", "#ff97ff",
           "#fecb52")
SMOOTHING = 0.6  # TensorBoard's default: an exponential moving average, debiased at the start
PREDICTIONS_SHOWN = 20
CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:16px 28px}header h1{margin:0;font-size:22px}
header p{margin:4px 0 0;color:#c9ced8;font-size:13px}
nav{padding:8px 28px;background:#fff;border-bottom:1px solid #dde1e8;font-size:14px}nav a{margin-right:14px}
main{padding:8px 28px 40px}section{background:#fff;border:1px solid #dde1e8;border-radius:6px;padding:12px 18px;
margin:16px 0}h2{font-size:18px;margin:4px 0 10px}h3{font-size:15px;margin:12px 0 6px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}th,td{border:1px solid #dde1e8;padding:3px 8px;
text-align:right;vertical-align:top}th{background:#eef1f5}td.text,th.text{text-align:left}
.notice{background:#fff6dc;border:1px solid #e9cf7a;padding:6px 10px;border-radius:4px;margin:6px 0;font-size:14px}
.bad{color:#b3261e;font-weight:600}.good{color:#1b7f3b}pre{background:#f3f4f7;padding:8px;overflow:auto;
font-size:12px;max-height:420px}.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(460px,1fr));gap:8px}
.grid>div{min-width:0}
details summary{cursor:pointer;font-weight:600;margin:6px 0}
"""


# Each chart is drawn as its div is parsed, before the grid around it has its final widths: fit them once the
# page has loaded (plotly's `responsive` follows later window resizes only).
RESIZE = ("<script>window.addEventListener('load',()=>document.querySelectorAll('.plotly-graph-div')"
          ".forEach(d=>Plotly.Plots.resize(d)));</script>")


def _e(value) -> str:
    return html.escape(str(value))


def fmt(value, digits: int = 4) -> str:
    """A number as the page shows it (the browser test reads these back)."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}g}" if abs(value) >= 1e5 or (value and abs(value) < 1e-3) else f"{value:.{digits}f}"


def smooth(values: list[float], weight: float = SMOOTHING) -> list[float]:
    out, average, count = [], 0.0, 0
    for v in values:
        if v is None or not math.isfinite(v):
            out.append(None)
            continue
        count += 1
        average = weight * average + (1 - weight) * v
        out.append(average / (1 - weight ** count))
    return out


def table(headers: list[str], rows: list[list], text_columns: int = 1, cell_attrs: list[list[str]] | None = None) -> str:
    head = "".join(f"<th class='text'>{_e(h)}</th>" if i < text_columns else f"<th>{_e(h)}</th>"
                   for i, h in enumerate(headers))
    body = []
    for r, row in enumerate(rows):
        cells = []
        for i, cell in enumerate(row):
            attrs = f" {cell_attrs[r][i]}" if cell_attrs and cell_attrs[r][i] else ""
            cls = " class='text'" if i < text_columns else ""
            cells.append(f"<td{cls}{attrs}>{cell}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


class Figures:
    """plotly figures as divs; plotly.js once, inlined in the page's head."""

    def __init__(self):
        try:
            import plotly.graph_objects as go
        except ImportError:
            raise ConfigError("t5forge report needs plotly: pip install 't5forge[report]' (or pip install plotly)") \
                from None
        self.go, self.count = go, 0

    def script(self) -> str:
        from plotly.offline import get_plotlyjs

        return f"<script>{get_plotlyjs()}</script>"

    def div(self, fig, title: str, xaxis: str, yaxis: str, log_y: bool = False) -> str:
        self.count += 1
        fig.update_layout(title=title, xaxis_title=xaxis, yaxis_title=yaxis, height=340, template="plotly_white",
                          margin=dict(l=60, r=20, t=40, b=45), legend=dict(font=dict(size=11)))
        if log_y:
            fig.update_yaxes(type="log")
        return fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"figure-{self.count}",
                           config={"displaylogo": False, "responsive": True})

    def lines(self, series: list[tuple[str, list, list, dict]], title: str, xaxis: str, yaxis: str,
              log_y: bool = False) -> str:
        """series: (name, x, y, extra trace options)."""
        fig = self.go.Figure()
        for name, x, y, options in series:
            fig.add_trace(self.go.Scatter(x=x, y=y, name=name, mode=options.pop("mode", "lines"), **options))
        return self.div(fig, title, xaxis, yaxis, log_y)

    def bars(self, categories: list[str], groups: list[tuple[str, list]], title: str, yaxis: str) -> str:
        fig = self.go.Figure([self.go.Bar(x=categories, y=values, name=name) for name, values in groups])
        fig.update_layout(barmode="group")
        return self.div(fig, title, "", yaxis)


def _column(records: list[dict], key: str) -> tuple[list, list]:
    pairs = [(r["iteration"], r[key]) for r in records if key in r]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _summary_rows(runs: list[Run]) -> tuple[list[list], list[list[str]]]:
    rows, attrs = [], []
    for run in runs:
        train, steady = run.train, run.steady()
        last = train[-1] if train else {}
        valid = [v for r in run.validation if isinstance(v := r["valid_loss"], (int, float)) and math.isfinite(v)]
        peak = max((r["mem_mib"] for r in train if isinstance(r.get("mem_mib"), (int, float))), default=None)
        values = {
            "iteration": last.get("iteration"), "last_loss": last.get("loss"),
            "best_valid_loss": min(valid) if valid else None,
            "median_samples_per_s": median_of(steady, "samples_per_s"),
            "median_tokens_per_s": median_of(steady, "tokens_per_s"), "median_mfu": median_of(steady, "mfu"),
            "peak_mem_mib": peak, "skipped_steps": last.get("skipped_steps")}
        max_steps = (run.info or {}).get("max_steps") or run.config.get("train", {}).get("max_steps")
        row = [_e(run.name), _e(run.model), f"{fmt(values['iteration'])} / {fmt(max_steps)}"]
        row += [fmt(values[k]) for k in ("last_loss", "best_valid_loss", "median_samples_per_s",
                                         "median_tokens_per_s")]
        row += ["-" if values["median_mfu"] is None else f"{100 * values['median_mfu']:.2f}%",
                fmt(values["peak_mem_mib"], 1), fmt(values["skipped_steps"])]
        keys = ["", "", "iteration", "last_loss", "best_valid_loss", "median_samples_per_s", "median_tokens_per_s",
                "median_mfu", "peak_mem_mib", "skipped_steps"]
        rows.append(row)
        attrs.append([f"data-run='{_e(run.name)}' data-key='{k}'" if k else "" for k in keys])
    return rows, attrs


def _loss_section(runs: list[Run], figures: Figures) -> str:
    by_step, by_tokens = [], []
    for i, run in enumerate(runs):
        colour = COLOURS[i % len(COLOURS)]
        x, y = _column(run.train, "loss")
        tokens = [tokens_seen(r) for r in run.train]
        raw = {"opacity": 0.3, "line": {"width": 1, "color": colour}}
        by_step += [(f"{run.name} train", x, smooth(y), {"line": {"color": colour}}),
                    (f"{run.name} train (raw)", x, y, dict(raw))]
        by_tokens += [(f"{run.name} train", tokens, smooth(y), {"line": {"color": colour}}),
                      (f"{run.name} train (raw)", tokens, y, dict(raw))]
        vx, vy = _column(run.validation, "valid_loss")
        if vx:
            valid = {"mode": "lines+markers", "line": {"color": colour, "dash": "dash"}}
            by_step.append((f"{run.name} valid", vx, vy, dict(valid)))
            valid_tokens = [tokens_seen(_nearest_train(run, r["iteration"])) for r in run.validation]
            by_tokens.append((f"{run.name} valid", valid_tokens, vy, dict(valid)))
    note = (f"<p>Smoothed: exponential moving average (weight {SMOOTHING}, debiased); raw values faint. Tokens: "
            "inputs + targets consumed (consumed samples x tokens per sample).</p>")
    return ("<section id='loss'><h2>Loss</h2>" + note + "<div class='grid'>"
            + figures.lines(by_step, "loss against iteration", "iteration", "cross-entropy (nats/token)")
            + figures.lines(by_tokens, "loss against tokens", "tokens", "cross-entropy (nats/token)")
            + "</div></section>")


def _nearest_train(run: Run, iteration: int) -> dict:
    before = [r for r in run.train if r["iteration"] <= iteration]
    return before[-1] if before else {}


def _optimization_section(runs: list[Run], figures: Figures) -> str:
    lr, grad, skipped = [], [], []
    for i, run in enumerate(runs):
        colour = COLOURS[i % len(COLOURS)]
        lr.append((run.name, *_column(run.train, "lr"), {"line": {"color": colour}}))
        grad.append((run.name, *_column(run.train, "grad_norm"), {"line": {"color": colour}}))
        skipped.append((run.name, *_column(run.train, "skipped_steps"), {"line": {"shape": "hv", "color": colour}}))
    nonfinite = [(run.name, r["iteration"]) for run in runs for r in run.train
                 if isinstance(r.get("loss"), float) and not math.isfinite(r["loss"])]
    notes = "".join(f"<div class='notice'>{_e(name)}: a non-finite loss at iteration {i}</div>"
                    for name, i in nonfinite)
    return ("<section id='optimization'><h2>Optimization</h2>" + notes + "<div class='grid'>"
            + figures.lines(lr, "learning rate", "iteration", "lr")
            + figures.lines(grad, "gradient norm (before clipping)", "iteration", "norm", log_y=True)
            + figures.lines(skipped, "skipped steps (non-finite gradients; fp16 overflow), cumulative",
                            "iteration", "steps")
            + "</div></section>")


def _throughput_section(runs: list[Run], figures: Figures) -> str:
    charts = []
    for key, title, unit, scale in (("samples_per_s", "throughput", "samples/s", 1),
                                    ("tokens_per_s", "tokens per second", "tokens/s", 1),
                                    ("mfu", "model FLOPs utilization", "MFU %", 100),
                                    ("mem_mib", "peak memory (most loaded rank)", "MiB", 1)):
        series = []
        for i, run in enumerate(runs):
            colour = COLOURS[i % len(COLOURS)]
            x, y = _column(run.train, key)
            y = [None if v is None else v * scale for v in y]
            series.append((run.name, x, y, {"mode": "lines+markers", "line": {"color": colour}}))
            median = median_of(run.steady(), key)
            if median is not None and x:
                series.append((f"{run.name} median (warm-up excluded)", [x[0], x[-1]], [median * scale] * 2,
                               {"line": {"dash": "dot", "color": colour}}))
        charts.append(figures.lines(series, title, "iteration", unit))
    return ("<section id='throughput'><h2>Throughput, MFU and memory</h2><p>Medians exclude the first log period "
            "(compilation, loader start-up).</p><div class='grid'>" + "".join(charts) + "</div></section>")


def _finetuning_section(runs: list[Run], figures: Figures) -> str:
    tuned = [r for r in runs if r.evaluations]
    if not tuned:
        return ""
    parts = ["<section id='finetuning'><h2>Fine-tuning evaluations</h2>"]
    series = []
    for run in tuned:
        for key in run.task_metrics:
            series.append((f"{run.name} {key.removeprefix('valid_')}", *_column(run.evaluations, key),
                           {"mode": "lines+markers"}))
    parts.append(figures.lines(series, "task metrics per evaluation", "iteration", "score"))
    for run in tuned:
        keys = run.task_metrics
        rows = [[fmt(r["iteration"]), *[fmt(r.get(k)) for k in keys]] for r in run.evaluations]
        parts.append(f"<h3>{_e(run.name)}</h3>" + table(["iteration", *[k.removeprefix("valid_") for k in keys]], rows))
        if run.best:
            parts.append(f"<p>best: {_e(run.best.get('metric'))} = {fmt(run.best.get('value'))} at iteration "
                         f"{fmt(run.best.get('iteration'))} (RUN_DIR/best)</p>")
        if run.predictions:
            shown = run.predictions[:PREDICTIONS_SHOWN]
            cells = [[_e(str(p.get("input", ""))[:400]), _e(p.get("target", "")), _e(p.get("prediction", "")),
                      "<span class='good'>yes</span>" if p.get("prediction") == p.get("target") else "no"]
                     for p in shown]
            parts.append(f"<h3>sample predictions at iteration {run.predictions_iteration} ({len(shown)} of "
                         f"{len(run.predictions)})</h3>"
                         + table(["input", "target", "prediction", "exact"], cells, text_columns=3))
    return "".join(parts) + "</section>"


def _audit_section(runs: list[Run], figures: Figures) -> str:
    audited = [r for r in runs if r.comm_audit]
    if not audited:
        return ("<section id='communication'><h2>Communication audit</h2><p>No run wrote comm_audit.json "
                "(train.comm_audit=true audits a step).</p></section>")
    parts = ["<section id='communication'><h2>Communication audit</h2><p>One step's collectives of rank 0, measured "
             "against the analytic minimum of the layout (comm_model); exposed time averaged over ranks.</p>"]
    for run in audited:
        a = run.comm_audit
        layout = ", ".join(f"{k}={v}" for k, v in a.get("layout", {}).items())
        verdict = ("<span class='good'>issued = required</span>" if a.get("ok")
                   else f"<span class='bad'>{len(a.get('differences', []))} difference(s)</span>")
        rows = a.get("rows", [])
        body = [[_e(r["collective"]), _e(r["dim"]), str(r["count"]), format_size(r["bytes"]), str(r["required_count"]),
                 format_size(r["required_bytes"]), "-" if r.get("ratio") is None else f"{r['ratio']:.2f}",
                 f"{r['exposed_ms']:.1f}", f"{100 * r['share']:.1f}%"] for r in rows]
        t = a.get("totals", {})
        if t:
            body.append(["<b>total</b>", "", str(t["count"]), format_size(t["bytes"]), str(t["required_count"]),
                         format_size(t["required_bytes"]), "-" if t.get("ratio") is None else f"{t['ratio']:.2f}",
                         f"{t['exposed_ms']:.1f}", f"{100 * t['share']:.1f}%"])
        attrs = [["", "", "", f"data-run='{_e(run.name)}' data-key='audit_bytes' data-bytes='{r['bytes']}'",
                  "", "", "", "", ""] for r in rows] + ([[""] * 9] if t else [])
        parts.append(f"<h3>{_e(run.name)}: {_e(layout)}, step {a.get('step_ms', 0):.0f} ms; {verdict}</h3>")
        parts.append(table(["collective", "mesh dim", "count", "bytes", "required count", "required bytes", "ratio",
                            "exposed ms", "share of step"], body, text_columns=2, cell_attrs=attrs))
        if rows:
            labels = [f"{r['collective']} / {r['dim']}" for r in rows]
            parts.append("<div class='grid'>" + figures.bars(
                labels, [("measured", [r["bytes"] / 2**20 for r in rows]),
                         ("required", [r["required_bytes"] / 2**20 for r in rows])],
                f"{run.name}: bytes per collective and mesh dimension", "MiB")
                + figures.bars(labels, [("exposed", [100 * r["share"] for r in rows])],
                               f"{run.name}: exposed share of the step", "% of step") + "</div>")
        for d in a.get("differences", [])[:20]:
            parts.append(f"<div class='notice'>rank {d['rank']}: {_e(d['collective'])} over {_e(d['dim'])}: issued "
                         f"{d['count']} x / {d['bytes']} B, required {d['required_count']} x / "
                         f"{d['required_bytes']} B</div>")
    return "".join(parts) + "</section>"


def _model_section(runs: list[Run]) -> str:
    parts = ["<section id='model'><h2>Model and layout</h2>"]
    for run in runs:
        info = run.info
        if info is None:
            parts.append(f"<p>{_e(run.name)}: no run_info.json (a run of an older version)</p>")
            continue
        p, gib = info["parameters"], info["model_state_gib"]
        parts.append(f"<h3>{_e(run.name)}: {_e(info['model'])} ({_e(info['variant'])})</h3>")
        parts.append(table(["part", "parameters", "share"], [
            [_e(k), f"{v:,}", f"{100 * v / p['total']:.1f}%" if p["total"] else "-"] for k, v in p.items()]))
        parts.append(table(["model state (AdamW, per replica)", "GiB"], [[_e(k), f"{v:.3f}"] for k, v in gib.items()]))
        arch, batch = info["architecture"], info["batch"]
        parts.append(table(["architecture", "value"], [[_e(k), _e(v)] for k, v in arch.items()]))
        layout = {**info["layout"], "precision": info["precision"], "device": info["device"],
                  "pipeline stages (blocks)": info.get("pp_layers") or "-"}
        parts.append(table(["layout", "value"], [[_e(k), _e(v)] for k, v in layout.items()]))
        parts.append(f"<p>batch: global {batch['global']} = micro {batch['micro']} x dp {batch['dp']} x accumulation "
                     f"{batch['accumulation']}; {batch['inputs_length']} -> {batch['targets_length']} tokens "
                     f"({batch['tokens_per_sample']} per sample); torch {_e(info.get('torch', '?'))}</p>")
    return "".join(parts) + "</section>"


def _config_section(runs: list[Run]) -> str:
    parts = ["<section id='config'><h2>Configuration</h2>"]
    if len(runs) > 1:
        differences = config_differences(runs)
        rows = [[_e(key), *[_e(json.dumps(v) if not isinstance(v, str) else v) for v in values]]
                for key, values in differences]
        parts.append("<h3>differences</h3>" + (table(["key", *[r.name for r in runs]], rows,
                                                      text_columns=len(runs) + 1)
                                               if rows else "<p>The configs are the same.</p>"))
    for run in runs:
        parts.append(f"<details><summary>{_e(run.name)}: config.yaml</summary><pre>{_e(run.config_text)}</pre>"
                     "</details>")
    return "".join(parts) + "</section>"


def _checkpoint_section(runs: list[Run]) -> str:
    parts = ["<section id='checkpoints'><h2>Checkpoints</h2>"]
    for run in runs:
        if not run.checkpoints:
            parts.append(f"<p>{_e(run.name)}: no checkpoints</p>")
            continue
        rows = [[_e(c.path.name), str(c.step), format_size(c.bytes),
                 f"<span class='{'good' if c.status.startswith('ok') else 'bad'}'>{_e(c.status)}</span>"]
                for c in run.checkpoints]
        parts.append(f"<h3>{_e(run.name)}</h3>" + table(["checkpoint", "step", "size", "verification"], rows,
                                                         text_columns=1))
    return "".join(parts) + "</section>"


def _page(title: str, subtitle: str, notices: list[str], sections: list[str], nav: list[tuple[str, str]],
          figures: Figures | None) -> str:
    notice_html = "".join(f"<div class='notice'>{_e(n)}</div>" for n in notices)
    links = "".join(f"<a href='#{_e(anchor)}'>{_e(name)}</a>" for anchor, name in nav)
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<meta name='viewport' content='width=device-width,initial-scale=1'><title>{_e(title)}</title>"
            f"<style>{CSS}</style>{figures.script() if figures and figures.count else ''}</head><body>"
            f"<header><h1>{_e(title)}</h1><p>{_e(subtitle)}</p></header><nav>{links}</nav><main>"
            f"<div id='notices'>{notice_html}</div>{''.join(sections)}</main>{RESIZE if figures and figures.count else ''}"
            "</body></html>")


def runs_page(runs: list[Run]) -> tuple[str, list[str]]:
    """The page of `runs` (one, or several overlaid and compared), and its notices (also shown in the page)."""
    figures = Figures()
    notices = [f"{run.name}: {n}" for run in runs for n in run.notices]
    models = {run.architecture for run in runs}
    if len(models) > 1:
        notices.append("the runs are of different models (" + "; ".join(sorted(models)) + "): losses compare "
                       "only where their vocabularies and tasks do")
    rows, attrs = _summary_rows(runs)
    summary = ("<section id='summary'><h2>Summary</h2>"
               + table(["run", "model", "iteration", "last loss", "best valid loss", "median samples/s",
                        "median tokens/s", "median MFU", "peak memory MiB", "skipped steps"], rows,
                       text_columns=2, cell_attrs=attrs) + "</section>")
    sections = [summary]
    if any(run.train for run in runs):
        sections += [_loss_section(runs, figures), _optimization_section(runs, figures),
                     _throughput_section(runs, figures)]
    sections += [_finetuning_section(runs, figures), _audit_section(runs, figures), _model_section(runs),
                 _config_section(runs), _checkpoint_section(runs)]
    nav = [("summary", "summary"), ("loss", "loss"), ("optimization", "optimization"), ("throughput", "throughput"),
           ("finetuning", "fine-tuning"), ("communication", "communication"), ("model", "model"),
           ("config", "config"), ("checkpoints", "checkpoints")]
    present = "".join(sections)
    nav = [(a, n) for a, n in nav if f"id='{a}'" in present]
    title = "t5forge report: " + ", ".join(run.name for run in runs)
    subtitle = " | ".join(str(run.path.resolve()) for run in runs) + " | written " + _now()
    return _page(title, subtitle, notices, sections, nav, figures), notices


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _flat_rows(value) -> list[dict] | None:
    """A list of flat records (dicts of scalars) inside a benchmark's JSON, if `value` is one."""
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [{k: v for k, v in row.items() if not isinstance(v, (dict, list))} for row in value]
    return None


def _cell(value) -> str:
    if isinstance(value, float):
        return fmt(value)
    return _e(value)


def bench_page(files: list[Path]) -> tuple[str, list[str]]:
    """The page of benchmark results (`t5forge bench` JSON files): each file's context (command, machine,
    date) and every list of records in it as a table; a bar chart of each table's throughput columns."""
    figures = Figures()
    sections, notices, nav = [], [], []
    for file in files:
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            notices.append(f"{file.name} is not valid JSON ({e}); skipped")
            continue
        if not isinstance(data, dict):
            notices.append(f"{file.name} holds no benchmark result (not a JSON object); skipped")
            continue
        anchor = f"{file.stem}-{len(nav)}" if any(a == file.stem for a, _ in nav) else file.stem
        nav.append((anchor, file.stem))
        context = {k: v for k, v in data.items() if not isinstance(v, (dict, list))}
        machine = data.get("machine") if isinstance(data.get("machine"), dict) else {}
        parts = [f"<section id='{_e(anchor)}'><h2>{_e(file.name)}</h2>"]
        if data.get("command"):
            parts.append(f"<pre>{_e(data['command'])}</pre>")
        info = {**{k: v for k, v in context.items() if k != "command"}, **{f"machine.{k}": v for k, v in machine.items()}}
        if info:
            parts.append(table(["", ""], [[_e(k), _cell(v)] for k, v in info.items()], text_columns=2))
        for key, value in data.items():
            rows = _flat_rows(value)
            if not rows:
                continue
            columns = list(dict.fromkeys(k for row in rows for k in row))
            if not columns:
                continue
            parts.append(f"<h3>{_e(key)} ({len(rows)})</h3>"
                         + table(columns, [[_cell(row.get(c, "")) for c in columns] for row in rows],
                                 text_columns=1))
            rates = [c for c in columns if c.endswith("_per_s") or c in ("samples/s", "tokens/s")]
            label = next((c for c in ("name", "case", "benchmark", "layout") if c in columns), columns[0])
            if rates:
                labels = [" ".join(str(row.get(c, "")) for c in (label, "implementation", "side") if c in row)
                          for row in rows]
                parts.append(figures.bars(labels, [(c, [row.get(c) for row in rows]) for c in rates[:2]],
                                          f"{file.stem}: {key}", rates[0]))
        sections.append("".join(parts) + "</section>")
    if not sections:
        raise ConfigError("no benchmark results to show: pass a benchmarks/ directory or --bench FILE.json "
                          "written by `t5forge bench`")
    title = f"t5forge benchmarks: {len(sections)} result file(s)"
    return _page(title, f"{files[0].parent.resolve()} | written {_now()}", notices, sections, nav, figures), notices


__all__ = ["bench_page", "fmt", "runs_page", "smooth"]
