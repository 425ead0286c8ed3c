// irisfed web: live updates and charts. No inline scripts anywhere (the CSP forbids
// them): everything the page needs is read from data-* attributes.
//
// /events (server-sent events) says what changed; each event becomes a DOM event
// that htmx re-fetches a fragment on:
//   jobs   -> "irisfed-jobs" on <body>, and "irisfed-job" on each [data-live-job]
//             element whose job moved
//   peers  -> "irisfed-peers" on <body>
//   resync -> "irisfed-resync" on <body> (the stream fell behind or reconnected)
//   mode   -> shows or hides the "polling Postgres" banner
// Each DOM event fires at most once a second per target, and always once more after
// the last change (no update is lost to the throttle).
//
// A stream the dashboard refuses (too many open: 429 for this browser's address, 503
// for everyone) is closed for good by the browser: the page then re-fetches its
// fragments every REFUSED_POLL_MS, says so, and asks for a stream again after
// REFUSED_RETRY_MS (the dashboard's --refused-retry, from <body data-refused-retry-ms>).
(function () {
  "use strict";
  var body = document.body;
  var THROTTLE_MS = 1000;
  var REFUSED_POLL_MS = 10000;
  var REFUSED_RETRY_MS = Number(body.dataset.refusedRetryMs) || 30000;
  var timers = new Map();
  var polling = null;

  function fire(target, name) {
    var key = target === body ? name : name + "\u0000" + (target.dataset.liveJob || "");
    var state = timers.get(key);
    if (state) { state.again = true; return; }
    target.dispatchEvent(new CustomEvent(name));
    state = { again: false };
    timers.set(key, state);
    setTimeout(function () {
      timers.delete(key);
      if (state.again) { fire(target, name); }
    }, THROTTLE_MS);
  }

  function setHidden(id, hidden) {
    var el = document.getElementById(id);
    if (el) { el.hidden = hidden; }
  }

  function liveJobs(ids, all) {
    var wanted = new Set(ids);
    document.querySelectorAll("[data-live-job]").forEach(function (el) {
      if (all || wanted.has(el.dataset.liveJob)) { fire(el, "irisfed-job"); }
    });
  }

  function refresh() {
    fire(body, "irisfed-resync");
    liveJobs([], true);
  }

  function startPolling() {
    setHidden("poll-banner", false);
    if (polling === null) { polling = setInterval(refresh, REFUSED_POLL_MS); }
  }

  function stopPolling() {
    setHidden("poll-banner", true);
    if (polling !== null) { clearInterval(polling); polling = null; }
  }

  function connect() {
    var url = body.dataset.events;
    if (!url || !window.EventSource) { return; }
    var source = new EventSource(url);
    var broken = false;
    source.addEventListener("open", function () {
      setHidden("stream-banner", true);
      stopPolling();
      if (broken) { broken = false; fire(body, "irisfed-resync"); }
    });
    source.addEventListener("error", function () {
      broken = true;
      if (source.readyState === EventSource.CLOSED) {  // refused: the browser will not retry
        setHidden("stream-banner", true);
        startPolling();
        setTimeout(connect, REFUSED_RETRY_MS);
        return;
      }
      setHidden("stream-banner", false);
    });
    source.addEventListener("mode", function (e) {
      var data = JSON.parse(e.data);
      setHidden("live-banner", data.live === true);
    });
    source.addEventListener("jobs", function (e) {
      var data = JSON.parse(e.data);
      fire(body, "irisfed-jobs");
      liveJobs(Array.isArray(data.ids) ? data.ids : [], data.all === true);
    });
    source.addEventListener("peers", function () { fire(body, "irisfed-peers"); });
    source.addEventListener("resync", refresh);
  }

  // ------------------------------------------------------------ charts (uPlot)

  var CHARTS = {
    submits: { label: "submits/s", key: "submits" },
    completions: { label: "completions/s", key: "completions" },
    queued: { label: "queued jobs", key: "queued" }
  };
  var COLORS = ["#2563eb", "#16a34a", "#dc2626", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777",
                "#4b5563", "#65a30d", "#7c3aed"];
  var plots = {};

  function chartOptions(el, series) {
    return {
      width: Math.max(320, el.clientWidth || 600),
      height: 220,
      scales: { x: { time: true } },
      series: [{}].concat(series.map(function (label, i) {
        return { label: label, stroke: COLORS[i % COLORS.length], width: 2 };
      })),
      axes: [{}, { size: 60 }]
    };
  }

  function draw(name, el, labels, data) {
    var plot = plots[name];
    var same = plot && plot.series.length === labels.length + 1 &&
      labels.every(function (label, i) { return plot.series[i + 1].label === label; });
    if (same) { plot.setData(data); return; }
    if (plot) { plot.destroy(); }
    plots[name] = new window.uPlot(chartOptions(el, labels), data, el);
  }

  function drawCharts(holder, json) {
    holder.querySelectorAll("[data-chart]").forEach(function (el) {
      var name = el.dataset.chart;
      if (name === "running") {
        var labels = json.running.map(function (s) { return s.peer; });
        var rows = json.running.map(function (s) { return s.values; });
        if (!labels.length) { labels = ["(no peer)"]; rows = [json.t.map(function () { return 0; })]; }
        draw(name, el, labels, [json.t].concat(rows));
      } else if (CHARTS[name]) {
        draw(name, el, [CHARTS[name].label], [json.t, json[CHARTS[name].key]]);
      }
    });
  }

  function charts() {
    var holder = document.getElementById("charts");
    if (!holder || !window.uPlot) { return; }
    var url = holder.dataset.chartsUrl;
    function load() {
      fetch(url, { credentials: "same-origin", headers: { "Accept": "application/json" } })
        .then(function (r) { if (!r.ok) { throw new Error(String(r.status)); } return r.json(); })
        .then(function (json) { setHidden("charts-error", true); drawCharts(holder, json); })
        .catch(function () { setHidden("charts-error", false); });
    }
    load();
    setInterval(load, 10000);
    window.addEventListener("resize", function () {
      Object.keys(plots).forEach(function (name) {
        var el = holder.querySelector('[data-chart="' + name + '"]');
        if (el) { plots[name].setSize({ width: Math.max(320, el.clientWidth), height: 220 }); }
      });
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    connect();
    charts();
  });
})();
