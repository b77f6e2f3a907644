// The trials view of the dashboard: for an experiment with metrics, its trials in a table
// sortable by any column, the objective's curves of the chosen trials on one chart, and
// the parameters against the objective in parallel coordinates (as Optuna's dashboard
// and TensorBoard's HParams show them). Pruned trials are dashed, failed ones dotted.
// Charts by Apache ECharts (vendor/echarts.min.js); h(), badge() and getJSON() are app.js's.
"use strict";

const TRIALS_POLL_MS = 3000; // the view asks again at most this often (not every poll)
const FIRST_CHOSEN = 8; // trials whose curves show before the user picks any
const LINE_TYPE = { pruned: "dashed", failed: "dotted" };
const STATE_COLOR = { running: "#8a929c", pruned: "#e08a00", failed: "#d64545" };
const trialsUi = { wid: null, exp: "", metric: "", goal: "", sort: null, dir: 1,
                   chosen: null, data: null, text: "", fetched: 0, charts: {} };

function trialsUrl() {
  const q = new URLSearchParams();
  for (const k of ["exp", "metric", "goal"]) {
    if (trialsUi[k]) q.set(k === "exp" ? "experiment" : k, trialsUi[k]);
  }
  return `/api/workflows/${encodeURIComponent(trialsUi.wid)}/trials?${q}`;
}

function resetTrials(wid) {
  Object.assign(trialsUi, { wid, exp: "", metric: "", goal: "", sort: null, dir: 1,
                            chosen: null, data: null, text: "", fetched: 0 });
  document.getElementById("trials").hidden = true;
}

// Called by app.js's refresh with the chosen workflow (null: none); asks the agent
// every TRIALS_POLL_MS at most (now with `force`) and redraws only what changed.
async function refreshTrials(wid, force) {
  if (wid !== trialsUi.wid) resetTrials(wid);
  if (!wid || (!force && Date.now() - trialsUi.fetched < TRIALS_POLL_MS)) return;
  trialsUi.fetched = Date.now();
  const url = trialsUrl();
  const data = await getJSON(url);
  if (wid !== trialsUi.wid || url !== trialsUrl()) return; // the user chose another meanwhile
  const text = JSON.stringify(data);
  if (text === trialsUi.text) return;
  trialsUi.text = text;
  trialsUi.data = data;
  renderTrials();
}

const fmtNum = (v) => (v === null || v === undefined ? "-" :
  typeof v === "number" ? String(Number(v.toPrecision(6))) : String(v));
const trialName = (t) => `#${t.index}` + (t.rank ? ` (${t.rank})` : ` ${t.state}`);

function renderTrials() {
  const data = trialsUi.data;
  const section = document.getElementById("trials");
  section.hidden = !data.experiment;
  if (!data.experiment) return;
  if (trialsUi.chosen === null) {
    trialsUi.chosen = new Set(data.trials.filter((t) => t.curve && t.curve.length)
      .slice(0, FIRST_CHOSEN).map((t) => t.task));
  }
  renderChoices(data);
  renderTrialTable(data);
  renderCharts(data);
}

function choice(id, values, current, onchange) {
  const el = document.getElementById(id);
  el.replaceChildren(...values.map((v) => h("option", { value: v }, v)));
  el.value = current;
  el.onchange = () => { onchange(el.value); trialsUi.chosen = null; refreshTrials(trialsUi.wid, true); };
}

function renderChoices(data) {
  const obj = data.objective;
  choice("trials-exp", data.experiments.map((e) => e.name), data.experiment, (v) => {
    Object.assign(trialsUi, { exp: v, metric: "", goal: "", sort: null });
  });
  const metrics = obj && !data.metrics.includes(obj.metric) ? [obj.metric, ...data.metrics] : data.metrics;
  choice("trials-metric", metrics, obj ? obj.metric : "", (v) => { trialsUi.metric = v; trialsUi.goal = ""; });
  choice("trials-goal", ["minimize", "maximize"], obj ? obj.goal : "minimize", (v) => {
    trialsUi.goal = v;
    trialsUi.metric = trialsUi.metric || (obj ? obj.metric : "");
  });
  const s = data.states || {};
  document.getElementById("trials-note").textContent = !obj ? "no metric reported yet" :
    `${data.total} trials: ${s.complete} complete, ${s.pruned} pruned, ${s.failed} failed, ` +
    `${s.running} running` + (data.declared ? "" : " · no objective in the recipe") +
    (data.trials.length < data.total ? ` · the best ${data.trials.length} listed` : "");
}

