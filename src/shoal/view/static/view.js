// shoal view: a dashboard that speaks MQTT over WebSockets to the broker (schemas/CONTRACT.md).
// Everything it shows comes from shoal's own topics; retained ones fill the page on load.
"use strict";

const MAX_KEY_CARDS = 12; // charts drawn at once (the filter picks others)
const HISTORY = 120; // points per key chart
const STALE_MS = 10000; // a heartbeat older than this is shown as stale
const FORGET_MS = 60000; // and one older than this is forgotten (the instance is gone)
const REASONS = 20; // latest dead-letter and late reasons kept

const state = {
  config: null,
  client: null,
  pipelines: new Map(), // name -> pipeline document
  keys: new Map(), // "pipeline\u0000segment" -> {pipeline, key, latest, xs, ys, agg, card, chart}
  alerts: new Map(), // topic -> alert message
  corrections: [], // latest window revisions > 1
  workers: new Map(), // id -> {body, heard}
  gateways: new Map(), // id -> gateway status
  partitions: new Map(), // "pipeline-partition" -> combiner heartbeat
  problems: new Map(), // pipeline -> {deadletters, late, dlTotal, lateTotal}
  reasons: [],
};

const $ = (id) => document.getElementById(id);
const text = (v) => (v === null || v === undefined ? "–" : String(v));
const fmtTime = (ms) => (ms === null || ms === undefined ? "–" : new Date(ms).toISOString().slice(11, 19));
const fmtNum = (v) => {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  return Number.isInteger(v) ? String(v) : v.toPrecision(5).replace(/\.?0+$/, "");
};

function setStatus(stateName, label) {
  const el = $("status");
  el.dataset.state = stateName;
  el.textContent = label || stateName;
}

function fillRows(tableId, rows) {
  const body = $(tableId).querySelector("tbody");
  body.replaceChildren(
    ...rows.map(({ cells, cls, data }) => {
      const tr = document.createElement("tr");
      if (cls) tr.className = cls;
      for (const [k, v] of Object.entries(data || {})) tr.dataset[k] = v;
      for (const c of cells) {
        const td = document.createElement("td");
        td.textContent = text(c);
        tr.appendChild(td);
      }
      return tr;
    }),
  );
  const empty = document.querySelector(`.empty[data-for="${tableId}"]`);
  if (empty) empty.hidden = rows.length > 0;
}

// --- topics ------------------------------------------------------------------------------

function relative(topic) {
  const root = state.config.root ? state.config.root.replace(/\/$/, "") + "/" : "";
  return root && topic.startsWith(root) ? topic.slice(root.length) : topic;
}

function under(filter) {
  return state.config.root ? `${state.config.root.replace(/\/$/, "")}/${filter}` : filter;
}

const FILTERS = [
  "shoal/pipelines/+",
  "results/#",
  "shoal/alerts/#",
  "shoal/metrics/#",
  "shoal/gateway/+",
  "shoal/late/#",
  "shoal/deadletter/#",
];

function route(topic, payload, packet) {
  const levels = relative(topic).split("/");
  if (levels[0] === "results") return onResult(levels, payload);
  if (levels[0] !== "shoal") return;
  const kind = levels[1];
  if (kind === "deadletter") return onDeadLetter(levels[2], payload, packet);
  if (payload.length === 0) return forget(levels);
  const body = parseJson(payload);
  if (body === null) return;
  if (kind === "pipelines" && !levels[2].startsWith("_")) onPipeline(body);
  else if (kind === "alerts") onAlert(topic, body);
  else if (kind === "metrics" && levels[2] === "worker") onWorker(body);
  else if (kind === "metrics" && levels[2] === "combiner") onCombiner(body);
  else if (kind === "gateway") onGateway(body);
  else if (kind === "late") onLate(body);
}

function parseJson(payload) {
  try {
    return JSON.parse(new TextDecoder().decode(payload));
  } catch (e) {
    return null;
  }
}

function forget(levels) {
  // An empty retained message clears a topic (e.g. a deleted alert or document).
  if (levels[1] === "pipelines") state.pipelines.delete(levels[2]);
  drawSoon();
}

