// ringserve chat page: conversations in localStorage, answers generated in the background and
// followed with EventSource, so a reload, a second tab or a network drop never loses text.
//
// Sending: POST /v1/messages (or /v1/chat/completions) with `Prefer: respond-async` and an
// Idempotency-Key. The 202 answer gives the message id and a stream_url carrying a short-lived
// stream token (an EventSource cannot send an API key). The page stores the message id, and with
// every event the text so far and the seq of the last event (ids are `<message_id>:<seq>`), in
// one localStorage write; after a reload it reconnects with `last_event_id=<id>:<seq>` and drops
// any event whose seq it already has, so the text has no gap and no repeat.
//
// A stream ends only at its terminal event (Anthropic message_stop or error, OpenAI [DONE] or
// {"error": ...}); then the page closes its EventSource. EventSource reconnects by itself after a
// drop (sending Last-Event-ID); when the server refuses a connection instead it gives up without
// saying why, so the page asks the same URL with fetch and acts on the status: 401 the stream
// token expired (get a fresh one: POST /v1/messages/{id}/stream_token), 410 the log expired or no
// longer holds the resume point, 204 the stream had already ended (both: read GET
// /v1/messages/{id}, polling while it still generates), 404 unknown message, 429/503 try again.
// A resume after the terminal event that is answered 200 with nothing in it (servers before the
// 204 answer) shows up as a connection that ends without an event; on that the page reads the
// message too (and streams on if it is still generating).
//
// Other tabs: every write fires a `storage` event there; a tab showing that conversation merges it
// (store.js) and follows any unfinished answer with its own EventSource. Stop (button or Escape)
// is POST /v1/messages/{id}/cancel; every reader, in every tab, then gets the terminal event.
//
// A model that thinks streams its reasoning before (or between) its answer's text: the page shows
// it in a collapsed "Thinking" section above the answer, filled as it comes (Anthropic
// thinking_delta, OpenAI delta.reasoning_content) and read back from GET /v1/messages/{id}'s
// content with the text.
//
// The model picker lists GET /v1/models (each with its status) and starts on the server's default
// model (GET /health's "model"), or the one the user picked last. A request names the picked
// model; while its answer waits for its first event the page reads GET /v1/models/{id}, and a
// model that is loading shows as "loading the model" with its progress (the stream meanwhile
// has only keepalives). A load that fails ends the answer with the server's reason for it.
//
// All model and user text reaches the DOM as Text nodes (markdown.js builds elements, never HTML).
import { renderMarkdown } from "./markdown.js";
import * as store from "./store.js";

const $ = (id) => document.getElementById(id);
const SETTINGS_KEY = "ringserve.settings";
const API_KEY = "ringserve.apiKey";  // sessionStorage only: this tab, until it closes
const SAVE_MS = 250;                  // most one conversation is written per this many ms while streaming
const WATCH_MS = 1000;                // a following tab notes it is still watching this often
const TIMING_GAP_MS = 3000;           // away longer than this (tab closed): timings are not measurable
const POLL_MS = 1000;
const RENDER_MS = 50;                 // an answer's Markdown is rendered again at most this often while streaming
const LOAD_POLL_MS = 500;             // a waiting answer reads its model's load progress this often
const FALLBACK_MODEL = "ringserve";   // the name sent before the models are known (a default model answers it)

// The read side of each surface: what an event adds to the answer, and whether it ends the stream;
// `reasoning` reads the reasoning of GET /v1/messages/{id}'s `content` (in the surface's shape).
const SURFACES = {
  anthropic: {
    path: "/v1/messages",
    maxTemperature: 1,
    events: ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
             "message_delta", "message_stop", "error"],
    body: (model, messages, s) => ({ model, max_tokens: s.maxTokens, temperature: s.temperature, stream: true, messages }),
    read(name, data, answer) {
      if (name === "content_block_delta" && data.delta.type === "text_delta") answer.text(data.delta.text);
      else if (name === "content_block_delta" && data.delta.type === "thinking_delta") answer.thinking(data.delta.thinking);
      else if (name === "message_delta") answer.finish(data.delta.stop_reason, data.usage.output_tokens, data.delta.ringserve_cancelled === true);
      else if (name === "message_stop") return true;
      else if (name === "error") { answer.fail(`${data.error.type}: ${data.error.message}`); return true; }
      return false;
    },
    reasoning: (content) => (content || []).filter((b) => b.type === "thinking").map((b) => b.thinking).join(""),
  },
  openai: {
    path: "/v1/chat/completions",
    maxTemperature: 2,
    events: null,  // unnamed events only ("message")
    body: (model, messages, s) => ({ model, max_tokens: s.maxTokens, temperature: s.temperature, stream: true,
                                     stream_options: { include_usage: true }, messages }),
    read(name, data, answer) {
      if (data === "[DONE]") return true;
      if (data.error) { answer.fail(`${data.error.type}: ${data.error.message}`); return true; }
      for (const choice of data.choices || []) {
        if (choice.delta && choice.delta.reasoning_content) answer.thinking(choice.delta.reasoning_content);
        if (choice.delta && choice.delta.content) answer.text(choice.delta.content);
        if (choice.finish_reason) answer.finish(choice.finish_reason, null, choice.ringserve_cancelled === true);
      }
      if (data.usage) answer.finish(null, data.usage.completion_tokens);
      return false;
    },
    reasoning: (message) => (message && message.reasoning_content) || "",
  },
};

const STATUS_FROM_SERVER = { complete: "done", cancelled: "stopped", failed: "error", interrupted: "error" };

