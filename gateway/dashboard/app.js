// kvgate dashboard: polls the admin server's /debug endpoints and redraws.
// Plain DOM and SVG, no libraries. Every value from the server is set with textContent, never
// parsed as HTML: request IDs and model names come from clients.
"use strict";

(function () {
  const OUTCOMES = ["owner", "pull", "recompute", "balanced", "fail_open"];
  const CHART_SECONDS = 120;
  const SVG_NS = "http://www.w3.org/2000/svg";

  const params = new URLSearchParams(location.hash.replace(/^#/, ""));
  const intervalMs = Math.max(200, Number(params.get("interval")) || 1000);
  let token = params.get("token") || sessionStorage.getItem("kvgate-token") || "";
  const expanded = new Set(); // request ids whose explanation is open
  let polls = 0;

  const $ = (id) => document.getElementById(id);

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else if (k.startsWith("data-")) node.setAttribute(k, v);
      else node[k] = v;
    }
    for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return node;
  }

  function svg(tag, attrs) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    return node;
  }

  function fmtInt(n) {
    return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US");
  }

  function fmtPct(x) {
    return x === null || !isFinite(x) ? "–" : (100 * x).toFixed(1) + " %";
  }

  function fmtS(x) {
    return x < 0.001 ? (x * 1e6).toFixed(0) + " µs" : x < 1 ? (x * 1e3).toFixed(2) + " ms" : x.toFixed(3) + " s";
  }

  async function getJson(path) {
    const resp = await fetch(path, { headers: { Authorization: "Bearer " + token }, cache: "no-store" });
    if (resp.status === 401) throw Object.assign(new Error("token refused"), { unauthorized: true });
    if (!resp.ok) throw new Error(path + " answered " + resp.status);
    return resp.json();
  }

  function setStatus(state, text) {
    const badge = $("status");
    badge.dataset.state = state;
    badge.textContent = text;
  }

  // --- fleet -----------------------------------------------------------------------------------

  function bar(value, max, cls) {
    const frac = max > 0 ? Math.min(1, value / max) : 0;
    const fill = el("span", { class: "bar-fill " + (cls || "") });
    fill.style.width = (100 * frac).toFixed(1) + "%";
    return el("span", { class: "bar" }, fill);
  }

  function renderFleet(snap) {
    const body = $("fleet").tBodies[0];
    const nodes = snap.nodes || [];
    const maxInflight = Math.max(1, ...nodes.map((n) => n.inflight || 0));
    const maxCached = Math.max(1, ...nodes.map((n) => n.capacity_blocks || n.cached_blocks || 0));
    body.replaceChildren(
      ...nodes.map((n) => {
        const b = n.bridge;
        const events = b
          ? (b.connected ? "connected" : "disconnected") + ` · ${fmtInt(b.batches)} batches · ${b.gaps_repaired} gaps repaired`
          : "–";
        return el(
          "tr",
          { "data-node-id": n.node_id, "data-live": String(n.live), class: n.live ? "" : "down" },
          el("td", { class: "mono" }, n.node_id),
          el("td", { class: "mono" }, n.address),
          el("td", {}, el("span", { class: "pill " + (n.live ? "ok" : "bad") }, n.live ? "live" : "down")),
          el("td", { class: "num" }, el("span", { "data-field": "inflight" }, fmtInt(n.inflight)), bar(n.inflight, maxInflight)),
          el("td", { class: "num", "data-field": "prefill" }, fmtInt(n.prefill_tokens)),
          el(
            "td",
            { class: "num" },
            el("span", { "data-field": "cached" }, fmtInt(n.cached_blocks)),
            n.cached_blocks === null ? "" : bar(n.cached_blocks, maxCached, "cached")
          ),
          el("td", { class: "muted" }, events)
        );
      })
    );
    $("tile-live").textContent = String(nodes.filter((n) => n.live).length);
    $("fleet-source").textContent = "cached blocks from: " + snap.cached_blocks_source;
    const err = $("fleet-error");
    err.hidden = !snap.error;
    err.textContent = snap.error || "";
  }

  // --- predicted vs delivered -----------------------------------------------------------------

  function doctorCell(d) {
    if (!d) return el("span", { class: "muted" }, "–");
    if (d.ok) return el("span", { class: "pill ok", title: d.detail }, "ok");
    if (d.degraded) return el("span", { class: "pill bad", title: d.detail }, "degraded: " + d.check);
    return el("span", { class: "pill", title: d.detail }, "not checked: " + d.check);
  }

  function renderCacheLoop(snap) {
    // what kvgate predicted each node would serve from cache, beside what the node says it did:
    // its own prefix-cache counters (scraped) and the cached_tokens of the answers kvgate read
    const body = $("cache-loop").tBodies[0];
    body.replaceChildren(
      ...(snap.nodes || []).map((n) => {
        const c = n.cache_loop || {};
        const engine = c.engine_query_tokens
          ? `${fmtInt(c.engine_hit_tokens)} ÷ ${fmtInt(c.engine_query_tokens)} (${fmtPct(c.engine_hit_tokens / c.engine_query_tokens)})`
          : "–";
        const read = c.observed_responses
          ? `${fmtInt(c.observed_expected_cached_tokens)} ÷ ${fmtInt(c.observed_cached_tokens)}` +
            (c.observed_cached_tokens ? ` (${fmtPct(c.observed_expected_cached_tokens / c.observed_cached_tokens)})` : "")
          : "–";
        return el(
          "tr",
          { "data-node-id": n.node_id, "data-degraded": String(Boolean(n.doctor && n.doctor.degraded)) },
          el("td", { class: "mono" }, n.node_id),
          el("td", {}, doctorCell(n.doctor)),
          el("td", { class: "num", "data-field": "routed" }, c.routed_prompt_tokens === undefined ? "–" : fmtInt(c.routed_prompt_tokens)),
          el("td", { class: "num", "data-field": "predicted" }, c.expected_cached_tokens === undefined ? "–" : fmtInt(c.expected_cached_tokens)),
          el("td", { class: "num", "data-field": "engine" }, engine),
          el("td", { class: "num", "data-field": "answers" }, fmtInt(c.observed_responses || 0)),
          el("td", { class: "num", "data-field": "read" }, read)
        );
      })
    );
  }

  // --- time series -----------------------------------------------------------------------------

  function series(seconds) {
    // dense last CHART_SECONDS seconds ending at the newest bucket (or now), zeros where idle
    const byT = new Map(seconds.map((s) => [s.t, s]));
    const end = Math.max(Math.floor(Date.now() / 1000), ...seconds.map((s) => s.t));
    const out = [];
    for (let t = end - CHART_SECONDS + 1; t <= end; t++) out.push(byT.get(t) || { t, prompt_tokens: 0, cached_tokens: 0 });
    return out;
  }

  function sumOver(points, n, f) {
    return points.slice(-n).reduce((acc, p) => acc + f(p), 0);
  }

  function renderOutcomes(points) {
    const chart = $("chart-outcomes");
    const w = 600, h = 160, bw = w / points.length;
    const totals = points.map((p) => OUTCOMES.reduce((a, o) => a + (p[o] || 0), 0));
    const max = Math.max(1, ...totals);
    const shapes = [];
    points.forEach((p, i) => {
      let y = h;
      for (const o of OUTCOMES) {
        const v = p[o] || 0;
        if (!v) continue;
        const bh = (v / max) * (h - 14);
        y -= bh;
        const r = svg("rect", { x: (i * bw).toFixed(2), y: y.toFixed(2), width: Math.max(bw - 0.6, 0.5).toFixed(2),
                                height: bh.toFixed(2), class: "o-" + o });
        r.append(svg("title", {}));
        r.lastChild.textContent = `${new Date(p.t * 1000).toLocaleTimeString()}: ${v} ${o}`;
        shapes.push(r);
      }
    });
    const label = svg("text", { x: 4, y: 12, class: "axis" });
    label.textContent = "max " + max + "/s";
    chart.replaceChildren(...shapes, label);
    chart.dataset.total = String(totals.reduce((a, b) => a + b, 0));
    $("legend").replaceChildren(...OUTCOMES.map((o) => el("span", { class: "key o-" + o }, o.replace("_", "-"))));
  }

  function renderHitRate(points) {
    const chart = $("chart-hit");
    const w = 600, h = 160, step = w / (points.length - 1 || 1);
    let d = "";
    let pen = false;
    points.forEach((p, i) => {
      if (!p.prompt_tokens) { pen = false; return; }
      const y = h - 4 - (p.cached_tokens / p.prompt_tokens) * (h - 18);
      d += (pen ? "L" : "M") + (i * step).toFixed(2) + " " + y.toFixed(2) + " ";
      pen = true;
    });
    const grid = [0, 0.5, 1].map((f) => {
      const y = h - 4 - f * (h - 18);
      return svg("line", { x1: 0, x2: w, y1: y, y2: y, class: "grid" });
    });
    const label = svg("text", { x: 4, y: 12, class: "axis" });
    label.textContent = "100 %";
    chart.replaceChildren(...grid, svg("path", { d: d.trim() || "M0 0", class: d ? "line" : "line empty" }), label);
  }

  function renderTimeline(tl) {
    const points = series(tl.seconds || []);
    renderOutcomes(points);
    renderHitRate(points);
    const n10 = sumOver(points, 10, (p) => OUTCOMES.reduce((a, o) => a + (p[o] || 0), 0));
    $("tile-rate").textContent = (n10 / 10).toFixed(1);
    const prompt = sumOver(points, 60, (p) => p.prompt_tokens);
    const cached = sumOver(points, 60, (p) => p.cached_tokens);
    $("tile-hit").textContent = prompt ? fmtPct(cached / prompt) : "–";
    const all60 = sumOver(points, 60, (p) => OUTCOMES.reduce((a, o) => a + (p[o] || 0), 0));
    const fo60 = sumOver(points, 60, (p) => p.fail_open || 0);
    $("tile-failopen").textContent = all60 ? fmtPct(fo60 / all60) : "–";
  }

  // --- decisions -------------------------------------------------------------------------------

  function explanation(d) {
    const rows = (d.candidates || []).map((c) =>
      el(
        "tr",
        { class: c.chosen ? "chosen" : "", "data-candidate": c.node_id },
        el("td", { class: "mono" }, (c.chosen ? "▶ " : "") + c.node_id),
        el("td", { class: "num" }, fmtInt(c.cached_blocks)),
        el("td", {}, c.tier),
        el("td", { class: "num" }, fmtInt(c.inflight)),
        el("td", { class: "num" }, fmtS(c.queue_s)),
        el("td", { class: "num" }, c.via_pull ? fmtS(c.transfer_s) : "–"),
        el("td", { class: "num" }, fmtS(c.prefill_s)),
        el("td", { class: "num strong" }, fmtS(c.total_s))
      )
    );
    const table = el(
      "table",
      { class: "candidates" },
      el("thead", {}, el("tr", {}, ...["node", "cached blocks", "tier", "in flight", "queue", "transfer", "prefill", "est. TTFT"]
        .map((h) => el("th", {}, h)))),
      el("tbody", {}, ...rows)
    );
    const facts = [];
    if (d.pull) facts.push(`pull ${d.pull.blocks} blocks from ${d.pull.source_node_id} (${d.pull.source_endpoint})`);
    if (d.best_cached) facts.push(`longest cached prefix: ${fmtInt(d.best_cached.tokens)} tokens on ${d.best_cached.node_id}`);
    if (d.fallbacks && d.fallbacks.length) facts.push("fallbacks: " + d.fallbacks.join(", "));
    const t = d.timings_ms || {};
    facts.push("stages: " + ["parse", "tokenize", "lookup", "score", "reserve"].filter((s) => s in t)
      .map((s) => `${s} ${t[s].toFixed(3)} ms`).join(" · "));
    return el("div", { class: "explain" }, el("p", { class: "reason" }, d.reason || ""),
      el("p", { class: "muted" }, facts.join(" — ")), table);
  }

  function renderDecisions(data) {
    const body = $("decisions").tBodies[0];
    const rows = [];
    for (const d of data.decisions || []) {
      const key = d.request_id || String(d.ts);
      const total = d.timings_ms && d.timings_ms.total !== undefined ? d.timings_ms.total.toFixed(3) : "–";
      const row = el(
        "tr",
        { class: "decision", "data-request-id": d.request_id || "", "data-outcome": d.outcome },
        el("td", { class: "mono" }, new Date(d.ts * 1000).toLocaleTimeString()),
        el("td", { class: "mono ellipsis", title: d.request_id || "" }, d.request_id || "–"),
        el("td", {}, d.model || "–"),
        el("td", { class: "num" }, fmtInt(d.prompt_tokens)),
        el("td", {}, el("span", { class: "pill o-" + d.outcome }, d.outcome.replace("_", "-"))),
        el("td", { class: "mono" }, d.chosen ? d.chosen.node_id : "–"),
        el("td", { class: "num" }, fmtInt(d.expected_cached_tokens)),
        el("td", { class: "num" }, total)
      );
      row.addEventListener("click", () => {
        if (expanded.has(key)) expanded.delete(key);
        else expanded.add(key);
        renderDecisions(data);
      });
      rows.push(row);
      if (expanded.has(key)) rows.push(el("tr", { class: "detail" }, el("td", { colSpan: 8 }, explanation(d))));
    }
    body.replaceChildren(...rows);
    $("tile-recorded").textContent = fmtInt(data.recorded);
  }

  // --- loop ------------------------------------------------------------------------------------

  async function poll() {
    try {
      const [nodes, timeline, decisions] = await Promise.all([
        getJson("/debug/nodes"),
        getJson("/debug/timeline"),
        getJson("/debug/decisions?limit=30"),
      ]);
      renderFleet(nodes);
      renderCacheLoop(nodes);
      renderTimeline(timeline);
      renderDecisions(decisions);
      polls += 1;
      document.body.dataset.polls = String(polls);
      setStatus("ok", "live");
      $("updated").textContent = "updated " + new Date().toLocaleTimeString();
    } catch (e) {
      if (e.unauthorized) {
        sessionStorage.removeItem("kvgate-token");
        showLogin("The admin token was refused.");
        return;
      }
      setStatus("error", "error: " + e.message);
    }
    setTimeout(poll, intervalMs);
  }

  function showLogin(message) {
    setStatus("error", message);
    $("login").hidden = false;
    $("main").hidden = true;
  }

  $("login").addEventListener("submit", (ev) => {
    ev.preventDefault();
    token = $("token-input").value.trim();
    sessionStorage.setItem("kvgate-token", token);
    $("login").hidden = true;
    $("main").hidden = false;
    poll();
  });

  if (params.get("token")) {
    sessionStorage.setItem("kvgate-token", token);
    history.replaceState(null, "", location.pathname); // keep the token out of screenshots and history
  }
  if (token) poll();
  else showLogin("An admin token is needed.");
})();
