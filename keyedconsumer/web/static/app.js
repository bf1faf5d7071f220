// keyedconsumer web: live refresh of server-rendered fragments, and confirmed actions.
// No framework, nothing from another origin; every text put in the page goes in as textContent.
"use strict";
(function () {
  const live = document.getElementById("live");
  const flash = document.getElementById("flash");
  const csrf = document.querySelector('meta[name="csrf-token"]');

  function busy(el) {
    // do not replace what a person is working with: a selection, an open detail, a focused field
    const active = document.activeElement;
    const typing = active && el.contains(active) && /^(INPUT|SELECT|TEXTAREA)$/.test(active.tagName);
    return typing || el.querySelector("input:checked, details[open]") !== null;
  }

  async function refresh() {
    if (!live || document.hidden || busy(live)) return;
    try {
      const r = await fetch(live.dataset.refresh, { credentials: "same-origin", cache: "no-store" });
      if (!r.ok) return;
      const html = await r.text();
      if (!busy(live)) live.innerHTML = html;  // server-rendered and escaped; innerHTML runs no script
      const updated = document.getElementById("updated");
      if (updated) updated.textContent = "updated " + new Date().toLocaleTimeString();
      live.dataset.refreshed = String(Number(live.dataset.refreshed || "0") + 1);
    } catch (e) { /* the next tick tries again */ }
  }
  if (live) setInterval(refresh, Number(live.dataset.refreshMs || "5000"));

  function say(ok, text) {
    flash.hidden = false;
    flash.className = ok ? "ok" : "error";
    flash.textContent = text;
    flash.scrollIntoView({ block: "nearest" });
  }

  function confirmed(text) {
    const dlg = document.getElementById("confirm");
    document.getElementById("confirm-text").textContent = text;
    return new Promise((resolve) => {
      dlg.addEventListener("close", () => resolve(dlg.returnValue === "ok"), { once: true });
      dlg.showModal();
    });
  }

  async function post(kind, body) {
    const r = await fetch("/actions/" + kind, {
      method: "POST",
      credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf ? csrf.content : "" },
      body: JSON.stringify(body),
    });
    return r.json();
  }

  // A replay: ask where each selected record would go, show it for confirmation, send to exactly that.
  async function replayBody(button) {
    const picked = Array.from(document.querySelectorAll("input.select:checked")).map((c) => c.value.split(":").map(Number));
    if (picked.length === 0) { say(false, "Select the dead letters to replay first."); return null; }
    const topic = button.dataset.topic;
    const answer = await post("replay-plan", { topic: topic, records: picked });
    if (!answer.ok) { say(false, answer.message); return null; }
    const go = answer.plan.filter((r) => !r.refused && !r.replayed);
    const lines = answer.plan.map((r) => r.dlq_partition + "@" + r.dlq_offset + " (key " + (r.key === null ? "(null)" : r.key) + ") -> "
      + (r.replayed ? "already replayed" : r.target));
    const head = go.length === 0
      ? "None of the " + picked.length + " selected dead letter(s) of " + topic + " can be replayed:"
      : "Replay " + go.length + " of the " + picked.length + " selected dead letter(s) of " + topic + " to:";
    return {
      text: head + "\n" + lines.join("\n"),
      body: { topic: topic, records: go.map((r) => [r.dlq_partition, r.dlq_offset]),
              targets: go.map((r) => [r.dlq_partition, r.dlq_offset, r.topic, r.partition]) },
      empty: go.length === 0,
    };
  }

  async function act(button) {
    const kind = button.dataset.action;
    let body, text;
    button.disabled = true;
    try {
      if (kind === "replay") {
        const plan = await replayBody(button);
        if (plan === null) return;
        if (plan.empty) { await confirmed(plan.text); return; }
        body = plan.body;
        text = plan.text;
      } else if (kind === "unpark") {
        body = { namespace: button.dataset.namespace, lid: button.dataset.lid };
        text = button.dataset.confirm;
      } else {
        body = { namespace: button.dataset.namespace, id: button.dataset.id };
        text = button.dataset.confirm;
      }
      if (!(await confirmed(text))) return;
      const answer = await post(kind, body);
      say(answer.ok, answer.message);
      document.querySelectorAll("input.select:checked, #select-all:checked").forEach((c) => { c.checked = false; });
    } catch (e) {
      say(false, "The dashboard did not answer: " + e);
    } finally {
      button.disabled = false;
      refresh();
    }
  }

  document.addEventListener("change", (ev) => {
    if (ev.target.id === "select-all") {
      document.querySelectorAll("input.select").forEach((c) => { c.checked = ev.target.checked; });
    }
  });

  document.addEventListener("click", (ev) => {
    const button = ev.target.closest("button.action");
    if (button) { ev.preventDefault(); act(button); }
  });
})();
