"""The chat page: self-contained, stable element ids, and its script driven in node.

The script runs against a tiny DOM/WebSocket/fetch stand-in (below), which plays the
gateway's side of the /v1/ws protocol: models load, a reply streams with TTFT and
tokens/s, history carries over, a 429 shows with its retry-after, stop sends cancel.
A headless-browser test of the real page lives with the HTTP shell's tests.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "services" / "gateway" / "static" / "index.html"
REQUIRED_IDS = {"prompt", "send", "stop", "messages", "api-key", "model", "max-tokens", "temperature", "status",
                "refresh-models", "clear", "key-panel", "save-key", "use-dev-key", "key-message", "change-key"}


class _Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.urls: list[str] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name == "id" and value:
                self.ids.append(value)
            if name in ("src", "href", "action") and value:
                self.urls.append(value)
        self._in_script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.scripts.append(data)


def _page() -> tuple[_Collector, str]:
    html = PAGE.read_text(encoding="utf-8")
    collector = _Collector()
    collector.feed(html)
    return collector, html


def test_page_has_the_stable_ids_once() -> None:
    collector, _ = _page()
    assert REQUIRED_IDS <= set(collector.ids)
    assert len(collector.ids) == len(set(collector.ids)), "duplicate ids"


def test_page_loads_nothing_from_elsewhere() -> None:
    collector, html = _page()
    assert collector.urls == []
    assert not re.search(r"https?://|//cdn|@import|url\(", html, re.I)
    script = "".join(collector.scripts)
    assert "innerHTML" not in script and "eval(" not in script  # model output is text, never markup


def test_page_styles_the_classes_tests_rely_on() -> None:
    _, html = _page()
    for cls in (".reply", ".reply-stats", ".error"):
        assert cls in html


# A DOM just big enough for the page, a scripted WebSocket, fetch and a manual clock.
# ``world(opts)`` runs the page script in a fresh context: ``session`` is the tab's
# sessionStorage, ``devKey`` what /dev-key answers (null: 404), ``goodKeys`` the keys
# /v1/models accepts (others get 401).
PRELUDE = r"""
const vm = require("vm");
const fs = require("fs");
const assert = require("assert");
const script = fs.readFileSync(process.argv[2], "utf8");

class Elem {
  constructor(tag, id = "") {
    this.tagName = tag.toUpperCase(); this.id = id; this.children = []; this._text = ""; this.className = "";
    this.dataset = {}; this.listeners = {}; this.attrs = {}; this._value = undefined; this.disabled = false;
    this.scrollTop = 0; this.scrollHeight = 0; this.hidden = false;
  }
  get classList() {
    const self = this;
    return { add(c) { self.className = `${self.className} ${c}`.trim(); },
             contains(c) { return self.className.split(/\s+/).includes(c); } };
  }
  set textContent(t) { this.children = []; this._text = String(t); }
  get textContent() { return this._text + this.children.map((c) => c.textContent).join(""); }
  get value() {
    if (this.tagName === "SELECT") {
      if (this._value !== undefined && this.children.some((c) => c.value === this._value)) return this._value;
      return this.children.length ? this.children[0].value : "";
    }
    return this._value === undefined ? "" : this._value;
  }
  set value(v) { this._value = String(v); }
  appendChild(c) { this.children.push(c); return c; }
  append(...cs) { cs.forEach((c) => this.appendChild(c)); }
  replaceChildren(...cs) { this.children = []; this._text = ""; cs.forEach((c) => this.appendChild(c)); }
  setAttribute(k, v) { this.attrs[k] = v; }
  addEventListener(type, fn) { (this.listeners[type] ||= []).push(fn); }
  fire(type, event = {}) { (this.listeners[type] || []).forEach((fn) => fn({ preventDefault() {}, ...event })); }
  all(cls) {
    const out = [];
    const walk = (e) => { e.children.forEach((c) => { if (c.classList.contains(cls)) out.push(c); walk(c); }); };
    walk(this);
    return out;
  }
}

