// The hypermesh dashboard: polls the agent's JSON endpoints once a second while
// the page is visible and redraws. No framework, no build step, nothing remote.
"use strict";

const POLL_MS = 1000;
const ui = { wid: null, task: null, attempt: 0, logOffset: 0, logDone: false, logKey: "" };

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "onclick") el.onclick = v;
    else if (v !== null && v !== undefined) el.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    el.append(c instanceof Node ? c : document.createTextNode(c === null || c === undefined ? "" : String(c)));
  }
  return el;
}

function svg(tag, attrs, ...children) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  for (const c of children) el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return el;
}

async function getJSON(url) {
  const resp = await fetch(url, { cache: "no-store" });
  if (resp.status === 401) location.assign("/login"); // the session expired: log in again
  const body = await resp.json();
  if (!resp.ok) throw new Error(body.error || resp.statusText);
  return body;
}

const badge = (state) => h("span", { class: "state " + (state || "") }, state || "-");
const fmtBytes = (n) => {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
};
const fmtTime = (t) => (t ? new Date(t * 1000).toLocaleTimeString() : "-");

function progressBar(e) {
  const pct = (n) => (e.total ? (100 * n) / e.total : 0);
  let left = 0;
  const parts = [];
  for (const [n, cls] of [[e.succeeded, "ok"], [e.failed, "bad"], [e.cancelled, "cx"], [e.running, "run"]]) {
    if (n) parts.push(h("i", { class: cls, style: `left:${left}%;width:${pct(n)}%` }));
    left += pct(n);
  }
  return h("div", { class: "bar" }, parts);
}

// ------------------------------------------------------------------ workflows
function renderWorkflows(data) {
  document.getElementById("where").textContent =
    `node ${data.node} · namespace ${data.namespace} · leader ${data.leader || "none"}`;
  const list = document.getElementById("wf-list");
  list.className = "";
  list.replaceChildren(
    ...(data.workflows.length ? [] : [h("div", { class: "muted" }, "none yet")]),
    ...data.workflows.map((w) =>
      h("div", { class: "wf" + (w.id === ui.wid ? " chosen" : ""), "data-wid": w.id,
                 onclick: () => chooseWorkflow(w.id) },
        h("div", {}, h("b", {}, w.name), " ", h("span", { class: "muted" }, w.id), " ", badge(w.state)),
        Object.entries(w.experiments).flatMap(([name, e]) => [
          h("div", { class: "exp", "data-exp": name },
            h("span", {}, name), progressBar(e),
            h("span", { class: "muted" }, `${e.succeeded + e.failed + e.cancelled}/${e.total}`)),
          // Why its pending tasks cannot start (no live node has the hardware, a gang short of nodes).
          ...(e.waiting ? [h("div", { class: "waiting", "data-waiting": name }, e.waiting)] : []),
        ]))));
}

function chooseWorkflow(wid) {
  ui.wid = wid;
  chooseTask(null);
  refresh();
}

function renderDag(dag, status) {
  const depth = {};
  const depthOf = (name) => {
    if (!(name in depth)) {
      const node = dag.find((d) => d.name === name);
      depth[name] = 0;
      depth[name] = node.after.length ? 1 + Math.max(...node.after.map(depthOf)) : 0;
    }
    return depth[name];
  };
  dag.forEach((d) => depthOf(d.name));
  const rows = {};
  const pos = {};
  const W = 170, H = 50, GX = 50, GY = 14;
  for (const d of dag) {
    const col = depth[d.name];
    const row = (rows[col] = (rows[col] || 0) + 1) - 1;
    pos[d.name] = { x: 8 + col * (W + GX), y: 8 + row * (H + GY) };
  }
  const width = 16 + (Math.max(...Object.values(depth)) + 1) * (W + GX);
  const height = 16 + Math.max(...Object.values(rows)) * (H + GY);
  const out = svg("svg", { width, height, id: "dag-svg" });
  for (const d of dag) {
    for (const dep of d.after) {
      const a = pos[dep], b = pos[d.name];
      out.append(svg("line", { x1: a.x + W, y1: a.y + H / 2, x2: b.x, y2: b.y + H / 2,
                               stroke: "#9aa3ad", "stroke-width": 1.5 }));
    }
  }
  const colors = { succeeded: "#d5f2dc", running: "#d6e8ff", failed: "#fbd8d8", cancelled: "#ece2c6", pending: "#eef0f3" };
  for (const d of dag) {
    const e = status.experiments[d.name];
    const p = pos[d.name];
    const done = e.succeeded + e.failed + e.cancelled;
    const g = svg("g", { "data-exp": d.name, "data-state": e.state });
    if (e.waiting) g.append(svg("title", {}, e.waiting));
    g.append(svg("rect", { x: p.x, y: p.y, width: W, height: H, rx: 6, fill: colors[e.state] || "#eee", stroke: "#9aa3ad" }));
    g.append(svg("text", { x: p.x + 8, y: p.y + 18 }, d.name + (d.cancelled ? " (cancelled)" : "")));
    g.append(svg("text", { x: p.x + 8, y: p.y + 36, fill: "#58606b" },
                 `${e.state} ${done}/${e.total}` + (d.workers !== null ? ` · ≤${d.workers}` : "")));
    out.append(g);
  }
  document.getElementById("dag").replaceChildren(out);
}

