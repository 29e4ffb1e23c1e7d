"""A sampler explorer that runs in the browser: five sliders over one real prediction.

The book is read two ways, and a widget that calls Python on every slider move only
works in one of them (a notebook with a kernel).  This one carries its data: the
`window` highest scores of one prediction, which of those tokens the history holds,
and the engine's own answers for a few settings.  Its script recomputes the
sampler's pipeline (penalty -> top-k -> temperature softmax -> top-p -> min-p, the
order and float32 arithmetic of `fucina_course.sampler`) on every move, so it works
the same on the static page and in JupyterLab, with or without a kernel.

A second implementation of the pipeline is a liability unless it is checked: when
the widget loads, it recomputes the embedded settings and compares them with the
engine's results (same kept ids, probabilities within 1e-6).  A disagreement is
printed in red in the widget and logged as a console error (which
scripts/check_book.py turns into a failed build).

Rejected alternatives: panels precomputed over a grid of five sliders and switched
with `jslink` (thousands of panels for a coarse grid); an ipywidgets callback (needs
a kernel, so the page would show a frozen copy).
"""

from __future__ import annotations

import html
import json
import secrets
from typing import Sequence

import numpy as np

from .sampler import Sampler, SamplerConfig

KNOBS = (  # name, label, min, max, step
    ("temperature", "temperature", 0.0, 2.0, 0.05),
    ("top_k", "top-k (0: off)", 0, 100, 1),
    ("top_p", "top-p", 0.05, 1.0, 0.01),
    ("min_p", "min-p", 0.0, 0.5, 0.01),
    ("repeat_penalty", "repeat penalty", 1.0, 2.0, 0.05),
)

