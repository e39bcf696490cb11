"""The /dashboard page: one self-contained HTML document (inline CSS and JS, no CDN, no fonts to fetch).

It polls /stats once a second and draws on canvases: requests running/waiting, tokens per second (live
decode and prefill rates, and reply tokens differenced from the totals), KV use per replica, and the
TTFT and latency distributions. `<body data-updates data-error data-requests data-peak-tokens>` record
what it has seen (polls, requests finished meanwhile, the highest reply tokens/s drawn, the last error),
so a headless browser (and an operator's console) can tell a live page from a stuck one.
"""

DASHBOARD_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>TensorFold dashboard</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{margin:0;font:14px system-ui,sans-serif;background:#0f1419;color:#d8dee6}
header{display:flex;gap:16px;align-items:baseline;padding:12px 20px;background:#161d26}
h1{font-size:18px;margin:0}#status{color:#8a97a6}#error{color:#ff7b72;font-weight:600}
.tiles{display:flex;flex-wrap:wrap;gap:10px;padding:12px 20px}
.tile{background:#161d26;border-radius:6px;padding:8px 14px;min-width:120px}
.tile b{display:block;font-size:20px;color:#fff}.tile span{color:#8a97a6;font-size:12px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(460px,1fr));gap:14px;padding:0 20px 20px}
.card{background:#161d26;border-radius:6px;padding:10px}.card h2{font-size:13px;margin:0 0 6px;color:#aab6c4}
canvas{width:100%;height:180px;display:block}
table{border-collapse:collapse;margin:0 20px 20px;min-width:60%}td,th{padding:4px 10px;border-bottom:1px solid #26303c;text-align:right}
th:first-child,td:first-child{text-align:left}
</style></head>
<body data-updates="0" data-error="" data-requests="0" data-peak-tokens="0">
<header><h1>TensorFold</h1><span id="model"></span><span id="status">connecting...</span><span id="error"></span></header>
<div class="tiles" id="tiles"></div>
<div class="grid">
<div class="card"><h2>Requests (running / waiting)</h2><canvas id="c-requests"></canvas></div>
<div class="card"><h2>Tokens per second (decode / prefill / replies)</h2><canvas id="c-tokens"></canvas></div>
<div class="card"><h2>KV cache use per replica (%)</h2><canvas id="c-kv"></canvas></div>
<div class="card"><h2>Time to first token (requests per bucket, seconds)</h2><canvas id="c-ttft"></canvas></div>
<div class="card"><h2>Request latency (requests per bucket, seconds)</h2><canvas id="c-latency"></canvas></div>
</div>
<table id="replicas"><thead><tr><th>replica</th><th>running</th><th>waiting</th><th>KV use</th>
<th>decode tok/s</th><th>prefill tok/s</th><th>requests</th></tr></thead><tbody></tbody></table>
<script>
"use strict";
const KEEP = 120, COLORS = ["#58a6ff", "#f0883e", "#3fb950", "#d2a8ff", "#ff7b72", "#e3b341"];
const series = {requests: [[], []], tokens: [[], [], []], kv: {}};
let previous = null, updates = 0, firstRequests = null;

function push(list, value) { list.push(value); if (list.length > KEEP) list.shift(); }

function canvasContext(id) {
  const canvas = document.getElementById(id), ratio = window.devicePixelRatio || 1;
  canvas.width = canvas.clientWidth * ratio; canvas.height = canvas.clientHeight * ratio;
  const ctx = canvas.getContext("2d"); ctx.scale(ratio, ratio);
  ctx.clearRect(0, 0, canvas.clientWidth, canvas.clientHeight);
  ctx.font = "11px system-ui"; ctx.fillStyle = "#8a97a6";
  return [ctx, canvas.clientWidth, canvas.clientHeight];
}

function lines(id, lists, names, fixedMax) {
  const [ctx, w, h] = canvasContext(id), pad = 28;
  const top = fixedMax || Math.max(1, ...lists.flat());
  ctx.fillText(top.toFixed(top < 10 ? 1 : 0), 2, 12); ctx.fillText("0", 2, h - 4);
  lists.forEach((list, i) => {
    ctx.strokeStyle = COLORS[i % COLORS.length]; ctx.lineWidth = 2; ctx.beginPath();
    list.forEach((v, j) => {
      const x = pad + (w - pad - 4) * (j + KEEP - list.length) / (KEEP - 1), y = h - 8 - (h - 24) * v / top;
      j ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
    });
    ctx.stroke(); ctx.fillStyle = COLORS[i % COLORS.length];
    ctx.fillText(names[i] + " " + (list.length ? list[list.length - 1].toFixed(1) : "-"), pad + 4 + i * 130, 12);
  });
}

function bars(id, histogram) {
  const [ctx, w, h] = canvasContext(id), counts = histogram.counts;
  let first = counts.findIndex(c => c > 0), last = counts.length - 1 - [...counts].reverse().findIndex(c => c > 0);
  if (first < 0) { ctx.fillText("no finished requests yet", 10, h / 2); return; }
  first = Math.max(0, first - 1); last = Math.min(counts.length - 1, last + 1);
  const shown = counts.slice(first, last + 1), top = Math.max(...shown), bw = (w - 10) / shown.length;
  shown.forEach((c, i) => {
    const bh = (h - 36) * c / top, bound = histogram.bounds[first + i];
    ctx.fillStyle = "#58a6ff"; ctx.fillRect(5 + i * bw + 1, h - 18 - bh, bw - 2, bh);
    ctx.fillStyle = "#8a97a6"; ctx.fillText(bound === undefined ? "inf" : "<=" + bound, 5 + i * bw + 2, h - 4);
  });
  const q = v => v === null ? "-" : v + "s";
  ctx.fillStyle = "#d8dee6";
  ctx.fillText(`n=${histogram.count}  p50<=${q(histogram.p50)}  p90<=${q(histogram.p90)}  p99<=${q(histogram.p99)}`, 8, 12);
}

function tiles(stats) {
  const t = stats.totals, l = stats.live;
  const items = [["running", l.running], ["waiting", l.waiting], ["requests", t.requests_total],
    ["prompt tokens", t.prompt_tokens_total], ["cached tokens", t.cached_tokens_total],
    ["reply tokens", t.completion_tokens_total], ["disconnects", t.client_disconnections_total],
    ["replicas", stats.replicas.length]];
  if (stats.drafts) {  // the engine drafts: how many of its drafts were kept
    items.push([`drafts kept (${stats.drafts.method})`, (100 * stats.drafts.acceptance_rate).toFixed(1) + "%"]);
  }
  if (stats.store) {  // the disk prompt-state store, when it is on
    items.push(["on disk MB", (stats.store.bytes_held / 1e6).toFixed(1)], ["restored tokens", stats.store.restored_tokens]);
  }
  document.getElementById("tiles").innerHTML =
    items.map(([name, value]) => `<div class="tile"><b>${value}</b><span>${name}</span></div>`).join("");
}

function table(stats) {
  document.querySelector("#replicas tbody").innerHTML = stats.replicas.map(r =>
    `<tr><td>${r.replica}</td><td>${r.running}</td><td>${r.waiting}</td><td>${(100 * r.kv_usage).toFixed(1)}%</td>` +
    `<td>${r.decode_tokens_per_second}</td><td>${r.prefill_tokens_per_second}</td><td>${r.requests_total}</td></tr>`).join("");
}

function record(stats) {
  push(series.requests[0], stats.live.running); push(series.requests[1], stats.live.waiting);
  push(series.tokens[0], stats.live.decode_tokens_per_second);
  push(series.tokens[1], stats.live.prefill_tokens_per_second);
  const seconds = previous ? stats.time - previous.time : 0;
  const replies = seconds > 0 ? (stats.totals.completion_tokens_total - previous.totals.completion_tokens_total) / seconds : 0;
  push(series.tokens[2], Math.max(0, replies));
  stats.replicas.forEach(r => push(series.kv[r.replica] = series.kv[r.replica] || [], 100 * r.kv_usage));
  previous = stats;
}

function draw(stats) {
  document.getElementById("model").textContent = stats.model;
  tiles(stats); table(stats);
  lines("c-requests", series.requests, ["running", "waiting"]);
  lines("c-tokens", series.tokens, ["decode", "prefill", "replies"]);
  const pools = Object.keys(series.kv).sort();
  lines("c-kv", pools.map(p => series.kv[p]), pools.map(p => p.slice(0, 10)), 100);
  bars("c-ttft", stats.histograms.ttft); bars("c-latency", stats.histograms.latency);
}

async function poll() {
  try {
    const response = await fetch("stats", {cache: "no-store"});
    if (!response.ok) throw new Error(`/stats answered ${response.status}`);
    const stats = await response.json();
    record(stats); draw(stats); updates += 1;
    if (firstRequests === null) firstRequests = stats.totals.requests_total;
    document.body.dataset.updates = updates;
    document.body.dataset.requests = stats.totals.requests_total - firstRequests;
    document.body.dataset.peakTokens = Math.max(...series.tokens[2]).toFixed(1);
    document.body.dataset.error = "";
    document.getElementById("error").textContent = "";
    document.getElementById("status").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (error) {
    document.body.dataset.error = String(error.message || error);
    document.getElementById("error").textContent = "error: " + document.body.dataset.error;
  }
}
poll(); setInterval(poll, 1000);
</script></body></html>
"""
