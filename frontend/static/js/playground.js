// The playground: sends the conversation to the dashboard's chat endpoint (admitted and billed
// like any API request), shows the reply as its tokens stream in (server-sent events), then
// fetches the request's recorded time to first token, speed and cost.
(function () {
  "use strict";
  const form = document.getElementById("playground");
  if (!form) return;
  const conversation = document.getElementById("pg-conversation");
  const status = document.getElementById("pg-status");
  const errorBox = document.getElementById("pg-error");
  const sendButton = document.getElementById("pg-send");
  const stats = document.getElementById("pg-stats");
  const statsPlaceholder = stats.innerHTML;
  const csrfToken = document.querySelector('meta[name="csrf-token"]').content;
  let messages = [];
  let busy = false;

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
    errorBox.hidden = false;
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
    busy = true;
    sendButton.disabled = true;
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
        throw new Error((body && body.error && body.error.message) || "The request failed (" + response.status + ").");
      }
      await readEvents(response, function (data) {
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) {
          failure = chunk.error.message;
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
      if (failure) throw new Error(failure);
      messages.push({ role: "assistant", content: content });
      status.textContent = "Done.";
    } catch (error) {
      messages.pop(); // the failed turn is not part of the conversation sent next time
      reply.parentElement.classList.add("failed");
      status.textContent = "";
      showError(error.message);
    } finally {
      reply.parentElement.removeAttribute("aria-busy");
      busy = false;
      sendButton.disabled = false;
      if (jobId) {
        window.htmx.ajax("GET", form.dataset.jobUrl.replace("JOB_ID", encodeURIComponent(jobId)), {
          target: "#pg-stats",
          swap: "innerHTML",
        });
      }
    }
  });

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
})();