// --- handlers ----------------------------------------------------------------------------

function onPipeline(doc) {
  if (typeof doc.name !== "string") return;
  state.pipelines.set(doc.name, doc);
  drawSoon();
}

function onResult(levels, payload) {
  const pipeline = levels[1];
  if (levels.length === 2 || (levels.length === 3 && levels[2] === "_json")) {
    if (payload[0] !== 0x7b) return; // "{": JSON window messages only (not MsgPack)
    const win = parseJson(payload);
    if (win && win.revision > 1) noteCorrection(win);
    return;
  }
  if (levels.length !== 3) return;
  const segment = levels[2];
  if (segment.startsWith("_") && !segment.startsWith("__") && segment !== "_") return; // _msgpack
  const row = parseJson(payload);
  if (row === null) return;
  onKey(pipeline, segment, row);
}

function onKey(pipeline, segment, row) {
  const id = `${pipeline}\u0000${segment}`;
  let entry = state.keys.get(id);
  if (!entry) {
    entry = { pipeline, segment, key: row.key, xs: [], ys: [], agg: null, card: null, chart: null };
    state.keys.set(id, entry);
  }
  entry.latest = row;
  entry.agg = entry.agg || chartAggregate(row);
  const x = (row.end ?? row.last_ts ?? Date.now()) / 1000;
  const y = entry.agg ? row[entry.agg] : null;
  const at = entry.xs.indexOf(x);
  if (at >= 0) entry.ys[at] = y; // a revision of a window already drawn
  else {
    let i = entry.xs.length;
    while (i > 0 && entry.xs[i - 1] > x) i--;
    entry.xs.splice(i, 0, x);
    entry.ys.splice(i, 0, y);
    if (entry.xs.length > HISTORY) {
      entry.xs.shift();
      entry.ys.shift();
    }
  }
  if (row.revision > 1) noteCorrection({ ...row, keys: 1, rows: row.rows });
  updateCard(entry);
}

const NOT_AGGREGATES = new Set([
  "pipeline", "window", "start", "end", "revision", "correction", "emitted_at", "key", "rows",
  "batches", "index", "first_ts", "last_ts",
]);

function aggregatesOf(row) {
  return Object.keys(row).filter((k) => !NOT_AGGREGATES.has(k));
}

function chartAggregate(row) {
  const names = aggregatesOf(row);
  for (const preferred of ["mean", "last", "p50", "max", "sum", "count"]) {
    if (names.includes(preferred)) return preferred;
  }
  return names[0] || "rows";
}

function noteCorrection(win) {
  const id = `${win.pipeline}|${win.window}|${win.start}|${win.partition ?? ""}`;
  state.corrections = state.corrections.filter((c) => c.id !== id || c.revision > win.revision);
  if (!state.corrections.some((c) => c.id === id)) {
    state.corrections.unshift({ id, ...win, keys: win.keys ?? 1 });
    state.corrections = state.corrections.slice(0, 20);
  }
  drawSoon();
}

function onAlert(topic, body) {
  state.alerts.set(topic, body);
  drawSoon();
}

function onWorker(body) {
  if (body.state === "gone") state.workers.delete(body.id);
  else state.workers.set(body.id, { body, heard: Date.now() });
  drawSoon();
}

function onCombiner(body) {
  state.partitions.set(`${body.pipeline}-${body.partition}`, { body, heard: Date.now() });
  drawSoon();
}

function onGateway(body) {
  state.gateways.set(body.gateway_id, body);
  drawSoon();
}

function problemsOf(pipeline) {
  if (!state.problems.has(pipeline)) {
    state.problems.set(pipeline, { deadletters: 0, late: 0 });
  }
  return state.problems.get(pipeline);
}

function noteReason(item) {
  state.reasons.unshift(item);
  state.reasons = state.reasons.slice(0, REASONS);
}

function onLate(body) {
  const p = problemsOf(body.pipeline);
  p.late += body.rows || 0;
  for (const entry of (body.late || []).slice(0, 3)) {
    noteReason({
      at: body.at,
      pipeline: body.pipeline,
      what: "late",
      reason: entry.reason,
      detail: `${entry.rows} row(s) of key ${text(entry.key)}, window ${entry.window} ${fmtTime(entry.start)} (gateway ${body.gateway_id}, seq ${body.seq})`,
    });
  }
  drawSoon();
}