const state = {
  conv: null,               // the conversation on screen
  keysOn: false,            // the server asked for an API key
  defaultModel: null,       // the server's default model (GET /health), null: none
  picked: null,             // the model the user picked last (kept in the settings), null: none
  followers: new Map(),     // assistant message id -> Follower (this conversation's unfinished answers)
  views: new Map(),         // message id -> its DOM parts
  logs: new Map(),          // message id -> connection log lines (this tab)
  saveTimers: new Map(),    // conversation id -> pending write
  banners: new Map(),       // reason -> text
  keyWaiters: new Set(),    // followers paused until a valid key is given
  healthTimer: null,
  leaving: false,           // the page is being unloaded: requests it aborts are not failures
  index: new Map(),         // conversation id -> {id, title, updatedAt, busy}: the sidebar
};

// ---------------------------------------------------------------------------------------------
// Small helpers

function apiKey() {
  return sessionStorage.getItem(API_KEY) || "";
}

function authHeaders() {
  const key = apiKey();
  return key ? { "Authorization": `Bearer ${key}`, "x-api-key": key } : {};
}

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

function errorText(data, status) {
  return (data && data.error && data.error.message) || `HTTP ${status}`;
}

class Unreachable extends Error {}

/** fetch with the API key; {status, data, message}. A network failure throws Unreachable. */
async function api(path, { method = "GET", headers = {}, body } = {}) {
  let resp;
  try {
    resp = await fetch(path, { method, body, cache: "no-store", headers: { ...headers, ...authHeaders() } });
  } catch (err) {
    serverUnreachable();
    throw new Unreachable(String(err));
  }
  serverReachable();
  let data = null;
  try {
    data = await resp.json();
  } catch {
    // a body that is not JSON (a proxy's error page): the status says enough
  }
  if (resp.status === 401) keyRefused(errorText(data, 401));
  return { status: resp.status, data, message: errorText(data, resp.status) };
}

function seqOf(lastEventId, messageId) {
  const cut = lastEventId.lastIndexOf(":");
  if (cut < 0 || lastEventId.slice(0, cut) !== messageId) return null;
  const seq = Number(lastEventId.slice(cut + 1));
  return Number.isInteger(seq) ? seq : null;
}

// ---------------------------------------------------------------------------------------------
// Banner: server down, model loading, storage full

function setBanner(reason, text, isError = false) {
  if (text) state.banners.set(reason, { text, isError });
  else state.banners.delete(reason);
  const shown = [...state.banners.values()].at(-1);
  $("banner").hidden = !shown;
  $("banner").textContent = shown ? shown.text : "";
  $("banner").className = shown && shown.isError ? "error" : "";
}

function serverUnreachable() {
  setBanner("server", "The server is not reachable. Retrying…", true);
  if (state.healthTimer === null) state.healthTimer = setTimeout(checkHealth, 2000);
}

function serverReachable() {
  if (state.banners.has("server")) setBanner("server", null);
}

async function checkHealth() {
  state.healthTimer = null;
  let resp;
  try {
    resp = await fetch("/health", { cache: "no-store" });
  } catch {
    serverUnreachable();
    return;
  }
  const body = await resp.json().catch(() => ({}));
  if (body.status === "loading") {
    setBanner("server", "The model is still loading…");
    state.healthTimer = setTimeout(checkHealth, 1000);
  } else if (body.status === "draining") {
    setBanner("server", "The server is shutting down; answers in progress may be interrupted.", true);
    state.healthTimer = setTimeout(checkHealth, 2000);
  } else {
    setBanner("server", null);
  }
}

// ---------------------------------------------------------------------------------------------
// API key (only when the server asks for one)

function showKeyPanel(text, isError) {
  $("key-panel").hidden = false;
  $("key-status").textContent = text;
  $("key-status").className = isError ? "error" : "";
}

function keyRefused(message) {
  state.keysOn = true;
  const text = apiKey() ? `The server refused the API key: ${message}` : `This server needs an API key: ${message}`;
  showKeyPanel(text, true);
}

async function useKey(event) {
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (key) sessionStorage.setItem(API_KEY, key);
  else sessionStorage.removeItem(API_KEY);
  $("api-key").value = "";
  await checkServer();
}

/** GET /v1/models without and then with the key: are keys on, is ours good, which model. */
async function checkServer() {
  let open;
  try {
    open = await fetch("/v1/models", { cache: "no-store" });
  } catch {
    serverUnreachable();
    setTimeout(checkServer, 2000);
    return;
  }
  serverReachable();
  if (open.status === 503) {
    setBanner("server", "The model is still loading…");
    setTimeout(checkServer, 1000);
    return;
  }
  setBanner("server", null);
  state.keysOn = open.status === 401;
  $("key-button").hidden = !state.keysOn;
  let models = open.ok ? await open.json().catch(() => null) : null;
  if (state.keysOn) {
    if (!apiKey()) {
      showKeyPanel("This server needs an API key.", false);
      $("api-key").focus();
      return;
    }
    const resp = await api("/v1/models").catch(() => null);
    if (!resp || resp.status !== 200) return;  // api() has shown why
    models = resp.data;
    for (const follower of state.keyWaiters) follower.resume();
    state.keyWaiters.clear();
  }
  $("key-panel").hidden = true;
  if (models && Array.isArray(models.data)) {
    state.defaultModel = await serverDefaultModel();
    showModels(models.data);
  }
}

// ---------------------------------------------------------------------------------------------
// Models: the picker, and a model's load

const MODEL_STATES = { loaded: "loaded", loading: "loading", unloaded: "not loaded", failed: "failed to load" };

function percent(share) {
  return `${Math.round(share * 100)}%`;
}

/** A model's status object of GET /v1/models ({value, progress, error}) in words. */
function statusWords(status) {
  if (!status || typeof status.value !== "string") return "";
  if (status.value === "loading" && typeof status.progress === "number") return `loading ${percent(status.progress)}`;
  return MODEL_STATES[status.value] || status.value;
}

