// specdec race: the lesson's Chapter 8 in one page, plain JS, no build step.
// No formula lives here: traces and predictions come from the server (specdec.race.sim and
// specdec.theory); this file only animates them and counts what it has shown.
"use strict";

const $ = (id) => document.getElementById(id);
const COLOR = { p: "#8c96a8", a: "#2f9e55", r: "#d64545", b: "#3b6fd6" };
const SVGNS = "http://www.w3.org/2000/svg";
let CONFIG = null;

async function api(path, options) {
  let res;
  try { res = await fetch(path, options); } catch (e) {  // no answer at all: the server has stopped
    throw new Error("cannot reach the race server (stopped?): start `specdec race` again, then reload this page");
  }
  let data;
  try { data = await res.json(); } catch (e) { data = { error: `${res.status} ${res.statusText}` }; }
  if (!res.ok) {
    const err = new Error((data && data.error) || `HTTP ${res.status}`);
    err.status = res.status; err.data = data;
    throw err;
  }
  return data;
}
const post = (path, body) => api(path, { method: "POST", headers: { "Content-Type": "application/json" },
                                         body: JSON.stringify(body) });
const fmt = (x, d = 2) => (x === null || x === undefined || !isFinite(x)) ? "–" : Number(x).toFixed(d);
// a count of positions: whole numbers as they are, a fractional budget's headroom (2.5) not rounded to 3
const fmtUnits = (x) => (x === null || x === undefined || !isFinite(x)) ? "–" : String(Math.round(x * 100) / 100);
function showError(id, message) { const e = $(id); e.textContent = message || ""; e.hidden = !message; }
function debounce(fn, ms) { let t = null; return (...a) => { clearTimeout(t); t = setTimeout(() => fn(...a), ms); }; }
function svg(tag, attrs, parent, text) {
  const el = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  if (parent) parent.appendChild(el);
  return el;
}

// --- token strips: one cell per token, a wider gap between rounds, scrolling up when full ------------
class Strip {
  constructor(canvas) { this.c = canvas; this.ctx = canvas.getContext("2d"); this.resize(); }
  resize() {
    const dpr = window.devicePixelRatio || 1;
    this.dpr = dpr; this.w = this.c.clientWidth || 600; this.h = this.c.clientHeight || 86;
    this.c.width = Math.round(this.w * dpr); this.c.height = Math.round(this.h * dpr);
    this.clear();
  }
  clear() {
    this.ctx.setTransform(this.dpr, 0, 0, this.dpr, 0, 0);
    this.ctx.clearRect(0, 0, this.w, this.h);
    this.x = 4; this.y = 4;
  }
  newline() {
    const row = 13;
    this.x = 4; this.y += row;
    if (this.y + 10 > this.h - 3) {  // scroll everything up one row
      const d = this.dpr, ctx = this.ctx;
      ctx.setTransform(1, 0, 0, 1, 0, 0);
      ctx.drawImage(this.c, 0, row * d, this.c.width, this.c.height - row * d, 0, 0, this.c.width, this.c.height - row * d);
      ctx.setTransform(d, 0, 0, d, 0, 0);
      this.y -= row;
      ctx.clearRect(0, this.y - 1, this.w, this.h - this.y + 1);
    }
  }
  round(codes) {
    if (this.x > 4) this.x += 3;
    for (const code of codes) {
      if (this.x + 6 > this.w - 4) this.newline();
      this.ctx.fillStyle = COLOR[code];
      this.ctx.fillRect(this.x, this.y, 6, 10);
      this.x += 7;
    }
  }
}

// --- the simulated race --------------------------------------------------------------------------
const SIM = { gen: 0, segment: 0, clock: 0, playing: false, last: 0, fetching: null, pred: null, hist: [],
              lanes: null, strips: null, shownAt: 0, resumeOnFix: false };
const KNOBS = ["alpha", "k", "tau", "occupancy", "budget", "step_ms", "seed"];

function newLane() { return { buf: [], i: 0, total: 0, lastEnd: 0, bufEnd: 0, segStart: 0, segTokens: 0, segRounds: 0 }; }