function onDeadLetter(pipeline, payload, packet) {
  // The payload is MsgPack; the reason and code travel as MQTT 5 user properties (§18).
  const props = (packet.properties && packet.properties.userProperties) || {};
  const one = (v) => (Array.isArray(v) ? v[0] : v);
  problemsOf(pipeline).deadletters += 1;
  noteReason({
    at: Date.now(),
    pipeline,
    what: "dead letter",
    reason: one(props.reason) || "(no reason property)",
    detail: `code ${text(one(props.code))}, ${payload.length} bytes`,
  });
  drawSoon();
}

// --- drawing -----------------------------------------------------------------------------

let drawPending = false;
function drawSoon() {
  if (drawPending) return;
  drawPending = true;
  requestAnimationFrame(() => {
    drawPending = false;
    drawTables();
  });
}

function runningPipelines() {
  // Pipelines started from a spec (shoal up, shoal combiner --pipeline) have no document:
  // they are known from their results and heartbeats.
  const seen = new Set();
  for (const e of state.keys.values()) seen.add(e.pipeline);
  for (const { body } of state.partitions.values()) seen.add(body.pipeline);
  for (const { body } of state.workers.values()) if (body.pipeline) seen.add(body.pipeline);
  return [...seen].filter((p) => !state.pipelines.has(p)).map((name) => {
    const sample = [...state.keys.values()].find((e) => e.pipeline === name);
    const row = sample ? sample.latest : {};
    return { name, version: null, state: "running (no document)", spec: { windows: row.window ? [{ name: row.window }] : [], aggregates: row.window ? aggregatesOf(row) : [] } };
  });
}