function renderTasks(tasks) {
  const body = document.querySelector("#tasks tbody");
  body.replaceChildren(...tasks.map((t) => {
    const last = t.attempts[t.attempts.length - 1] || {};
    return h("tr", { class: "pick" + (t.id === ui.task ? " chosen" : ""), "data-task": t.id,
                     "data-state": t.state, onclick: () => chooseTask(t.id) },
      h("td", {}, t.id), h("td", {}, badge(t.state)), h("td", {}, t.node || "-"),
      h("td", {}, t.attempts.length), h("td", {}, last.exit_code ?? "-"),
      h("td", { class: "muted" }, Object.entries(t.params).map(([k, v]) => `${k}=${v}`).join(" "),
        t.waiting ? h("div", { class: "waiting" }, t.waiting) : ""));
  }));
  const task = tasks.find((t) => t.id === ui.task);
  if (task) renderAttempts(task);
}

// ------------------------------------------------------------------ one task and its log
function chooseTask(id, attempt) {
  ui.task = id;
  ui.attempt = attempt || 0;
  ui.logOffset = 0;
  ui.logDone = false;
  document.getElementById("log").textContent = "";
  document.getElementById("log-note").textContent = "";
  document.getElementById("task-title").textContent = id || "(pick one above)";
  if (!id) document.querySelector("#attempts tbody").replaceChildren();
  refresh();
}

function renderAttempts(task) {
  const latest = task.attempts.length ? task.attempts[task.attempts.length - 1].attempt : 0;
  const shown = ui.attempt || latest;
  document.querySelector("#attempts tbody").replaceChildren(...task.attempts.map((a) =>
    h("tr", { class: "pick" + (a.attempt === shown ? " chosen" : ""), "data-attempt": a.attempt,
              onclick: () => chooseTask(task.id, a.attempt) },
      h("td", {}, a.attempt), h("td", {}, a.node), h("td", {}, badge(a.state)), h("td", {}, a.reason || "-"),
      h("td", {}, a.exit_code ?? "-"), h("td", {}, fmtTime(a.started_at)),
      h("td", {}, a.ended_at && a.started_at ? (a.ended_at - a.started_at).toFixed(1) + " s" : "-"))));
}

async function refreshLog() {
  if (!ui.task || ui.logDone) return;
  const key = `${ui.task}#${ui.attempt}`;
  ui.logKey = key;
  const url = `/api/logs/${encodeURIComponent(ui.task)}?attempt=${ui.attempt}&offset=${ui.logOffset}`;
  let data;
  try {
    data = await getJSON(url);
  } catch (err) {
    document.getElementById("log-note").textContent = String(err.message || err);
    return;
  }
  if (ui.logKey !== key) return; // the user picked another task meanwhile
  const log = document.getElementById("log");
  log.textContent += data.text;
  ui.logOffset = data.offset;
  if (!ui.attempt) ui.attempt = data.attempt;
  document.getElementById("log-note").textContent =
    `attempt ${data.attempt}${data.running ? " (running)" : ""}${data.note ? " · " + data.note : ""}`;
  if (!data.running && !data.text) ui.logDone = true;
}

// ------------------------------------------------------------------ nodes
const fmtRate = (n) => fmtBytes(Math.round(n || 0)) + "/s";
const known = (n) => n !== null && n !== undefined && n >= 0;

// A node's latest telemetry sample (null: it did not answer, or has not sampled yet).
function telemetryCell(n) {
  const s = n.telemetry;
  if (!s) return h("td", { class: "muted" }, n.address ? "no sample" : "-");
  const gpus = s.gpus.map((g) =>
    h("span", { class: "gpu", "data-gpu": g.index },
      `GPU${g.index} ${known(g.utilization_percent) ? g.utilization_percent.toFixed(0) + "%" : "?"} ` +
      `${known(g.memory_used_bytes) ? fmtBytes(g.memory_used_bytes) : "?"}` +
      (known(g.temperature_c) ? ` ${g.temperature_c.toFixed(0)}°C` : "")));
  return h("td", { class: "telemetry" },
    h("span", { class: "cpu", "data-cpu": s.cpu_percent.toFixed(1) }, `CPU ${s.cpu_percent.toFixed(0)}%`),
    ` load ${s.load1.toFixed(2)} · mem ${fmtBytes(s.memory_used_bytes)}/${fmtBytes(s.memory_total_bytes)}` +
    ` · disk ${fmtBytes(s.disk_used_bytes)}/${fmtBytes(s.disk_total_bytes)}` +
    ` · net ↓${fmtRate(s.net_recv_bytes_per_s)} ↑${fmtRate(s.net_sent_bytes_per_s)} `,
    gpus.length ? gpus : h("span", { class: "muted" }, n.nvml ? "" : "no NVML"));
}