function params() {
  const num = (id) => { const v = $(id).value; return v === "" ? null : Number(v); };
  return { alpha: num("alpha"), k: num("k"), tau: num("tau"), occupancy: num("occupancy"),
           budget: num("budget"), step_ms: num("step_ms"), seed: num("seed") };
}
const speed = () => Number($("speed").value);
const horizon = () => Math.max(200, speed() * 5000);  // simulated ms per request: about 5 s of playback

function showOutputs() {
  for (const id of ["alpha", "k", "tau", "occupancy"]) {
    const out = document.querySelector(`output[for=${id}]`);
    const v = Number($(id).value);
    out.textContent = id === "tau" ? v.toFixed(3) : id === "alpha" ? v.toFixed(2) : String(v);
  }
}

async function fetchMore() {
  const gen = SIM.gen, v = SIM.lanes.v, s = SIM.lanes.s;
  SIM.fetching = gen;
  const body = { ...params(), segment: SIM.segment, start_vanilla_ms: v.bufEnd, start_spec_ms: s.bufEnd,
                 horizon_ms: horizon(), max_rounds: 4000 };
  try {
    const d = await post("/api/sim", body);
    if (gen !== SIM.gen) return;  // the knobs changed while it was on its way
    SIM.segment += 1;
    append(v, d.vanilla); append(s, d.spec);
    SIM.pred = d.prediction;
    showError("sim-error", "");
    showPrediction();
    if (SIM.resumeOnFix) { SIM.resumeOnFix = false; play(); }  // the knob that stopped it is valid again
  } catch (e) {
    if (gen !== SIM.gen) return;
    showError("sim-error", e.message);
    if (SIM.playing) SIM.resumeOnFix = true;  // an invalid knob pauses the race until it is fixed
    pause(false);
  } finally {
    if (SIM.fetching === gen) SIM.fetching = null;
  }
}

function append(lane, d) {
  for (let j = 0; j < d.end_ms.length; j++) lane.buf.push({ end: d.end_ms[j], acc: d.accepted[j], kind: d.kind[j] });
  if (d.end_ms.length) lane.bufEnd = d.end_ms[d.end_ms.length - 1];
}

function emit(lane, strip, isSpec) {
  while (lane.i < lane.buf.length && lane.buf[lane.i].end <= SIM.clock) {
    const r = lane.buf[lane.i++], n = r.acc + 1;
    lane.total += n; lane.segTokens += n; lane.segRounds += 1; lane.lastEnd = r.end;
    if (isSpec) SIM.hist[n] = (SIM.hist[n] || 0) + 1;
    strip.round(Array(r.acc).fill("a").concat([r.kind]));
  }
  if (lane.i > 4000) { lane.buf = lane.buf.slice(lane.i); lane.i = 0; }
}

function frame(now) {
  if (!SIM.playing) return;
  const dt = Math.min(now - SIM.last, 100);
  SIM.last = now;
  const v = SIM.lanes.v, s = SIM.lanes.s;
  const limit = Math.min(v.bufEnd, s.bufEnd);
  SIM.clock = Math.min(SIM.clock + dt * speed(), limit);
  emit(v, SIM.strips.v, false);
  emit(s, SIM.strips.s, true);
  if (SIM.fetching === null && limit - SIM.clock < horizon() / 2) fetchMore();
  if (now - SIM.shownAt > 120) { showReadouts(); SIM.shownAt = now; }
  requestAnimationFrame(frame);
}

function play() {
  SIM.resumeOnFix = false;
  if (SIM.playing) return;
  SIM.playing = true; SIM.last = performance.now();
  requestAnimationFrame(frame);
}
function pause(byUser = true) { if (byUser) SIM.resumeOnFix = false; SIM.playing = false; showReadouts(); }

function reset() {
  SIM.gen += 1; SIM.segment = 0; SIM.clock = 0; SIM.hist = []; SIM.pred = null;
  SIM.lanes = { v: newLane(), s: newLane() };
  SIM.strips.v.resize(); SIM.strips.s.resize();
  showReadouts();
  return fetchMore();
}