function drawTables() {
  const now = Date.now();
  for (const beats of [state.workers, state.partitions]) {
    for (const [id, { heard }] of beats) if (now - heard > FORGET_MS) beats.delete(id);
  }
  fillRows(
    "pipelines",
    [...state.pipelines.values(), ...runningPipelines()]
      .sort((a, b) => a.name.localeCompare(b.name))
      .map((d) => {
        const spec = d.spec || {};
        const rules = [spec.where && "where", spec.derive && "derive", spec.having && "having", spec.alerts && `${spec.alerts.length} alert(s)`].filter(Boolean);
        return {
          data: { pipeline: d.name },
          cls: d.state.split(" ")[0],
          cells: [d.name, d.version, d.state, spec.key, (spec.windows || []).map((w) => w.name).join(", "), (spec.aggregates || []).join(", "), rules.join(", ") || "–"],
        };
      }),
  );
  const alerts = [...state.alerts.values()].sort((a, b) => (a.state === b.state ? 0 : a.state === "firing" ? -1 : 1));
  const firing = alerts.filter((a) => a.state === "firing").length;
  $("alerts-firing").textContent = String(firing);
  $("alerts-firing").className = firing ? "badge firing" : "badge";
  fillRows(
    "alerts",
    alerts.map((a) => ({ cls: a.state, data: { key: text(a.key) }, cells: [a.pipeline, a.alert, a.key, a.state, `${a.window} ${fmtTime(a.start)}`, a.condition] })),
  );
  fillRows(
    "corrections",
    state.corrections.map((c) => ({ cells: [c.pipeline, c.window, fmtTime(c.start), c.revision, c.keys, c.rows] })),
  );
  fillRows(
    "workers",
    [...state.workers.values()]
      .sort((a, b) => a.body.id.localeCompare(b.body.id))
      .map(({ body, heard }) => ({
        cls: now - heard > STALE_MS ? "stale" : "",
        cells: [body.id, body.pipeline ?? Object.keys(body.serving || {}).join(", "), body.state, fmtNum(body.rows_per_s), fmtNum(body.cpu_percent), body.deadletters, `${Math.round((now - heard) / 1000)} s ago`],
      })),
  );
  const progress = new Map(); // gateway -> worst of the partitions' views
  for (const { body } of state.partitions.values()) {
    for (const [g, p] of Object.entries(body.gateway_progress || {})) {
      const seen = progress.get(g);
      if (!seen || (p.watermark ?? Infinity) < (seen.watermark ?? Infinity)) progress.set(g, p);
    }
  }
  const gatewayIds = new Set([...state.gateways.keys(), ...progress.keys()]);
  fillRows(
    "gateways",
    [...gatewayIds].sort().map((g) => {
      const s = state.gateways.get(g) || {};
      const p = progress.get(g) || {};
      const offset = p.clock_offset_ms === null || p.clock_offset_ms === undefined ? null : `${p.clock_offset_ms} ms`;
      return { data: { gateway: g }, cells: [g, s.unconfirmed_batches, s.unconfirmed_rows, fmtTime(p.watermark), offset, p.holding === undefined ? "–" : p.released ? "released" : p.holding ? "yes" : "no"] };
    }),
  );
  fillRows(
    "partitions",
    [...state.partitions.entries()].sort().map(([id, { body, heard }]) => ({
      cls: now - heard > STALE_MS ? "stale" : "",
      cells: [id, fmtTime(body.watermark), fmtTime(body.closed_through), body.rows_late, body.corrections_emitted, body.pending_batches],
    })),
  );
  // Since the page loaded (messages seen), and the totals the heartbeats report.
  const lateTotals = new Map();
  for (const { body } of state.partitions.values()) {
    lateTotals.set(body.pipeline, (lateTotals.get(body.pipeline) || 0) + (body.rows_late || 0));
    problemsOf(body.pipeline);
  }
  const deadTotals = new Map();
  for (const { body } of state.workers.values()) {
    if (!body.pipeline) continue; // a pool worker's count covers several pipelines
    deadTotals.set(body.pipeline, (deadTotals.get(body.pipeline) || 0) + (body.deadletters || 0));
    problemsOf(body.pipeline);
  }
  const withTotal = (seen, total) => (total === undefined ? `${seen}` : `${seen} (total ${total})`);
  fillRows(
    "problems",
    [...state.problems.entries()].sort().map(([p, v]) => ({
      data: { pipeline: p },
      cells: [p, withTotal(v.deadletters, deadTotals.get(p)), withTotal(v.late, lateTotals.get(p))],
    })),
  );
  $("reasons").replaceChildren(
    ...state.reasons.map((r) => {
      const li = document.createElement("li");
      li.dataset.reason = r.reason;
      li.textContent = `${fmtTime(r.at)} ${r.pipeline} ${r.what}: ${r.reason} — ${r.detail}`;
      return li;
    }),
  );
  drawKeyList();
}

function visibleKeys() {
  const filter = $("key-filter").value.trim();
  const all = [...state.keys.values()].sort((a, b) => a.pipeline.localeCompare(b.pipeline) || a.segment.localeCompare(b.segment, undefined, { numeric: true }));
  const matching = filter ? all.filter((e) => `${e.pipeline}/${e.key}`.includes(filter)) : all;
  $("key-count").textContent = `${matching.length} of ${all.length} key(s)` + (matching.length > MAX_KEY_CARDS ? `, showing ${MAX_KEY_CARDS}` : "");
  return matching.slice(0, MAX_KEY_CARDS);
}

function drawKeyList() {
  const shown = visibleKeys();
  const keep = new Set(shown);
  for (const entry of state.keys.values()) {
    if (!keep.has(entry) && entry.card) {
      if (entry.chart) entry.chart.destroy();
      entry.card.remove();
      entry.card = entry.chart = null;
    }
  }
  const list = $("results");
  for (const entry of shown) {
    if (!entry.card) makeCard(entry);
    list.appendChild(entry.card); // keeps the sorted order
    updateCard(entry);
  }
}

