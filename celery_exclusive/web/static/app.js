// The page of celery-exclusive's web view: plain JavaScript, no build step.
//
// Everything the store holds is user data (keys, task ids, host names): it is put on the
// page with textContent and setAttribute only, never as HTML, and control characters
// are shown as escapes so that a key with a newline or a NUL reads as one line.
"use strict";

(function () {
  const MAX_SHOWN = 160; // characters of a key shown before "…" (the title has all)
  const MAX_FEED = 500;

  const $ = (id) => document.getElementById(id);
  const state = {
    config: null,
    filter: "",
    cursors: [], // cursors of the pages before this one
    cursor: null, // this page's
    next: null, // the next page's, null on the last
    source: null,
    seen: new Set(),
    token: null,
    pending: null, // the key and holders the release dialog is about
  };

  // --- showing values ---------------------------------------------------------------

  // A value as text nodes: printable runs as they are, control characters (and other
  // invisible ones) as \n, \t, \x00, \u2028 escapes in a span of their own.
  function visible(value, limit) {
    const text = value === null || value === undefined ? "" : String(value);
    const fragment = document.createDocumentFragment();
    let shown = 0;
    let run = "";
    for (const ch of text) {
      if (limit && shown >= limit) {
        run += "…";
        break;
      }
      const code = ch.codePointAt(0);
      if (code < 0x20 || (code >= 0x7f && code < 0xa0) || code === 0x2028 || code === 0x2029) {
        if (run) fragment.append(document.createTextNode(run));
        run = "";
        const esc = document.createElement("span");
        esc.className = "esc";
        esc.textContent = escapeOf(ch);
        fragment.append(esc);
      } else {
        run += ch;
      }
      shown += 1;
    }
    if (run) fragment.append(document.createTextNode(run));
    return fragment;
  }

  function escapeOf(ch) {
    const named = { "\n": "\\n", "\r": "\\r", "\t": "\\t" };
    if (named[ch]) return named[ch];
    const code = ch.codePointAt(0);
    return code < 0x100 ? "\\x" + code.toString(16).padStart(2, "0") : "\\u" + code.toString(16).padStart(4, "0");
  }

  function titleOf(value) {
    return Array.from(String(value)).map((ch) => (ch.codePointAt(0) < 0x20 ? escapeOf(ch) : ch)).join("");
  }

  function cell(value, className, limit) {
    const td = document.createElement("td");
    if (className) td.className = className;
    if (value === null || value === undefined || value === "") {
      td.textContent = "–";
      return td;
    }
    td.append(visible(value, limit));
    if (limit && String(value).length > limit) td.setAttribute("title", titleOf(value));
    return td;
  }

  function duration(seconds) {
    if (seconds === null || seconds === undefined) return null;
    if (seconds < 60) return seconds.toFixed(1) + "s";
    const whole = Math.floor(seconds);
    if (whole < 3600) return Math.floor(whole / 60) + "m" + String(whole % 60).padStart(2, "0") + "s";
    if (whole < 86400) return Math.floor(whole / 3600) + "h" + String(Math.floor((whole % 3600) / 60)).padStart(2, "0") + "m";
    return Math.floor(whole / 86400) + "d" + String(Math.floor((whole % 86400) / 3600)).padStart(2, "0") + "h";
  }

  const ago = (s) => (s === null || s === undefined ? null : duration(Math.max(0, s)) + " ago");
  const within = (s) => (s === null || s === undefined ? null : s > 0 ? "in " + duration(s) : "due");

  function chip(text, className) {
    const span = document.createElement("span");
    span.className = "chip" + (className ? " " + className : "");
    span.append(visible(text, 40));
    span.setAttribute("title", titleOf(text));
    return span;
  }

  // --- the table of held keys -------------------------------------------------------

  function renderPage(page) {
    const body = document.querySelector("#leases tbody");
    const rows = [];
    for (const held of page.keys) {
      held.leases.forEach((lease, index) => {
        const tr = document.createElement("tr");
        tr.dataset.key = held.key;
        if (lease.expires_in !== null && lease.expires_in <= 0) tr.className = "due";
        const span = held.leases.length;
        if (index === 0) {
          const key = cell(held.key, "key", MAX_SHOWN);
          key.rowSpan = span;
          tr.append(key);
        }
        tr.append(
          cell(lease.foreign ? lease.holder : lease.task), // a foreign client: what the store names it by
          cell(lease.task_id, "mono"),
          cell(lease.hostname),
          cell(lease.pid, "num"),
          cell(lease.fencing_token, "num mono"),
          cell(ago(lease.age), "num"),
          cell(within(lease.expires_in), "num left"),
          cell(ago(lease.renewed_ago), "num")
        );
        if (index === 0) {
          const slots = cell(held.limit && held.limit > 1 ? held.leases.length + " of " + held.limit : null, "num");
          const line = document.createElement("td");
          held.line.forEach((waiter) => line.append(chip(waiter.id, waiter.priority ? "priority" : "")));
          if (!held.line.length) line.textContent = "–";
          const rerun = cell(held.rerun, "mono");
          const queued = cell(held.queued, "mono");
          const actions = document.createElement("td");
          actions.className = "actions";
          if (state.config && state.config.release) {
            const button = document.createElement("button");
            button.type = "button";
            button.textContent = "Release…";
            button.className = "release";
            button.addEventListener("click", () => askRelease(held));
            actions.append(button);
          }
          for (const td of [slots, line, rerun, queued, actions]) {
            td.rowSpan = span;
            tr.append(td);
          }
        }
        rows.push(tr);
      });
    }
    body.replaceChildren(...rows);
    $("empty").hidden = page.keys.length > 0;
    const keys = page.keys.length === 1 ? " key" : " keys";
    $("held-count").textContent = "(" + page.keys.length + (page.cursor ? "+" + keys + " on this page" : keys) + ")";
    state.next = page.cursor;
    $("next").disabled = !page.cursor;
    $("first").disabled = state.cursor === null;
    $("pageinfo").textContent = "page " + (state.cursors.length + 1);
  }

  // --- beat -------------------------------------------------------------------------

  function renderBeat(beat) {
    const box = $("beat");
    if (!beat.leaders || !beat.leaders.length) {
      const p = document.createElement("p");
      p.className = "muted";
      p.textContent = "No leader-elected beat holds a lease.";
      box.replaceChildren(p);
      return;
    }
    const parts = [];
    for (const leader of beat.leaders) {
      const p = document.createElement("p");
      p.append("Leader of ");
      const code = document.createElement("code");
      code.append(visible(leader.key, MAX_SHOWN));
      p.append(code, ": ");
      p.append(visible(leader.hostname || "?"), " pid ", visible(leader.pid === null ? "?" : leader.pid));
      p.append(", token ", visible(leader.fencing_token), ", renewed ", ago(leader.renewed_ago) || "–");
      parts.push(p);
      if (leader.entries.length) {
        const table = document.createElement("table");
        const head = document.createElement("tr");
        for (const name of ["Entry", "Last sent", "Sends", "Token"]) {
          const th = document.createElement("th");
          th.textContent = name;
          head.append(th);
        }
        table.append(head);
        for (const entry of leader.entries) {
          const tr = document.createElement("tr");
          const sent = entry.last_run_at === null ? null : new Date(entry.last_run_at * 1000).toLocaleString();
          tr.append(
            cell(entry.name),
            cell(entry.error || sent),
            cell(entry.total_run_count, "num"),
            cell(entry.fencing_token, "num mono")
          );
          table.append(tr);
        }
        parts.push(table);
      }
    }
    box.replaceChildren(...parts);
  }

  // --- the feed ---------------------------------------------------------------------

  const KIND_TEXT = {
    skipped: "skipped",
    requeued: "requeued",
    coalesced: "coalesced",
    lost: "lease lost",
    released: "released",
    missed: "missed",
  };

  function renderFeed(feed) {
    const list = $("feed");
    const prefix = state.config.key_prefix + state.filter;
    for (const event of feed.events || []) {
      if (state.seen.has(event.id)) continue;
      state.seen.add(event.id);
      if (event.kind !== "missed" && !(typeof event.key === "string" && event.key.startsWith(prefix))) continue;
      const li = document.createElement("li");
      li.dataset.kind = String(event.kind);
      const kind = document.createElement("span");
      kind.className = "kind " + String(event.kind).replace(/[^a-z]/g, "");
      kind.textContent = KIND_TEXT[event.kind] || String(event.kind);
      const when = document.createElement("span");
      when.className = "muted";
      when.textContent = typeof event.at === "number" ? new Date(event.at * 1000).toLocaleTimeString() + " " : "";
      li.append(when, kind, " ");
      if (event.kind === "missed") {
        li.append(visible(event.count + " event(s) could not be reported from " + event.host + " pid " + event.pid));
      } else {
        const code = document.createElement("code");
        code.append(visible(event.key, 80));
        code.setAttribute("title", titleOf(event.key));
        li.append(code, " ");
        const detail = [];
        if (event.task) detail.push(event.task + (event.task_id ? "[" + event.task_id + "]" : ""));
        // Whom it was held by: a task id, or a holder that is no task in words (a lock, a
        // foreign client); events of earlier versions name task ids only.
        const holder = event.holder || event.other;
        if (event.kind === "coalesced" && event.other) detail.push("into rerun " + event.other);
        else if (event.kind === "released") {
          if (holder) detail.push("held by " + holder);
          if (event.left_alone) detail.push("left alone: " + event.left_alone);
          detail.push("by " + event.by);
        } else if (holder) detail.push("held by " + holder);
        if (event.kind === "requeued" && typeof event.countdown === "number") detail.push("back in " + duration(event.countdown));
        if (event.reason) detail.push(event.reason);
        if (event.host && event.kind !== "released") detail.push("on " + event.host + " pid " + event.pid);
        li.append(visible(detail.join(" · "), 400));
      }
      list.prepend(li);
    }
    while (list.children.length > MAX_FEED) list.lastElementChild.remove();
    $("feed-empty").hidden = list.children.length > 0;
  }

  // --- the stream -------------------------------------------------------------------

  function query() {
    const params = new URLSearchParams();
    if (state.filter) params.set("filter", state.filter);
    if (state.cursor) params.set("cursor", state.cursor);
    return params.toString();
  }

  function connect() {
    if (state.source) state.source.close();
    const source = new EventSource("api/stream?" + query());
    state.source = source;
    source.addEventListener("snapshot", (message) => {
      if (source !== state.source) return;
      const snapshot = JSON.parse(message.data);
      const status = $("status");
      const error = snapshot.page.error || snapshot.beat.error || snapshot.feed.error;
      $("error").hidden = !error;
      $("error").textContent = error || "";
      status.className = "status " + (error ? "down" : "live");
      status.textContent = (error ? "store not answering · " : "live · ") + new Date(snapshot.at * 1000).toLocaleTimeString();
      document.body.dataset.refreshed = String(snapshot.at);
      if (!snapshot.page.error) renderPage(snapshot.page);
      if (!snapshot.beat.error) renderBeat(snapshot.beat);
      if (!snapshot.feed.error) renderFeed(snapshot.feed);
    });
    source.addEventListener("error", () => {
      const status = $("status");
      status.className = "status down";
      status.textContent = "reconnecting…";
    });
  }

  // --- releasing ----------------------------------------------------------------------

  function askRelease(held) {
    // The holders confirmed are those a release frees: never a foreign client's.
    const ours = held.leases.filter((lease) => !lease.foreign);
    state.pending = { key: held.key, tokens: ours.map((lease) => lease.fencing_token) };
    const key = $("confirm-key");
    key.replaceChildren(visible(held.key));
    const holders = held.leases.map((lease) => {
      const li = document.createElement("li");
      const token = lease.fencing_token === null ? "" : ", fencing token " + lease.fencing_token;
      li.append(visible(lease.holder + token + (lease.foreign ? " (left alone)" : ""), 300));
      return li;
    });
    $("confirm-holders").replaceChildren(...holders);
    $("confirm-error").hidden = true;
    $("token").value = state.token || "";
    $("confirm").showModal();
    $("token").focus();
  }

  async function release(event) {
    event.preventDefault();
    const pending = state.pending;
    const token = $("token").value;
    const response = await fetch("api/release", {
      method: "POST",
      headers: { "content-type": "application/json", "x-release-token": token },
      body: JSON.stringify(pending),
      credentials: "same-origin",
    });
    let answer = {};
    try {
      answer = await response.json();
    } catch (e) {
      answer = { error: "the server answered " + response.status };
    }
    if (!response.ok) {
      const error = $("confirm-error");
      error.hidden = false;
      error.textContent = answer.error || "refused (" + response.status + ")";
      if (response.status === 403) state.token = null;
      return;
    }
    state.token = token;
    $("confirm").close();
    const status = $("status");
    const left = answer.left_alone && answer.left_alone.length ? "; left alone: " + answer.left_alone.join(", ") : "";
    status.textContent = "released " + answer.released + " lease(s)" + left;
  }

  // --- start ------------------------------------------------------------------------

  async function start() {
    const response = await fetch("api/config", { credentials: "same-origin" });
    state.config = await response.json();
    $("store").textContent = state.config.store;
    $("prefix").replaceChildren(visible(state.config.key_prefix));
    $("mode").textContent = state.config.release ? "releasing is on (token needed)" : "read-only";
    document.body.dataset.release = state.config.release ? "on" : "off";
    let timer = null;
    $("filter").addEventListener("input", () => {
      clearTimeout(timer);
      timer = setTimeout(() => {
        state.filter = $("filter").value;
        state.cursors = [];
        state.cursor = null;
        $("feed").replaceChildren();
        state.seen.clear();
        connect();
      }, 250);
    });
    $("next").addEventListener("click", () => {
      if (!state.next) return;
      state.cursors.push(state.cursor);
      state.cursor = state.next;
      connect();
    });
    $("first").addEventListener("click", () => {
      state.cursors = [];
      state.cursor = null;
      connect();
    });
    $("cancel").addEventListener("click", () => $("confirm").close());
    $("confirm-form").addEventListener("submit", release);
    connect();
  }

  start();
})();