// A knob changed: keep what was shown, drop what was simulated ahead, go on from each lane's last round.
const knobsChanged = debounce(() => {
  SIM.gen += 1; SIM.hist = [];
  for (const lane of [SIM.lanes.v, SIM.lanes.s]) {
    lane.buf = []; lane.i = 0; lane.bufEnd = lane.lastEnd;
    lane.segStart = lane.lastEnd; lane.segTokens = 0; lane.segRounds = 0;
  }
  SIM.clock = Math.max(SIM.clock, Math.max(SIM.lanes.v.lastEnd, SIM.lanes.s.lastEnd));
  fetchMore().then(showReadouts);
  syncWidgets();
}, 120);

function showPrediction() {
  const p = SIM.pred;
  if (!p) return;
  $("r-predicted").textContent = `${fmt(p.speedup)}×`;
  $("r-predicted-sub").textContent = `at B = 0: ${fmt(p.speedup_free)}× · best k (0–${CONFIG.limits.k_max}) for these knobs: ${p.best_k}`;
  $("v-info").textContent = `${fmt(p.vanilla_ms, 2)} ms per token` +
    (p.vanilla_stretch > 1 ? ` (×${fmt(p.vanilla_stretch)} past the budget)` : "");
  $("s-info").textContent = `k = ${$("k").value}, ${fmt(p.round_ms, 2)} ms per round`;
  $("r-round").textContent = `${fmt(p.round_ms, 2)} ms`;
  $("r-round-sub").textContent = p.verify_stretch > 1 ? `verify stretched ×${fmt(p.verify_stretch, 3)}` : "verify flat (memory-bound)";
  $("r-round").parentElement.classList.toggle("warn", p.verify_stretch > 1);
  $("r-headroom").textContent = fmtUnits(p.headroom);
  const budget = Number($("budget").value);
  $("r-headroom-sub").textContent = `this pass: B + k + 1 = ${fmtUnits(p.demand)}` + (p.demand > budget ? " > budget: compute-bound" : " fits");
  $("r-headroom").parentElement.classList.toggle("warn", p.demand > budget);
  drawSurface();
}

function rate(lane) { const span = SIM.clock - lane.segStart; return span > 0 ? lane.segTokens / span : 0; }

function showReadouts() {
  const v = SIM.lanes.v, s = SIM.lanes.s;
  $("v-tokens").textContent = v.total; $("s-tokens").textContent = s.total;
  const lead = Math.max(v.total, s.total, 1);
  $("v-bar").style.width = `${100 * v.total / lead}%`;
  $("s-bar").style.width = `${100 * s.total / lead}%`;
  $("r-time").textContent = SIM.clock < 1000 ? `${SIM.clock.toFixed(0)} ms` : `${(SIM.clock / 1000).toFixed(2)} s`;
  const rv = rate(v), rs = rate(s);
  $("r-measured").textContent = rv > 0 && s.segRounds > 0 ? `${fmt(rs / rv)}×` : "–";
  $("r-mean").textContent = s.segRounds ? fmt(s.segTokens / s.segRounds) : "–";
  $("r-mean-sub").textContent = SIM.pred ? `formula: ${fmt(SIM.pred.expected_tokens)} · ${s.segRounds} rounds` : "";
  drawHistogram();
}

