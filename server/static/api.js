// Talking to the server's OpenAI API from the pages: the API key (kept in this
// browser's localStorage, sent as a Bearer token), JSON calls, error bodies as
// readable messages, and server-sent events read from a fetch body stream.
"use strict";

const Api = (() => {
  const KEY = "markbase.apiKey";

  function apiKey() {
    return localStorage.getItem(KEY) || "";
  }
  function setApiKey(value) {
    if (value) localStorage.setItem(KEY, value);
    else localStorage.removeItem(KEY);
  }
  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const key = apiKey();
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  // An HTTP error with the server's OpenAI error body, shown as is to the user.
  class ApiError extends Error {
    constructor(status, message, type, code, param) {
      super(message);
      this.status = status;
      this.type = type || "";
      this.code = code || "";
      this.param = param || "";
    }
    get title() {
      const names = { 400: "Bad request", 401: "Unauthorized", 404: "Not found", 413: "Too large",
        429: "Too many requests", 500: "Server error", 503: "Unavailable", 504: "Timed out" };
      const what = this.status ? "HTTP " + this.status + (names[this.status] ? " " + names[this.status] : "") : "Error";
      return what + (this.code ? " \u00b7 " + this.code : this.type ? " \u00b7 " + this.type : "");
    }
  }

  async function errorFrom(response) {
    const text = await response.text().catch(() => "");
    try {
      const e = JSON.parse(text).error || {};
      return new ApiError(response.status, e.message || text || response.statusText, e.type, e.code, e.param);
    } catch (_) {
      return new ApiError(response.status, text || response.statusText);
    }
  }

  async function getJson(path) {
    const r = await fetch(path, { headers: headers(), cache: "no-store" });
    if (!r.ok) throw await errorFrom(r);
    return r.json();
  }

  // POST ``body`` and call ``onEvent(obj)`` for each ``data:`` JSON event until
  // ``[DONE]``. An error event inside the stream (``{"error": ...}``) throws an
  // ApiError; aborting ``signal`` throws an AbortError.
  async function streamJson(path, body, onEvent, signal) {
    const r = await fetch(path, {
      method: "POST",
      headers: headers({ "Content-Type": "application/json", Accept: "text/event-stream" }),
      body: JSON.stringify(body),
      signal,
    });
    if (!r.ok) throw await errorFrom(r);
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
        const data = event
          .split(/\r?\n/)
          .filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, ""))
          .join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        const obj = JSON.parse(data);
        if (obj.error) {
          const e = obj.error;
          throw new ApiError(0, e.message || JSON.stringify(e), e.type, e.code, e.param);
        }
        onEvent(obj);
      }
    }
  }

  return { apiKey, setApiKey, headers, getJson, streamJson, ApiError };
})();
