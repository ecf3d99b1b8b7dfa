// Preserves text, coloured: split into tokens, each a <span> holding text.  The
// concatenated text is always exactly the input; embedded references (#:...) get
// their own span so they stand out.
import { h } from "./lib.js";

const DELIM = new Set(["<", ">", "[", "]", "{", "}", '"', ",", ";", " ", "\t", "\n", "\r"]);
const OPEN = { "<": ">", "[": "]", "{": "}" };

function scanString(t, i, q) { // t[i] is the opening quote: index after the closing one
  for (let j = i + 1; j < t.length; j++) {
    if (t[j] === "\\") j++;
    else if (t[j] === q) return j + 1;
  }
  return t.length;
}

function scanValue(t, i) { // the end of one value starting at i
  while (i < t.length && /\s/.test(t[i])) i++;
  if (i >= t.length) return i;
  const c = t[i];
  if (c === '"' || c === "|") return scanString(t, i, c);
  if (OPEN[c]) {
    const stack = [OPEN[c]];
    let j = i + 1;
    while (j < t.length && stack.length) {
      const d = t[j];
      if (d === '"' || d === "|") { j = scanString(t, j, d); continue; }
      if (OPEN[d]) stack.push(OPEN[d]);
      else if (d === stack[stack.length - 1]) stack.pop();
      j++;
    }
    return j;
  }
  if (c === "#" && t[i + 1] === ":") return scanValue(t, i + 2);
  if (c === "#" && (t[i + 1] === '"' || ((t[i + 1] === "x" || t[i + 1] === "[") && t[i + 2] === '"'))) {
    const q = t.indexOf('"', i);
    return scanString(t, q, '"');
  }
  let j = i + 1;
  while (j < t.length && !DELIM.has(t[j])) j++;
  return j;
}

function pvInto(parent, t, start, end) {
  let i = start;
  let afterOpen = false;
  while (i < end) {
    const c = t[i];
    let j;
    let cls = null;
    if (/\s/.test(c)) {
      j = i + 1;
      while (j < end && /\s/.test(t[j])) j++;
      parent.append(t.slice(i, j));
      i = j;
      continue;
    }
    if (c === "#" && t[i + 1] === ":") {
      j = Math.min(scanValue(t, i + 2), end);
      const span = h("span", { class: "pv-emb", title: "an embedded reference" }, "#:");
      pvInto(span, t, i + 2, j);
      parent.append(span);
      i = j;
      afterOpen = false;
      continue;
    }
    if (c === '"') { j = scanString(t, i, '"'); cls = "pv-str"; }
    else if (c === "|") { j = scanString(t, i, "|"); cls = afterOpen ? "pv-label" : "pv-sym"; }
    else if (c === "#" && (t[i + 1] === '"' || ((t[i + 1] === "x" || t[i + 1] === "[") && t[i + 2] === '"'))) {
      j = scanString(t, t.indexOf('"', i), '"');
      cls = "pv-bytes";
    } else if (OPEN[c] || c === ">" || c === "]" || c === "}" || c === "," || c === ";") {
      j = i + 1;
      cls = "pv-punct";
    } else {
      j = i + 1;
      while (j < end && !DELIM.has(t[j])) j++;
      const word = t.slice(i, j);
      if (afterOpen) cls = "pv-label";
      else if (/^[-+]?(\d|\.\d)/.test(word)) cls = "pv-num";
      else if (word.startsWith("#")) cls = "pv-kw";
      else if (word === "_" || word.startsWith("$")) cls = "pv-pat";
      else cls = "pv-sym";
    }
    j = Math.min(j, end);
    parent.append(h("span", { class: cls }, t.slice(i, j)));
    afterOpen = c === "<";
    i = j;
  }
}

export function pv(text, cls = "") {
  const span = h("span", { class: ("pv " + cls).trim() });
  const t = String(text ?? "");
  if (t.length > 20000) span.append(t); // very long values: plain text, no colours
  else pvInto(span, t, 0, t.length);
  return span;
}
