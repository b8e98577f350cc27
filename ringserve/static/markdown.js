// A small Markdown renderer that builds DOM nodes and never parses HTML.
//
// Model text is untrusted. Nothing here uses innerHTML, insertAdjacentHTML or document.write:
// every character of the source ends up in a Text node (so `<script>` or `<img onerror>` show as
// the characters they are) or decides which element to create. The only attribute taken from the
// source is a link's href, and only for the schemes in SAFE_SCHEMES, after the URL parser has
// normalised it. Raw HTML, images and other schemes (javascript:, data:, vbscript:, relative
// URLs) stay text.
//
// The subset (a CommonMark subset, https://spec.commonmark.org/0.31.2/):
//   blocks:  paragraphs (a single newline is a line break, as chat models mean it), ``` and ~~~
//            code fences (an unclosed fence runs to the end, so a streaming answer shows code as
//            it comes), ATX headings (#..######), "-", "*", "+" and "1." / "1)" lists (a line
//            indented under an item continues it), "> " block quotes, --- / *** / ___ rules.
//   inline:  `code` (any backtick run length), **bold** / __bold__, *italic* / _italic_ (not
//            inside a word for "_"), [text](url) and <url> links, backslash escapes.
const SAFE_SCHEMES = new Set(["http:", "https:", "mailto:"]);
const FENCE = /^ {0,3}(`{3,}|~{3,})(.*)$/;
const HEADING = /^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$/;
const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
const BULLET = /^( {0,3})([-*+])[ \t]+(.*)$/;
const ORDERED = /^( {0,3})(\d{1,9})([.)])[ \t]+(.*)$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const PUNCTUATION = /[!-/:-@[-`{-~]/;

/** The href for `url` if its scheme is safe, else null. */
export function safeHref(url) {
  let parsed;
  try {
    parsed = new URL(url);  // no base: relative URLs throw and stay text
  } catch {
    return null;
  }
  return SAFE_SCHEMES.has(parsed.protocol) ? parsed.href : null;
}

/** A DocumentFragment with `source` rendered (see the subset above). */
export function renderMarkdown(source, doc = document) {
  const out = doc.createDocumentFragment();
  renderBlocks(source.replace(/\r\n?/g, "\n").split("\n"), out, doc);
  return out;
}

function el(doc, tag, parent) {
  const node = doc.createElement(tag);
  parent.appendChild(node);
  return node;
}

function isBlank(line) {
  return line.trim() === "";
}

// Does `line` start a block other than a paragraph (so it ends a paragraph)?
function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || BULLET.test(line) ||
         ORDERED.test(line) || QUOTE.test(line);
}

function renderBlocks(lines, parent, doc) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (isBlank(line)) {
      i += 1;
    } else if ((m = FENCE.exec(line))) {
      const marker = m[1];
      const info = m[2].trim().split(/\s+/)[0];
      const body = [];
      i += 1;
      while (i < lines.length && !isClosingFence(lines[i], marker)) body.push(lines[i++]);
      i += 1;  // the closing fence (or past the end)
      const pre = el(doc, "pre", parent);
      const code = el(doc, "code", pre);
      if (info) code.dataset.lang = info;
      code.textContent = body.join("\n");
    } else if ((m = HEADING.exec(line))) {
      renderInline(m[2] || "", el(doc, `h${Math.min(6, m[1].length + 2)}`, parent), doc);
      i += 1;
    } else if (RULE.test(line)) {
      el(doc, "hr", parent);
      i += 1;
    } else if (QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) { body.push(m[1]); i += 1; }
      renderBlocks(body, el(doc, "blockquote", parent), doc);
    } else if (BULLET.test(line) || ORDERED.test(line)) {
      i = renderList(lines, i, parent, doc);
    } else {
      const body = [line];
      i += 1;
      while (i < lines.length && !isBlank(lines[i]) && !startsBlock(lines[i])) body.push(lines[i++]);
      const p = el(doc, "p", parent);
      body.forEach((text, n) => {
        if (n > 0) el(doc, "br", p);
        renderInline(text, p, doc);
      });
    }
  }
}

function isClosingFence(line, marker) {
  const m = FENCE.exec(line);
  return m !== null && m[1][0] === marker[0] && m[1].length >= marker.length && m[2].trim() === "";
}

// One list from lines[start]; returns the index after it.
function renderList(lines, start, parent, doc) {
  const ordered = !BULLET.test(lines[start]);
  const first = ordered ? ORDERED.exec(lines[start]) : BULLET.exec(lines[start]);
  const list = el(doc, ordered ? "ol" : "ul", parent);
  if (ordered && first[2] !== "1") list.setAttribute("start", String(Number(first[2])));
  const marker = ordered ? first[3] : first[2];
  const indent = first[1].length;  // an item marker indented 2 more than this starts a nested list
  let i = start;
  let items = [];
  const flush = () => {
    if (!items.length) return;
    const li = el(doc, "li", list);
    renderBlocks(items, li, doc);
    if (!items.some(isBlank)) {  // a tight item: its paragraphs are plain lines
      for (const p of [...li.children]) if (p.tagName === "P") p.replaceWith(...p.childNodes);
    }
    items = [];
  };
  while (i < lines.length) {
    const line = lines[i];
    const m = ordered ? ORDERED.exec(line) : BULLET.exec(line);
    if (m && (ordered ? m[3] : m[2]) === marker && m[1].length < indent + 2) {
      flush();
      items.push(ordered ? m[4] : m[3]);
    } else if (!isBlank(line) && /^[ \t]{2,}/.test(line)) {
      items.push(line.replace(/^(?: {1,4}|\t)/, ""));  // continues the item (a nested list, say)
    } else if (isBlank(line) && i + 1 < lines.length && /^[ \t]{2,}\S/.test(lines[i + 1])) {
      items.push("");
    } else if (isBlank(line) && i + 1 < lines.length && (ordered ? ORDERED : BULLET).test(lines[i + 1])) {
      // a blank line between two items keeps the list going
    } else {
      break;
    }
    i += 1;
  }
  flush();
  return i;
}

