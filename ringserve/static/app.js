// ringserve playground: create a message with `Prefer: respond-async`, then read it with EventSource.
//
// The 202 answer gives the message id and its stream_url (with a stream token when the server
// uses API keys; it is used exactly as given). EventSource reconnects by itself after a drop and
// sends Last-Event-ID; event ids are `<message_id>:<seq>`, and an event whose seq was already shown
// is dropped, so the text has no gap and no repeat. A stream ends only at its terminal event
// (Anthropic message_stop or error, OpenAI [DONE] or {"error": ...}); then the page closes the
// EventSource, which would otherwise reconnect. If the server refuses the stream (for example 410:
// the log has expired), the page reads GET /v1/messages/{id} for the rest of the text.
"use strict";

const $ = (id) => document.getElementById(id);

const ANTHROPIC_EVENTS = ["message_start", "content_block_start", "content_block_delta",
                          "content_block_stop", "message_delta", "message_stop", "error"];

// Read side of each surface: what an event adds to the view, and whether it ends the stream.
const SURFACES = {
  anthropic: {
    path: "/v1/messages",
    body: (prompt, maxTokens) => ({ model: "ringserve", max_tokens: maxTokens, stream: true,
                                    messages: [{ role: "user", content: prompt }] }),
    read(name, data, view) {
      if (name === "content_block_delta" && data.delta.type === "text_delta") view.text(data.delta.text);
      else if (name === "message_delta") {
        view.finish(data.delta.stop_reason, data.usage.output_tokens, data.delta.ringserve_cancelled === true);
      }
      else if (name === "message_stop") return true;
      else if (name === "error") { view.fail(`${data.error.type}: ${data.error.message}`); return true; }
      return false;
    },
  },
  openai: {
    path: "/v1/chat/completions",
    body: (prompt, maxTokens) => ({ model: "ringserve", max_tokens: maxTokens, stream: true,
                                    stream_options: { include_usage: true },
                                    messages: [{ role: "user", content: prompt }] }),
    read(name, data, view) {
      if (data === "[DONE]") return true;
      if (data.error) { view.fail(`${data.error.type}: ${data.error.message}`); return true; }
      for (const choice of data.choices || []) {
        if (choice.delta && choice.delta.content) view.text(choice.delta.content);
        if (choice.finish_reason) view.finish(choice.finish_reason, null, choice.ringserve_cancelled === true);
      }
      if (data.usage) view.finish(null, data.usage.completion_tokens);
      return false;
    },
  },
};

let current = null;  // the message on screen: {id, url, es, done}

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { "Authorization": `Bearer ${key}`, "x-api-key": key } : {};
}

function logLine(text) {
  const li = document.createElement("li");
  li.textContent = `${new Date().toISOString().slice(11, 23)} ${text}`;
  $("log").appendChild(li);
}

function setStatus(text, isError = false) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "";
}

// The view of one message: text, timings and counters. All DOM writes use textContent.
// A cancelled message has a plain stop reason (end_turn, stop) and "ringserve_cancelled": true.
function makeView(startedAt) {
  let firstAt = null, stopReason = null, outputTokens = null, cancelled = false;
  const stats = () => {
    if (stopReason !== null) $("stop-reason").textContent = stopReason;
    if (outputTokens !== null && firstAt !== null) {
      const seconds = (performance.now() - firstAt) / 1000;
      $("tps").textContent = seconds > 0 ? (outputTokens / seconds).toFixed(1) : "–";
    }
  };
  return {
    text(t) {
      if (firstAt === null) {
        firstAt = performance.now();
        $("ttft").textContent = `${Math.round(firstAt - startedAt)} ms`;
      }
      $("output").textContent += t;
    },
    finish(reason, tokens, wasCancelled = false) {
      if (reason !== null) stopReason = reason;
      if (tokens !== null) outputTokens = tokens;
      if (wasCancelled) cancelled = true;
      stats();
    },
    get cancelled() { return cancelled; },
    fail(message) { setStatus(`error: ${message}`, true); },
  };
}

function seqOf(lastEventId, messageId) {
  const cut = lastEventId.lastIndexOf(":");
  if (cut < 0 || lastEventId.slice(0, cut) !== messageId) return null;
  const seq = Number(lastEventId.slice(cut + 1));
  return Number.isInteger(seq) ? seq : null;
}

function end(msg, view = null) {
  msg.done = true;
  if (msg.es) msg.es.close();
  $("stop").disabled = true;
  $("send").disabled = false;
  if (!$("status").className) setStatus(view && view.cancelled ? "cancelled" : "done");
}