function drawHistogram() {
  const el = $("hist");
  el.replaceChildren();
  const k = Number($("k").value), n = k + 1, rounds = SIM.lanes.s.segRounds;
  const dist = SIM.pred ? SIM.pred.distribution : [];
  const W = Math.max(300, Math.round(el.clientWidth || 900)), H = 130, left = 30, bottom = 18, top = 6;
  el.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const cw = (W - left - 6) / n, maxP = Math.max(0.05, ...dist, ...Array.from({ length: n }, (_, j) => (SIM.hist[j + 1] || 0) / Math.max(rounds, 1)));
  const y = (p) => top + (H - top - bottom) * (1 - p / maxP);
  svg("line", { x1: left, y1: H - bottom, x2: W - 4, y2: H - bottom, class: "axis" }, el);
  for (const p of [0, maxP / 2, maxP]) svg("text", { x: left - 4, y: y(p) + 3, "text-anchor": "end" }, el, `${Math.round(p * 100)}%`);
  for (let j = 0; j < n; j++) {
    const m = rounds ? (SIM.hist[j + 1] || 0) / rounds : 0, x = left + j * cw;
    const code = j === n - 1 && k > 0 ? "b" : k === 0 ? "p" : "a";
    svg("rect", { x: x + cw * 0.18, y: y(m), width: cw * 0.64, height: H - bottom - y(m), fill: COLOR[code], opacity: 0.75 }, el);
    if (dist[j] !== undefined) svg("line", { x1: x + cw * 0.1, x2: x + cw * 0.9, y1: y(dist[j]), y2: y(dist[j]), stroke: "#1d2330", "stroke-width": 2 }, el);
    svg("text", { x: x + cw / 2, y: H - 5, "text-anchor": "middle" }, el, String(j + 1));
  }
}

function applyPreset() {
  const p = CONFIG.presets.find((x) => x.key === $("preset").value);
  if (p) { $("alpha").value = p.alpha; $("tau").value = p.tau; $("preset-note").textContent = `α = ${p.alpha}, τ = ${p.tau}: ${p.source}`; }
  showOutputs();
  knobsChanged();
}

function matchPreset() {
  const a = Number($("alpha").value), t = Number($("tau").value);
  const p = CONFIG.presets.find((x) => Math.abs(x.alpha - a) < 1e-9 && Math.abs(x.tau - t) < 1e-9);
  $("preset").value = p ? p.key : "custom";
  $("preset-note").textContent = p ? `α = ${p.alpha}, τ = ${p.tau}: ${p.source}` : "your own α and τ";
}

function applySource(which) {
  const src = $(`${which === "budget" ? "budget" : "step"}-src`).value;
  const value = src === "measured" && CONFIG.measured ? CONFIG.measured[which] : CONFIG.lesson[which];
  $(which).value = value;
  knobsChanged();
}

function setupSim() {
  const d = CONFIG.defaults, sel = $("preset");
  for (const p of CONFIG.presets) sel.add(new Option(`${p.label} (α ${p.alpha})`, p.key));
  sel.add(new Option("custom", "custom"));
  for (const key of KNOBS) $(key).value = d[key];
  $("k").max = CONFIG.limits.k_max; $("occupancy").max = CONFIG.limits.occupancy_max;
  matchPreset(); showOutputs();
  if (CONFIG.measured) {
    $("measured-note").textContent = `measured: budget ${CONFIG.measured.budget}, step ${CONFIG.measured.step_ms} ms (${CONFIG.measured.source})`;
  } else {
    for (const id of ["budget-src", "step-src"]) $(id).options[1].disabled = true;
    $("measured-note").textContent = CONFIG.model ? `no measurement yet: \`specdec probe --model ${CONFIG.model}\` gives this machine's budget and step` : "";
  }
  sel.addEventListener("change", applyPreset);
  for (const key of KNOBS) $(key).addEventListener("input", () => { showOutputs(); if (key === "alpha" || key === "tau") matchPreset(); knobsChanged(); });
  $("budget-src").addEventListener("change", () => applySource("budget"));
  $("step-src").addEventListener("change", () => applySource("step_ms"));
  $("play").addEventListener("click", play);
  $("pause").addEventListener("click", () => pause());
  $("reset").addEventListener("click", () => {
    const was = SIM.playing || SIM.resumeOnFix;
    pause();
    reset().then(() => { if (was && SIM.pred) play(); else if (was) SIM.resumeOnFix = true; });
  });
  SIM.strips = { v: new Strip($("v-canvas")), s: new Strip($("s-canvas")) };
  window.addEventListener("resize", debounce(() => { SIM.strips.v.resize(); SIM.strips.s.resize(); }, 200));
  return reset();
}

// --- the live race -----------------------------------------------------------------------------
const LIVE = { id: null, timer: null, lanes: null, raf: null };