class FakeWebSocket extends Elem {
  constructor(url) { super("ws"); this.url = url; this.readyState = 0; this.sent = []; FakeWebSocket.all.push(this); }
  send(data) { assert.strictEqual(this.readyState, 1, "send before open"); this.sent.push(JSON.parse(data)); }
  close() { this.readyState = 3; this.fire("close", {}); }
  open() { this.readyState = 1; this.fire("open", {}); }
  push(obj) { this.fire("message", { data: JSON.stringify(obj) }); }
}
FakeWebSocket.CONNECTING = 0; FakeWebSocket.OPEN = 1;

const storage = (map) => ({ getItem: (k) => (map.has(k) ? map.get(k) : null), setItem: (k, v) => map.set(k, String(v)),
                            removeItem: (k) => map.delete(k) });
const json = (status, body) => ({ ok: status < 400, status, statusText: String(status), json: async () => body });

function world({ session = [], local = [], devKey = null, goodKeys = ["msk-test"] } = {}) {
  const tags = { model: "select", prompt: "textarea", messages: "main", status: "span", "key-panel": "form",
                 "key-message": "div" };
  const buttons = ["send", "stop", "clear", "refresh-models", "save-key", "use-dev-key", "change-key"];
  const byId = {};
  for (const id of ["api-key", "model", "refresh-models", "max-tokens", "temperature", "clear", "status", "messages",
                    "prompt", "send", "stop", "key-panel", "save-key", "use-dev-key", "key-message", "change-key"]) {
    byId[id] = new Elem(tags[id] || (buttons.includes(id) ? "button" : "input"), id);
  }
  byId["key-panel"].hidden = byId["use-dev-key"].hidden = byId["key-message"].hidden = true;  // as in the HTML
  const w = { byId, sockets: [], fetches: [], clock: 1000, session: new Map(session), local: new Map(local), devKey, goodKeys };
  FakeWebSocket.all = w.sockets;
  const sandbox = {
    document: { getElementById: (id) => byId[id] || null, createElement: (tag) => new Elem(tag) },
    sessionStorage: storage(w.session), localStorage: storage(w.local),
    location: { protocol: "http:", host: "gw.test:8080" },
    performance: { now: () => w.clock },
    WebSocket: FakeWebSocket,
    fetch: async (url, init) => {
      w.fetches.push({ url, init });
      if (url === "/dev-key") return w.devKey ? json(200, { api_key: w.devKey }) : json(404, { error: { code: "unknown_url" } });
      const auth = ((init || {}).headers || {}).Authorization || "";
      if (!w.goodKeys.some((k) => auth === `Bearer ${k}`)) {
        return json(401, { error: { message: "Incorrect API key provided", code: "invalid_api_key" } });
      }
      return json(200, { object: "list", data: [{ id: "sim" }, { id: "big" }] });
    },
    console, JSON, Math, Number, Date, Map, Promise, Error, String, Array, Object, setTimeout,
  };
  vm.createContext(sandbox);
  vm.runInContext(script, sandbox);
  w.$ = (id) => byId[id];
  w.replies = () => byId.messages.all("reply");
  return w;
}
const tick = () => new Promise((r) => setImmediate(r));
const settle = async () => { for (let i = 0; i < 6; i += 1) await tick(); };
"""

# A tab that already holds a key: models load, replies stream, errors show, the key can change.
HARNESS = PRELUDE + r"""
(async () => {
  const w = world({ session: [["meshserve.apiKey", "msk-test"]], local: [["meshserve.apiKey", "msk-old"]],
                    goodKeys: ["msk-test", "msk-other"] });
  const { $, sockets, fetches } = w;
  await settle();
  // models load with the tab's key as Bearer; a key an older page left in localStorage is dropped
  assert.strictEqual(fetches[0].url, "/v1/models");
  assert.strictEqual(fetches[0].init.headers.Authorization, "Bearer msk-test");
  assert.ok(!w.local.has("meshserve.apiKey"));
  assert.ok($("key-panel").hidden);
  assert.deepStrictEqual($("model").children.map((o) => o.value), ["sim", "big"]);
  assert.strictEqual($("model").value, "sim");
  assert.ok($("send").disabled === false && $("stop").disabled === true);

  // a streamed reply
  $("prompt").value = "hello";
  $("send").fire("click");
  assert.strictEqual(sockets.length, 1);
  assert.strictEqual(sockets[0].url, "ws://gw.test:8080/v1/ws");
  assert.ok($("send").disabled && !$("stop").disabled);
  const ws = sockets[0];
  ws.open(); await tick();
  assert.deepStrictEqual(ws.sent[0], { type: "auth", api_key: "msk-test" });
  const first = ws.sent[1];
  assert.strictEqual(first.type, "chat.completion");
  assert.deepStrictEqual(first.body, { model: "sim", messages: [{ role: "user", content: "hello" }], stream: true });
  const reply = w.replies()[0];
  assert.strictEqual(reply.dataset.state, "streaming");
  assert.strictEqual(reply.dataset.requestId, first.id);
  w.clock += 120;
  ws.push({ type: "token", id: first.id, seq: 0, text: "Hi", token_ids: [1] });
  w.clock += 500;
  ws.push({ type: "token", id: first.id, seq: 1, text: " there", token_ids: [2, 3] });
  w.clock += 500;
  ws.push({ type: "done", id: first.id, finish_reason: "stop",
            usage: { prompt_tokens: 50, completion_tokens: 3, total_tokens: 53, prompt_tokens_details: { cached_tokens: 16 } } });
  assert.strictEqual(reply.dataset.state, "done");
  assert.strictEqual(reply.all("reply-text")[0].textContent, "Hi there");
  const stats = reply.all("reply-stats")[0].textContent;
  assert.ok(stats.includes("TTFT 120 ms"), stats);
  assert.ok(stats.includes("2.0 tokens/s"), stats);  // (3 - 1) tokens over the 1 s after the first
  assert.ok(stats.includes("16 cached"), stats);
  assert.ok(!$("send").disabled && $("stop").disabled);

  // the next request carries the conversation; a 429 shows legibly and is not remembered
  $("max-tokens").value = "32";
  $("prompt").value = "again";
  $("send").fire("click"); await tick();
  const second = ws.sent[2];
  assert.deepStrictEqual(second.body.messages.map((m) => m.role), ["user", "assistant", "user"]);
  assert.strictEqual(second.body.messages[1].content, "Hi there");
  assert.strictEqual(second.body.max_tokens, 32);
  ws.push({ type: "error", id: second.id, status: 429,
            error: { message: "Rate limit reached", type: "requests", param: null, code: "rate_limit_exceeded" },
            retry_after: 2.5 });
  const failed = w.replies()[1];
  assert.strictEqual(failed.dataset.state, "error");
  const errorText = failed.all("error")[0].textContent;
  assert.ok(errorText.includes("429") && errorText.includes("rate_limit_exceeded") && errorText.includes("retry after 2.5 s"), errorText);

  // stop sends cancel; the server's abort (with the usage billed so far) marks the reply stopped
  $("prompt").value = "long story";
  $("send").fire("click"); await tick();
  const third = ws.sent[3];
  assert.strictEqual(third.body.messages.length, 3);  // the failed turn was dropped
  $("stop").fire("click");
  assert.deepStrictEqual(ws.sent[4], { type: "cancel", id: third.id });
  ws.push({ type: "token", id: third.id, seq: 0, text: "Once", token_ids: [7, 8] });
  ws.push({ type: "done", id: third.id, finish_reason: "abort",
            usage: { prompt_tokens: 60, completion_tokens: 2, total_tokens: 62 } });
  assert.strictEqual(w.replies()[2].dataset.state, "stopped");
  assert.ok(w.replies()[2].all("reply-stats")[0].textContent.includes("2 tokens"));

  // the socket closing mid-reply fails the reply instead of leaving it streaming
  $("prompt").value = "one more";
  $("send").fire("click"); await tick();
  ws.close();
  assert.strictEqual(w.replies()[3].dataset.state, "error");

  // the socket's key refused (revoked): no protocol error, the key panel asks again
  $("prompt").value = "after revoke";
  $("send").fire("click");
  const ws2 = sockets[1];
  ws2.open(); await tick();
  ws2.push({ type: "error", id: null, status: 401, error: { message: "Incorrect API key provided", type: "invalid_request_error",
             param: null, code: "invalid_api_key" }, retry_after: null });
  await settle();
  assert.strictEqual($("messages").children.filter((c) => c.classList.contains("error")).length, 0);
  assert.ok(!$("key-panel").hidden && !$("key-message").hidden);
  assert.ok($("key-message").textContent.includes("no longer accepted"), $("key-message").textContent);
  assert.ok(!w.session.has("meshserve.apiKey"));

  // a new key is checked, kept for the tab, and the next request opens a fresh, re-authenticated socket
  $("api-key").value = "msk-other";
  $("key-panel").fire("submit"); await settle();
  assert.ok($("key-panel").hidden);
  assert.strictEqual(w.session.get("meshserve.apiKey"), "msk-other");
  $("prompt").value = "with the new key";
  $("send").fire("click");
  const ws3 = sockets[sockets.length - 1];
  assert.notStrictEqual(ws3, ws2);
  ws3.open(); await tick();
  assert.deepStrictEqual(ws3.sent[0], { type: "auth", api_key: "msk-other" });
  console.log(JSON.stringify({ ok: true }));
})().catch((err) => { console.error(err); process.exit(1); });
"""

# A fresh tab: the page asks for the key before anything else, offers the development key when
# the gateway hands it out, and answers a bad key in words.
FRESH_HARNESS = PRELUDE + r"""
(async () => {
  const w = world({ devKey: "msk-dev", goodKeys: ["msk-dev", "msk-good"] });
  const { $ } = w;
  await settle();
  assert.ok(!$("key-panel").hidden, "the page opens on the key panel");
  assert.ok($("key-message").hidden);
  assert.deepStrictEqual(w.fetches.map((f) => f.url), ["/dev-key"]);  // no API call without a key
  assert.ok($("status").className !== "status-error" && $("status").textContent === "");
  assert.strictEqual($("messages").children.length, 0);
  assert.ok(!$("use-dev-key").hidden, "the development key is offered");

  // sending without a key asks for one
  $("prompt").value = "hi";
  $("send").fire("click"); await settle();
  assert.strictEqual(w.sockets.length, 0);
  assert.ok(!$("key-panel").hidden && $("key-message").textContent.includes("API key"));

  // a wrong key: a sentence, not "401", and the panel stays
  $("api-key").value = "msk-wrong";
  $("key-panel").fire("submit"); await settle();
  assert.ok(!$("key-panel").hidden && !$("key-message").hidden);
  const said = $("key-message").textContent;
  assert.ok(said.includes("not accepted") && !said.includes("401"), said);
  assert.ok(!w.session.has("meshserve.apiKey"));

  // the development key
  $("use-dev-key").fire("click"); await settle();
  assert.ok($("key-panel").hidden);
  assert.strictEqual(w.session.get("meshserve.apiKey"), "msk-dev");
  assert.deepStrictEqual($("model").children.map((o) => o.value), ["sim", "big"]);

  // elsewhere /dev-key is a 404: nothing is offered
  const remote = world({ devKey: null });
  await settle();
  assert.ok(!remote.$("key-panel").hidden && remote.$("use-dev-key").hidden);
  console.log(JSON.stringify({ ok: true }));
})().catch((err) => { console.error(err); process.exit(1); });
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
@pytest.mark.parametrize("harness", [HARNESS, FRESH_HARNESS], ids=["tab-with-key", "fresh-tab"])
def test_page_script_speaks_the_ws_protocol(tmp_path: Path, harness: str) -> None:
    collector, _ = _page()
    script = tmp_path / "page.js"
    script.write_text("".join(collector.scripts), encoding="utf-8")
    harness_file = tmp_path / "harness.js"
    harness_file.write_text(harness, encoding="utf-8")
    run = subprocess.run(["node", str(harness_file), str(script)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr + run.stdout
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"ok": True}
