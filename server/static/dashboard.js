// The dashboard: polls /v1/stats every 2 s and draws the last minutes of the
// engine's metrics as inline SVG line charts (no chart library), per model.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const COLORS = ["#6366f1", "#f59e0b", "#10b981", "#ef4444", "#06b6d4", "#a855f7"];
  const NS = "http://www.w3.org/2000/svg";
  const state = { data: null, model: localStorage.getItem("markbase.dashModel") || "", timer: null };

  // ------------------------------------------------------------------ formatting
  const fmt = {
    count: (v) => (v === null || v === undefined ? "\u2014" : String(Math.round(v))),
    rate: (v) => (v === null || v === undefined ? "\u2014" : v >= 100 ? v.toFixed(0) : v.toFixed(1)),
    ms: (v) => (v === null || v === undefined ? "\u2014" : v * 1000 >= 1000 ? v.toFixed(2) + " s" : (v * 1000).toFixed(v * 1000 < 10 ? 1 : 0) + " ms"),
    pct: (v) => (v === null || v === undefined ? "\u2014" : (v * 100).toFixed(v < 0.1 ? 1 : 0) + "%"),
  };

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  function lastValue(values) {
    for (let i = values.length - 1; i >= 0; i--) if (values[i] !== null && values[i] !== undefined) return values[i];
    return null;
  }

  function mean(values, n) {
    const tail = values.slice(-n).filter((v) => v !== null && v !== undefined);
    return tail.length ? tail.reduce((a, b) => a + b, 0) / tail.length : null;
  }

  // ------------------------------------------------------------------ charts
  function svgEl(tag, attrs) {
    const e = document.createElementNS(NS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    return e;
  }

  // Draws ``series`` ([{name, values, color}]) against times ``t`` (seconds since
  // the epoch) over the last ``windowS`` seconds into ``box``.
  function drawChart(box, title, subtitle, t, series, windowS, format, fixedMax) {
    box.innerHTML = "";
    const h3 = document.createElement("h3");
    h3.textContent = title;
    const small = document.createElement("small");
    small.textContent = subtitle;
    h3.appendChild(small);
    box.appendChild(h3);
    const legend = document.createElement("div");
    legend.className = "legend";
    box.appendChild(legend);

    const W = Math.max(240, box.clientWidth - 24), H = 190;
    const L = 48, R = 10, T = 8, B = 22;
    const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title });
    const now = t.length ? t[t.length - 1] : Date.now() / 1000;
    const t0 = now - windowS;
    let max = 0, points = 0;
    for (const s of series) for (const v of s.values) if (v !== null && v !== undefined) { max = Math.max(max, v); points++; }
    const yMax = fixedMax || niceMax(max);
    const x = (ts) => L + ((ts - t0) / windowS) * (W - L - R);
    const y = (v) => T + (1 - Math.min(v, yMax) / yMax) * (H - T - B);

    const grid = svgEl("g", { class: "grid" });
    const axis = svgEl("g", { class: "axis" });
    for (let i = 0; i <= 4; i++) {
      const v = (yMax * i) / 4;
      grid.appendChild(svgEl("line", { x1: L, x2: W - R, y1: y(v), y2: y(v) }));
      const label = svgEl("text", { x: L - 6, y: y(v) + 3.5, "text-anchor": "end" });
      label.textContent = format(v);
      axis.appendChild(label);
    }
    const step = windowS <= 60 ? 15 : windowS <= 300 ? 60 : 120;
    for (let s = 0; s <= windowS; s += step) {
      const label = svgEl("text", { x: x(now - s), y: H - 6, "text-anchor": s === 0 ? "end" : "middle" });
      label.textContent = s === 0 ? "now" : s % 60 === 0 ? `-${s / 60}m` : `-${s}s`;
      axis.appendChild(label);
    }
    svg.appendChild(grid);
    svg.appendChild(axis);

    series.forEach((s, k) => {
      let d = "", open = false, area = "", first = null, lastX = null;
      s.values.forEach((v, i) => {
        if (t[i] < t0) return;
        if (v === null || v === undefined) { open = false; return; }
        const px = x(t[i]).toFixed(1), py = y(v).toFixed(1);
        d += (open ? "L" : "M") + px + " " + py;
        open = true;
        if (k === 0) { if (first === null) first = px; area += (area ? "L" : "M") + px + " " + py; lastX = px; }
      });
      if (k === 0 && area && series.length <= 2) {
        svg.appendChild(svgEl("path", { d: `${area}L${lastX} ${y(0)}L${first} ${y(0)}Z`, fill: s.color, opacity: 0.09 }));
      }
      if (d) svg.appendChild(svgEl("path", { d, fill: "none", stroke: s.color, "stroke-width": 2, "stroke-linejoin": "round", "stroke-linecap": "round", "data-series": s.name }));
      const item = document.createElement("span");
      item.innerHTML = `<i style="background:${s.color}"></i>${s.name} `;
      const b = document.createElement("b");
      b.textContent = format(lastValue(s.values));
      item.appendChild(b);
      legend.appendChild(item);
    });
    svg.dataset.points = String(points);
    svg.dataset.max = String(max);
    box.appendChild(svg);
  }

  // ------------------------------------------------------------------ page
  function tile(k, v) {
    const d = document.createElement("div");
    d.className = "tile";
    d.innerHTML = '<div class="k"></div><div class="v"></div>';
    d.querySelector(".k").textContent = k;
    d.querySelector(".v").textContent = v;
    return d;
  }

  function render() {
    const data = state.data;
    if (!data) return;
    const names = Object.keys(data.models);
    const select = $("model");
    if (select.options.length !== names.length || names.some((n, i) => select.options[i].value !== n)) {
      select.innerHTML = "";
      for (const n of names) select.appendChild(new Option(n, n));
    }
    if (!names.includes(state.model)) state.model = names[0] || "";
    select.value = state.model;
    const m = data.models[state.model];
    const win = Number($("window").value);
    if (!m) {
      $("tiles").innerHTML = "";
      return;
    }
    const tot = m.totals;
    const finished = Object.values(tot.requests_finished || {}).reduce((a, b) => a + b, 0);
    const tiles = $("tiles");
    tiles.innerHTML = "";
    tiles.append(
      tile("Running", fmt.count(lastValue(m.running))),
      tile("Waiting", fmt.count(lastValue(m.waiting))),
      tile("Generation tok/s (5 s)", fmt.rate(mean(m.generation_tok_s, 5))),
      tile("TTFT p50 (all)", fmt.ms(tot.ttft_p50_s)),
      tile("ITL p50 (all)", fmt.ms(tot.itl_p50_s)),
      tile("KV cache", fmt.pct(lastValue(m.kv_cache_usage))),
      tile("Prefix-cache hits (all)", fmt.pct(tot.prefix_cache_hit_rate)),
      tile("Requests finished", String(finished)),
    );
    const lim = data.limits || {};
    drawChart($("chart-requests"), "Requests", `running (max ${lim.max_num_seqs}) and waiting`, m.t,
      [{ name: "running", values: m.running, color: COLORS[0] }, { name: "waiting", values: m.waiting, color: COLORS[1] }], win, fmt.count,
      4 * Math.max(1, Math.ceil(Math.max(0, ...m.running, ...m.waiting) / 4)));
    drawChart($("chart-throughput"), "Throughput", "tokens per second", m.t,
      [{ name: "generated", values: m.generation_tok_s, color: COLORS[2] }, { name: "prompt", values: m.prompt_tok_s, color: COLORS[4] }], win, fmt.rate);
    drawChart($("chart-ttft"), "Time to first token", "p50 / p90 / p99, 10 s window", m.t,
      [{ name: "p50", values: m.ttft_p50_s, color: COLORS[0] }, { name: "p90", values: m.ttft_p90_s, color: COLORS[1] }, { name: "p99", values: m.ttft_p99_s, color: COLORS[3] }], win, fmt.ms);
    drawChart($("chart-itl"), "Inter-token latency", "p50 / p90 / p99, 10 s window", m.t,
      [{ name: "p50", values: m.itl_p50_s, color: COLORS[0] }, { name: "p90", values: m.itl_p90_s, color: COLORS[1] }, { name: "p99", values: m.itl_p99_s, color: COLORS[3] }], win, fmt.ms);
    drawChart($("chart-kv"), "KV cache", `share of ${lim.max_kv_tokens} tokens reserved`, m.t,
      [{ name: "used", values: m.kv_cache_usage, color: COLORS[5] }], win, fmt.pct, niceMax(Math.max(0.05, ...m.kv_cache_usage.filter((v) => v !== null))));
    drawChart($("chart-prefix"), "Prefix cache", "hit rate of prompt tokens, 10 s window", m.t,
      [{ name: "hit rate", values: m.prefix_cache_hit_rate, color: COLORS[4] }], win, fmt.pct, 1);
    renderTable(data);
  }

  function renderTable(data) {
    const rows = Object.entries(data.models).map(([name, m]) => {
      const tot = m.totals;
      const finished = Object.values(tot.requests_finished || {}).reduce((a, b) => a + b, 0);
      return [name, fmt.count(lastValue(m.running)), fmt.count(lastValue(m.waiting)), fmt.rate(mean(m.generation_tok_s, 5)),
        fmt.ms(tot.ttft_p50_s), fmt.ms(tot.ttft_p99_s), fmt.ms(tot.itl_p50_s), fmt.pct(lastValue(m.kv_cache_usage)),
        fmt.pct(tot.prefix_cache_hit_rate), String(tot.generation_tokens), String(finished)];
    });
    const head = ["model", "running", "waiting", "tok/s (5 s)", "TTFT p50", "TTFT p99", "ITL p50", "KV cache", "prefix hits", "tokens out", "finished"];
    const table = document.createElement("table");
    const tr = table.createTHead().insertRow();
    for (const h of head) tr.appendChild(Object.assign(document.createElement("th"), { textContent: h }));
    const body = table.createTBody();
    for (const r of rows) {
      const row = body.insertRow();
      for (const c of r) row.insertCell().textContent = c;
    }
    $("per-model").innerHTML = "";
    $("per-model").appendChild(table);
  }

  function setStatus(ok, text) {
    $("status").innerHTML = `<span class="status-dot${ok ? "" : " off"}"></span>`;
    $("status").appendChild(document.createTextNode(text));
  }

  async function poll() {
    try {
      state.data = await Api.getJson("/v1/stats?seconds=" + $("window").value);
      $("banner").hidden = true;
      $("key-row").hidden = true;
      setStatus(true, "live");
      render();
    } catch (e) {
      setStatus(false, "offline");
      $("banner").hidden = false;
      $("banner").textContent = (e.title ? e.title + ": " : "") + (e.message || "cannot reach the server");
      if (e.status === 401) $("key-row").hidden = false;
    }
  }

  $("model").addEventListener("change", () => { state.model = $("model").value; localStorage.setItem("markbase.dashModel", state.model); render(); });
  $("window").addEventListener("change", poll);
  $("save-key").addEventListener("click", () => { Api.setApiKey($("api-key").value.trim()); poll(); });
  window.addEventListener("resize", render);
  poll();
  state.timer = setInterval(poll, 2000);
  window.markbaseDashboard = { state, poll };
})();
