// Live dashboard updates. The page holds one WebSocket to /ws/dashboard/ (signed in by the session
// cookie) that carries notices such as {"topic": "node", "node": 12}. On a notice, every element
// marked data-live-node="12" (or data-live-topic="node") is fetched again from its data-live-url
// and replaced in place: the server renders it, with the same permission checks as a page load.
// data-live-topic may name several topics ("node strike"). What a person is doing is kept: an element
// holding the focused field waits until the focus leaves it, or until its own htmx request is answered
// (a refresh fetched meanwhile would undo what that answer did), nothing is replaced while a dialog
// asks to confirm an action, and typed values carry over to the new element.
(function () {
  "use strict";
  const path = document.body.dataset.liveSocket;
  if (!path || !("WebSocket" in window)) return;

  const TOPIC_DELAY_MS = 500; // a burst of notices about many nodes refreshes a shared view once
  const inFlight = new Map(); // element id -> {again: bool}
  const topicTimers = new Map(); // element id -> timer
  const BUSY_RETRY_MS = 1000; // how soon to try again an element left alone while the person used it
  const deferred = new Set(); // element ids waiting for that

  async function refresh(id) {
    const state = inFlight.get(id);
    if (state) {
      state.again = true; // one more fetch once this one lands, so the last change is never missed
      return;
    }
    const element = document.getElementById(id);
    if (!element || !element.dataset.liveUrl) return;
    if (busy(element)) {
      later(id);
      return;
    }
    inFlight.set(id, { again: false });
    try {
      const response = await fetch(element.dataset.liveUrl, {
        headers: { "HX-Request": "true" },
        credentials: "same-origin",
        cache: "no-store",
      });
      if (response.redirected) {
        window.location.reload(); // signed out meanwhile: the page itself goes to the sign-in form
        return;
      }
      // The body is read before the page is looked at again: from here to the swap nothing
      // awaits, so no click can send a request whose target this replaces unseen.
      const html = response.ok ? (await response.text()).trim() : "";
      const current = document.getElementById(id);
      if (response.ok && current && busy(current)) {
        // The person acted on it while this was fetched (a form of its own on its way): that
        // answer replaces it; this one, rendered before, would bring back what it removes.
        later(id);
      } else if (response.ok && current) {
        const template = document.createElement("template");
        template.innerHTML = html;
        const fresh = template.content.firstElementChild;
        if (fresh && fresh.id === id) {
          keepTyped(current, fresh);
          current.replaceWith(fresh);
          if (window.htmx) window.htmx.process(fresh);
          fresh.dispatchEvent(new CustomEvent("live:updated", { bubbles: true }));
        }
      } else if (response.status === 404 && current) {
        current.remove(); // it is gone (a deleted node)
      }
    } catch (error) {
      // Offline for a moment: the next notice, or the reconnection, fetches it again.
    } finally {
      const done = inFlight.get(id);
      inFlight.delete(id);
      if (done && done.again) refresh(id);
    }
  }

  function later(id) {
    if (deferred.has(id)) return;
    deferred.add(id);
    window.setTimeout(function () {
      deferred.delete(id);
      refresh(id);
    }, BUSY_RETRY_MS);
  }

  function busy(element) {
    const active = document.activeElement;
    const typing = active !== null && element.contains(active) && active.matches("input, textarea, select");
    // htmx marks an element whose request is on its way with .htmx-request.
    const sending = element.matches(".htmx-request") || element.querySelector(".htmx-request") !== null;
    return typing || sending || document.querySelector("dialog[open]") !== null;
  }

  function keepTyped(current, fresh) {
    current.querySelectorAll("textarea[name], input[name]:not([type=hidden])").forEach(function (field) {
      if (field.value === field.defaultValue) return;
      const twin = fresh.querySelector('[name="' + CSS.escape(field.name) + '"]');
      if (twin) twin.value = field.value;
    });
  }

  function refreshLater(id) {
    if (topicTimers.has(id)) return;
    topicTimers.set(
      id,
      window.setTimeout(function () {
        topicTimers.delete(id);
        refresh(id);
      }, TOPIC_DELAY_MS),
    );
  }

  function onNotice(notice) {
    if (notice.node !== undefined && notice.node !== null) {
      document.querySelectorAll('[data-live-node="' + Number(notice.node) + '"]').forEach(function (element) {
        refresh(element.id);
      });
    }
    document.querySelectorAll('[data-live-topic~="' + CSS.escape(String(notice.topic)) + '"]').forEach(function (element) {
      refreshLater(element.id);
    });
  }

  let delay = 1000;
  let connectedBefore = false;

  function connect() {
    const scheme = window.location.protocol === "https:" ? "wss:" : "ws:";
    const socket = new WebSocket(scheme + "//" + window.location.host + path);
    socket.addEventListener("open", function () {
      if (connectedBefore) {
        // Notices sent while the connection was down are lost: fetch everything live once.
        document.querySelectorAll("[data-live-url]").forEach(function (element) {
          refresh(element.id);
        });
      }
      connectedBefore = true;
      delay = 1000;
      document.body.dataset.live = "on";
    });
    socket.addEventListener("message", function (event) {
      let notice;
      try {
        notice = JSON.parse(event.data);
      } catch (error) {
        return;
      }
      onNotice(notice);
    });
    socket.addEventListener("close", function (event) {
      document.body.dataset.live = "off";
      if (event.code === 4401) return; // signed out: nothing to listen to
      window.setTimeout(connect, delay);
      delay = Math.min(delay * 2, 15000);
    });
  }

  connect();
})();