// ------------------------------------------------------------------ table
function trialColumns(data) {
  const metric = data.objective ? data.objective.metric : "";
  return [
    { key: "rank", label: "#", get: (t) => t.rank },
    { key: "index", label: "trial", get: (t) => t.index },
    { key: "state", label: "state", get: (t) => t.state },
    { key: "value", label: metric, get: (t) => t.value, cls: "objective" },
    ...data.params.map((p) => ({ key: "param:" + p, label: p, get: (t) => t.params[p] })),
    ...data.metrics.filter((m) => m !== metric)
      .map((m) => ({ key: "metric:" + m, label: m, get: (t) => t.metrics[m], cls: "muted" })),
  ];
}

function sortedTrials(trials, col, dir) {
  if (!col) return trials; // as the agent ranks them: best first, then the others by index
  const missing = (v) => v === null || v === undefined;
  return [...trials].sort((a, b) => {
    const x = col.get(a), y = col.get(b);
    if (missing(x) || missing(y)) return missing(x) - missing(y); // missing last, either way
    return dir * (typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y)));
  });
}

function renderTrialTable(data) {
  const cols = trialColumns(data);
  const col = cols.find((c) => c.key === trialsUi.sort);
  document.querySelector("#trial-table thead").replaceChildren(h("tr", {}, h("th", {}, ""),
    ...cols.map((c) => h("th", { class: "sortable", "data-sort": c.key, onclick: () => sortTrials(c.key) },
      c.label, c.key === trialsUi.sort ? (trialsUi.dir > 0 ? " ▲" : " ▼") : ""))));
  document.querySelector("#trial-table tbody").replaceChildren(...sortedTrials(data.trials, col, trialsUi.dir).map((t) => {
    const chosen = trialsUi.chosen.has(t.task);
    const box = h("input", { type: "checkbox", title: t.curve ? "show its curve" : "curve not sent (not among the best)" });
    box.checked = chosen;
    box.disabled = !t.curve;
    return h("tr", { class: `pick trial ${t.state}` + (chosen ? " chosen" : ""), "data-task": t.task,
                     "data-state": t.state, "data-index": t.index, onclick: () => chooseTrial(t) },
      h("td", {}, box), ...cols.map((c) =>
        h("td", { class: c.cls || null, "data-col": c.key }, c.key === "state" ? badge(t.state) : fmtNum(c.get(t)))));
  }));
}

function sortTrials(key) {
  trialsUi.dir = trialsUi.sort === key ? -trialsUi.dir : 1;
  trialsUi.sort = key;
  renderTrialTable(trialsUi.data);
}

function chooseTrial(t) {
  if (!t.curve) return;
  if (!trialsUi.chosen.delete(t.task)) trialsUi.chosen.add(t.task);
  renderTrialTable(trialsUi.data);
  renderCharts(trialsUi.data);
}

// ------------------------------------------------------------------ charts
function chart(id) {
  const el = document.getElementById(id);
  if (!window.echarts) {
    el.textContent = "charts unavailable (vendor/echarts.min.js did not load)";
    return null;
  }
  if (!trialsUi.charts[id]) trialsUi.charts[id] = echarts.init(el);
  return trialsUi.charts[id];
}

function renderCharts(data) {
  if (!data.objective) return;
  const curves = chart("trials-curves");
  const parallel = chart("trials-parallel");
  if (!curves || !parallel) return;
  const option = curvesOption(data);
  curves.setOption(option, true);
  document.getElementById("trials-curves").dataset.series = option.series.length;
  const par = parallelOption(data);
  parallel.setOption(par, true);
  document.getElementById("trials-parallel").dataset.lines =
    par.series.reduce((n, s) => n + s.data.length, 0);
}