function optionText(model) {
  const words = statusWords(model.status);
  return words ? `${model.id} · ${words}` : model.id;
}

/** GET /health's default model (null: none, or no answer). */
async function serverDefaultModel() {
  try {
    const body = await (await fetch("/health", { cache: "no-store" })).json();
    return typeof body.model === "string" ? body.model : null;
  } catch {
    return null;
  }
}

/**
 * Fill the picker with GET /v1/models' `data`, keeping its choice: the model on it, else the one
 * picked last, else the server's default, else the first listed.
 */
function showModels(models) {
  const picker = $("model");
  const ids = models.map((m) => m.id);
  const current = [...picker.options].map((o) => o.value);
  if (ids.length === current.length && ids.every((id, i) => id === current[i])) {
    models.forEach((m, i) => { picker.options[i].textContent = optionText(m); });  // an open list stays open
    return;
  }
  const wanted = [picker.value, state.picked, state.defaultModel].find((id) => id && ids.includes(id));
  picker.replaceChildren(...models.map((m) => {
    const option = el("option", null, null, optionText(m));
    option.value = m.id;
    return option;
  }));
  picker.value = wanted || ids[0] || "";
}

/** The picker's line for model `id`, with its status as just read. */
function showModelStatus(id, status) {
  const option = [...$("model").options].find((o) => o.value === id);
  if (option) option.textContent = optionText({ id, status });
}

/** Read the models again (their statuses change as they load and unload). */
async function refreshModels() {
  if (state.keysOn && !apiKey()) return;
  const resp = await api("/v1/models").catch(() => null);
  if (resp && resp.status === 200 && resp.data && Array.isArray(resp.data.data)) showModels(resp.data.data);
}

/** The status object of model `id` (GET /v1/models/{id}), or null when it cannot be read. */
async function modelStatus(id) {
  const resp = await api(`/v1/models/${encodeURIComponent(id)}`).catch(() => null);
  return resp && resp.status === 200 && resp.data && resp.data.status ? resp.data.status : null;
}

/** What an answer says when its model failed to load: the server's reason, and what to do. */
function loadFailure(model, status) {
  const why = status.error || `the model ${model} failed to load`;
  return `${why.charAt(0).toUpperCase()}${why.slice(1)}. Sending again tries to load it once more.`;
}

// ---------------------------------------------------------------------------------------------
// Settings

function loadSettings() {
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}");
  } catch {
    // start from the defaults
  }
  if (saved.surface in SURFACES) $("surface").value = saved.surface;
  if (saved.maxTokens) $("max-tokens").value = saved.maxTokens;
  if (saved.temperature !== undefined) $("temperature").value = saved.temperature;
  if (typeof saved.model === "string") state.picked = saved.model;
  limitTemperature();
}

function limitTemperature() {
  const max = SURFACES[$("surface").value].maxTemperature;
  $("temperature").max = String(max);
  if (Number($("temperature").value) > max) $("temperature").value = String(max);
}

function settings() {
  limitTemperature();
  const s = {
    surface: $("surface").value,
    maxTokens: Math.max(1, Math.floor(Number($("max-tokens").value) || 512)),
    temperature: Math.max(0, Number($("temperature").value) || 0),
    model: state.picked,
  };
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(s));
  return s;
}

// ---------------------------------------------------------------------------------------------
// Conversations

function newConversation(id = store.newId()) {
  const now = Date.now();
  return { id, title: "", createdAt: now, updatedAt: now, messages: [] };
}

/** Write now (merging other tabs' writes); a full storage is shown, not thrown. */
function saveNow(conv) {
  clearTimeout(state.saveTimers.get(conv.id));
  state.saveTimers.delete(conv.id);
  if (conv.deleted) return;
  try {
    const changed = store.save(conv);
    setBanner("storage", null);
    index(conv.id, conv);
    if (conv === state.conv) showChanges(changed);
  } catch (err) {
    setBanner("storage", `This browser's storage is full; the conversation is not saved (${err.name}).`, true);
  }
}

function saveSoon(conv) {
  if (!state.saveTimers.has(conv.id)) state.saveTimers.set(conv.id, setTimeout(() => saveNow(conv), SAVE_MS));
}

function flushSaves() {
  if (state.conv && state.saveTimers.has(state.conv.id)) saveNow(state.conv);
}

function busy(conv) {
  return conv.messages.some((m) => m.role === "assistant" && !store.isTerminal(m));
}

function entry(conv) {
  return { id: conv.id, title: conv.title, updatedAt: conv.updatedAt, busy: busy(conv) };
}

/** Note `conv` (or its removal: null) in the sidebar's index; re-render the sidebar if that changed it. */
function index(id, conv) {
  const before = JSON.stringify(state.index.get(id) || null);
  if (conv) state.index.set(id, entry(conv));
  else state.index.delete(id);
  if (JSON.stringify(state.index.get(id) || null) !== before) renderSidebar();
}

function recent() {
  return [...state.index.values()].sort((a, b) => b.updatedAt - a.updatedAt);
}

function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren();
  for (const conv of recent()) {
    const li = document.createElement("li");
    if (state.conv && conv.id === state.conv.id) li.className = "current";
    const button = document.createElement("button");
    button.type = "button";
    button.textContent = conv.title || "New conversation";
    button.title = conv.title;
    if (conv.busy) button.classList.add("busy");
    button.addEventListener("click", () => { location.hash = conv.id; closeDrawer(); });
    li.appendChild(button);
    list.appendChild(li);
  }
}