_SCRIPT = r"""
(function () {
  const root = document.getElementById("__ID__");
  const data = root.querySelector("script[type='application/json']");
  const D = JSON.parse(data.textContent);
  const f = Math.fround;
  const n = D.logits.length;

  // The engine's pipeline, in its order and in float32 (fucina_course/sampler.py).
  function distribution(s) {
    const x = D.logits.map((v, i) => D.repeats[i] && s.repeat_penalty !== 1
      ? (v <= 0 ? f(v * f(s.repeat_penalty)) : f(v / f(s.repeat_penalty))) : f(v));
    const order = [...Array(n).keys()]
      .sort((a, b) => x[b] - x[a] || D.ids[a] - D.ids[b]);     // ties: lower id
    if (s.temperature <= 0) {
      return {order, x, kept: [order[0]], probs: [1], pre: [1], nucleus: 1};
    }
    const k = Math.min(s.top_k > 0 ? s.top_k : n, n);
    const cand = order.slice(0, k);
    const t = f(s.temperature);
    const scaled = cand.map((i) => f(x[i] / t));
    const e = scaled.map((v) => f(Math.exp(f(v - scaled[0]))));
    let sum = f(0);
    for (const v of e) sum = f(sum + v);
    const p = e.map((v) => f(v / sum));
    let keep = k;                 // after top-p, then after min-p
    if (s.top_p < 1) {
      let cum = f(0);
      const target = f(s.top_p);
      for (let i = 0; i < k; i++) {
        cum = f(cum + p[i]);
        if (cum >= target) { keep = i + 1; break; }
      }
    }
    const nucleus = keep;
    if (s.min_p > 0) {
      const floor = f(scaled[0] + f(Math.log(s.min_p)));
      for (let i = 1; i < keep; i++) if (scaled[i] < floor) { keep = i; break; }
    }
    let total = 0;
    for (let i = 0; i < keep; i++) total += p[i];
    return {order, x, kept: cand.slice(0, keep), nucleus,
            probs: p.slice(0, keep).map((v) => v / total), pre: p};
  }

  function settings() {
    const s = {};
    for (const input of root.querySelectorAll("input[type=range]"))
      s[input.name] = parseFloat(input.value);
    return s;
  }

  function bar(width, colour) {
    return `<span style="display:inline-block;height:0.9em;vertical-align:middle;` +
      `width:${(100 * width).toFixed(2)}%;background:${colour}"></span>`;
  }

  function draw() {
    const s = settings();
    for (const input of root.querySelectorAll("input[type=range]"))
      root.querySelector(`[data-value="${input.name}"]`).textContent =
        Number(input.value).toFixed(input.step < 1 ? 2 : 0);
    const d = distribution(s);
    const rank = new Map(d.order.map((i, r) => [i, r]));
    // Bars are scaled so the longest shown fills the column; the numbers are absolute.
    const scale = Math.max(...d.probs, ...d.pre.slice(0, D.shown), 1e-9);
    const kept = new Map(d.kept.map((i, r) => [i, d.probs[r]]));
    const rows = d.order.slice(0, D.shown).map((i) => {
      const p = kept.get(i);
      const r = rank.get(i);
      const before = s.temperature > 0 && r < d.pre.length ? d.pre[r] : 0;
      const label = D.labels[i] + (D.repeats[i] ? " \u21ba" : "");
      const why = p !== undefined ? (100 * p).toFixed(1) + "%"
        : s.temperature <= 0 ? "greedy: no"
        : r >= d.pre.length ? "cut: top-k" : r >= d.nucleus ? "cut: top-p"
        : "cut: min-p";
      return `<tr><td class="fw-tok">${label}</td><td class="fw-bar">` +
        (p !== undefined ? bar(p / scale, "#1f6feb") : bar(before / scale, "#d0d7de")) +
        `</td><td class="fw-p">${why}</td></tr>`;
    });
    root.querySelector(".fw-rows").innerHTML = rows.join("");
    const top = Math.max(...d.probs);
    root.querySelector(".fw-summary").textContent =
      `kept ${d.kept.length} of ${n} candidates; the draw picks the most likely ` +
      `with probability ${(100 * top).toFixed(1)}%`;
  }

  // Self-check: the engine's answers for a few settings, recomputed here.
  const bad = [];
  for (const c of D.checks) {
    const d = distribution(c.settings);
    const ids = d.kept.map((i) => D.ids[i]);
    const same = ids.length === c.ids.length && ids.every((v, j) => v === c.ids[j]) &&
      d.probs.every((v, j) => Math.abs(v - c.probs[j]) < 1e-6);
    if (!same) bad.push(JSON.stringify(c.settings));
  }
  if (bad.length) {
    const msg = "sampler widget disagrees with the engine for " + bad.join(", ");
    root.querySelector(".fw-check").textContent = msg;
    console.error(msg);
  } else {
    root.querySelector(".fw-check").textContent =
      `checked against the engine's results for ${D.checks.length} settings ` +
      "when it loaded";
  }
  root.dataset.checked = bad.length ? "failed" : "ok";
  for (const input of root.querySelectorAll("input[type=range]"))
    input.addEventListener("input", draw);
  draw();
})();
"""

_STYLE = """
#__ID__ { font-size: 0.9em; max-width: 100%; box-sizing: border-box;
          border: 1px solid #d0d7de; border-radius: 6px; padding: 0.6em; }
#__ID__ .fw-knob { display: flex; align-items: center; gap: 0.5em; margin: 0.15em 0; }
#__ID__ .fw-knob label { flex: 0 0 8.5em; }
#__ID__ .fw-knob input { flex: 1 1 auto; min-width: 4em; }
#__ID__ .fw-knob output { flex: 0 0 3em; text-align: right;
                          font-family: monospace; }
#__ID__ table { width: 100%; border-collapse: collapse; margin-top: 0.4em;
                table-layout: fixed; }
#__ID__ td { padding: 1px 4px; border: none; }
#__ID__ .fw-tok { width: 7.5em; font-family: monospace; white-space: pre;
                  overflow: hidden; text-overflow: ellipsis; }
#__ID__ .fw-p { width: 7.5em; text-align: right; color: #57606a; }
#__ID__ .fw-summary { margin-top: 0.3em; }
#__ID__ .fw-check, #__ID__ .fw-caption { color: #57606a; font-size: 0.9em; }
"""


