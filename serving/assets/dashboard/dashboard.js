// Polls /v1/memory and draws four charts on <canvas>: the page pool split (stacked), requests, tokens/s, and the
// cost adjuster's predicted and measured copy time against compute time a step.
// No libraries. An API key can be given as #key=... in the address; it is sent as a bearer token.
"use strict";

const POLL_MS = 500;
const MIB = 1024 * 1024;
const COLORS = {
  expert_bytes: "#e8702a", kv_bytes: "#1f77d4", state_bytes: "#2ca02c", trapped_bytes: "#9b59b6", free_bytes: "#d9dde3",
  running: "#2ca02c", waiting: "#d62728", tokens_per_s: "#8c564b",
  predicted_copy_ms: "#ff7f0e", measured_copy_ms: "#17becf", compute_ms: "#7f7f7f",
};
const LABELS = {
  expert_bytes: "experts", kv_bytes: "KV cache", state_bytes: "linear-attention state", trapped_bytes: "trapped", free_bytes: "free",
  running: "running", waiting: "waiting", tokens_per_s: "tokens/s",
  predicted_copy_ms: "copies, predicted", measured_copy_ms: "copies, measured", compute_ms: "compute",
};

function apiKey() {
  const match = /(?:^|[#&])key=([^&]+)/.exec(location.hash);
  return match ? decodeURIComponent(match[1]) : null;
}

function legend(id, names) {
  const list = document.getElementById(id);
  list.innerHTML = "";
  for (const name of names) {
    const item = document.createElement("li");
    item.style.setProperty("--c", COLORS[name]);
    item.textContent = LABELS[name];
    list.appendChild(item);
  }
}

// Draw `names` from `series` against time. stacked: filled bands summed bottom-up; else: lines.
function draw(canvas, series, names, stacked, scale) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = { l: 56, r: 8, t: 8, b: 20 };
  ctx.clearRect(0, 0, w, h);
  const t = series.t || [];
  const n = t.length;
  const values = names.map((name) => (series[name] || []).map((v) => v / scale));
  let top = 0;
  for (let i = 0; i < n; i++) {
    const column = values.map((v) => v[i] || 0);
    top = Math.max(top, stacked ? column.reduce((a, b) => a + b, 0) : Math.max(...column));
  }
  top = top > 0 ? top * 1.05 : 1;
  const t0 = n ? t[0] : 0, t1 = n > 1 ? t[n - 1] : t0 + 1;
  const x = (i) => pad.l + ((t[i] - t0) / (t1 - t0 || 1)) * (w - pad.l - pad.r);
  const y = (v) => h - pad.b - (v / top) * (h - pad.t - pad.b);
  axes(ctx, w, h, pad, top, t0, t1);
  if (n < 2) return 0;
  const base = new Array(n).fill(0);
  for (let k = 0; k < names.length; k++) {
    ctx.beginPath();
    if (stacked) {
      for (let i = 0; i < n; i++) ctx.lineTo(x(i), y(base[i] + values[k][i]));
      for (let i = n - 1; i >= 0; i--) ctx.lineTo(x(i), y(base[i]));
      ctx.closePath();
      ctx.fillStyle = COLORS[names[k]];
      ctx.fill();
      for (let i = 0; i < n; i++) base[i] += values[k][i];
    } else {
      for (let i = 0; i < n; i++) ctx.lineTo(x(i), y(values[k][i]));
      ctx.strokeStyle = COLORS[names[k]];
      ctx.lineWidth = 2;
      ctx.stroke();
    }
  }
  return n;
}

function axes(ctx, w, h, pad, top, t0, t1) {
  ctx.strokeStyle = "#bbb";
  ctx.fillStyle = "#555";
  ctx.font = "11px system-ui, sans-serif";
  ctx.lineWidth = 1;
  ctx.beginPath();
  ctx.moveTo(pad.l, pad.t);
  ctx.lineTo(pad.l, h - pad.b);
  ctx.lineTo(w - pad.r, h - pad.b);
  ctx.stroke();
  ctx.textAlign = "right";
  ctx.fillText(format(top), pad.l - 4, pad.t + 10);
  ctx.fillText("0", pad.l - 4, h - pad.b);
  ctx.textAlign = "left";
  ctx.fillText(`${format(t0)} s`, pad.l, h - 5);
  ctx.textAlign = "right";
  ctx.fillText(`${format(t1)} s`, w - pad.r, h - 5);
}

function format(v) {
  return v >= 100 ? v.toFixed(0) : v >= 1 ? v.toFixed(1) : v.toFixed(2);
}

function showNow(current) {
  const rows = [
    ["expert pages", current.expert_pages], ["KV pages", current.kv_pages], ["trapped pages", current.trapped_pages],
    ["free (expert pages)", current.free_pages], ["running", current.running], ["waiting", current.waiting],
    ["tokens/s", current.tokens_per_s], ["experts on the host", current.offloaded_experts],
    ["touch probability of a host expert", current.touch_p_mean],
  ];
  document.querySelector("#now tbody").innerHTML = rows
    .map(([k, v]) => `<tr><td>${k}</td><td>${v === undefined ? "-" : v}</td></tr>`).join("");
}

async function poll() {
  const headers = {};
  const key = apiKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  try {
    const response = await fetch("/v1/memory", { headers, cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const data = await response.json();
    const s = data.series;
    document.getElementById("model").textContent = data.model || "";
    const charts = [["pool", true, MIB], ["requests", false, 1], ["throughput", false, 1], ["copies", false, 1]];
    for (const [id, stacked, scale] of charts) {
      const canvas = document.getElementById(id);
      const names = canvas.dataset.series.split(" ");
      canvas.dataset.points = draw(canvas, s, names, stacked, scale);
      canvas.dataset.max = names.map((name) => Math.max(0, ...(s[name] || []))).join(" ");
    }
    document.body.dataset.samples = s.t.length;
    showNow(data.current);
    document.getElementById("status").textContent =
      `${s.t.length} samples, pool ${(data.pool_bytes / MIB).toFixed(1)} MiB, updated ${new Date().toLocaleTimeString()}`;
  } catch (error) {
    document.getElementById("status").textContent = `cannot read /v1/memory: ${error.message}`;
  }
}

legend("pool-legend", ["expert_bytes", "kv_bytes", "state_bytes", "trapped_bytes", "free_bytes"]);
legend("requests-legend", ["running", "waiting"]);
legend("throughput-legend", ["tokens_per_s"]);
legend("copies-legend", ["predicted_copy_ms", "measured_copy_ms", "compute_ms"]);
poll();
setInterval(poll, POLL_MS);