function openConversation(id) {
  if (state.conv && state.conv.id === id) return;
  for (const follower of state.followers.values()) follower.close();
  state.followers.clear();
  flushSaves();
  state.conv = store.load(id) || newConversation(id);
  renderConversation();
  renderSidebar();
  follow(false);
}

function openFromHash() {
  const id = decodeURIComponent(location.hash.slice(1));
  if (/^[0-9a-f]{8,64}$/.test(id)) {
    openConversation(id);
    return;
  }
  const last = recent()[0];
  history.replaceState(null, "", `#${last ? last.id : store.newId()}`);
  openConversation(decodeURIComponent(location.hash.slice(1)));
}

function newChat() {
  location.hash = store.newId();
  closeDrawer();
  $("input").focus();
}

function deleteChat() {
  const conv = state.conv;
  if (!conv || !confirm(`Delete “${conv.title || "this conversation"}”?`)) return;
  for (const follower of state.followers.values()) follower.close();
  state.followers.clear();
  conv.deleted = true;
  store.remove(conv.id);
  index(conv.id, null);
  state.conv = null;
  const next = recent()[0];
  location.hash = next ? next.id : store.newId();
}

/** Follow every unfinished answer of the conversation on screen. */
function follow(fromOtherTab) {
  for (const msg of state.conv.messages) {
    if (msg.role === "assistant" && !store.isTerminal(msg) && !state.followers.has(msg.id)) {
      const follower = new Follower(state.conv, msg);
      state.followers.set(msg.id, follower);
      follower.start({ fresh: false, fromOtherTab });
    }
  }
  updateComposer();
}

function onStorage(event) {
  if (event.storageArea !== localStorage || event.key === null) return;
  if (!event.key.startsWith(store.PREFIX)) return;
  const id = event.key.slice(store.PREFIX.length);
  if (state.conv && id === state.conv.id) {
    if (event.newValue === null) {  // deleted in another tab
      for (const follower of state.followers.values()) follower.close();
      state.followers.clear();
      state.conv = null;
      openFromHash();
      return;
    }
    showChanges(store.adopt(state.conv, store.load(id)));
    index(id, state.conv);
  } else {
    let conv = null;
    try {
      conv = event.newValue === null ? null : JSON.parse(event.newValue);
    } catch {
      // not ours to read
    }
    index(id, conv);
  }
}

/** Show messages another tab changed or added; follow the unfinished ones. */
function showChanges(changed) {
  if (!changed.length) return;
  for (const msgId of changed) {
    const follower = state.followers.get(msgId);
    if (follower) follower.adopted();
  }
  if (changed.every((msgId) => state.views.has(msgId))) {
    for (const msg of state.conv.messages) if (changed.includes(msg.id)) updateMessage(msg);
  } else {
    renderConversation();
  }
  follow(true);
}

// ---------------------------------------------------------------------------------------------
// Rendering

function el(tag, className, parent, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}

function renderConversation() {
  const box = $("messages");
  box.replaceChildren();
  state.views.clear();
  const conv = state.conv;
  $("title").textContent = conv.title || "New conversation";
  document.title = conv.title ? `${conv.title} · ringserve` : "ringserve";
  if (!conv.messages.length) el("p", "empty", box, "Send a message to start. Answers keep streaming through reloads.");
  for (const msg of conv.messages) {
    const article = el("article", `msg ${msg.role}`, box);
    article.dataset.id = msg.id;
    if (msg.role === "user") {
      el("div", "body", article, msg.text);
      continue;
    }
    const thinking = el("details", "thinking", article);
    el("summary", null, thinking, "Thinking");
    const view = { article, thinking, thinkingText: el("div", "thinking-text", thinking),
                   body: el("div", "body", article), rendered: null, timer: null };
    view.src = el("pre", "src", article);
    view.src.hidden = true;
    view.load = el("div", "load", article);
    view.loadBar = el("progress", null, view.load);
    view.loadText = el("span", null, view.load);
    view.note = el("p", "note", article);
    const meta = el("div", "meta", article);
    view.state = el("span", "state", meta);
    const stat = (label, className, after = "") => {
      const span = el("span", null, meta, label);
      const value = el("b", className, span);
      if (after) span.append(after);
      return value;
    };
    view.ttft = stat("TTFT ", "ttft");
    view.tps = stat("", "tps", " tok/s");
    view.stopReason = stat("stop ", "stop-reason");
    view.reconnects = stat("reconnects ", "reconnects");
    view.model = el("span", "model", meta);
    el("span", "surface", meta, `${msg.surface} · t=${msg.temperature ?? "?"}`);
    const toggle = el("button", "toggle-src", meta, "source");
    toggle.type = "button";
    toggle.addEventListener("click", () => {
      view.src.hidden = !view.src.hidden;
      view.body.hidden = !view.src.hidden;
      toggle.textContent = view.src.hidden ? "source" : "rendered";
    });
    const log = el("details", "log", article);
    view.logSummary = el("summary", null, log);
    view.logList = el("ol", null, log);
    state.views.set(msg.id, view);
    updateMessage(msg);
  }
  updateComposer();
  box.scrollTop = box.scrollHeight;
}

function stateLabel(msg) {
  const follower = state.followers.get(msg.id);
  if (!store.isTerminal(msg) && follower) {
    if (follower.stopping) return "stopping";
    if (follower.reconnecting) return "reconnecting";
    if (follower.loading !== null) return "loading the model";
  }
  return { sending: "sending", waiting: "waiting for the model", streaming: "streaming", done: "done",
           stopped: "stopped", error: "error" }[msg.status];
}

