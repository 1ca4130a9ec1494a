// A small Markdown renderer for model answers. Everything the model wrote is
// HTML-escaped first; only the constructs below become tags, links only for
// http(s) and mailto URLs. Handles text still being streamed (an unclosed code
// fence renders as code). Supported: fenced code (with a copy button), headings,
// paragraphs (single newlines kept as line breaks), bullet and numbered lists
// (nested by indentation), block quotes, tables, rules, inline code, bold,
// italics, strike-through, links.
"use strict";

const Markdown = (() => {
  function escapeHtml(s) {
    return s
      .replace(/&/g, "&amp;")
      .replace(/</g, "&lt;")
      .replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;")
      .replace(/'/g, "&#39;");
  }

  // Inline spans. Code spans are cut out first (their content is literal), the
  // rest is escaped, then emphasis and links are turned into tags.
  function inline(text) {
    const codes = [];
    let s = text.replace(/\u0000/g, "").replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g, (_, ticks, code) => {
      codes.push("<code>" + escapeHtml(code.replace(/^ (.*) $/, "$1")) + "</code>");
      return "\u0000" + (codes.length - 1) + "\u0000";
    });
    s = escapeHtml(s);
    s = s.replace(
      /\[([^\]\n]+)\]\(((?:https?:\/\/|mailto:)[^\s)]+)\)/g,
      '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>'
    );
    s = s.replace(/(\*\*|__)(?=\S)([\s\S]*?\S)\1/g, "<strong>$2</strong>");
    s = s.replace(/(^|[^*\w])\*(?=\S)([^*\n]*?\S)\*(?!\*)/g, "$1<em>$2</em>");
    s = s.replace(/(^|[^_\w])_(?=\S)([^_\n]*?\S)_(?![_\w])/g, "$1<em>$2</em>");
    s = s.replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
    s = s.replace(/\n/g, "<br>");
    return s.replace(/\u0000(\d+)\u0000/g, (_, i) => codes[Number(i)]);
  }

  function codeBlock(lang, code) {
    const label = lang ? escapeHtml(lang) : "code";
    return (
      '<div class="codeblock"><div class="codebar"><span>' + label +
      '</span><button type="button" class="copy-code" title="Copy code">Copy</button></div>' +
      "<pre><code" + (lang ? ' class="lang-' + escapeHtml(lang) + '"' : "") + ">" +
      escapeHtml(code) + "</code></pre></div>"
    );
  }

  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)[^`]*$/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}> ?/;
  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const TABLE_SEP = /^\s*\|?\s*:?-{1,}:?\s*(\|\s*:?-{1,}:?\s*)*\|?\s*$/;

  function startsBlock(line, next) {
    return (
      FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
      ITEM.test(line) || (line.includes("|") && next !== undefined && TABLE_SEP.test(next))
    );
  }

  function cells(row) {
    return row.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());
  }

  function list(lines, i) {
    // Items at the first item's indentation; deeper lines belong to the item
    // above (a nested list or a continuation).
    const first = lines[i].match(ITEM);
    const indent = first[1].length;
    const ordered = /\d/.test(first[2]);
    const items = [];
    while (i < lines.length) {
      const line = lines[i];
      const m = line.match(ITEM);
      if (m && m[1].length === indent) {
        items.push([m[3]]);
        i++;
        continue;
      }
      if (!line.trim()) {
        const next = lines[i + 1];
        const nm = next === undefined ? null : next.match(ITEM);
        const sameList = nm && nm[1].length === indent && /\d/.test(nm[2]) === ordered;
        if (next !== undefined && next.trim() && (next.match(/^(\s*)/)[1].length > indent || sameList)) {
          items[items.length - 1].push("");
          i++;
          continue;
        }
        break;
      }
      const lead = line.match(/^(\s*)/)[1].length;
      if (lead > indent || (!m && !startsBlock(line, lines[i + 1]))) {
        items[items.length - 1].push(line.slice(Math.min(lead, indent + 2)));
        i++;
        continue;
      }
      break;
    }
    const start = ordered ? parseInt(first[2], 10) : 1;
    const tag = ordered ? "ol" : "ul";
    const html = items
      .map((body) => {
        while (body.length > 1 && !body[body.length - 1].trim()) body.pop();
        const nested = body.slice(1).some((l) => ITEM.test(l) || FENCE.test(l) || !l.trim());
        return "<li>" + (nested ? blocks(body.join("\n")) : inline(body.join("\n"))) + "</li>";
      })
      .join("");
    return [
      "<" + tag + (ordered && start !== 1 ? ' start="' + start + '"' : "") + ">" + html + "</" + tag + ">",
      i,
    ];
  }

  function blocks(src) {
    const lines = src.replace(/\r\n?/g, "\n").split("\n");
    const out = [];
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (!line.trim()) {
        i++;
      } else if ((m = line.match(FENCE))) {
        const fence = m[1];
        const code = [];
        i++;
        while (i < lines.length && !lines[i].trim().startsWith(fence)) code.push(lines[i++]);
        i++; // the closing fence (or the end of a streamed, unfinished block)
        out.push(codeBlock(m[2], code.join("\n")));
      } else if ((m = line.match(HEADING))) {
        const level = m[1].length;
        out.push("<h" + level + ">" + inline(m[2]) + "</h" + level + ">");
        i++;
      } else if (RULE.test(line)) {
        out.push("<hr>");
        i++;
      } else if (QUOTE.test(line)) {
        const quoted = [];
        while (i < lines.length && lines[i].trim() && QUOTE.test(lines[i])) {
          quoted.push(lines[i].replace(QUOTE, ""));
          i++;
        }
        out.push("<blockquote>" + blocks(quoted.join("\n")) + "</blockquote>");
      } else if (ITEM.test(line)) {
        const [html, next] = list(lines, i);
        out.push(html);
        i = next;
      } else if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1])) {
        const head = cells(line);
        const aligns = cells(lines[i + 1]).map((c) =>
          c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : ""
        );
        const attr = (k) => (aligns[k] ? ' style="text-align:' + aligns[k] + '"' : "");
        let html = "<table><thead><tr>" + head.map((c, k) => "<th" + attr(k) + ">" + inline(c) + "</th>").join("") + "</tr></thead><tbody>";
        i += 2;
        while (i < lines.length && lines[i].includes("|") && lines[i].trim()) {
          html += "<tr>" + cells(lines[i]).map((c, k) => "<td" + attr(k) + ">" + inline(c) + "</td>").join("") + "</tr>";
          i++;
        }
        out.push('<div class="table-wrap">' + html + "</tbody></table></div>");
      } else {
        const para = [line];
        i++;
        while (i < lines.length && lines[i].trim() && !startsBlock(lines[i], lines[i + 1])) para.push(lines[i++]);
        out.push("<p>" + inline(para.join("\n")) + "</p>");
      }
    }
    return out.join("\n");
  }

  return { render: blocks, escapeHtml, inline };
})();

if (typeof module !== "undefined") module.exports = Markdown; // for node-based checks