// Inline spans of `text` appended to `parent`. `links`: whether links may start here (not inside one).
function renderInline(text, parent, doc, links = true) {
  let plain = "";
  const flushText = () => {
    if (plain) parent.appendChild(doc.createTextNode(plain));
    plain = "";
  };
  let i = 0;
  while (i < text.length) {
    const c = text[i];
    if (c === "\\" && i + 1 < text.length && PUNCTUATION.test(text[i + 1])) {
      plain += text[i + 1];
      i += 2;
      continue;
    }
    if (c === "`") {
      const run = /^`+/.exec(text.slice(i))[0];
      const close = findBacktickRun(text, i + run.length, run.length);
      if (close < 0) {
        plain += run;
        i += run.length;
        continue;
      }
      flushText();
      let body = text.slice(i + run.length, close);
      if (/^ .*\S.* $/.test(body)) body = body.slice(1, -1);
      el(doc, "code", parent).textContent = body;
      i = close + run.length;
      continue;
    }
    if (links && c === "[") {
      const link = parseLink(text, i);
      if (link) {
        flushText();
        const a = el(doc, "a", parent);
        a.setAttribute("href", link.href);
        a.setAttribute("rel", "noopener noreferrer nofollow");
        a.setAttribute("target", "_blank");
        renderInline(link.label, a, doc, false);
        i = link.end;
        continue;
      }
    }
    if (links && c === "<") {
      const m = /^<([a-zA-Z][a-zA-Z0-9+.-]{1,31}:[^\s<>]*)>/.exec(text.slice(i));
      const href = m && safeHref(m[1]);
      if (href) {
        flushText();
        const a = el(doc, "a", parent);
        a.setAttribute("href", href);
        a.setAttribute("rel", "noopener noreferrer nofollow");
        a.setAttribute("target", "_blank");
        a.textContent = m[1];
        i += m[0].length;
        continue;
      }
    }
    if (c === "*" || c === "_") {
      const span = parseEmphasis(text, i);
      if (span) {
        flushText();
        renderInline(span.body, el(doc, span.strong ? "strong" : "em", parent), doc, links);
        i = span.end;
        continue;
      }
    }
    plain += c;
    i += 1;
  }
  flushText();
}

function findBacktickRun(text, from, length) {
  const re = /`+/g;
  re.lastIndex = from;
  let m;
  while ((m = re.exec(text))) if (m[0].length === length) return m.index;
  return -1;
}

// [label](url) at text[start], with a safe url; null otherwise.
function parseLink(text, start) {
  let depth = 0;
  let close = -1;
  for (let j = start; j < text.length; j += 1) {
    if (text[j] === "\\") { j += 1; continue; }
    if (text[j] === "[") depth += 1;
    else if (text[j] === "]" && --depth === 0) { close = j; break; }
  }
  if (close < 0 || text[close + 1] !== "(") return null;
  const m = /^\(\s*<?([^\s()<>]+)>?(?:\s+"[^"]*")?\s*\)/.exec(text.slice(close + 1));
  const href = m && safeHref(m[1]);
  if (!href) return null;
  return { label: text.slice(start + 1, close), href, end: close + 1 + m[0].length };
}

// *x*, _x_, **x**, __x__ at text[start]; null when it does not open a span.
function parseEmphasis(text, start) {
  const c = text[start];
  const strong = text[start + 1] === c;
  const delim = strong ? c + c : c;
  const open = start + delim.length;
  if (open >= text.length || /\s/.test(text[open]) || text[open] === c) return null;
  if (c === "_" && start > 0 && /[\p{L}\p{N}]/u.test(text[start - 1])) return null;  // snake_case
  for (let j = open + 1; j <= text.length - delim.length; j += 1) {
    if (text[j] === "\\") { j += 1; continue; }
    if (text[j] === "`") {  // a code span inside: skip it whole
      const run = /^`+/.exec(text.slice(j))[0];
      const end = findBacktickRun(text, j + run.length, run.length);
      if (end >= 0) j = end + run.length - 1;
      continue;
    }
    if (text.startsWith(delim, j) && !/\s/.test(text[j - 1]) &&
        (strong || (text[j - 1] !== c && text[j + 1] !== c)) &&
        !(c === "_" && j + delim.length < text.length && /[\p{L}\p{N}]/u.test(text[j + delim.length]))) {
      return { strong, body: text.slice(open, j), end: j + delim.length };
    }
  }
  return null;
}