def reference_settings() -> list[dict]:
    """The settings the widget re-checks against the engine when it loads."""
    return [
        dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0),
        dict(temperature=0.7, top_k=20, top_p=0.95, min_p=0.0, repeat_penalty=1.0),
        dict(temperature=0.6, top_k=20, top_p=0.95, min_p=0.0, repeat_penalty=1.3),
        dict(temperature=1.5, top_k=0, top_p=0.9, min_p=0.05, repeat_penalty=1.1),
        dict(temperature=0.3, top_k=5, top_p=0.5, min_p=0.2, repeat_penalty=2.0),
        dict(temperature=0.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.5),
        dict(temperature=2.0, top_k=100, top_p=1.0, min_p=0.0, repeat_penalty=1.0),
    ]


def sampler_explorer_html(tokenizer, logits: np.ndarray, history: Sequence[int], *,
                          window: int = 256, shown: int = 12, caption: str = "",
                          **start) -> str:
    """The widget as one self-contained HTML fragment (sliders, table, script).

    `logits` is one prediction `[vocab]`; `history` the ids before it (the repeat
    penalty reads the last 64).  The widget works on the `window` highest scores;
    its self-check compares it with `Sampler.distribution` on the same window (all
    other scores set to -inf), so both see exactly the same candidates.
    """
    logits = np.asarray(logits, dtype=np.float32)
    ids = np.argsort(-logits, kind="stable")[:window]
    window_logits = np.full_like(logits, -np.inf)
    window_logits[ids] = logits[ids]
    recent = set(int(t) for t in list(history)[-64:])
    labels = [html.escape(_label(tokenizer, int(i))) for i in ids]
    checks = []
    for s in reference_settings():
        cfg = SamplerConfig(**s, repeat_last_n=64, max_candidates=window, seed=0)
        d = Sampler(cfg).distribution(window_logits, history)
        checks.append({"settings": s, "ids": d.ids.tolist(), "probs": d.probs.tolist()})
    data = {"ids": ids.tolist(), "logits": [float(v) for v in logits[ids]],
            "labels": labels, "repeats": [int(int(i) in recent) for i in ids],
            "shown": shown, "checks": checks}
    values = dict(temperature=0.7, top_k=20, top_p=0.95, min_p=0.0, repeat_penalty=1.0)
    values.update(start)
    uid = "fw-" + secrets.token_hex(4)
    knobs = "".join(
        f'<div class="fw-knob"><label for="{uid}-{name}">{label}</label>'
        f'<input type="range" id="{uid}-{name}" name="{name}" min="{lo}" max="{hi}" '
        f'step="{step}" value="{values[name]}"><output data-value="{name}"></output>'
        f'</div>'
        for name, label, lo, hi, step in KNOBS)
    payload = json.dumps(data).replace("</", "<\\/")
    return (f'<div id="{uid}" class="fucina-sampler-widget">'
            f'<style>{_STYLE.replace("__ID__", uid)}</style>'
            f'<div class="fw-caption">{caption}</div>{knobs}'
            f'<table><tbody class="fw-rows"></tbody></table>'
            f'<div class="fw-summary"></div><div class="fw-check"></div>'
            f'<script type="application/json">{payload}</script>'
            f'<script>{_SCRIPT.replace("__ID__", uid)}</script></div>')


def sampler_explorer(tokenizer, logits, history, **kwargs):
    """`sampler_explorer_html` wrapped for display in a notebook."""
    from IPython.display import HTML

    return HTML(sampler_explorer_html(tokenizer, logits, history, **kwargs))


def _label(tokenizer, tid: int) -> str:
    from .widgets import piece_label

    return piece_label(tokenizer.token_to_bytes(tid))
