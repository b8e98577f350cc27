// Conversations kept in the browser's localStorage, one key per conversation.
//
// Key "ringserve.conv.<id>" holds {id, title, createdAt, updatedAt, messages}. A user message is
// {id, role: "user", text, at}. An assistant message is the state of one answer:
//   request, idempotencyKey, surface   the POST body (a string, re-sent byte for byte after a reload
//                                      during the POST, with the same Idempotency-Key)
//   model                              the model it asked for (the stored message's, once read back)
//   messageId, url, streamUrl, tokenExpires   from the 202 answer (streamUrl carries a stream token)
//   text, reasoning, lastSeq           the text and the reasoning of every event up to seq lastSeq,
//                                      written together in one setItem, so a reload resumes after
//                                      lastSeq with neither a gap nor a repeat; source "stored"
//                                      instead marks text read from GET /v1/messages/{id} (no seq:
//                                      never resumed by stream)
//   status                             sending | waiting | streaming | done | stopped | error
//   stopReason, outputTokens, error, note, reconnects, connects
//   sentAt, firstAt, finishedAt, watchedAt (epoch ms), ttftLost, tpsLost
// Several tabs write the same keys: a write first merges what is stored (see better()), so a
// tab never replaces a finished answer, or one further along, with its own older copy.
export const PREFIX = "ringserve.conv.";
export const TERMINAL = new Set(["done", "stopped", "error"]);

/** A random id (hex); crypto.randomUUID needs a secure context, getRandomValues does not. */
export function newId() {
  return Array.from(crypto.getRandomValues(new Uint8Array(12)), (b) => b.toString(16).padStart(2, "0")).join("");
}

export function isTerminal(msg) {
  return TERMINAL.has(msg.status);
}

/** Whether assistant record `b` should replace `a` (the same answer as seen by two tabs). */
export function better(a, b) {
  if (isTerminal(a) || isTerminal(b)) return !isTerminal(a) && isTerminal(b);
  if (a.source === "stored" || b.source === "stored") return false;  // text without a seq: never mixed
  if (!a.messageId !== !b.messageId) return Boolean(b.messageId);
  return b.lastSeq > a.lastSeq;
}

/** The stored conversation `id`, or null. */
export function load(id) {
  const raw = localStorage.getItem(PREFIX + id);
  if (raw === null) return null;
  try {
    return JSON.parse(raw);
  } catch {
    return null;
  }
}

/** Every stored conversation, most recently updated first. */
export function loadAll() {
  const all = [];
  for (let i = 0; i < localStorage.length; i += 1) {
    const key = localStorage.key(i);
    if (key.startsWith(PREFIX)) {
      const conv = load(key.slice(PREFIX.length));
      if (conv) all.push(conv);
    }
  }
  return all.sort((a, b) => b.updatedAt - a.updatedAt);
}

/**
 * Bring `conv` (in memory) up to date with `stored`, in place, keeping object identity: a message
 * object is replaced field by field when the stored one is better, and stored messages it lacks
 * are inserted. Returns the ids of the messages that changed.
 */
export function adopt(conv, stored) {
  const changed = [];
  if (!stored) return changed;
  const mine = new Map(conv.messages.map((m) => [m.id, m]));
  const merged = [];
  for (const theirs of stored.messages) {
    const m = mine.get(theirs.id);
    if (m === undefined) {
      merged.push(theirs);
      changed.push(theirs.id);
    } else {
      if (m.role === "assistant" && better(m, theirs)) {
        for (const key of Object.keys(m)) delete m[key];
        Object.assign(m, theirs);
        changed.push(m.id);
      }
      merged.push(m);
      mine.delete(theirs.id);
    }
  }
  merged.push(...mine.values());  // mine, not stored yet
  conv.messages = merged;
  conv.title = conv.title || stored.title;
  conv.updatedAt = Math.max(conv.updatedAt, stored.updatedAt);
  return changed;
}

/**
 * Write `conv` after merging what another tab may have stored into it (the ids of the messages
 * that merge changed are returned). Throws when the storage is full.
 */
export function save(conv) {
  const changed = adopt(conv, load(conv.id));
  localStorage.setItem(PREFIX + conv.id, JSON.stringify(conv));
  return changed;
}

export function remove(id) {
  localStorage.removeItem(PREFIX + id);
}