/** Render the answer's text (Markdown and source), keeping the view at the bottom if it was. */
function renderText(view, msg) {
  clearTimeout(view.timer);
  view.timer = null;
  if (view.rendered === msg.text) return;
  const box = $("messages");
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  view.body.replaceChildren(renderMarkdown(msg.text));
  view.src.textContent = msg.text;
  view.rendered = msg.text;
  if (atBottom) box.scrollTop = box.scrollHeight;
}

function updateMessage(msg) {
  const view = state.views.get(msg.id);
  if (!view) return;
  const box = $("messages");
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  if (view.rendered !== msg.text) {
    // The whole text is rendered again: at most every RENDER_MS while it streams, at once at its end.
    if (view.rendered === null || store.isTerminal(msg)) renderText(view, msg);
    else if (view.timer === null) view.timer = setTimeout(() => renderText(view, msg), RENDER_MS);
  }
  view.thinking.hidden = !msg.reasoning;
  if (view.thinkingText.textContent !== (msg.reasoning || "")) view.thinkingText.textContent = msg.reasoning || "";
  const label = stateLabel(msg);
  view.article.dataset.state = label;
  view.article.dataset.messageId = msg.messageId || "";
  view.state.textContent = label;
  view.state.className = `state ${label.split(" ")[0]}`;
  view.ttft.textContent = msg.firstAt && !msg.ttftLost ? `${Math.max(0, Math.round(msg.firstAt - msg.sentAt))} ms` : "–";
  const seconds = (msg.finishedAt - msg.firstAt) / 1000;
  view.tps.textContent = msg.outputTokens && msg.finishedAt && msg.firstAt && !msg.tpsLost && seconds > 0
    ? (msg.outputTokens / seconds).toFixed(1) : "–";
  view.stopReason.textContent = msg.stopReason || "–";
  view.reconnects.textContent = String(msg.reconnects || 0);
  view.model.textContent = msg.model || "";
  const follower = state.followers.get(msg.id);
  const loading = follower && !store.isTerminal(msg) ? follower.loading : null;
  view.load.hidden = loading === null;
  if (loading !== null) {
    view.loadBar.value = loading;
    view.loadText.textContent = `Loading ${msg.model}… ${percent(loading)}`;
  }
  const notes = [];
  if (msg.status === "stopped") notes.push("Stopped: the text above is what was generated before the stop.");
  if (msg.error) notes.push(msg.error);
  if (msg.note) notes.push(msg.note);
  view.note.textContent = notes.join(" ");
  view.note.className = msg.status === "error" ? "note error" : "note";
  const lines = state.logs.get(msg.id) || [];
  view.logSummary.textContent = `connection log (${lines.length})`;
  if (view.logList.childElementCount !== lines.length) {
    view.logList.replaceChildren(...lines.map((line) => el("li", null, null, line)));
  }
  if (atBottom) box.scrollTop = box.scrollHeight;
}

function logLine(msg, text) {
  if (!state.logs.has(msg.id)) state.logs.set(msg.id, []);
  state.logs.get(msg.id).push(`${new Date().toISOString().slice(11, 23)} ${text}`);
}

function updateComposer() {
  const running = state.conv && busy(state.conv);
  $("stop").disabled = !running;
  $("send").disabled = Boolean(running);
}

// ---------------------------------------------------------------------------------------------
// One unfinished answer, followed by this tab

class Follower {
  constructor(conv, msg) {
    this.conv = conv;
    this.msg = msg;
    this.es = null;
    this.closed = false;
    this.reconnecting = false;
    this.stopping = false;
    this.stopRequested = false;
    this.watchTimer = null;
    this.url = null;
    this.refusals = 0;  // refused connections in a row
    this.awaitingId = false;  // another tab posts this answer; its message id is still to come
    this.loading = null;  // the share of its model loaded (0..1) while the answer waits for the load
    this.watchingLoad = false;
    // what SURFACES[...].read adds to the answer
    this.answer = {
      text: (t) => {
        if (!msg.firstAt) msg.firstAt = Date.now();
        msg.text += t;
        msg.status = "streaming";
      },
      thinking: (t) => {
        if (!msg.firstAt) msg.firstAt = Date.now();
        msg.reasoning = (msg.reasoning || "") + t;
        msg.status = "streaming";
      },
      // A cancelled message keeps an SDK stop reason (end_turn, stop) and says "ringserve_cancelled": true.
      finish: (reason, tokens, cancelled = false) => {
        if (reason !== null) msg.stopReason = reason;
        if (tokens !== null) msg.outputTokens = tokens;
        if (cancelled) msg.cancelled = true;
      },
      fail: (message) => { msg.error = message; },
    };
  }

  start({ fresh, fromOtherTab }) {
    const msg = this.msg;
    if (!fresh && msg.watchedAt && Date.now() - msg.watchedAt > TIMING_GAP_MS && !fromOtherTab) {
      // nobody watched for a while (the tab was closed): arrival times no longer measure the model
      msg.tpsLost = true;
      if (!msg.firstAt) msg.ttftLost = true;
    }
    this.watchTimer = setInterval(() => { this.msg.watchedAt = Date.now(); saveSoon(this.conv); }, WATCH_MS);
    if (msg.status === "sending") {
      if (!fromOtherTab) {
        this.post();  // again after a reload: the same body and Idempotency-Key give the same message
        return;
      }
      // Another tab is posting it: give that tab time to store the message id (see adopted()).
      this.awaitingId = true;
      setTimeout(() => {
        if (this.closed || !this.awaitingId) return;
        this.awaitingId = false;
        if (this.msg.status === "sending") {
          this.post();
        } else {
          this.connect();
          this.stopIfRequested();
        }
      }, 5000);
    } else if (msg.source === "stored") {
      this.readStored(null);
    } else {
      this.connect();
    }
  }