function renderNodes(data) {
  document.getElementById("nodes-seen").textContent = `(gossip as seen by ${data.node})`;
  document.querySelector("#node-table tbody").replaceChildren(...data.nodes.map((n) =>
    h("tr", { "data-node": n.name },
      h("td", {}, n.name), h("td", {}, badge(n.state)), h("td", {}, badge(n.gossip)),
      h("td", {}, n.incarnation ?? "-"), h("td", {}, n.pool || "-"), h("td", {}, n.slots ?? "-"),
      h("td", {}, n.running), h("td", {}, n.gpus ?? "-"), h("td", {}, n.leader ? "★" : ""),
      telemetryCell(n),
      h("td", {}, n.http ? h("a", { href: `${location.protocol}//${n.http}/` }, n.http) : "-"))));
  const usage = data.nodes.flatMap((n) => (n.task_usage || []).map((u) => ({ ...u, node: n.name })));
  document.querySelector("#usage-table tbody").replaceChildren(...(usage.length ? usage.map((u) =>
    h("tr", { "data-usage": u.task_id, "data-cpu": u.cpu_percent.toFixed(1) },
      h("td", {}, u.task_id), h("td", {}, u.attempt), h("td", {}, u.node), h("td", {}, u.processes),
      h("td", {}, u.cpu_percent.toFixed(1)), h("td", {}, fmtBytes(u.rss_bytes)),
      h("td", {}, fmtBytes(u.gpu_memory_bytes)))) :
    [h("tr", {}, h("td", { class: "muted", colspan: 7 }, "no running tasks"))]));
  renderCacheMap(data.nodes);
}

// Shares of blocks read by source, as whole percentages ("-" before any read).
function hitText(rates) {
  if (!rates) return "-";
  return ["cache", "peer", "store"].map((s) => `${s} ${Math.round(100 * (rates[s] || 0))}%`).join(" · ");
}

function blockRates(c) {
  const total = c.cache_blocks + c.peer_blocks + c.store_blocks;
  return total ? { cache: c.cache_blocks / total, peer: c.peer_blocks / total, store: c.store_blocks / total } : null;
}

// The chunk-cache map: per node its bytes cached and hit rates by source, and under
// it each data set it caches (from the node's telemetry: absent if it did not answer).
function renderCacheMap(nodes) {
  const most = Math.max(1, ...nodes.map((n) => n.cached_bytes || 0),
                        ...nodes.flatMap((n) => (n.caches || []).map((c) => c.cached_bytes)));
  const bar = (bytes) => h("div", { class: "bar cache" },
    h("i", { style: `left:0;width:${(100 * (bytes || 0)) / most}%` }));
  document.querySelector("#cache-map tbody").replaceChildren(...nodes.flatMap((n) => [
    h("tr", { "data-cache": n.name },
      h("td", { style: "width:160px" }, h("b", {}, n.name)), h("td", {}, bar(n.cached_bytes)),
      h("td", { style: "width:100px" }, fmtBytes(n.cached_bytes)),
      h("td", { class: "hits" }, hitText(n.hit_rates))),
    ...(n.caches || []).map((c) =>
      h("tr", { "data-cache-set": `${n.name}/${c.dataset}`, "data-bytes": c.cached_bytes },
        h("td", { class: "muted", style: "padding-left:18px" }, c.dataset), h("td", {}, bar(c.cached_bytes)),
        h("td", {}, fmtBytes(c.cached_bytes)), h("td", { class: "hits muted" }, hitText(blockRates(c))))),
  ]));
}

// ------------------------------------------------------------------ loop
let busy = false;
async function refresh() {
  if (busy || document.hidden) return;
  busy = true;
  try {
    renderWorkflows(await getJSON("/api/workflows"));
    if (ui.wid) {
      const wf = await getJSON(`/api/workflows/${encodeURIComponent(ui.wid)}`);
      document.getElementById("wf-title").textContent = `${wf.status.name} ${wf.status.id} · ${wf.status.state}`;
      renderDag(wf.dag, wf.status);
      renderTasks(wf.tasks);
    }
    await refreshTrials(ui.wid); // trials.js: the chosen workflow's trials, every few seconds
    await refreshLog();
    renderNodes(await getJSON("/api/nodes"));
    document.getElementById("error").textContent = "";
  } catch (err) {
    document.getElementById("error").textContent = "agent not answering: " + (err.message || err);
  } finally {
    busy = false;
  }
}

setInterval(refresh, POLL_MS);
document.addEventListener("visibilitychange", refresh);
refresh();
