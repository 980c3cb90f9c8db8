"""Benchmark figures rendered from the JSON the benchmarks write, not copied by hand.

``{benchmark-results} NAME.json`` (a file of ``docs/benchmarks/``, written by
``python -m benchmarks.<topic> <name> --json docs/benchmarks/NAME.json``) renders the run's
setup (the exact command, the date, the machine, JAX's version and backend, the allocator, how
busy the machine was), its goals (what was measured, the target, whether it holds) and its rows.
``:columns:`` names the row keys to show (default: every number, string and boolean).
"""

from __future__ import annotations

import json
import pathlib

from docutils import nodes
from docutils.parsers.rst import Directive, directives


def _fmt(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if value is None:
        return "-"
    return str(value)


def _table(header: list[str], rows: list[list[str]]) -> nodes.table:
    table = nodes.table(classes=["benchmark-table"])
    group = nodes.tgroup(cols=len(header))
    table += group
    for _ in header:
        group += nodes.colspec(colwidth=1)
    head = nodes.thead()
    group += head
    line = nodes.row()
    for h in header:
        line += nodes.entry("", nodes.paragraph(text=h))
    head += line
    body = nodes.tbody()
    group += body
    for r in rows:
        line = nodes.row()
        for cell in r:
            line += nodes.entry("", nodes.paragraph(text=cell))
        body += line
    return table


def setup_sentence(setup: dict) -> str:
    load = setup.get("other_load")
    parts = [f"Date: {setup.get('date', 'not recorded')}",
             f"machine: {setup.get('machine', '?')} ({setup.get('platform', '?')}), "
             f"{setup.get('cpu_count', '?')} CPUs",
             f"Python {setup.get('python', '?')}, JAX {setup.get('jax', '?')} on "
             f"{setup.get('backend', '?')} ({setup.get('devices', '?')} device(s))",
             f"malloc: {setup.get('malloc', '?')}"]
    if isinstance(load, (int, float)):
        parts.append(f"other processes used {100 * load:.0f} % of the machine's CPU meanwhile")
    if isinstance(setup.get("seconds"), (int, float)):
        parts.append(f"{setup['seconds']:.0f} s")
    return "; ".join(parts) + "."


class BenchmarkResults(Directive):
    required_arguments = 1
    option_spec = {"columns": directives.unchanged}

    def run(self):
        env = self.state.document.settings.env
        path = pathlib.Path(env.srcdir) / "benchmarks" / self.arguments[0]
        env.note_dependency(str(path))
        result = json.loads(path.read_text())
        setup = result["setup"]
        out: list[nodes.Node] = []
        para = nodes.paragraph()
        para += nodes.Text("Command: ")
        para += nodes.literal(text=setup.get("command", "?"))
        para += nodes.Text(". " + setup_sentence(setup))
        out.append(para)
        goals = result.get("goals") or {}
        if goals:
            out.append(_table(["what", "target", "measured", "holds"],
                              [[name, _fmt(g.get("target")), _fmt(g.get("measured")),
                                _fmt(g.get("holds")) if g.get("holds") is not None else "reported"]
                               for name, g in goals.items()]))
        rows = result.get("rows") or []
        if rows:
            if "columns" in self.options:
                columns = [c.strip() for c in self.options["columns"].split(",") if c.strip()]
            else:
                columns = [k for k, v in rows[0].items()
                           if isinstance(v, (int, float, str, bool)) or v is None]
            out.append(_table(columns, [[_fmt(r.get(c)) for c in columns] for r in rows]))
        return out


def setup(app):
    app.add_directive("benchmark-results", BenchmarkResults)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
