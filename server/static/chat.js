// The chat page: conversations kept in localStorage, answers streamed from
// /v1/chat/completions, Stop through an AbortController (closing the stream
// frees the request's slot on the server), tokens/s and time to first token
// under each answer, structured output and tool calls in OpenAI's shapes.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const STORE = "markbase.conversations";
  const SETTINGS = "markbase.settings";
  const DEFAULTS = { model: "", temperature: 0.7, top_p: 1, max_tokens: 512, schema: "", tools: "", tool_choice: "auto" };

  const state = {
    conversations: [],
    currentId: null,
    settings: Object.assign({}, DEFAULTS),
    models: [],
    controller: null, // the AbortController of the answer being streamed
  };

  // ------------------------------------------------------------------ storage
  function load() {
    try {
      const saved = JSON.parse(localStorage.getItem(STORE) || "{}");
      state.conversations = Array.isArray(saved.conversations) ? saved.conversations : [];
      state.currentId = saved.currentId || null;
    } catch (_) {
      state.conversations = [];
    }
    try {
      Object.assign(state.settings, JSON.parse(localStorage.getItem(SETTINGS) || "{}"));
    } catch (_) { /* defaults */ }
    if (!current()) newConversation();
  }
  function save() {
    localStorage.setItem(STORE, JSON.stringify({ conversations: state.conversations, currentId: state.currentId }));
    localStorage.setItem(SETTINGS, JSON.stringify(state.settings));
  }
  function current() {
    return state.conversations.find((c) => c.id === state.currentId) || null;
  }
  function newId() {
    return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
  }
  function newConversation() {
    const open = current();
    if (open && !open.messages.length) return open; // an empty chat is already there
    const conv = { id: newId(), title: "New chat", created: Date.now(), updated: Date.now(), system: "", messages: [] };
    state.conversations.unshift(conv);
    state.currentId = conv.id;
    save();
    return conv;
  }

  // ------------------------------------------------------------------ models
  async function loadModels() {
    const select = $("model");
    try {
      const list = await Api.getJson("/v1/models");
      state.models = list.data || [];
      hideBanner();
    } catch (e) {
      state.models = [];
      if (e.status === 401) {
        showBanner("This server needs an API key: enter it under Settings.");
        openSettings(true);
        $("api-key").focus();
      } else {
        showBanner("Cannot list the models: " + (e.title ? e.title + ": " : "") + e.message);
      }
    }
    select.innerHTML = "";
    for (const m of state.models) {
      const opt = document.createElement("option");
      opt.value = m.id;
      opt.textContent = m.id;
      select.appendChild(opt);
    }
    if (state.models.some((m) => m.id === state.settings.model)) select.value = state.settings.model;
    else if (state.models.length) state.settings.model = state.models[0].id;
    showModelInfo();
  }
  function showModelInfo() {
    const m = state.models.find((x) => x.id === state.settings.model);
    const bits = [];
    if (m && m.architecture) bits.push(m.architecture);
    if (m && m.context_length) bits.push(m.context_length.toLocaleString() + " tokens context");
    $("model-info").textContent = bits.join(" \u00b7 ");
  }

  // ------------------------------------------------------------------ request
  function pendingToolCall(conv) {
    // The first tool call of the last assistant turn that no tool message answered yet.
    let last = -1;
    for (let i = conv.messages.length - 1; i >= 0; i--) {
      if (conv.messages[i].role === "assistant") { last = i; break; }
      if (conv.messages[i].role === "user") return null;
    }
    if (last < 0 || !conv.messages[last].tool_calls) return null;
    const answered = new Set(conv.messages.slice(last + 1).filter((m) => m.role === "tool").map((m) => m.tool_call_id));
    return conv.messages[last].tool_calls.find((c) => !answered.has(c.id)) || null;
  }

  function parseJsonBox(id, hintId, what, wantArray) {
    const text = $(id).value.trim();
    const hint = $(hintId);
    hint.classList.remove("bad");
    if (!text) return undefined;
    try {
      const value = JSON.parse(text);
      if (wantArray && !Array.isArray(value)) throw new Error("expected a JSON array");
      return value;
    } catch (e) {
      hint.textContent = what + " is not valid JSON: " + e.message;
      hint.classList.add("bad");
      openSettings(true);
      throw e;
    }
  }

  function number(id, parse) {
    const v = parse($(id).value);
    return Number.isFinite(v) ? v : undefined;
  }

  function buildRequest(conv) {
    const messages = [];
    if (conv.system && conv.system.trim()) messages.push({ role: "system", content: conv.system });
    for (const m of conv.messages) {
      if (m.role === "assistant") {
        if (!m.content && !m.tool_calls) continue; // an error or a stop before any token
        const out = { role: "assistant", content: m.content || null };
        if (m.tool_calls) out.tool_calls = m.tool_calls;
        messages.push(out);
      } else if (m.role === "tool") {
        messages.push({ role: "tool", tool_call_id: m.tool_call_id, content: m.content });
      } else {
        messages.push({ role: "user", content: m.content });
      }
    }
    const body = {
      model: state.settings.model,
      messages,
      stream: true,
      stream_options: { include_usage: true },
    };
    const temperature = number("temperature", parseFloat);
    const topP = number("top_p", parseFloat);
    const maxTokens = number("max_tokens", (s) => parseInt(s, 10));
    if (temperature !== undefined) body.temperature = temperature;
    if (topP !== undefined) body.top_p = topP;
    if (maxTokens !== undefined) body.max_tokens = maxTokens;
    const schema = parseJsonBox("schema", "schema-hint", "The JSON schema", false);
    if (schema !== undefined) {
      body.response_format = { type: "json_schema", json_schema: { name: "response", schema, strict: true } };
    }
    const tools = parseJsonBox("tools", "tools-hint", "The tool list", true);
    if (tools !== undefined && tools.length) {
      body.tools = tools;
      body.tool_choice = $("tool_choice").value || "auto";
    }
    return body;
  }

  // ------------------------------------------------------------------ streaming
  function mergeToolCalls(msg, deltas) {
    msg.tool_calls = msg.tool_calls || [];
    for (const d of deltas) {
      const i = typeof d.index === "number" ? d.index : msg.tool_calls.length;
      const call = msg.tool_calls[i] || (msg.tool_calls[i] = { id: "", type: "function", function: { name: "", arguments: "" } });
      if (d.id) call.id = d.id;
      if (d.type) call.type = d.type;
      if (d.function) {
        if (d.function.name && d.function.name !== call.function.name) call.function.name += d.function.name;
        if (d.function.arguments) call.function.arguments += d.function.arguments;
      }
    }
  }

  async function generate() {
    const conv = current();
    let body;
    try {
      body = buildRequest(conv);
    } catch (_) {
      return; // the settings box says what is wrong
    }
    if (!body.model) {
      showBanner("No model to ask: the server listed none (is the API key right?).");
      return;
    }
    const msg = { role: "assistant", content: "", meta: { model: body.model, structured: !!body.response_format } };
    conv.messages.push(msg);
    conv.updated = Date.now();
    const controller = new AbortController();
    state.controller = controller;
    setBusy(true);
    renderThread();
    const t0 = performance.now();
    let tFirst = null;
    let chunks = 0;
    let usage = null;
    try {
      await Api.streamJson("/v1/chat/completions", body, (chunk) => {
        if (chunk.usage) usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) return;
        const delta = choice.delta || {};
        if (delta.content) {
          msg.content += delta.content;
          chunks++;
        }
        if (delta.tool_calls) mergeToolCalls(msg, delta.tool_calls);
        if (tFirst === null && (delta.content || delta.tool_calls)) tFirst = performance.now();
        if (choice.finish_reason) msg.meta.finish_reason = choice.finish_reason;
        scheduleUpdate(msg);
      }, controller.signal);
    } catch (e) {
      if (e.name === "AbortError") msg.meta.stopped = true;
      else msg.error = { title: e.title || "Error", message: e.message || String(e) };
    } finally {
      state.controller = null;
      if (pending) cancelAnimationFrame(pending);
      pending = null;
      const tEnd = performance.now();
      const tokens = usage ? usage.completion_tokens : chunks;
      Object.assign(msg.meta, {
        ttft_ms: tFirst === null ? null : Math.round(tFirst - t0),
        total_ms: Math.round(tEnd - t0),
        completion_tokens: tokens,
        tokens_exact: !!usage,
        prompt_tokens: usage ? usage.prompt_tokens : null,
        cached_tokens: usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : null,
        tok_s: tFirst !== null && tokens > 1 && tEnd > tFirst ? (tokens - 1) / ((tEnd - tFirst) / 1000) : null,
      });
      save();
      setBusy(false);
      renderThread();
      $("prompt").focus();
    }
  }

  function stop() {
    if (state.controller) state.controller.abort();
  }

  let pending = null;
  function scheduleUpdate(msg) {
    if (pending) return;
    pending = requestAnimationFrame(() => {
      pending = null;
      const el = document.querySelector('.msg[data-last="1"]');
      if (el && state.controller) fillAssistant(el, msg, true);
      stickToBottom();
    });
  }

  // ------------------------------------------------------------------ rendering
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function answerHtml(msg) {
    let html = "";
    if (msg.meta && msg.meta.structured && msg.content) {
      let text = msg.content;
      try { text = JSON.stringify(JSON.parse(msg.content), null, 2); } catch (_) { /* still streaming */ }
      html = Markdown.render("```json\n" + text + "\n```");
    } else if (msg.content) {
      html = Markdown.render(msg.content);
    }
    for (const call of msg.tool_calls || []) {
      let args = call.function.arguments || "";
      try { args = JSON.stringify(JSON.parse(args), null, 2); } catch (_) { /* partial */ }
      html += '<div class="toolcall"><div class="head"><span class="badge">tool call</span><span class="fn">' +
        Markdown.escapeHtml(call.function.name || "?") + '</span><span class="muted">' +
        Markdown.escapeHtml(call.id || "") + "</span></div><pre>" + Markdown.escapeHtml(args) + "</pre></div>";
    }
    return html;
  }

  function metaText(meta) {
    const out = [];
    if (!meta) return out;
    if (meta.completion_tokens) out.push(meta.completion_tokens + (meta.tokens_exact ? "" : "~") + " tokens");
    if (meta.tok_s) out.push(meta.tok_s.toFixed(1) + " tok/s");
    if (meta.ttft_ms !== null && meta.ttft_ms !== undefined) out.push("TTFT " + fmtMs(meta.ttft_ms));
    if (meta.cached_tokens) out.push(meta.cached_tokens + " prompt tokens cached");
    if (meta.stopped) out.push("stopped");
    else if (meta.finish_reason && meta.finish_reason !== "stop") out.push("finish: " + meta.finish_reason);
    return out;
  }

  function fmtMs(ms) {
    return ms < 1000 ? Math.round(ms) + " ms" : (ms / 1000).toFixed(2) + " s";
  }

  function fillAssistant(node, msg, streaming) {
    const bubble = node.querySelector(".bubble");
    bubble.innerHTML = answerHtml(msg);
    if (msg.error) {
      const box = el("div", "error-box");
      box.appendChild(el("div", "error-title", msg.error.title));
      box.appendChild(el("div", "error-message", msg.error.message));
      if (msg.content || msg.tool_calls) box.style.marginTop = "8px";
      bubble.appendChild(box);
    }
    node.classList.toggle("error", !!msg.error && !msg.content);
    bubble.classList.toggle("cursor", streaming);
    node.dataset.state = streaming ? "streaming" : msg.error ? "error" : msg.meta && msg.meta.stopped ? "stopped" : "done";
  }

  function renderThread() {
    const conv = current();
    const thread = $("thread");
    thread.innerHTML = "";
    $("system").value = conv.system || "";
    if (!conv.messages.length) {
      const empty = el("div", "empty");
      empty.appendChild(el("div", "brand")).innerHTML = '<span class="logo">m</span>';
      empty.querySelector(".brand").style.justifyContent = "center";
      empty.appendChild(el("h2", "", "What can I help with?"));
      empty.appendChild(el("div", "", state.settings.model ? "Talking to " + state.settings.model + " on this server." : ""));
      thread.appendChild(empty);
    }
    const lastUser = conv.messages.map((m) => m.role).lastIndexOf("user");
    conv.messages.forEach((m, i) => {
      const last = i === conv.messages.length - 1;
      const node = el("div", "msg " + m.role);
      node.dataset.role = m.role;
      node.dataset.index = String(i);
      if (last) node.dataset.last = "1";
      node.appendChild(el("div", "who", m.role === "tool" ? "tool result" : m.role === "assistant" ? (m.meta && m.meta.model) || "assistant" : "you"));
      const bubble = el("div", "bubble");
      node.appendChild(bubble);
      const meta = el("div", "meta");
      if (m.role === "assistant") {
        const streaming = last && state.controller !== null;
        fillAssistant(node, m, streaming);
        if (!streaming) {
          for (const t of metaText(m.meta)) meta.appendChild(el("span", "stat", t));
          const tools = el("span", "tools");
          if (m.content) tools.appendChild(button("Copy", "copy-answer", () => copyText(m.content)));
          if (last) tools.appendChild(button("Regenerate", "regenerate", regenerate));
          meta.appendChild(tools);
        }
      } else {
        bubble.textContent = m.content;
        if (i === lastUser && !state.controller) {
          const tools = el("span", "tools");
          tools.appendChild(button("Edit", "edit-last", editLast));
          meta.appendChild(tools);
        }
      }
      node.appendChild(meta);
      thread.appendChild(node);
    });
    renderConversations();
    updateComposerNote();
    stickToBottom(true);
  }

  function button(label, cls, onClick) {
    const b = el("button", "btn small ghost " + cls, label);
    b.type = "button";
    b.addEventListener("click", onClick);
    return b;
  }

  function renderConversations() {
    const list = $("conv-list");
    list.innerHTML = "";
    for (const c of state.conversations) {
      const item = el("div", "conv" + (c.id === state.currentId ? " active" : ""));
      item.dataset.id = c.id;
      item.appendChild(el("span", "title", c.title || "New chat"));
      const del = el("button", "btn ghost small del", "\u2715");
      del.type = "button";
      del.title = "Delete this conversation";
      del.addEventListener("click", (ev) => {
        ev.stopPropagation();
        if (!confirm("Delete \u201c" + (c.title || "New chat") + "\u201d?")) return;
        state.conversations = state.conversations.filter((x) => x.id !== c.id);
        if (state.currentId === c.id) state.currentId = state.conversations.length ? state.conversations[0].id : null;
        if (!current()) newConversation();
        save();
        renderThread();
      });
      item.appendChild(del);
      item.addEventListener("click", () => {
        if (state.controller) return;
        state.currentId = c.id;
        save();
        renderThread();
        document.body.firstElementChild.classList.remove("sidebar-open");
      });
      list.appendChild(item);
    }
  }

  function updateComposerNote() {
    const call = pendingToolCall(current());
    $("prompt").placeholder = call
      ? "Result of " + (call.function.name || "the tool call") + " (sent as a tool message)"
      : "Send a message";
  }

  function stickToBottom(force) {
    const box = $("messages");
    if (force || box.scrollHeight - box.scrollTop - box.clientHeight < 120) box.scrollTop = box.scrollHeight;
  }

  function setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    $("new-chat").disabled = busy;
  }

  function showBanner(text) {
    $("banner").textContent = text;
    $("banner").hidden = false;
  }
  function hideBanner() {
    $("banner").hidden = true;
  }

  async function copyText(text) {
    try {
      await navigator.clipboard.writeText(text);
    } catch (_) {
      const area = document.createElement("textarea");
      area.value = text;
      document.body.appendChild(area);
      area.select();
      document.execCommand("copy");
      area.remove();
    }
  }

  // ------------------------------------------------------------------ actions
  function send(text) {
    const conv = current();
    const call = pendingToolCall(conv);
    if (call) {
      conv.messages.push({ role: "tool", tool_call_id: call.id, content: text });
    } else {
      conv.messages.push({ role: "user", content: text });
      if (conv.title === "New chat") conv.title = text.replace(/\s+/g, " ").slice(0, 48);
    }
    save();
    generate();
  }

  function regenerate() {
    const conv = current();
    while (conv.messages.length && conv.messages[conv.messages.length - 1].role === "assistant") conv.messages.pop();
    save();
    generate();
  }

  function editLast() {
    const conv = current();
    const i = conv.messages.map((m) => m.role).lastIndexOf("user");
    if (i < 0) return;
    $("prompt").value = conv.messages[i].content;
    conv.messages.splice(i);
    save();
    renderThread();
    autosize();
    $("prompt").focus();
  }

  function exportAll() {
    const data = JSON.stringify({ exported: new Date().toISOString(), conversations: state.conversations }, null, 2);
    const a = document.createElement("a");
    a.href = URL.createObjectURL(new Blob([data], { type: "application/json" }));
    a.download = "markbase-conversations-" + new Date().toISOString().slice(0, 10) + ".json";
    document.body.appendChild(a);
    a.click();
    setTimeout(() => { URL.revokeObjectURL(a.href); a.remove(); }, 0);
  }

  async function importFile(file) {
    try {
      const data = JSON.parse(await file.text());
      const convs = Array.isArray(data) ? data : data.conversations;
      if (!Array.isArray(convs)) throw new Error("no conversations in this file");
      const known = new Set(state.conversations.map((c) => c.id));
      for (const c of convs) {
        if (!c || !Array.isArray(c.messages)) continue;
        state.conversations.push(Object.assign({ title: "Imported chat", system: "" }, c, { id: known.has(c.id) || !c.id ? newId() : c.id }));
      }
      save();
      renderThread();
    } catch (e) {
      showBanner("Cannot import " + file.name + ": " + e.message);
    }
  }

  function openSettings(open) {
    document.body.firstElementChild.classList.toggle("settings-open", open);
  }

  function autosize() {
    const t = $("prompt");
    t.style.height = "auto";
    t.style.height = Math.min(t.scrollHeight, 220) + "px";
  }

  // ------------------------------------------------------------------ wiring
  function bind() {
    const s = state.settings;
    $("temperature").value = s.temperature;
    $("top_p").value = s.top_p;
    $("max_tokens").value = s.max_tokens;
    $("schema").value = s.schema || "";
    $("tools").value = s.tools || "";
    $("tool_choice").value = s.tool_choice || "auto";
    $("api-key").value = Api.apiKey();
    for (const id of ["temperature", "top_p", "max_tokens", "schema", "tools", "tool_choice"]) {
      $(id).addEventListener("change", () => { s[id] = $(id).value; save(); });
    }
    $("system").addEventListener("input", () => { current().system = $("system").value; save(); });
    $("api-key").addEventListener("change", () => { Api.setApiKey($("api-key").value.trim()); loadModels(); });
    $("model").addEventListener("change", () => { s.model = $("model").value; save(); showModelInfo(); });
    $("composer").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const text = $("prompt").value;
      if (!text.trim() || state.controller) return;
      $("prompt").value = "";
      autosize();
      send(text);
    });
    $("prompt").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
        ev.preventDefault();
        $("composer").requestSubmit();
      } else if (ev.key === "Escape") {
        stop();
      }
    });
    $("prompt").addEventListener("input", autosize);
    $("stop").addEventListener("click", stop);
    $("new-chat").addEventListener("click", () => { newConversation(); renderThread(); $("prompt").focus(); });
    $("export").addEventListener("click", exportAll);
    $("import").addEventListener("click", () => $("import-file").click());
    $("import-file").addEventListener("change", () => {
      const f = $("import-file").files[0];
      if (f) importFile(f);
      $("import-file").value = "";
    });
    const app = document.body.firstElementChild;
    $("toggle-settings").addEventListener("click", () => openSettings(!app.classList.contains("settings-open")));
    $("close-settings").addEventListener("click", () => openSettings(false));
    $("menu").addEventListener("click", () => app.classList.toggle("sidebar-open"));
    $("scrim").addEventListener("click", () => { app.classList.remove("sidebar-open"); openSettings(false); });
    $("thread").addEventListener("click", (ev) => {
      const b = ev.target.closest(".copy-code");
      if (!b) return;
      copyText(b.closest(".codeblock").querySelector("code").textContent);
      b.textContent = "Copied";
      setTimeout(() => { b.textContent = "Copy"; }, 1200);
    });
  }

  load();
  bind();
  renderThread();
  loadModels().then(renderThread);
  window.markbaseChat = { state, current, stop }; // for the browser tests and the console
})();