function follow(msg, surface, view, lastSeq = -1) {
  let opened = false, lost = false;
  const es = new EventSource(new URL(msg.stream_url, location.href));
  msg.es = es;
  const onEvent = (ev) => {
    const seq = seqOf(ev.lastEventId, msg.id);
    if (seq === null || seq <= lastSeq) return;  // a replayed event: already shown
    lastSeq = seq;
    const data = ev.data === "[DONE]" ? ev.data : JSON.parse(ev.data);
    if (SURFACES[surface].read(ev.type, data, view)) end(msg, view);
  };
  if (surface === "anthropic") {
    // "error" is also EventSource's own connection-error event; only a MessageEvent is the server's.
    for (const name of ANTHROPIC_EVENTS) es.addEventListener(name, (ev) => { if (ev instanceof MessageEvent) onEvent(ev); });
  } else {
    es.onmessage = onEvent;
  }
  es.onopen = () => {
    if (opened) {
      const count = Number($("reconnects").textContent) + 1;
      $("reconnects").textContent = String(count);
      logLine(`reconnect #${count}: resumed after event ${msg.id}:${lastSeq}`);
    }
    opened = true;
    lost = false;
    if (!msg.done) setStatus("streaming");
  };
  es.onerror = (ev) => {
    if (msg.done || ev instanceof MessageEvent) return;  // the server's own "error" event is handled above
    if (es.readyState === EventSource.CONNECTING) {
      if (!lost) logLine(`connection lost after event ${lastSeq}; reconnecting with Last-Event-ID`);
      lost = true;
      setStatus("reconnecting");
    } else {  // the server refused the stream: an expired stream token, or the log is gone
      es.close();
      if (opened) {
        // it streamed before: most likely the token expired, so resume with a fresh one
        renew(msg, surface, view, lastSeq).catch(() => pollMessage(msg, view));
      } else {
        logLine("the stream was refused; reading the message");
        pollMessage(msg, view);
      }
    }
  };
}

// A fresh stream token (POST /v1/messages/{id}/stream_token), then resume after lastSeq.
async function renew(msg, surface, view, lastSeq) {
  const resp = await fetch(`${msg.url}/stream_token`, { method: "POST", headers: authHeaders() });
  if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
  const body = await resp.json();
  const after = lastSeq >= 0 ? `&last_event_id=${encodeURIComponent(`${msg.id}:${lastSeq}`)}` : "";
  msg.stream_url = body.stream_url + after;
  logLine("the stream was refused; resuming with a fresh stream token");
  follow(msg, surface, view, lastSeq);
}

// GET /v1/messages/{id} until the message is finished; shows any text not yet streamed.
async function pollMessage(msg, view) {
  while (!msg.done) {
    const resp = await fetch(msg.url, { headers: authHeaders() });
    const body = await resp.json();
    if (!resp.ok) { setStatus(`error: ${body.error ? body.error.message : resp.status}`, true); break; }
    const shown = $("output").textContent;
    if (body.text.startsWith(shown) && body.text.length > shown.length) view.text(body.text.slice(shown.length));
    if (body.status !== "queued" && body.status !== "generating") {
      view.finish(body.stop_reason, body.usage.output_tokens, body.status === "cancelled");
      if (body.status === "failed" || body.status === "interrupted") view.fail(body.error || body.status);
      end(msg, view);
      break;
    }
    await new Promise((resolve) => setTimeout(resolve, 500));
  }
}

async function send(event) {
  event.preventDefault();
  if (current && !current.done) end(current);
  const surface = $("surface").value;
  for (const id of ["ttft", "tps", "stop-reason", "message-id"]) $(id).textContent = "–";
  $("output").textContent = "";
  $("reconnects").textContent = "0";
  $("log").textContent = "";
  $("send").disabled = true;
  setStatus("sending");
  const startedAt = performance.now();
  let resp, body;
  try {
    resp = await fetch(SURFACES[surface].path, {
      method: "POST",
      headers: { "Content-Type": "application/json", "Prefer": "respond-async", ...authHeaders() },
      body: JSON.stringify(SURFACES[surface].body($("prompt").value, Number($("max-tokens").value))),
    });
    body = await resp.json();
  } catch (err) {
    setStatus(`error: ${err}`, true);
    $("send").disabled = false;
    return;
  }
  if (resp.status !== 202) {
    setStatus(`error: HTTP ${resp.status} ${body.error ? body.error.message : ""}`, true);
    $("send").disabled = false;
    return;
  }
  current = { id: body.id, url: body.url, stream_url: body.stream_url, es: null, done: false };
  $("message-id").textContent = body.id;
  $("stop").disabled = false;
  setStatus("waiting");
  follow(current, surface, makeView(startedAt));
}

async function stop() {
  if (!current || current.done) return;
  $("stop").disabled = true;
  logLine("stop: cancelling the generation");
  // The stream then ends with its terminal event, marked "ringserve_cancelled": true.
  await fetch(`/v1/messages/${encodeURIComponent(current.id)}/cancel`, { method: "POST", headers: authHeaders() });
}

$("form").addEventListener("submit", send);
$("stop").addEventListener("click", stop);