function setupLive() {
  const sel = $("method");
  for (const m of CONFIG.methods) {
    if (m.name === "plain") continue;
    sel.add(new Option(m.available ? m.name : `${m.name} (unavailable)`, m.name));
  }
  if ([...sel.options].some((o) => o.value === "prompt-lookup")) sel.value = "prompt-lookup";
  const note = () => { const m = CONFIG.methods.find((x) => x.name === sel.value); $("method-note").textContent = m ? m.note : ""; };
  sel.addEventListener("change", note); note();
  if (!CONFIG.model) { $("go").disabled = true; showError("live-error", "this server has no model: start `specdec race --model NAME`"); }
  $("go").addEventListener("click", go);
  $("cancel").addEventListener("click", () => LIVE.id && post(`/api/live/${LIVE.id}/cancel`, {}).catch((e) => showError("live-error", e.message)));
  $("replay").addEventListener("click", replay);
  if (CONFIG.model) followRunning();
}

function liveBody() {
  const kText = $("live-k").value.trim();
  const k = kText === "auto" ? "auto" : /^\d+$/.test(kText) ? Number(kText) : kText;
  const num = (id) => ($(id).value === "" ? null : Number($(id).value));
  return { prompt: $("prompt").value, method: $("method").value, k, max_new_tokens: num("max-new"), temperature: num("temperature") };
}

function follow(race) {
  clearInterval(LIVE.timer);
  LIVE.id = race.id;
  $("go").disabled = true; $("cancel").disabled = false; $("replay").disabled = true;
  $("live-progress").hidden = false;
  progress(race);
  LIVE.timer = setInterval(poll, 250);
}

async function go() {
  showError("live-error", "");
  try {
    follow(await post("/api/live", liveBody()));
  } catch (e) {
    if (e.status === 409 && e.data && e.data.race_id != null) {  // started elsewhere: show it, let Cancel stop it
      try {
        const race = await api(`/api/live/${e.data.race_id}`);
        if (!["done", "error", "cancelled"].includes(race.state)) {
          follow(race);
          showError("live-error", `${e.message} (started from another tab or before a reload): following it here; Cancel stops it`);
          return;
        }
      } catch (e2) { /* gone meanwhile: say what the server said */ }
    }
    showError("live-error", e.message);
  }
}

async function followRunning() {  // a reload (or a second tab) while a race runs: follow it instead of a 409
  try {
    const d = await api("/api/live");
    if (d.race && !LIVE.timer) follow(d.race);
  } catch (e) { /* an older server without GET /api/live: Go reports a running race */ }
}

function progress(d) {
  const total = 2 * d.max_new_tokens;
  const done = (d.lane && d.lane !== "plain" ? d.max_new_tokens : 0) + d.tokens;
  $("live-fill").style.width = `${Math.min(100, 100 * done / total)}%`;
  $("live-phase").textContent = d.state === "running" ? `${d.lane}: ${d.tokens} / ${d.max_new_tokens} tokens` : d.phase || d.state;
}

async function poll() {
  let d;
  try { d = await api(`/api/live/${LIVE.id}`); } catch (e) { showError("live-error", e.message); return stopPolling(); }
  progress(d);
  if (!["done", "error", "cancelled"].includes(d.state)) return;
  stopPolling();
  showError("live-error", "");
  if (d.state === "error") { showError("live-error", d.error); clearLanes(); }
  if (d.state === "cancelled") { $("live-phase").textContent = "cancelled"; LIVE.id = null; }
  if (d.state === "done") { LIVE.lanes = d.lanes; LIVE.method = d.method; $("live-progress").hidden = true; replay(); }
}
function clearLanes() {  // a failed race: nothing of the previous one may stand beside its error
  cancelAnimationFrame(LIVE.raf);
  LIVE.lanes = null;
  $("live-progress").hidden = true; $("replay").disabled = true;
  for (const id of ["lp-text", "lm-text", "lp-stats", "lm-stats"]) $(id).replaceChildren();
  for (const id of ["lp-clock", "lm-clock", "live-summary"]) $(id).textContent = "";
}
function stopPolling() { clearInterval(LIVE.timer); LIVE.timer = null; $("go").disabled = false; $("cancel").disabled = true; }

