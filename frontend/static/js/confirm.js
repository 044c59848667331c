// Confirmations of the actions that move money or remove a node. A button marked
// hx-confirm="question" asks in a modal dialog on the page (its text visible to everyone, focus
// kept inside, Escape cancels) before HTMX sends its request; the request goes only on "Confirm".
// The dialog's confirm label comes from the button's data-confirm-label ("Confirm" otherwise).
(function () {
  "use strict";
  let dialog = null;

  function build() {
    dialog = document.createElement("dialog");
    dialog.className = "confirm";
    dialog.setAttribute("aria-labelledby", "confirm-question");
    dialog.innerHTML =
      '<form method="dialog">' +
      '<p id="confirm-question" class="question"></p>' +
      '<div class="button-row">' +
      '<button type="submit" value="confirm" class="danger confirm-yes"></button>' +
      '<button type="submit" value="cancel" class="secondary" autofocus>Cancel</button>' +
      "</div></form>";
    document.body.appendChild(dialog);
    return dialog;
  }

  function ask(question, label) {
    const box = dialog || build();
    box.querySelector(".question").textContent = question;
    box.querySelector(".confirm-yes").textContent = label;
    box.returnValue = "cancel";
    return new Promise(function (resolve) {
      box.addEventListener(
        "close",
        function () {
          resolve(box.returnValue === "confirm");
        },
        { once: true },
      );
      box.showModal();
    });
  }

  document.addEventListener("htmx:confirm", function (event) {
    const question = event.detail.question;
    if (!question) return; // not a confirmed action: HTMX goes on as usual
    event.preventDefault();
    const label = event.detail.elt.dataset.confirmLabel || "Confirm";
    ask(question, label).then(function (confirmed) {
      if (confirmed) event.detail.issueRequest(true);
    });
  });
})();