  /** Another tab stored a newer state of this answer (store.adopt has put it in this.msg). */
  adopted() {
    if (store.isTerminal(this.msg)) {
      this.close();
      state.followers.delete(this.msg.id);
    } else if (this.awaitingId && this.msg.messageId) {
      this.awaitingId = false;
      this.connect();
      this.stopIfRequested();
    }
  }

  close() {
    this.closed = true;
    clearInterval(this.watchTimer);
    if (this.es) this.es.close();
    this.es = null;
    state.keyWaiters.delete(this);
  }

  changed(now = false) {
    if (now) saveNow(this.conv);
    else saveSoon(this.conv);
    updateMessage(this.msg);
    updateComposer();
  }

  end(status) {
    const msg = this.msg;
    msg.status = status;
    if (!msg.finishedAt) msg.finishedAt = Date.now();
    this.close();
    state.followers.delete(msg.id);
    this.changed(true);
    refreshModels();  // the picker's statuses: a model may have loaded for it
  }

  endWithError(text) {
    this.msg.error = text;
    this.end("error");
  }

  /**
   * End with `error`; one that came before any text, from a model that failed to load, is said
   * as the server's reason for the failed load (not the surface's error type).
   */
  async endWithFailure(error) {
    const msg = this.msg;
    this.close();  // no reconnect while the model's status is read
    const status = !msg.text && !msg.reasoning && msg.model ? await modelStatus(msg.model) : null;
    this.endWithError(status && status.value === "failed" ? loadFailure(msg.model, status) : error);
  }

  /**
   * While the answer waits for its first event, read its model's status every LOAD_POLL_MS and
   * show a load's progress, until the model is loaded (a failed load: the stream's error follows)
   * or the answer moves on.
   */
  async watchLoad() {
    if (this.watchingLoad || !this.msg.model) return;
    this.watchingLoad = true;
    try {
      while (!this.closed && this.msg.status === "waiting") {
        const status = await modelStatus(this.msg.model);
        if (this.closed || this.msg.status !== "waiting") break;
        if (status) showModelStatus(this.msg.model, status);
        const loading = status && status.value === "loading" ? (status.progress ?? 0) : null;
        if (loading !== this.loading) {
          if (loading !== null && this.loading === null) logLine(this.msg, `waiting for the model ${this.msg.model} to load`);
          this.loading = loading;
          updateMessage(this.msg);
        }
        if (status && (status.value === "loaded" || status.value === "failed")) break;
        await sleep(LOAD_POLL_MS);
      }
    } finally {
      this.watchingLoad = false;
      if (this.loading !== null) {
        this.loading = null;
        updateMessage(this.msg);
      }
    }
  }

  async post() {
    const msg = this.msg;
    let resp;
    try {
      resp = await api(SURFACES[msg.surface].path, {
        method: "POST",
        headers: { "Content-Type": "application/json", "Prefer": "respond-async", "Idempotency-Key": msg.idempotencyKey },
        body: msg.request,
      });
    } catch (err) {
      if (state.leaving) return;  // the reload or close aborted it: the next page posts again
      this.endWithError(`Could not reach the server, so nothing was generated (${err.message}). Send again when it is back.`);
      return;
    }
    if (resp.status === 401) {
      this.endWithError(`The server refused the API key: ${resp.message}`);
      return;
    }
    if (resp.status !== 202) {
      this.endWithFailure(`The server refused the request (HTTP ${resp.status}): ${resp.message}`);
      return;
    }
    const body = resp.data;
    msg.messageId = body.id;
    msg.url = body.url;
    msg.streamUrl = body.stream_url;
    msg.tokenExpires = body.stream_token_expires_at;
    msg.status = "waiting";
    this.changed(true);  // also when this tab has moved on to another conversation: it is stored
    if (this.closed) return;
    this.connect();
    this.stopIfRequested();
  }

  streamUrl() {
    const msg = this.msg;
    const url = new URL(msg.streamUrl, location.href);
    if (msg.lastSeq >= 0) url.searchParams.set("last_event_id", `${msg.messageId}:${msg.lastSeq}`);
    return url.href;
  }

  async connect() {
    if (this.closed || store.isTerminal(this.msg)) return;
    const msg = this.msg;
    if (msg.tokenExpires && Date.now() / 1000 > msg.tokenExpires - 2) {
      if (!(await this.renew()) || this.closed) return;
    }
    this.url = this.streamUrl();
    const es = new EventSource(this.url);
    this.es = es;
    if (msg.status === "waiting") this.watchLoad();
    let gotEvent = false;
    let opened = false;
    const onEvent = (ev) => {
      if (this.es !== es) return;
      const seq = seqOf(ev.lastEventId, msg.messageId);
      if (seq === null || seq <= msg.lastSeq) return;  // replayed: already shown (or by another tab)
      gotEvent = true;
      this.reconnecting = false;
      let data;
      try {
        data = ev.data === "[DONE]" ? ev.data : JSON.parse(ev.data);
      } catch {
        this.endWithError(`The server sent an event that is not JSON (${ev.lastEventId}).`);
        return;
      }
      msg.lastSeq = seq;
      msg.watchedAt = Date.now();
      if (SURFACES[msg.surface].read(ev.type, data, this.answer)) {
        if (msg.error) this.endWithFailure(msg.error);
        else this.end(msg.cancelled ? "stopped" : "done");
      } else {
        this.changed(false);
      }
    };
    const events = SURFACES[msg.surface].events;
    if (events) {
      // "error" is also EventSource's own connection-error event; only a MessageEvent is the server's.
      for (const name of events) es.addEventListener(name, (ev) => { if (ev instanceof MessageEvent) onEvent(ev); });
    } else {
      es.onmessage = onEvent;
    }
    es.onopen = () => {
      if (this.es !== es) return;
      opened = true;
      this.refusals = 0;
      if (msg.connects > 0) {
        msg.reconnects = (msg.reconnects || 0) + 1;
        logLine(msg, `reconnect #${msg.reconnects}: resumed after event ${msg.messageId}:${msg.lastSeq}`);
      }
      msg.connects = (msg.connects || 0) + 1;
      this.reconnecting = false;
      this.changed(false);
    };
    es.onerror = (ev) => {
      if (this.es !== es || ev instanceof MessageEvent || this.closed) return;
      if (es.readyState === EventSource.CONNECTING) {
        if (opened && !gotEvent) {
          // A connection that ended without a new event: a resume after the terminal event is
          // answered so by servers without the 204 answer. Ask the message.
          es.close();
          this.es = null;
          logLine(msg, `a connection ended without new events after ${msg.lastSeq}; reading the message`);
          this.readStored(null);
          return;
        }
        if (!this.reconnecting) logLine(msg, `connection lost after event ${msg.lastSeq}; reconnecting with Last-Event-ID`);
        this.reconnecting = true;
        opened = false;
        gotEvent = false;
        if (!state.banners.has("server")) checkHealth();
        updateMessage(msg);
      } else {  // refused: EventSource gives up; find out why
        es.close();
        this.es = null;
        this.refused();
      }
    };
  }