function curvesOption(data) {
  const { metric, goal } = data.objective;
  const shown = data.trials.filter((t) => t.curve && trialsUi.chosen.has(t.task));
  return {
    animation: false,
    title: { text: `${metric} per step (${goal})`, left: 0, textStyle: { fontSize: 13 } },
    tooltip: { trigger: "axis", valueFormatter: fmtNum },
    legend: { type: "scroll", top: 22, left: 0, right: 0 },
    grid: { left: 56, right: 56, top: 58, bottom: 36 },
    xAxis: { type: "value", name: "step", nameLocation: "middle", nameGap: 24, minInterval: 1 },
    yAxis: { type: "value", scale: true },
    series: shown.map((t) => ({
      name: trialName(t), type: "line", data: t.curve, showSymbol: t.curve.length <= 30, symbolSize: 5,
      lineStyle: { width: 2, type: LINE_TYPE[t.state] || "solid" },
      endLabel: { show: t.state in LINE_TYPE, formatter: t.state, color: STATE_COLOR[t.state] },
    })),
  };
}

// A log axis for a positive parameter spanning 20x or more (a learning rate, a decay).
function logScale(values) {
  const v = values.filter((x) => typeof x === "number");
  return v.length > 0 && Math.min(...v) > 0 && Math.max(...v) / Math.min(...v) >= 20;
}

function parallelOption(data) {
  const { metric, goal } = data.objective;
  const params = data.params;
  const rows = data.trials.filter((t) => t.value !== null && t.value !== undefined);
  const isCategory = params.map((p) => rows.some((t) => typeof t.params[p] !== "number"));
  const axes = params.map((p, i) => (isCategory[i]
    ? { dim: i, name: p, type: "category", data: [...new Set(rows.map((t) => fmtNum(t.params[p])))] }
    : { dim: i, name: p, type: logScale(rows.map((t) => t.params[p])) ? "log" : "value", scale: true }));
  // No lines run left of the first axis: its labels go there, clear of them (a parallel
  // axis ignores axisLabel.inside, so a negative margin and right-aligned text).
  if (axes.length) axes[0].axisLabel = { margin: -8, align: "right" };
  axes.push({ dim: params.length, name: metric, type: "value", scale: true,
              nameTextStyle: { fontWeight: "bold" }, inverse: goal === "maximize" });
  const values = (t) => [...params.map((p, i) => (isCategory[i] ? fmtNum(t.params[p]) : t.params[p] ?? null)), t.value];
  const complete = rows.filter((t) => t.state === "complete").map((t) => t.value);
  const series = ["complete", "running", "pruned", "failed"].map((state) => ({
    name: state, type: "parallel", smooth: false,
    lineStyle: { width: 1.5, opacity: 0.85, color: STATE_COLOR[state], type: LINE_TYPE[state] || "solid" },
    emphasis: { lineStyle: { width: 3, opacity: 1 } },
    data: rows.filter((t) => t.state === state).map((t) => ({
      name: trialName(t), value: values(t),
      lineStyle: trialsUi.chosen.has(t.task) ? { width: 3, opacity: 1 } : { opacity: 0.45 },
    })),
  })).filter((s) => s.data.length);
  const lows = goal === "minimize";
  return {
    animation: false,
    title: { text: `parameters → ${metric}`, left: 0, textStyle: { fontSize: 13 } },
    tooltip: { trigger: "item", formatter: (p) => `${p.name}: ${metric} ${fmtNum(p.value[params.length])}` },
    legend: { top: 22, left: 0 },
    // The axes above the lines (z 3 over the series' 2), their labels on a white box, so that
    // "adam" or "0.01" stay readable where the lines cross them.
    parallel: { left: 72, right: 110, top: 72, bottom: 28, parallelAxisDefault: {
      nameGap: 14, z: 3,
      axisLabel: { backgroundColor: "#fff", padding: [1, 3], borderRadius: 2 },
    } },
    parallelAxis: axes,
    // Complete trials coloured by the objective, the best darkest (on the series 0 only).
    visualMap: complete.length && series[0].name === "complete" ? {
      type: "continuous", seriesIndex: 0, dimension: params.length, right: 4, top: "middle",
      min: Math.min(...complete), max: Math.max(...complete), itemHeight: 110, calculable: false,
      text: [lows ? "worse" : "better", lows ? "better" : "worse"], precision: 3,
      inRange: { color: lows ? ["#08306b", "#4292c6", "#c6dbef"] : ["#c6dbef", "#4292c6", "#08306b"] },
    } : undefined,
    series,
  };
}

window.addEventListener("resize", () => Object.values(trialsUi.charts).forEach((c) => c.resize()));