function laneStats(el, r, plain) {
  const rows = [["tokens/s", fmt(r.tokens_per_s, 1)], ["tokens", r.new_tokens], ["seconds", fmt(r.seconds, 2)],
                ["mean accepted", fmt(r.mean_accepted)], ["α", plain || !r.drafted ? "–" : fmt(r.acceptance_rate)],
                ["target forwards", r.target_forwards]];
  el.replaceChildren();
  for (const [label, value] of rows) { const d = document.createElement("div"); d.innerHTML = `<b></b> <span class="dim"></span>`; d.firstChild.textContent = value; d.lastChild.textContent = label; el.appendChild(d); }
}

function replay() {
  if (!LIVE.lanes) return;
  cancelAnimationFrame(LIVE.raf);
  const plain = LIVE.lanes.plain, method = LIVE.lanes[LIVE.method];
  $("lm-name").textContent = LIVE.method;
  const lanes = [[plain, $("lp-text"), $("lp-clock")], [method, $("lm-text"), $("lm-clock")]];
  for (const [lane, text] of lanes) { text.replaceChildren(); lane.i = 0; }
  laneStats($("lp-stats"), plain.result, true);
  laneStats($("lm-stats"), method.result, false);
  const ratio = plain.result.tokens_per_s > 0 ? method.result.tokens_per_s / plain.result.tokens_per_s : NaN;
  $("live-summary").textContent = `${LIVE.method}: ${fmt(ratio)}× the plain lane's tokens/s`;
  $("replay").disabled = false;
  const t0 = performance.now();
  const step = (now) => {
    const t = (now - t0) / 1000;
    let running = false;
    for (const [lane, text, clock] of lanes) {
      while (lane.i < lane.t.length && lane.t[lane.i] <= t) {
        const span = document.createElement("span");
        span.className = `tok ${lane.kind[lane.i]}`;
        span.textContent = lane.text[lane.i];
        text.appendChild(span);
        lane.i += 1;
      }
      const end = lane.t.length ? lane.t[lane.t.length - 1] : 0;
      clock.textContent = lane.i < lane.t.length ? `t = ${t.toFixed(2)} s` : `finished in ${end.toFixed(2)} s`;
      text.scrollTop = text.scrollHeight;
      running = running || lane.i < lane.t.length;
    }
    if (running) LIVE.raf = requestAnimationFrame(step);
  };
  LIVE.raf = requestAnimationFrame(step);
}

// --- widgets ---------------------------------------------------------------------------------------
const W = { surface: null };

function heat(s, lo, hi) {  // white at 1x, green above, red below
  if (s >= 1) { const f = Math.min(1, Math.log(s) / Math.log(Math.max(hi, 1.01))); return `rgb(${Math.round(255 - 208 * f)},${Math.round(255 - 97 * f)},${Math.round(255 - 170 * f)})`; }
  const f = Math.min(1, (1 - s) / Math.max(1 - lo, 0.01));
  return `rgb(${Math.round(255 - 41 * f)},${Math.round(255 - 186 * f)},${Math.round(255 - 186 * f)})`;
}

async function loadSurface() {
  try { W.surface = await api(`/api/surface?tau=${encodeURIComponent($("w-tau").value)}&k_max=10`); drawSurface(); }
  catch (e) { W.surface = null; $("surface").replaceChildren(); svg("text", { x: 10, y: 20 }, $("surface"), e.message); }
}

