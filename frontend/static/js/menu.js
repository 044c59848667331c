// The header's compact menu on narrow screens: the "Menu" button shows and hides the sections and
// the account. Without this script the header simply wraps, with everything in it.
(function () {
  "use strict";
  const header = document.querySelector("header.top");
  const button = header && header.querySelector(".menu-toggle");
  if (!button) return;

  function setOpen(open) {
    header.dataset.menu = open ? "open" : "closed";
    button.setAttribute("aria-expanded", String(open));
  }

  setOpen(false);
  button.addEventListener("click", function () {
    setOpen(header.dataset.menu !== "open");
  });
  document.addEventListener("keydown", function (event) {
    if (event.key === "Escape" && header.dataset.menu === "open") {
      setOpen(false);
      button.focus();
    }
  });
})();