  async refused() {
    const msg = this.msg;
    let status;
    try {
      const ctl = new AbortController();
      const resp = await fetch(this.url, { cache: "no-store", signal: ctl.signal });
      status = resp.status;
      ctl.abort();  // a 200 is a stream: only its status was wanted
      serverReachable();
    } catch {
      serverUnreachable();
      this.reconnecting = true;
      updateMessage(msg);
      await sleep(1000);
      this.connect();
      return;
    }
    if (this.closed) return;
    this.refusals += 1;
    if (this.refusals > 3 && (status === 200 || status === 401)) {
      logLine(msg, `the stream was refused ${this.refusals} times in a row (HTTP ${status}); reading the message`);
      this.readStored(null);
      return;
    }
    switch (status) {
      case 200:  // refused a moment ago, open now
        this.connect();
        break;
      case 204:
        logLine(msg, "the stream had already ended (204); reading the message");
        this.readStored(null);
        break;
      case 401:
        logLine(msg, "the stream was refused (401); resuming with a fresh stream token");
        msg.tokenExpires = 0;
        this.connect();
        break;
      case 404:
        this.endWithError("The server does not know this message (its store was reset?).");
        break;
      case 410:
        logLine(msg, `the stream log no longer holds event ${msg.messageId}:${msg.lastSeq} (410); reading the stored message`);
        this.readStored("The stream log no longer holds this answer (it expired, or the ring moved on); the text is the stored message.");
        break;
      case 429:
      case 503:
        this.reconnecting = true;
        updateMessage(msg);
        await sleep(1000);
        this.connect();
        break;
      default:
        logLine(msg, `the stream was refused (HTTP ${status}); reading the message`);
        this.readStored(null);
    }
  }

  /** A fresh stream token; false when none can be had (the reason is shown). */
  async renew() {
    const msg = this.msg;
    let resp;
    try {
      resp = await api(`${msg.url}/stream_token`, { method: "POST" });
    } catch {
      this.reconnecting = true;
      updateMessage(msg);
      await sleep(1000);
      return this.closed ? false : this.renew();
    }
    if (this.closed) return false;
    if (resp.status === 401) {
      this.waitForKey();
      return false;
    }
    if (resp.status !== 200) {
      this.endWithError(`No stream token for this message (HTTP ${resp.status}): ${resp.message}`);
      return false;
    }
    msg.streamUrl = resp.data.stream_url;
    msg.tokenExpires = resp.data.stream_token_expires_at;
    logLine(msg, "got a fresh stream token");
    return true;
  }

  waitForKey() {
    this.msg.note = "Waiting for a valid API key to continue this answer.";
    state.keyWaiters.add(this);
    updateMessage(this.msg);
  }

  resume() {
    this.msg.note = null;
    if (this.msg.source === "stored") this.readStored(null);
    else this.connect();
  }

  /**
   * GET /v1/messages/{id}. A finished message ends the answer with its stored text. One still
   * generating: with `note` (the log cannot serve it), show its text and poll; without, stream again.
   */
  async readStored(note) {
    const msg = this.msg;
    let resp;
    try {
      resp = await api(msg.url);
    } catch {
      this.reconnecting = true;
      updateMessage(msg);
      await sleep(POLL_MS);
      if (!this.closed) this.readStored(note);
      return;
    }
    if (this.closed) return;
    if (resp.status === 401) {
      this.waitForKey();
      return;
    }
    if (resp.status !== 200) {
      this.endWithError(`Could not read the message (HTTP ${resp.status}): ${resp.message}`);
      return;
    }
    const body = resp.data;
    this.reconnecting = false;
    const final = STATUS_FROM_SERVER[body.status];
    if (final === undefined && note === null && msg.source !== "stored") {
      await sleep(500);  // still generating: stream on, but not in a tight loop
      this.connect();
      return;
    }
    msg.text = body.text;
    msg.reasoning = SURFACES[msg.surface].reasoning(body.content);
    msg.model = body.model;  // the model that wrote it (the store keeps it)
    msg.source = "stored";
    if (note) msg.note = note;
    if (final === undefined) {
      msg.status = body.text ? "streaming" : "waiting";
      this.changed(false);
      await sleep(POLL_MS);
      if (!this.closed) this.readStored(note);
      return;
    }
    msg.stopReason = body.stop_reason;
    msg.outputTokens = body.usage.output_tokens;
    msg.tpsLost = true;  // the end was not seen as it happened
    if (final === "error") msg.error = `The generation ${body.status}: ${body.error || "no reason given"}.`;
    this.end(final);
  }

