// The gateway's page: a chat box whose answer streams in, each token coloured by how it came
// (the stream's `vericache.tokens` extension), and live charts read from /metrics.
"use strict";
const $ = (id) => document.getElementById(id);
const HISTORY = 120;  // points kept per chart (one per scrape)
const POLL_MS = 1000;

// ---- /metrics ---------------------------------------------------------------------------
// Prometheus text: {name: [{labels: {...}, value}]}
function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    for (const l of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
    (out[m[1]] = out[m[1]] || []).push({labels, value: parseFloat(m[3])});
  }
  return out;
}
function metric(ms, name, labels = {}) {
  for (const s of ms[name] || []) {
    if (Object.entries(labels).every(([k, v]) => s.labels[k] === v)) return s.value;
  }
  return null;
}

const series = {tps: [], tau: [], kvVer: [], kvDra: [], utilVer: [], utilDra: []};
const mib = (bytes) => bytes === null ? "?" : (bytes / 1048576).toFixed(1);
let previous = null, scrapes = 0;

function push(name, v) {
  series[name].push(v);
  if (series[name].length > HISTORY) series[name].shift();
}

// τ over all rounds of finished requests: the tokens-per-round histogram's sum / count
function meanTau(ms) {
  const n = metric(ms, "vericache_tokens_per_round_count");
  return n ? metric(ms, "vericache_tokens_per_round_sum") / n : null;
}

async function poll() {
  try {
    const r = await fetch("/metrics", {cache: "no-store"});
    const ms = parseMetrics(await r.text());
    const now = performance.now() / 1000;
    const tokens = metric(ms, "vericache_tokens_total");
    const tauSum = metric(ms, "vericache_tokens_per_round_sum");
    const tauN = metric(ms, "vericache_tokens_per_round_count");
    let tps = null, tau = null;
    if (previous) {
      const dt = now - previous.t;
      tps = (tokens - previous.tokens) / dt;
      tau = tauN > previous.tauN ? (tauSum - previous.tauSum) / (tauN - previous.tauN) : null;
    }
    previous = {t: now, tokens, tauSum, tauN};
    push("tps", tps);
    push("tau", tau);
    // KV in use as a share of each side's budget (no budget: unbounded, nothing to draw)
    const kv = {};
    for (const side of ["verifier", "drafter"]) {
      const used = metric(ms, "vericache_kv_bytes", {side});
      const budget = metric(ms, "vericache_kv_budget_bytes", {side});
      kv[side] = budget ? used / budget : null;
      $("m-kv-" + side).textContent = `${mib(used)} of ${budget ? mib(budget) : "∞"} MiB`;
    }
    push("kvVer", kv.verifier);
    push("kvDra", kv.drafter);
    push("utilVer", metric(ms, "vericache_lane_utilisation", {lane: "verify"}));
    push("utilDra", metric(ms, "vericache_lane_utilisation", {lane: "draft"}));
    const tauAll = meanTau(ms);
    $("m-tokens").textContent = String(tokens);
    $("m-tau").textContent = tauAll === null ? "–" : tauAll.toFixed(3);
    $("m-tps").textContent = tps === null ? "–" : tps.toFixed(1);
    $("m-active").textContent = String(metric(ms, "vericache_active_requests"));
    $("m-scrapes").textContent = String(++scrapes);
    draw($("c-tps"), [{data: series.tps, color: "#1f6fd1"}]);
    draw($("c-tau"), [{data: series.tau, color: "#8e44ad", dots: true}]);
    draw($("c-kv"), [{data: series.kvVer, color: "#1f6fd1"}, {data: series.kvDra, color: "#2e8b57"}], 1);
    draw($("c-util"), [{data: series.utilVer, color: "#1f6fd1"}, {data: series.utilDra, color: "#2e8b57"}], 1);
  } catch (e) {
    $("m-tps").textContent = "metrics unavailable";
  }
}

// one line per series over the last HISTORY points; null values leave gaps
function draw(canvas, lines, fixedMax) {
  const ctx = canvas.getContext("2d"), w = canvas.width, h = canvas.height, pad = 16;
  ctx.clearRect(0, 0, w, h);
  let max = fixedMax || 0;
  for (const l of lines) for (const v of l.data) if (v !== null && v > max) max = v;
  max = max || 1;
  ctx.fillStyle = "#777";
  ctx.font = "10px sans-serif";
  ctx.fillText(max.toPrecision(3), 2, 10);
  ctx.fillText("0", 2, h - 2);
  const x = (i) => pad + (w - 2 * pad) * i / (HISTORY - 1);
  const y = (v) => h - pad / 2 - (h - pad) * v / max;
  for (const l of lines) {
    ctx.strokeStyle = ctx.fillStyle = l.color;
    ctx.setLineDash(l.dash ? [4, 3] : []);
    ctx.beginPath();
    let drawing = false;
    const offset = HISTORY - l.data.length;
    l.data.forEach((v, i) => {
      if (v === null) { drawing = false; return; }
      if (l.dots) ctx.fillRect(x(offset + i) - 1.5, y(v) - 1.5, 3, 3);
      if (drawing) ctx.lineTo(x(offset + i), y(v)); else ctx.moveTo(x(offset + i), y(v));
      drawing = true;
    });
    ctx.stroke();
  }
  ctx.setLineDash([]);
}