function makeCard(entry) {
  const card = document.createElement("div");
  card.className = "key";
  card.dataset.pipeline = entry.pipeline;
  card.dataset.key = text(entry.key);
  card.innerHTML = '<h3><span class="name"></span><span class="revision"></span></h3><div class="meta"></div><div class="values"></div><div class="chart"></div>';
  card.querySelector(".name").textContent = `${entry.pipeline} / ${text(entry.key)}`;
  entry.card = card;
  entry.chart = new uPlot(
    {
      width: 250, height: 90, legend: { show: false }, cursor: { show: false },
      scales: { x: { time: true } },
      axes: [{ size: 22, font: "10px system-ui" }, { size: 52, font: "10px system-ui" }],
      series: [{}, { label: entry.agg, stroke: "#2563eb", width: 1.5, points: { size: 4 } }],
    },
    [entry.xs, entry.ys],
    card.querySelector(".chart"),
  );
}

function updateCard(entry) {
  if (!entry.card) {
    drawSoon(); // a new key: the list decides whether it gets a card
    return;
  }
  const row = entry.latest;
  entry.card.querySelector(".meta").textContent = `${row.window} ${fmtTime(row.start)}–${fmtTime(row.end)}, ${row.rows} row(s)`;
  const values = entry.card.querySelector(".values");
  values.replaceChildren(
    ...aggregatesOf(row).map((name) => {
      const span = document.createElement("span");
      span.className = "value";
      span.dataset.agg = name;
      span.innerHTML = "<b></b> ";
      span.firstChild.textContent = `${name} `;
      span.appendChild(document.createTextNode(`${fmtNum(row[name])}  `));
      return span;
    }),
  );
  const revised = row.revision > 1;
  entry.card.classList.toggle("revised", revised);
  entry.card.querySelector(".revision").textContent = revised ? `revision ${row.revision}` : "";
  if (entry.chart) entry.chart.setData([entry.xs, entry.ys]);
}

// --- connection --------------------------------------------------------------------------

function brokerUrl() {
  const url = new URL(state.config.ws_url);
  const loopback = ["127.0.0.1", "localhost", "[::1]"];
  if (loopback.includes(url.hostname) && !loopback.includes(location.hostname) && location.hostname) {
    url.hostname = location.hostname; // the page was opened from another machine
  }
  return url.toString();
}

const REFUSALS = {
  4: "bad user name or password",
  5: "not authorized",
  134: "bad user name or password",
  135: "not authorized",
};

function connect(username, password) {
  const url = brokerUrl();
  $("broker").textContent = url;
  setStatus("connecting");
  const client = mqtt.connect(url, {
    protocolVersion: 5,
    clientId: `shoal-view-${Math.random().toString(16).slice(2, 10)}`,
    username: username || undefined,
    password: password || undefined,
    reconnectPeriod: 1000,
    connectTimeout: 4000,
    keepalive: 15,
    clean: true,
    resubscribe: true,
  });
  state.client = client;
  client.on("connect", () => {
    setStatus("connected");
    $("login").hidden = true;
    $("login-error").hidden = true;
    client.subscribe(FILTERS.map(under), { qos: 0 });
  });
  client.on("reconnect", () => setStatus("reconnecting"));
  client.on("offline", () => setStatus("offline"));
  client.on("close", () => {
    if ($("status").dataset.state === "connected") setStatus("reconnecting");
  });
  client.on("error", (err) => {
    const why = REFUSALS[err.code];
    if (why === undefined) return; // transport errors: mqtt.js reconnects by itself
    client.end(true);
    setStatus("refused", "refused");
    const box = $("login-error");
    box.textContent = `The broker refused the connection: ${why}. Check the user name and password (only dashboard users may connect).`;
    box.hidden = false;
    $("login").hidden = false;
  });
  client.on("message", (topic, payload, packet) => route(topic, payload, packet));
}

async function main() {
  state.config = await (await fetch("config.json")).json();
  $("key-filter").addEventListener("input", drawSoon);
  setInterval(drawSoon, 2000); // heartbeat ages
  if (!state.config.login) {
    connect();
    return;
  }
  setStatus("log in");
  $("login").hidden = false;
  $("username").value = state.config.username || "";
  $("login").addEventListener("submit", (ev) => {
    ev.preventDefault();
    if (state.client) state.client.end(true);
    $("login-error").hidden = true;
    connect($("username").value, $("password").value);
  });
}

main();