function drawSurface() {
  const d = W.surface, el = $("surface");
  if (!d) return;
  el.replaceChildren();
  const left = 30, top = 8, right = 8, bottom = 30, Wd = 440, H = 270;
  const na = d.alphas.length, nk = d.ks.length, cw = (Wd - left - right) / na, ch = (H - top - bottom) / nk;
  const all = d.speedup.flat(), lo = Math.min(...all), hi = Math.max(...all);
  for (let ki = 0; ki < nk; ki++) {
    for (let ai = 0; ai < na; ai++) {
      const s = d.speedup[ki][ai], x = left + ai * cw, y = top + (nk - 1 - ki) * ch;
      const best = d.best_k[ai] === d.ks[ki];
      const r = svg("rect", { x, y, width: cw + 0.5, height: ch + 0.5, fill: heat(s, lo, hi) }, el);
      if (best) r.setAttribute("stroke", "#1d2330");
      svg("title", {}, r, `α ${d.alphas[ai]}, k ${d.ks[ki]}: ${fmt(s)}×`);
    }
    svg("text", { x: left - 5, y: top + (nk - 1 - ki) * ch + ch / 2 + 3, "text-anchor": "end" }, el, String(d.ks[ki]));
  }
  for (let ai = 0; ai < na; ai += Math.max(1, Math.round((na - 1) / 5))) {
    svg("text", { x: left + ai * cw + cw / 2, y: H - bottom + 12, "text-anchor": "middle" }, el, String(d.alphas[ai]));
  }
  svg("text", { x: left + (Wd - left) / 2, y: H - 4, "text-anchor": "middle" }, el, `α (acceptance rate) — τ = ${d.tau}, max ${fmt(hi)}×`);
  svg("text", { x: 10, y: top + (H - top - bottom) / 2, transform: `rotate(-90 10 ${top + (H - top - bottom) / 2})`, "text-anchor": "middle" }, el, "k");
  const a = Number($("alpha").value), k = Number($("k").value);
  if (k <= d.ks[nk - 1]) {
    const ai = Math.round(a * (na - 1));
    svg("circle", { cx: left + ai * cw + cw / 2, cy: top + (nk - 1 - k) * ch + ch / 2, r: Math.min(cw, ch) / 3.2, fill: "#1d2330" }, el);
  }
}

async function loadRounds() {
  const el = $("rounds");
  try {
    const d = await api(`/api/rounds?alpha=${encodeURIComponent($("w-alpha").value)}&k=${encodeURIComponent($("w-k").value)}`);
    el.replaceChildren();
    const Wd = 440, H = 230, left = 34, bottom = 22, top = 30, n = d.tokens.length, cw = (Wd - left - 6) / n;
    const maxP = Math.max(...d.probability, 0.05), y = (p) => top + (H - top - bottom) * (1 - p / maxP);
    svg("line", { x1: left, y1: H - bottom, x2: Wd - 4, y2: H - bottom, class: "axis" }, el);
    d.probability.forEach((p, j) => {
      const x = left + j * cw, code = d.k === 0 ? "p" : j === n - 1 ? "b" : "a";
      svg("rect", { x: x + cw * 0.15, y: y(p), width: cw * 0.7, height: H - bottom - y(p), fill: COLOR[code] }, el);
      svg("text", { x: x + cw / 2, y: y(p) - 3, "text-anchor": "middle" }, el, `${(100 * p).toFixed(1)}%`);
      svg("text", { x: x + cw / 2, y: H - 7, "text-anchor": "middle" }, el, String(d.tokens[j]));
    });
    svg("text", { x: 4, y: 11 }, el, "P(a round emits n tokens)");
    $("rounds-note").textContent = d.k === 0 ? `E[tokens per round] = ${fmt(d.expected, 4)} · k = 0: every round is one plain step (no drafts, no bonus)`
      : `E[tokens per round] = ${fmt(d.expected, 4)} · all k accepted plus the bonus (blue): ${(100 * d.full_burst).toFixed(2)}% of rounds`;
  } catch (e) { el.replaceChildren(); $("rounds-note").textContent = e.message; }
}

