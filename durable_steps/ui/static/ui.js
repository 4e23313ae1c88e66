// durable-steps ui: refreshes the list of runs. Everything a run holds is set
// with textContent, never as markup (a run id or a wait may contain anything).
"use strict";

(function () {
  const table = document.getElementById("runs");
  if (!table) return;
  const api = table.dataset.api;
  const every = Math.max(1, parseFloat(table.dataset.refresh || "5")) * 1000;
  const columns = ["workflow", "run_id", "status", "step", "iteration", "age", "size", "waiting_for"];

  function cell(row, name) {
    const td = document.createElement("td");
    const text = String(row[name]);
    if (name === "run_id") {
      const a = document.createElement("a");
      a.href = "/runs/" + encodeURIComponent(row.workflow) + "/" + encodeURIComponent(row.run_id);
      a.textContent = text;
      td.appendChild(a);
    } else if (name === "status") {
      const span = document.createElement("span");
      span.className = "status " + row.status.replace(/[^a-z_]/g, "");
      span.textContent = text.replace(/_/g, "-");
      td.appendChild(span);
    } else {
      td.textContent = text;
      if (name === "iteration" || name === "size") td.className = "num";
    }
    return td;
  }

  function show(listing) {
    const body = document.createElement("tbody");
    for (const row of listing.rows) {
      const tr = document.createElement("tr");
      for (const name of columns) tr.appendChild(cell(row, name));
      body.appendChild(tr);
    }
    table.replaceChild(body, table.tBodies[0]);
    for (const b of document.querySelectorAll("[data-count]")) {
      b.textContent = listing.counts[b.dataset.count] || "0";
    }
    document.getElementById("empty").hidden = listing.rows.length > 0;
    document.getElementById("more").hidden = !listing.more;
    table.dataset.refreshed = String(Date.now());
  }

  function poll() {
    if (document.hidden) return;
    fetch(api, { headers: { Accept: "application/json" }, credentials: "same-origin" })
      .then((r) => (r.ok ? r.json() : null))
      .then((listing) => { if (listing) show(listing); })
      .catch(() => {});
  }

  setInterval(poll, every);
})();