// ---- the chat ---------------------------------------------------------------------------
function options() {
  const o = {mode: $("mode").value, draft_len: parseInt($("draft_len").value, 10),
             adaptive: $("adaptive").checked};
  if (o.mode !== "full") {
    o.compressor = $("compressor").value;
    o.ratio = parseFloat($("ratio").value);
  }
  return o;
}

function addTokens(answer, chunk) {
  const content = chunk.choices.length ? chunk.choices[0].delta.content || "" : "";
  const toks = (chunk.vericache && chunk.vericache.tokens) || [];
  // a span per token where the tokens' own texts make up the chunk's content; otherwise
  // (a character split across tokens, a cut stop string) one span of the last token's kind
  if (toks.length && toks.map((t) => t.text).join("") === content) {
    for (const t of toks) {
      const s = document.createElement("span");
      s.className = "tok tok-" + t.kind;
      s.title = t.kind + " (id " + t.id + ")";
      s.textContent = t.text;
      answer.appendChild(s);
    }
  } else if (content) {
    const s = document.createElement("span");
    s.className = "tok tok-" + (toks.length ? toks[toks.length - 1].kind : "plain");
    s.textContent = content;
    answer.appendChild(s);
  }
}

async function ask(event) {
  event.preventDefault();
  const answer = $("answer"), status = $("status"), opts = options();
  answer.textContent = "";
  status.textContent = "streaming…";
  status.dataset.state = "streaming";
  $("send").disabled = true;
  const headers = {"content-type": "application/json"};
  if ($("api_key").value) headers.authorization = "Bearer " + $("api_key").value;
  const body = {messages: [{role: "user", content: $("prompt").value}], stream: true,
                stream_options: {include_usage: true}, temperature: 0,
                max_tokens: parseInt($("max_tokens").value, 10), vericache: opts};
  const t0 = performance.now();
  let usage = null, error = null;
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST", headers, body: JSON.stringify(body)});
    if (!r.ok) {
      const retry = r.headers.get("retry-after");
      throw new Error(`${r.status}: ${(await r.json()).error.message}` + (retry ? ` (retry after ${retry} s)` : ""));
    }
    const reader = r.body.getReader(), dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += dec.decode(value, {stream: true});
      let at;
      while ((at = buf.indexOf("\n\n")) >= 0) {
        const line = buf.slice(0, at).trim();
        buf = buf.slice(at + 2);
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const chunk = JSON.parse(line.slice(6));
        if (chunk.error) { error = chunk.error.message; continue; }
        if (chunk.usage) usage = chunk.usage;
        addTokens(answer, chunk);
      }
    }
  } catch (e) {
    error = e.message;
  }
  const seconds = (performance.now() - t0) / 1000;
  $("send").disabled = false;
  if (error) {
    status.textContent = "error: " + error;
    status.dataset.state = "error";
    return;
  }
  const row = document.createElement("tr");
  const tps = usage ? usage.completion_tokens / seconds : 0;
  const full = opts.mode === "full";
  const cells = [opts.mode, full ? "–" : opts.compressor, full ? "–" : opts.ratio,
                 full ? "–" : opts.adaptive ? `≤${opts.draft_len}` : String(opts.draft_len),
                 usage ? usage.completion_tokens : "?", usage ? usage.tokens_per_round.toFixed(3) : "?",
                 usage ? usage.acceptance_rate.toFixed(3) : "?", usage ? usage.rounds : "?", tps.toFixed(1)];
  const names = ["mode", "compressor", "ratio", "k", "tokens", "tau", "acceptance", "rounds", "tps"];
  cells.forEach((c, i) => {
    const td = document.createElement("td");
    td.className = "req-" + names[i];
    td.textContent = c;
    row.appendChild(td);
  });
  $("requests").querySelector("tbody").prepend(row);
  status.textContent = `done in ${seconds.toFixed(2)} s`;
  status.dataset.state = "done";
}

async function header() {
  try {
    const m = await (await fetch("/v1/models", {headers: $("api_key").value ?
      {authorization: "Bearer " + $("api_key").value} : {}})).json();
    $("model").textContent = m.data[0].id;
  } catch (e) { /* behind an API key: the name stays unknown */ }
  const r = await fetch("/ready").catch(() => null);
  $("ready").textContent = r && r.ok ? "ready" : "not ready";
  $("ready").className = "badge " + (r && r.ok ? "ok" : "down");
}

$("ask").addEventListener("submit", ask);
$("mode").addEventListener("change", () => {
  const full = $("mode").value === "full";
  for (const id of ["compressor", "ratio", "draft_len", "adaptive"]) $(id).disabled = full;
});
header();
setInterval(header, 5000);
poll();
setInterval(poll, POLL_MS);
