// gpucloud console: progressive enhancement only (every page works without it).
// Times in the viewer's zone, confirmations, a pod's live logs over Server-Sent Events, and
// the pods list's rows fetched again every few seconds while the page is visible.
"use strict";

function formatTimes(root) {
  const fmt = new Intl.DateTimeFormat(undefined, { dateStyle: "medium", timeStyle: "medium" });
  root.querySelectorAll("time[datetime]").forEach((el) => {
    const when = new Date(el.getAttribute("datetime"));
    if (Number.isNaN(when.getTime())) return;
    el.title = fmt.format(when);
    el.textContent = el.hasAttribute("data-age") ? age(when) : fmt.format(when);
  });
}

function age(when) {
  const s = Math.max(0, Math.round((Date.now() - when.getTime()) / 1000));
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m";
  if (s < 86400) return Math.floor(s / 3600) + "h" + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + "m";
  return Math.floor(s / 86400) + "d";
}

function confirmForms() {
  document.querySelectorAll("form[data-confirm]").forEach((form) => {
    form.addEventListener("submit", (event) => {
      if (!window.confirm(form.dataset.confirm)) event.preventDefault();
    });
  });
}

// The pod started after the page was drawn: fill its "Started" field.
function showStarted(iso) {
  const started = document.getElementById("started");
  if (!started || !iso || started.querySelector("time")) return;
  const time = document.createElement("time");
  time.setAttribute("datetime", iso);
  time.textContent = iso;
  started.replaceChildren(time);
  formatTimes(started);
}

function followLogs() {
  const logs = document.getElementById("logs");
  if (!logs || !logs.dataset.stream || !window.EventSource) return;
  const live = document.getElementById("live");
  const phase = document.getElementById("phase");
  const source = new EventSource(logs.dataset.stream);
  const initial = phase ? phase.textContent : "";
  const TERMINAL = ["Succeeded", "Failed", "Stopped", "Lost"];
  let attempt = null;
  source.addEventListener("open", () => { if (live) live.hidden = false; });
  source.addEventListener("log", (event) => {
    const data = JSON.parse(event.data);
    if (attempt !== null && data.attempt !== attempt) logs.append("\n--- restart (attempt " + data.attempt + ") ---\n");
    attempt = data.attempt;
    const atBottom = logs.scrollTop + logs.clientHeight >= logs.scrollHeight - 4;
    logs.append(data.text);
    if (atBottom) logs.scrollTop = logs.scrollHeight;
  });
  source.addEventListener("phase", (event) => {
    const data = JSON.parse(event.data);
    if (phase) {
      phase.textContent = data.phase;
      phase.className = "phase phase-" + data.phase.toLowerCase();
    }
    const node = document.getElementById("node");
    if (node && data.node) node.textContent = data.node;
    showStarted(data.started_at);
    // Ended since the page was drawn: draw it again (actions, events and cost change).
    // A viewer already leaving for another page is not brought back by the redraw.
    if (TERMINAL.includes(data.phase) && !TERMINAL.includes(initial)) {
      source.close();
      document.body.dataset.redraw = "pending";
      const redraw = window.setTimeout(() => window.location.reload(), 300);
      window.addEventListener("beforeunload", () => window.clearTimeout(redraw), { once: true });
    }
    const why = document.getElementById("why-card");
    if (why && data.phase !== "Pending") why.hidden = true;
    const reason = document.getElementById("phase-reason");
    if (reason) reason.textContent = data.reason;
  });
  source.addEventListener("gone", () => { source.close(); if (live) live.hidden = true; });
  source.addEventListener("error", () => { if (live) live.hidden = true; });
}

const REFRESH_MS = 3000;

function refreshRows() {
  const rows = document.querySelector("tbody[data-refresh]");
  if (!rows) return;
  let busy = false;
  async function fetchRows() {
    if (busy || document.visibilityState !== "visible") return;
    busy = true;
    try {
      // A signed-out session is a redirect to the sign-in page: keep the rows as they are.
      const response = await fetch(rows.dataset.refresh, { redirect: "manual", credentials: "same-origin" });
      if (response.ok) {
        rows.innerHTML = await response.text();
        formatTimes(rows);
      }
    } catch (error) {
      // The server is away for a moment: try again on the next tick.
    } finally {
      busy = false;
    }
  }
  window.setInterval(fetchRows, REFRESH_MS);
  document.addEventListener("visibilitychange", fetchRows);
}

document.addEventListener("DOMContentLoaded", () => {
  formatTimes(document);
  confirmForms();
  followLogs();
  refreshRows();
});
