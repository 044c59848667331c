// Copy buttons: <button data-copy-target="ID"> copies the text of the element with that id.
// Delegated from the document, so buttons that HTMX swaps in work too.
(function () {
  "use strict";

  function selectText(element) {
    const range = document.createRange();
    range.selectNodeContents(element);
    const selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
  }

  document.addEventListener("click", async function (event) {
    const button = event.target.closest("button[data-copy-target]");
    if (!button) return;
    const source = document.getElementById(button.dataset.copyTarget);
    if (!source) return;
    const label = button.dataset.label || button.textContent;
    button.dataset.label = label;
    let copied = false;
    try {
      await navigator.clipboard.writeText(source.textContent.trim());
      copied = true;
    } catch (error) {
      // No clipboard access (an insecure origin, or permission refused): select the text instead,
      // so that the keyboard shortcut copies it.
      selectText(source);
    }
    button.textContent = copied ? "Copied" : "Selected: press Ctrl+C";
    window.setTimeout(function () {
      button.textContent = label;
    }, 2500);
  });
})();