async function loadHeadroom() {
  const el = $("headroom"), q = new URLSearchParams({ budget: $("h-budget").value, occupancy: $("h-occ").value,
    k: $("h-k").value, interactive: $("h-chats").value, batch: $("h-batch").value });
  try {
    const d = await api(`/api/headroom?${q}`);
    el.replaceChildren();
    const Wd = 440, H = 185, left = 36, bottom = 34, top = 8, xmax = d.curve[d.curve.length - 1].occupancy;
    const ys = d.curve.map((c) => c.headroom), ymax = Math.max(...ys, 1), ymin = Math.min(...ys, 0);
    const x = (b) => left + (Wd - left - 8) * b / xmax, y = (h) => top + (H - top - bottom) * (ymax - h) / (ymax - ymin);
    svg("line", { x1: left, y1: y(0), x2: Wd - 8, y2: y(0), class: "axis" }, el);
    svg("path", { d: d.curve.map((c, j) => `${j ? "L" : "M"}${x(c.occupancy)},${y(c.headroom)}`).join(""), fill: "none", stroke: "#2b5fce", "stroke-width": 2 }, el);
    if (ymin < 0) svg("rect", { x: x(d.budget), y: y(0), width: Math.max(0, Wd - 8 - x(d.budget)), height: y(ymin) - y(0), fill: "#d64545", opacity: 0.1 }, el);
    for (const b of [0, 50, 100, 150, 200].filter((b) => b <= xmax)) svg("text", { x: x(b), y: H - bottom + 13, "text-anchor": "middle" }, el, String(b));
    for (const h of [ymin, 0, ymax]) svg("text", { x: left - 4, y: y(h) + 3, "text-anchor": "end" }, el, String(Math.round(h)));
    svg("line", { x1: x(d.occupancy), x2: x(d.occupancy), y1: top, y2: H - bottom, stroke: "#1d2330", "stroke-dasharray": "3 3" }, el);
    svg("circle", { cx: x(d.occupancy), cy: y(d.headroom), r: 4, fill: "#1d2330" }, el);
    const right = x(d.occupancy) > Wd / 2;
    svg("text", { x: x(d.occupancy) + (right ? -6 : 6), y: top + 12, "text-anchor": right ? "end" : "start" }, el,
        `B = ${d.occupancy}: ${fmt(d.headroom, 0)} left, ${d.fit} fit at k = ${d.k}`);
    svg("text", { x: left + (Wd - left) / 2, y: H - 4, "text-anchor": "middle" }, el, `batch occupancy B (headroom = ${d.budget} − B; red: past the budget)`);
    const alloc = $("alloc");
    alloc.replaceChildren();
    for (const s of d.allocation) {
      const c = document.createElement("span");
      c.className = `chip${s.granted ? " on" : ""}${s.interactive ? "" : " batch"}`;
      c.textContent = `${s.name}: k=${s.granted}`;
      alloc.appendChild(c);
    }
    const got = d.allocation.filter((s) => s.granted).length;
    $("alloc-note").textContent = `Priority allocation (Ch. 7): ${fmt(d.headroom, 0)} units of headroom, ${d.cost_per_request} per request at k = ${d.k}: ` +
      `${got} of ${d.allocation.length} sessions speculate (${d.used} units), interactive first; the rest drop to plain decoding for this step. ` +
      `Everyone at k = ${d.k} would need B + ${d.allocation.length}×${d.cost_per_request} = ${fmt(d.demand_if_all, 0)} of ${d.budget}.`;
  } catch (e) { el.replaceChildren(); $("alloc").replaceChildren(); $("alloc-note").textContent = e.message; }
}

function syncWidgets() {  // the bursts widget follows the race's alpha and k
  $("w-alpha").value = $("alpha").value; $("w-k").value = $("k").value;
  loadRounds(); drawSurface();
}

function setupWidgets() {
  $("w-tau").addEventListener("input", debounce(loadSurface, 150));
  for (const id of ["w-alpha", "w-k"]) $(id).addEventListener("input", debounce(loadRounds, 150));
  for (const id of ["h-budget", "h-occ", "h-k", "h-chats", "h-batch"]) $(id).addEventListener("input", debounce(loadHeadroom, 150));
  $("w-alpha").value = $("alpha").value; $("w-k").value = $("k").value;
  return Promise.all([loadSurface(), loadRounds(), loadHeadroom()]);
}

async function main() {
  try { CONFIG = await api("/api/config"); } catch (e) { showError("sim-error", `cannot reach the server: ${e.message}`); return; }
  $("model-name").textContent = CONFIG.model || "none";
  setupLive();
  await setupSim();
  await setupWidgets();
  document.body.dataset.ready = "1";
}
main();
