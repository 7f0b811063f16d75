// swarmnode dashboard: polls /api/v1/state every 2 s and redraws. No external scripts.
"use strict";

const $ = (id) => document.getElementById(id);
const short = (peer) => (peer || "").slice(-6);

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmtBytes(n) {
  if (!n && n !== 0) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}

// every peer: from serving records (per block) and capacity records (planned nodes)
function peersOf(state) {
  const peers = {};
  for (const s of state.servers || []) {
    const p = peers[s.peer_id] || (peers[s.peer_id] = { peer: s.peer_id, spans: [], server: s });
    p.spans.push([s.start, s.end, s.state]);
  }
  for (const [peer, node] of Object.entries(state.nodes || {})) {
    const p = peers[peer] || (peers[peer] = { peer, spans: [] });
    p.node = node;
  }
  return Object.values(peers).sort((a, b) =>
    (a.spans[0] ? a.spans[0][0] : 1e9) - (b.spans[0] ? b.spans[0][0] : 1e9) || a.peer.localeCompare(b.peer));
}

function drawCoverage(state, peers) {
  const n = state.num_blocks, grid = $("coverage");
  grid.replaceChildren();
  grid.style.gridTemplateColumns = `110px repeat(${n}, minmax(14px, 1fr))`;
  grid.appendChild(el("div", { class: "cell head rowlabel" }, "block"));
  for (let b = 0; b < n; b++) grid.appendChild(el("div", { class: "cell head" }, String(b)));
  grid.appendChild(el("div", { class: "cell head rowlabel" }, "replicas"));
  for (let b = 0; b < n; b++) {
    const r = (state.replicas || [])[b] || 0;
    grid.appendChild(el("div", { class: `cell block r${Math.min(r, 3)}`, "data-block": b, "data-replicas": r,
                                 title: `block ${b}: ${r} replicas` }, String(r)));
  }
  for (const p of peers) {
    const label = el("div", { class: "cell rowlabel node-row", "data-peer": p.peer, title: p.peer },
                     (p.server && p.server.public_name) || short(p.peer));
    grid.appendChild(label);
    for (let b = 0; b < n; b++) {
      const span = p.spans.find(([s, e]) => s <= b && b < e);
      grid.appendChild(el("div", { class: "cell " + (span ? "served" : "empty"),
                                   ...(span ? { "data-serves": `${p.peer}:${b}` } : {}) }, ""));
    }
  }
}

function drawPlacement(state) {
  const box = $("placement"), pl = state.placement;
  box.replaceChildren();
  if (!pl) {
    box.textContent = "no placement from a trusted coordinator (manual nodes serve their --blocks)";
    return;
  }
  box.appendChild(el("div", {}, `v${pl.version} · term ${pl.term} · ${pl.algorithm} · by ${short(pl.coordinator)} · `
    + `${Math.round(pl.throughput)} tok/s planned · ${pl.moved_blocks} blocks moved`));
  box.appendChild(el("div", { id: "placement-reason" }, "why: " + pl.reason));
  const floor = state.min_replicas || 1, spof = state.single_points || [];
  if (spof.length) {
    box.appendChild(el("div", { id: "single-points", class: "warn" },
      `single points of failure: blocks ${spof.map(([a, b]) => b - a > 1 ? `${a}-${b - 1}` : `${a}`).join(", ")} `
      + `are planned on fewer than ${floor} nodes (the offers cannot hold more copies)`));
  } else if (floor > 1) {
    box.appendChild(el("div", { id: "single-points" }, `every block planned on at least ${floor} nodes`));
  }
  for (const [peer, why] of Object.entries(state.unused || {})) {
    box.appendChild(el("div", { class: "unused", "data-peer": peer }, `unused ${short(peer)}: ${why}`));
  }
  const list = el("div", {});
  for (const [peer, range] of Object.entries(pl.assignments || {})) {
    list.appendChild(el("code", {}, `${short(peer)} → ${range[0]}:${range[1]}  `));
  }
  box.appendChild(list);
}

function drawNodes(state, peers) {
  const body = $("nodes").querySelector("tbody");
  body.replaceChildren();
  const rtts = (state.api || {}).rtts || {};
  for (const p of peers) {
    const node = p.node || {}, server = p.server || {};
    const links = Object.entries(node.links || {}).map(([to, l]) =>
      `${short(to)} ${Math.round(l.rtt_ms)} ms` + (l.bandwidth_mbps ? ` ${Math.round(l.bandwidth_mbps)} Mbps` : "")).join(", ");
    const row = el("tr", { "data-peer": p.peer });
    const cells = [
      short(p.peer) + (rtts[p.peer] !== undefined ? ` (${rtts[p.peer]} ms)` : ""),
      node.public_name || server.public_name || "",
      node.state || server.state || "",
      [node.dtype || server.dtype || "", ...[node.quantization || server.quantization].filter(q => q && q !== "none")].join("+") || "–",
      p.spans.map(([s, e]) => `${s}:${e}`).join(", ") || "–",
      node.assigned ? `${node.assigned[0]}:${node.assigned[1]}` : "–",
      node.memory_bytes ? `${fmtBytes(node.memory_bytes)} / ${node.max_blocks} blk` : "–",
      String(Math.round(node.block_throughput || server.throughput || 0)),
      `${server.free_cache_tokens ?? node.free_cache_tokens ?? "–"} / ${server.cache_tokens ?? node.cache_tokens ?? "–"}`,
      links || "–",
      (node.phase && node.phase !== "both" ? `[${node.phase}] ` : "") +
        (node.relayed ? (node.relay ? `[relayed via ${short(node.relay)}] ` : "[relayed, no relay yet] ") : "") +
        (node.note || ""),
    ];
    for (const c of cells) row.appendChild(el("td", {}, c));
    body.appendChild(row);
  }
}

async function refresh() {
  try {
    const response = await fetch("/api/v1/state", { cache: "no-store" });
    const state = await response.json();
    if (!response.ok) throw new Error((state.error || {}).message || response.statusText);
    const peers = peersOf(state);
    $("model").textContent = state.model || state.prefix;
    $("tps").textContent = ((state.api || {}).tokens_per_s ?? 0).toFixed(1);
    $("active").textContent = String((state.api || {}).active_generations ?? 0);
    $("nservers").textContent = String(new Set((state.servers || []).map((s) => s.peer_id)).size);
    $("uncovered").textContent = String((state.uncovered_blocks || []).length);
    drawCoverage(state, peers);
    drawPlacement(state);
    drawNodes(state, peers);
    $("status").textContent = "updated " + new Date().toLocaleTimeString();
    document.body.setAttribute("data-ready", "1");
  } catch (err) {
    $("status").textContent = "cannot read the swarm: " + err;
  }
}

refresh();
setInterval(refresh, 2000);
