// The playground: sends the conversation to the dashboard's chat endpoint (admitted and billed
// like any API request), shows the reply as its tokens stream in (server-sent events), then
// fetches the request's recorded time to first token, speed and cost (and the balance after it).
// Stop hangs up mid-reply, which cancels the job as any client leaving does; the tokens received
// stay. A refusal or failure shows the advice the page carries for its error code (#pg-advice,
// from marketplace/web/playground_errors.py), never the failure's own internals.
(function () {
  "use strict";
  const form = document.getElementById("playground");
  if (!form) return;
  const conversation = document.getElementById("pg-conversation");
  const status = document.getElementById("pg-status");
  const errorBox = document.getElementById("pg-error");
  const sendButton = document.getElementById("pg-send");
  const stopButton = document.getElementById("pg-stop");
  const stats = document.getElementById("pg-stats");
  const statsPlaceholder = stats.innerHTML;
  const priceLine = document.getElementById("pg-price");
  const advice = JSON.parse(document.getElementById("pg-advice").textContent);
  const csrfToken = document.querySelector('meta[name="csrf-token"]').content;
  let messages = [];
  let busy = false;
  let controller = null;

  // A refused request or a failed reply: the code the API named, and its message (shown only
  // where the advice says so: a refused input's message is about what the customer typed).
  class ReplyError extends Error {
    constructor(code, message) {
      super(message);
      this.code = code;
    }
  }

  function addMessage(role, text) {
    const item = document.createElement("li");
    item.className = "message " + role;
    const who = document.createElement("span");
    who.className = "who";
    who.textContent = role === "user" ? "You" : "Assistant";
    const body = document.createElement("div");
    body.className = "text";
    body.textContent = text;
    item.append(who, body);
    conversation.append(item);
    return body;
  }

  function showError(message) {
    errorBox.textContent = message;
    delete errorBox.dataset.code;
    errorBox.hidden = false;
  }

  function actionFor(action) {
    if (action.href) {
      const link = document.createElement("a");
      link.className = "button";
      link.href = action.href;
      link.textContent = action.label;
      return link;
    }
    const button = document.createElement("button");
    button.type = "button";
    button.className = "secondary";
    button.textContent = action.label;
    button.addEventListener("click", function () {
      errorBox.hidden = true;
      if (action.focus) document.getElementById(action.focus).focus();
      if (action.press) document.getElementById(action.press).click();
    });
    return button;
  }

  function showAdvice(code, message) {
    const found = advice[code] || advice["default"];
    const text = document.createElement("p");
    text.textContent = found.show_message && message ? found.message + " " + message : found.message;
    errorBox.replaceChildren(text);
    if (found.action) {
      const actions = document.createElement("p");
      actions.append(actionFor(found.action));
      errorBox.append(actions);
    }
    errorBox.dataset.code = code;
    errorBox.hidden = false;
  }

  function showPrice() {
    const option = form.elements.model.selectedOptions[0];
    if (priceLine && option) priceLine.textContent = option.dataset.price;
  }

  // Server-sent events: blocks separated by a blank line, each "data: ..." line one payload.
  async function readEvents(response, onData) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of block.split("\n")) {
          if (line.startsWith("data: ")) onData(line.slice(6));
        }
      }
    }
  }

  function settle(busyNow) {
    busy = busyNow;
    sendButton.disabled = busyNow;
    stopButton.hidden = !busyNow;
  }

  form.addEventListener("submit", async function (event) {
    event.preventDefault();
    if (busy) return;
    const text = form.elements.message.value.trim();
    if (!text) {
      showError("Write a message first.");
      form.elements.message.focus();
      return;
    }
    errorBox.hidden = true;
    settle(true);
    controller = new AbortController();
    status.textContent = "Waiting for the first token…";
    messages.push({ role: "user", content: text });
    addMessage("user", text);
    form.elements.message.value = "";
    const reply = addMessage("assistant", "");
    reply.parentElement.setAttribute("aria-busy", "true");
    let jobId = null;
    let content = "";
    let failure = null;
    try {
      const response = await fetch(form.dataset.chatUrl, {
        method: "POST",
        credentials: "same-origin",
        signal: controller.signal,
        headers: { "Content-Type": "application/json", "X-CSRFToken": csrfToken },
        body: JSON.stringify({
          model: form.elements.model.value,
          messages: messages,
          max_tokens: Number(form.elements.max_tokens.value),
          temperature: Number(form.elements.temperature.value),
        }),
      });
      if (!response.ok) {
        const body = await response.json().catch(function () {
          return null;
        });
        const error = (body && body.error) || {};
        throw new ReplyError(error.code || (response.status === 400 ? "invalid_request" : ""), error.message || "");
      }
      await readEvents(response, function (data) {
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) {
          failure = new ReplyError(chunk.error.code || "", chunk.error.message || "");
          return;
        }
        jobId = chunk.id || jobId;
        const choice = chunk.choices && chunk.choices[0];
        const delta = choice && choice.delta && choice.delta.content;
        if (delta) {
          content += delta;
          reply.textContent = content;
          status.textContent = "Streaming…";
        }
      });
      if (failure) throw failure;
      messages.push({ role: "assistant", content: content });
      status.textContent = "Done.";
    } catch (error) {
      if (error.name === "AbortError") {
        // Stopped: what arrived stays, as part of the conversation (and is billed as received).
        if (content) messages.push({ role: "assistant", content: content });
        else messages.pop();
        reply.parentElement.classList.add("stopped");
        status.textContent = "Stopped.";
      } else {
        messages.pop(); // the failed turn is not part of the conversation sent next time
        reply.parentElement.classList.add("failed");
        status.textContent = "";
        if (error instanceof ReplyError) showAdvice(error.code, error.message);
        else showAdvice("network", "");
      }
    } finally {
      reply.parentElement.removeAttribute("aria-busy");
      controller = null;
      settle(false);
      if (jobId) {
        window.htmx.ajax("GET", form.dataset.jobUrl.replace("JOB_ID", encodeURIComponent(jobId)), {
          target: "#pg-stats",
          swap: "innerHTML",
        });
      }
    }
  });

  stopButton.addEventListener("click", function () {
    if (controller) controller.abort();
  });

  form.elements.model.addEventListener("change", showPrice);

  form.elements.message.addEventListener("keydown", function (event) {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) form.requestSubmit();
  });

  document.getElementById("pg-new").addEventListener("click", function () {
    messages = [];
    conversation.replaceChildren();
    stats.innerHTML = statsPlaceholder;
    errorBox.hidden = true;
    status.textContent = "";
    form.elements.message.focus();
  });

  // The page renders Send disabled: a click before this script ran (it is deferred, and a busy
  // machine runs it late) would have submitted the form as a plain page load and lost the message.
  sendButton.disabled = !form.elements.model.value;
})();