  /** Stop was asked for before the message had an id; it has one now. */
  stopIfRequested() {
    if (!this.stopRequested) return;
    this.stopRequested = false;
    this.stopping = false;
    this.stop();
  }

  async stop() {
    const msg = this.msg;
    if (store.isTerminal(msg) || this.stopping) return;
    this.stopping = true;
    updateMessage(msg);
    if (!msg.messageId) {
      this.stopRequested = true;  // post() cancels once the server has named the message
      return;
    }
    logLine(msg, "stop: cancelling the generation on the server");
    let resp;
    try {
      resp = await api(`${msg.url}/cancel`, { method: "POST" });
    } catch {
      this.stopping = false;
      msg.note = "Could not reach the server to stop the answer.";
      updateMessage(msg);
      return;
    }
    this.stopping = false;
    if (resp.status !== 200) {
      msg.note = `The server did not stop the answer (HTTP ${resp.status}): ${resp.message}`;
      updateMessage(msg);
      return;
    }
    // The stream ends with its terminal event too; whichever comes first ends the answer.
    if (!store.isTerminal(msg) && STATUS_FROM_SERVER[resp.data.status]) {
      msg.text = resp.data.text;
      msg.reasoning = SURFACES[msg.surface].reasoning(resp.data.content);
      msg.stopReason = resp.data.stop_reason;
      msg.outputTokens = resp.data.usage.output_tokens;
      this.end(STATUS_FROM_SERVER[resp.data.status]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Sending and stopping

function historyFor(conv) {
  const turns = [];
  for (let i = 0; i < conv.messages.length; i += 1) {
    const m = conv.messages[i];
    const next = conv.messages[i + 1];
    if (m.role === "user" && next && next.role === "assistant" && !next.text) {
      i += 1;  // an exchange with no answer text (refused, unreachable) is left out
      continue;
    }
    turns.push({ role: m.role, content: m.text });
  }
  return turns;
}

function send(event) {
  if (event) event.preventDefault();
  const text = $("input").value;
  if (!text.trim() || busy(state.conv)) return;
  if (state.keysOn && !apiKey()) {
    showKeyPanel("Enter the API key first.", true);
    $("api-key").focus();
    return;
  }
  const conv = state.conv;
  const s = settings();
  const now = Date.now();
  const user = { id: store.newId(), role: "user", text, at: now };
  const messages = [...historyFor(conv), { role: "user", content: text }];
  const model = $("model").value || FALLBACK_MODEL;
  const request = JSON.stringify(SURFACES[s.surface].body(model, messages, s));
  const answer = {
    id: store.newId(), role: "assistant", surface: s.surface, model, temperature: s.temperature, request,
    idempotencyKey: store.newId(), messageId: null, url: null, streamUrl: null, tokenExpires: null,
    text: "", reasoning: "", lastSeq: -1, source: "stream", status: "sending", stopReason: null, outputTokens: null,
    error: null, note: null, reconnects: 0, connects: 0,
    sentAt: now, firstAt: null, finishedAt: null, watchedAt: now, ttftLost: false, tpsLost: false,
  };
  conv.messages.push(user, answer);
  if (!conv.title) conv.title = text.trim().replace(/\s+/g, " ").slice(0, 60);
  conv.updatedAt = now;
  $("input").value = "";
  saveNow(conv);
  renderConversation();
  const follower = new Follower(conv, answer);
  state.followers.set(answer.id, follower);
  follower.start({ fresh: true, fromOtherTab: false });
  updateComposer();
}

function stop() {
  for (const follower of state.followers.values()) follower.stop();
}

// ---------------------------------------------------------------------------------------------
// Phone-width drawer and wiring

function closeDrawer() {
  $("sidebar").classList.remove("open");
  $("menu").setAttribute("aria-expanded", "false");
}

function toggle(buttonId, panelId) {
  const panel = $(panelId);
  panel.hidden = !panel.hidden;
  $(buttonId).setAttribute("aria-expanded", String(!panel.hidden));
}

function init() {
  loadSettings();
  $("composer").addEventListener("submit", send);
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("delete-chat").addEventListener("click", deleteChat);
  $("key-form").addEventListener("submit", useKey);
  $("key-button").addEventListener("click", () => { $("key-panel").hidden = false; $("api-key").focus(); });
  $("surface").addEventListener("change", () => { limitTemperature(); settings(); });
  $("model").addEventListener("change", () => { state.picked = $("model").value; settings(); });
  $("model").addEventListener("pointerenter", refreshModels);
  $("model").addEventListener("focus", refreshModels);
  $("max-tokens").addEventListener("change", settings);
  $("temperature").addEventListener("change", settings);
  $("settings-toggle").addEventListener("click", () => toggle("settings-toggle", "settings"));
  $("menu").addEventListener("click", () => {
    const opened = $("sidebar").classList.toggle("open");
    $("menu").setAttribute("aria-expanded", String(opened));
  });
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (ev) => {
    if (ev.key === "Escape") {
      stop();
      closeDrawer();
    }
  });
  window.addEventListener("storage", onStorage);
  window.addEventListener("hashchange", openFromHash);
  window.addEventListener("pagehide", () => { state.leaving = true; flushSaves(); });
  window.addEventListener("pageshow", () => { state.leaving = false; });
  document.addEventListener("visibilitychange", () => { if (document.hidden) flushSaves(); });
  for (const conv of store.loadAll()) state.index.set(conv.id, entry(conv));
  openFromHash();
  checkServer();
}

init();
